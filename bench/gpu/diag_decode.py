"""GPU diagnosis: one k3_slice decode step, triton backend vs eager, per row and per module.

For each dtype (fp32, bf16) and batch (1, 64): the same prefilled cache (eager prefill), one decode step under
each backend, forward hooks on every layer's attention, FFN and router. Prints, in layer order, the relative
error of each module output vs eager, the fraction of tokens whose top-k expert set differs, and the logits'
per-row error (median / max) and argmax agreement. fp32 isolates kernel bugs from bf16 rounding; a bf16 run
with the MXFP4 decode forced to the exact ``split`` mode isolates ``tl.dot_scaled``.

    python3 -m bench.gpu.diag_decode [--config k3_slice] [--batches 1,64]
"""

from __future__ import annotations

import argparse
import time

import torch

from k3nn.cache.hybrid import HybridCache
from k3nn.config import KimiK3Config
from k3nn.decode.runner import make_decode_runner
from k3nn.layers.moe import Router

from bench.e2e import clone_cache
from bench.models import build_model


def _moes(model):
    from k3nn.layers.moe import MoE

    return [(i, m) for i, layer in enumerate(model.model.layers) for m in layer.modules() if isinstance(m, MoE)]


def _hooks(model, store):
    for _, m in _moes(model):
        m.record_routing = True  # MoE.forward keeps (router logits, top-k ids) of its latest call
    hs = []
    for i, layer in enumerate(model.model.layers):
        mods = [("attn", layer.self_attn), ("ffn", layer.ffn)]
        mods += [("router", m) for m in layer.ffn.modules() if isinstance(m, Router)]
        for name, m in mods:
            def h(mod, inp, out, key=f"L{i}.{name}"):
                store[key] = out[0].detach().clone() if isinstance(out, tuple) else out.detach().float().clone()
            hs.append(m.register_forward_hook(h))
    return hs


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@torch.no_grad()
def step(model, base, nxt, backend):
    model.backend = backend
    store = {}
    hs = _hooks(model, store)
    try:
        cache = clone_cache(base)
        logits = model(nxt[:, None], cache=cache, logits_to_keep=1).logits[:, -1].float()
    finally:
        for h in hs:
            h.remove()
        for i, m in _moes(model):
            if getattr(m, "last_routing", None) is not None:
                store[f"L{i}.route"] = (m.last_routing[0].float().clone(), m.last_routing[1].clone())
            m.record_routing, m.last_routing = False, None
        model.backend = None
    if logits.is_cuda:
        torch.cuda.synchronize()
    return logits, store


@torch.no_grad()
def runner_step(model, base, nxt, backend, decode_backend, graph):
    """First-step logits through a decode runner (the e2e bench's path): no per-module hooks."""
    model.backend = backend
    cache = clone_cache(base)
    try:
        runner = make_decode_runner(model, cache, cuda_graph=graph, decode_backend=decode_backend)
        first = runner(nxt[:, None]).float().clone()
        second = runner(nxt[:, None]).float().clone() if graph else first  # the replayed graph
        info = f"path={runner.name} graph={runner.uses_graph} fallback={runner.fallback_reason}"
        runner.close()
    finally:
        model.backend = None
    if first.is_cuda:
        torch.cuda.synchronize()
    return first, second, info


def report_runner(tag, ref, model, base, nxt, backend, decode_backend, graph):
    try:
        first, second, info = runner_step(model, base, nxt, backend, decode_backend, graph)
    except Exception as e:  # keep diagnosing the other paths
        print(f"-- {tag}: {type(e).__name__}: {e}"[:400], flush=True)
        return
    lr = ref[0]
    per_row = ((first - lr).norm(dim=-1) / lr.norm(dim=-1)).cpu()
    agree = (first.argmax(-1) == lr.argmax(-1)).float().mean().item()
    print(f"-- {tag} [{info}]: logits rel {_rel(first, lr):.3g} per-row median {per_row.median():.3g} "
          f"max {per_row.max():.3g} argmax agree {agree:.3f}", flush=True)


