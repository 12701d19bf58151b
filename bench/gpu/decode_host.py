#!/usr/bin/env python3
"""Where the host time of an uncaptured decode step goes: the standard step without a CUDA graph (what
``generate(cuda_graph=False)`` and the eager speculative rounds run), where the host's launches, not the kernels, set
the time. The step runs as ``generate()`` runs it, under ``KernelTuning.uncaptured`` (so ``default`` leaves the
projections to torch's GEMM). Per tuning variant (``default``, ``skinny-always``: the skinny GEMM for every projection
it takes, as before that rule; ``no-pdl``: no programmatic dependent launches; as in :mod:`bench.decode_roofline`), on
clones of one prefilled cache:

    step        one step's host time (until it returns, every kernel launched) and its device time (until the stream
                drains), minimum over the timed steps
    by op       a host profile of one step: the registry ops (``k3nn::*``, their launches included) and the other
                torch ops by host time, with counts (the profiler's own cost inflates these: compare them with each
                other, not with the step's time)

    python3 -m bench.gpu.decode_host [--config k3_slice] [--batch 1] [--ctx 128] [--variants default,skinny-always]
    python3 -m bench.gpu.decode_host --config k3_like_tiny      (CPU: the host time of the ops, no launches)
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from k3nn import KimiK3
from k3nn.cache.hybrid import HybridCache
from k3nn.decode.runner import make_decode_runner
from k3nn.kernels.registry import tuning

from bench.common import sync
from bench.decode_roofline import VARIANTS
from bench.e2e import clone_cache
from bench.gpu.decode_launches import _label_registry_ops, k3_like_tiny


def step_times(step, tok: torch.Tensor, dev: torch.device, steps: int) -> tuple[float, float]:
    """(host ms, device ms) of one step: minima over ``steps`` calls."""
    host, total = [], []
    for _ in range(steps):
        sync(dev)
        t0 = time.perf_counter()
        step(tok)
        t1 = time.perf_counter()
        sync(dev)
        host.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    return 1e3 * min(host), 1e3 * min(total)


def host_profile(step, tok: torch.Tensor) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    """One step under the CPU profiler: per outermost registry op its host µs (inclusive) and calls; per torch op
    outside them its own host µs (self time) and calls."""
    from torch.profiler import ProfilerActivity, profile

    with _label_registry_ops(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step(tok)
    us, calls, own = collections.Counter(), collections.Counter(), collections.Counter()
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.name.startswith("k3nn::")]

    def nested(e, strict: bool) -> bool:  # inside a registry op's span (another one's, when strict)
        a, b = e.time_range.start, e.time_range.end
        return any(s <= a and b <= t and (not strict or (s, t) != (a, b)) for s, t in spans)

    for e in prof.events():
        if e.name.startswith("k3nn::") and not nested(e, True):  # a public op calling another: counted once
            us[e.name] += e.cpu_time_total
            calls[e.name] += 1
        elif e.name.startswith("aten::") and not nested(e, False):
            own[e.name] += e.self_cpu_time_total
            calls[e.name] += 1
    return us, own, calls


def _build(name: str, dev: torch.device) -> KimiK3:
    if name == "k3_slice":
        from bench.models import build_model
        from k3nn import KimiK3Config

        return build_model(KimiK3Config.k3_slice(), str(dev), torch.bfloat16)
    return KimiK3(k3_like_tiny(), seed=0).to(dev).eval()


@torch.no_grad()
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="k3_slice (default on CUDA) or k3_like_tiny (default on CPU)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--variants", default="default,skinny-always,no-pdl")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = args.config or ("k3_slice" if dev.type == "cuda" else "k3_like_tiny")
    model = _build(name, dev)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.ctx), generator=torch.Generator().manual_seed(0)).to(dev)
    base = HybridCache(cfg, args.batch, args.ctx + args.steps + 16, model.dtype, dev)
    tok = model(ids, cache=base, logits_to_keep=1).logits[:, -1].argmax(-1)[:, None]
    L = cfg.num_hidden_layers
    out = {}
    for v in variants:
        with tuning(**VARIANTS[v]):
            cache = clone_cache(base)
            runner = make_decode_runner(model, cache, cuda_graph=False)
            try:
                for _ in range(3):  # compiles and tunes outside the timing
                    runner(tok)
                host_ms, step_ms = step_times(runner, tok, dev, args.steps)
                us, own, calls = host_profile(runner, tok)
            finally:
                runner.close()
        n_reg = sum(c for k, c in calls.items() if k.startswith("k3nn::"))
        print(f"== {name} B={args.batch} ctx={args.ctx} {v}: host {host_ms:.2f} ms, step {step_ms:.2f} ms "
              f"({host_ms / L:.3f} ms host per layer); {n_reg} registry op calls ({1e-3 * sum(us.values()):.2f} ms), "
              f"{sum(calls.values()) - n_reg} other torch ops ({1e-3 * sum(own.values()):.2f} ms)", flush=True)
        rows = sorted([(k, t) for k, t in us.items()] + [(k, t) for k, t in own.items()], key=lambda kv: -kv[1])
        for k, t in rows[:args.top]:
            print(f"   {k:<44} {calls[k]:5d} calls {t:9.1f} us {t / calls[k]:7.1f} us/call", flush=True)
        out[v] = {"host_ms": host_ms, "step_ms": step_ms, "registry_us": dict(us), "aten_self_us": dict(own),
                  "calls": dict(calls)}
    return out


if __name__ == "__main__":
    main()
