"""GPU A/B of the splitg score kernel: one program per 16×16 block pair (``K3NN_KDA_SPLITG_SCORES=pairs``)
against one program per row strip (``rows``, the default since h200-s5-run5: blocks (i, 0) … (i, i) share strip
i's loads and row factor), B=1 K=V=128 bf16, K3's bounded gate.

    PYTHONPATH=src python3 bench/gpu/kda_scores.py

1. T=8192 H=96: every output of the splitg intra stage (qg kg w u A egl X) with rows against pairs (max |diff|
   and relative difference; the same operations per block, so expected equal up to dot accumulation order);
   the score kernel alone with every config of each variant.
2. The whole forward (``ops.kda_chunk``, final state out) with pairs and with rows at T=8K, 32K and 64K, H=96,
   and the output / final state of rows against pairs.

Ends with ``summary: scores pairs X ms, rows Y ms (T=8K); forward pairs/rows ...``. Stays under ~2 minutes.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from kda_intra import _bufs, bench, cfg_name, env_set, inputs, plan, rel, say, sync  # noqa: E402

from k3nn import backend, ops  # noqa: E402
from k3nn.kernels.kda import triton_chunk as tc  # noqa: E402
from k3nn.kernels.kda import triton_intra_g as tg  # noqa: E402

T0 = time.time()
BUDGET_S = float(os.environ.get("K3NN_SCORES_BUDGET_S", "110"))
NAMES = ("qg", "kg", "w", "u", "A", "egl", "X")


def left():
    return BUDGET_S - (time.time() - T0)


def scores(mode):
    return env_set("K3NN_KDA_SPLITG_SCORES", mode)


def stage_ab(args):
    q, k, v, g, beta, scale, NC, cs, cl = args
    outs = {}
    for mode in ("pairs", "rows"):
        with scores(mode):
            outs[mode] = tc._intra_launch(*args, mode="splitg", return_x=True)
    sync()
    worst = 0.0
    parts = []
    for name, a, b in zip(NAMES, outs["pairs"], outs["rows"]):
        if name == "X":  # only the block-lower part is written by every pipeline
            r64 = torch.arange(64, device=a.device)
            m = (r64[None, :] // 16) <= (r64[:, None] // 16)
            a, b = a[..., m], b[..., m]
        d = (a.float() - b.float()).abs().max().item()
        e = rel(b, a)
        worst = max(worst, e)
        parts.append(f"{name} {d:.1e}/{e:.1e}")
    say("  rows vs pairs (max |diff| / rel): " + "  ".join(parts))
    outs = None
    bufs = _bufs(q, v, NC)
    G = tg.g_buffer(NC, q.shape[2], q.shape[3], q.device)
    kern = tg.g_kernels()[1]
    first = tuple(kk.configs[0] for kk in tg.g_kernels())
    best = {}
    for mode in ("pairs", "rows"):
        launch = lambda cfgs, st, mode=mode: tg.intra_g_launch(  # noqa: E731
            q, k, v, g, beta, scale, NC, cs, cl, *bufs, configs=cfgs, stages=st, G=G, scores=mode)
        launch(first, (0, 1, 2, 3))
        sync()
        for cfg in kern.configs:
            if left() < 40:
                say(f"  scores {mode} {cfg_name(cfg)}: skipped (time)")
                continue
            cfgs = (first[0], cfg, first[2], first[3])
            try:
                launch(cfgs, (1,))
                sync()
                ms = bench(lambda cfgs=cfgs: launch(cfgs, (1,)))
            except Exception as ex:  # a config that does not compile must not stop the run
                say(f"  scores {mode} {cfg_name(cfg)}: failed {type(ex).__name__}: {str(ex)[:200]}")
                continue
            say(f"  scores {mode:5s} {cfg_name(cfg)}: {ms:.3f} ms")
            if mode not in best or ms < best[mode][0]:
                best[mode] = (ms, cfg_name(cfg))
    return worst, best


def forward_ab(gen, T):
    q, k, v, g, beta, _ = inputs(T, 96, "lower_bound", gen)
    res = {}
    for mode in ("pairs", "rows"):
        if left() < 12:
            say(f"  T={T} {mode}: skipped (time)")
            continue
        with scores(mode), backend("triton"):
            run = lambda: ops.kda_chunk(q, k, v, g, beta, output_final_state=True)  # noqa: E731
            o, ht = run()
            sync()
            res[mode] = (bench(run, rep=40 if T <= 8192 else 100), o, ht)
    line = f"  forward T={T} H=96: " + ", ".join(f"{m} {r[0]:.3f} ms" for m, r in res.items())
    if len(res) == 2:
        (tp, op, hp), (tr, orr, hr) = res["pairs"], res["rows"]
        line += f"; rows/pairs time {tr / tp:.3f}; rel diff o {rel(orr, op):.1e} final {rel(hr, hp):.1e}"
    say(line)
    return {m: r[0] for m, r in res.items()}


def main():
    tune = os.environ.get("K3NN_KDA_TUNE", "1")
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__} K3NN_KDA_TUNE={tune}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, g, beta, _ = inputs(8192, 96, "lower_bound", gen)
    NC, cs, cl = plan(8192)
    worst, best = stage_ab((q, k, v, g, beta, 128 ** -0.5, NC, cs, cl))
    del q, k, v, g, beta
    torch.cuda.empty_cache()
    fwd = {}
    for T in (8192, 65536, 32768):
        if left() < 15:
            say(f"  forward T={T}: skipped (time)")
            continue
        fwd[T] = forward_ab(gen, T)
        torch.cuda.empty_cache()
    ok = worst < 1e-3
    fmt = lambda b: f"{b[0]:.3f} ms [{b[1]}]" if b else "-"  # noqa: E731
    say("summary: scores pairs " + fmt(best.get("pairs")) + ", rows " + fmt(best.get("rows")) + " (T=8K); forward "
        + "; ".join(f"T={T}: " + ", ".join(f"{m} {ms:.3f}" for m, ms in r.items()) for T, r in fwd.items())
        + f"; rows vs pairs outputs {worst:.1e} {'ok' if ok else 'FAIL'}; done in {time.time() - T0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