def report(tag, ref, out):
    (lr, sr), (lo, so) = ref, out
    per_row = ((lo - lr).norm(dim=-1) / lr.norm(dim=-1)).cpu()
    agree = (lo.argmax(-1) == lr.argmax(-1)).float().mean().item()
    print(f"-- {tag}: logits rel {_rel(lo, lr):.3g}  per-row median {per_row.median():.3g} max {per_row.max():.3g} "
          f" argmax agree {agree:.3f}", flush=True)
    parts = []
    for k in sr:
        if k.endswith(".route") and k in so:  # expert-set flips, and how close the eager top-k boundary was
            (lg, ia), (_, ib) = sr[k], so[k]
            flip = (ia.sort(-1).values != ib.sort(-1).values).any(-1).float().mean().item()
            kk = ia.shape[-1]
            top = lg.sigmoid().topk(min(kk + 1, lg.shape[-1]), -1).values  # (bias-free margin, a proxy)
            gap = (top[:, kk - 1] - top[:, -1]).min().item() if top.shape[-1] > kk else float("nan")
            parts.append(f"{k} flips {flip:.2f} (min top-k gap {gap:.1e})")
        elif k.endswith("router"):
            a, b = sr[k], so[k]
            flip = (a.sort(-1).values != b.sort(-1).values).any(-1).float().mean().item()
            parts.append(f"{k} flips {flip:.2f}")
        else:
            parts.append(f"{k} {_rel(so[k], sr[k]):.2g}")
    print("   " + " | ".join(parts), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="k3_slice")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--ctx", type=int, default=32)
    ap.add_argument("--prefill-backend", default="eager", help="backend of the prompt prefill (the e2e bench uses auto)")
    ap.add_argument("--dtypes", default="bfloat16", help="comma list; float32 eager k3_slice needs most of an H200")
    args = ap.parse_args()
    from k3nn.kernels.moe import triton_fused

    cfg = getattr(KimiK3Config, args.config)()
    dev = args.device
    for dtype in [getattr(torch, n) for n in args.dtypes.split(",")]:
        if dtype == torch.float32 and args.config == "k3_slice":
            # fp32 eager dequantises the experts: 32 of them keep it inside the GPU's memory
            cfg = KimiK3Config.k3_slice(num_experts=32)
        else:
            cfg = getattr(KimiK3Config, args.config)()
        t0 = time.perf_counter()
        model = build_model(cfg, dev, dtype)
        print(f"== {dtype}: built in {time.perf_counter() - t0:.1f}s", flush=True)
        for B in [int(b) for b in args.batches.split(",")]:
            gen = torch.Generator(device=dev).manual_seed(B)
            ids = torch.randint(0, cfg.vocab_size, (B, args.ctx), generator=gen, device=dev)
            base = HybridCache(cfg, B, args.ctx + 8, dtype, dev, mla_pool=True)
            model.backend = args.prefill_backend
            nxt = model(ids, cache=base, logits_to_keep=1).logits[:, -1].argmax(-1)
            model.backend = None
            ref = step(model, base, nxt, "eager")
            report(f"{dtype} B={B} ctx={args.ctx} prefill={args.prefill_backend} auto", ref, step(model, base, nxt, "auto"))
            again = step(model, base, nxt, "auto")
            report(f"{dtype} B={B} auto (2nd run; vs eager)", ref, again)
            for dec, graph in (("auto", False), ("auto", True), ("latency_specialized", False),
                               ("latency_specialized", True)):
                report_runner(f"{dtype} B={B} runner {dec} graph={graph}", ref, model, base, nxt, "auto", dec, graph)
            if dtype == torch.bfloat16:
                old = triton_fused.MX_DEFAULT
                triton_fused.MX_DEFAULT = "split"
                try:
                    report(f"{dtype} B={B} auto, MXFP4 split decode", ref, step(model, base, nxt, "auto"))
                finally:
                    triton_fused.MX_DEFAULT = old
            del base
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
