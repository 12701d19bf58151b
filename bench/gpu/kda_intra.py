"""GPU check of the Triton chunked KDA forward's intra stage: the ``splitg`` pipeline (chunk-local cumulative
decay G computed once, then score blocks / solve / w/u reading it), the ``split`` pipeline and the fused kernel,
and the full forward per intra mode, at T=8192 H=96 (B=1, K=V=128, bf16, K3's bounded gate).

    PYTHONPATH=src python3 bench/gpu/kda_intra.py

1. ``splitg`` (``K3NN_KDA_INTRA=splitg``, :mod:`k3nn.kernels.kda.triton_intra_g`): each of its four kernels
   (cumsum, scores, solve, w/u) alone with every config, the sum of the per-kernel bests, the autotuned total;
   its outputs against the fused kernel's (relative difference per output, qg kg w u A egl X).
2. Full forward, bounded gate: ``split`` (the default) and ``splitg``.
3. Correctness against the eager chunk form (fp32 math on the same rounded inputs): one bf16 case per gate,
   T=300 H=16 varlen with checkpoints and an initial state, split and splitg.
4. ``split`` (:mod:`k3nn.kernels.kda.triton_intra_split`): each kernel alone with every config, the autotuned
   total, its outputs against the fused ones; the fused ``_kda_intra`` with its first config (the best measured).
5. Time permitting: the softplus-gate full forward (split / splitg); fla-core ``chunk_kda`` as an anchor, only
   when more than 60 s remain (its own autotuning compiles for over a minute; ``python -m k3nn.bench.kda_prefill``
   measures it properly).

Ends with the summary line ``intra: split X ms, splitg Y ms; forward: split A ms, splitg B ms``. Timing uses
``triton.testing.do_bench`` with short warm-up / repetition windows; later sections are skipped when the elapsed
time nears the budget (BUDGET_S), so the script stays under ~100 s including compilation.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

from k3nn.kernels.kda import triton_chunk as tc
from k3nn.kernels.kda import triton_intra_g as tg
from k3nn.kernels.kda import triton_intra_split as ts
from k3nn.kernels.kda.chunk_torch import kda_chunk_eager

T0 = time.time()
BUDGET_S = 90.0
D = 128
DEV = "cuda"
HALF = torch.bfloat16
T_BIG, H_BIG = 8192, 96
NAMES = ("qg", "kg", "w", "u", "A", "egl", "X")


def say(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def left():
    return BUDGET_S - (time.time() - T0)


def sync():
    torch.cuda.synchronize()


def bench(fn, rep=25):
    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


@contextlib.contextmanager
def env_set(name, value):
    """Environment variable ``name`` = ``value`` inside the block, restored after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def intra(mode):
    return env_set("K3NN_KDA_INTRA", mode)


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(T, H, gate, gen, dtype=None, K=D, V=D, N=1):
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    dtype = dtype or HALF
    q = F.normalize(r(1, T, H, K), dim=-1).to(dtype)
    k = F.normalize(r(1, T, H, K), dim=-1).to(dtype)
    v = r(1, T, H, V).to(dtype)
    x = r(1, T, H, K)
    if gate == "lower_bound":  # K3: lower_bound · sigmoid(·), lower_bound = −5
        g = -5.0 * torch.sigmoid(x - 2.0)
    else:  # Kimi Linear: −exp(A_log) · softplus(·), A in [1, 16]
        A = torch.empty(H, device=DEV).uniform_(1, 16, generator=gen)
        g = -A[:, None] * F.softplus(x - 4.0)
    beta = torch.sigmoid(r(1, T, H))
    h0 = r(N, H, K, V) * 0.1
    return q, k, v, g.float().contiguous(), beta, h0


def plan(T):
    (NC, c_start, c_len, *_), _, _ = tc.build_chunk_plan(1, T, None, [], DEV)
    return NC, c_start, c_len


def cfg_name(c):
    if c is None:
        return "?"
    return " ".join(f"{k}={v}" for k, v in c.kwargs.items()) + f" warps={c.num_warps} stages={c.num_stages}"


def fused_variants(args, cfgs):
    best = None
    for cfg in cfgs:
        if left() < 10:
            say(f"  {cfg_name(cfg)}: skipped (time)")
            continue
        try:
            tc._intra_launch(*args, config=cfg, mode="fused")
            sync()
            ms = bench(lambda cfg=cfg: tc._intra_launch(*args, config=cfg, mode="fused"))
            say(f"  fused {cfg_name(cfg)}: {ms:.3f} ms")
            best = min(best or (ms, cfg_name(cfg)), (ms, cfg_name(cfg)))
        except Exception as e:  # a variant that does not compile or fit must not stop the run
            say(f"  fused {cfg_name(cfg)}: failed {type(e).__name__}: {str(e)[:200]}")
    return best


def _bufs(q, v, NC):
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    bufs = [torch.empty(NC, H, 64, K, dtype=q.dtype, device=DEV) for _ in range(3)]
    return bufs + [torch.empty(NC, H, 64, V, dtype=q.dtype, device=DEV),
                   torch.empty(NC, H, 64, 64, dtype=q.dtype, device=DEV),
                   torch.empty(NC, H, K, dtype=torch.float32, device=DEV),
                   torch.empty(NC, H, 64, 64, dtype=torch.float32, device=DEV)]


def _time(name, cfg, run, minus=0.0):
    try:
        run()
        sync()
        ms = bench(run) - minus
        say(f"  {name:8s} {cfg_name(cfg)}: {ms:.3f} ms")
        return ms
    except Exception as e:  # a variant that does not compile or fit must not stop the run
        say(f"  {name:8s} {cfg_name(cfg)}: failed {type(e).__name__}: {str(e)[:200]}")
        return None


def g_variants(args):
    q, k, v, g, beta, scale, NC, cs, cl = args
    bufs = _bufs(q, v, NC)
    G = tg.g_buffer(NC, q.shape[2], q.shape[3], DEV)
    kernels = tg.g_kernels()
    names = ("cumsum", "scores", "solve", "w/u")
    first = tuple(kern.configs[0] for kern in kernels)
    launch = lambda cfgs, stages: tg.intra_g_launch(  # noqa: E731
        q, k, v, g, beta, scale, NC, cs, cl, *bufs, configs=cfgs, stages=stages, G=G)
    launch(first, (0, 1, 2, 3))  # compiles the first ones and fills G / the scratch for the single stages
    sync()
    say(f"splitg pipeline at T={T_BIG} H={H_BIG} bounded gate: each kernel alone, every config "
        f"({', '.join(str(len(kern.configs)) for kern in kernels)} configs)")
    bests = []
    for stage, (name, kern) in enumerate(zip(names, kernels)):
        best = None
        for cfg in kern.configs:
            if left() < 45:
                say(f"  {name:6s} {cfg_name(cfg)}: skipped (time)")
                continue
            cfgs = tuple(cfg if s == stage else first[s] for s in range(4))
            ms = _time(name, cfg, lambda cfgs=cfgs, stage=stage: launch(cfgs, (stage,)))
            if ms is not None and (best is None or ms < best[0]):
                best = (ms, cfg_name(cfg))
        say(f"  {name} best: {best}")
        bests.append(best[0] if best else float("nan"))
    say(f"  sum of the per-kernel bests: {sum(bests):.3f} ms")
    t_g = bench(lambda: tc._intra_launch(*args, mode="splitg"))
    picks = [cfg_name(getattr(kern, "best_config", None)) for kern in kernels]
    say(f"  splitg autotuned total: {t_g:.3f} ms; picks: " + " ".join(f"{n} [{p}]" for n, p in zip(names, picks)))
    if left() < 50:
        say("  K3NN_KDA_SPLITG_QK=cumsum variant skipped (time)")
        return t_g, None
    # variant: qg / kg written by the cumsum kernel (it holds G already), the w/u kernel only w and u
    say("  K3NN_KDA_SPLITG_QK=cumsum (qg / kg in the cumsum kernel): cumsum and w/u alone, every config")
    launch_c = lambda cfgs, stages: tg.intra_g_launch(  # noqa: E731
        q, k, v, g, beta, scale, NC, cs, cl, *bufs, configs=cfgs, stages=stages, G=G, qk="cumsum")
    for stage in (0, 3):
        best = None
        for cfg in kernels[stage].configs:
            if left() < 45:
                say(f"  {names[stage]:6s} {cfg_name(cfg)}: skipped (time)")
                continue
            cfgs = tuple(cfg if s == stage else first[s] for s in range(4))
            ms = _time(names[stage] + "/c", cfg, lambda cfgs=cfgs, stage=stage: launch_c(cfgs, (stage,)))
            if ms is not None and (best is None or ms < best[0]):
                best = (ms, cfg_name(cfg))
        say(f"  {names[stage]} (qk in cumsum) best: {best}")
    with env_set("K3NN_KDA_SPLITG_QK", "cumsum"):
        t_c = bench(lambda: tc._intra_launch(*args, mode="splitg"))
    say(f"  splitg (qk in cumsum) autotuned total: {t_c:.3f} ms (default qk in w/u: {t_g:.3f} ms)")
    return t_g, t_c


def split_variants(args):
    q, k, v, g, beta, scale, NC, cs, cl = args
    bufs = _bufs(q, v, NC)
    kernels = ts.split_kernels()
    first = tuple(kern.configs[0] for kern in kernels)
    ts.intra_split_launch(q, k, v, g, beta, scale, NC, cs, cl, *bufs, configs=first)  # compiles the first ones
    sync()
    say(f"split pipeline at T={T_BIG} H={H_BIG} bounded gate: each kernel alone, every config "
        f"({', '.join(str(len(kern.configs)) for kern in kernels)} configs)")
    bests = []
    for stage, (name, kern) in enumerate(zip(("scores", "solve", "w/u"), kernels)):
        best = None
        for cfg in kern.configs:
            if left() < 25:
                say(f"  {name:6s} {cfg_name(cfg)}: skipped (time)")
                continue
            cfgs = tuple(cfg if s == stage else first[s] for s in range(3))
            ms = _time(name, cfg, lambda cfgs=cfgs, stage=stage: ts.intra_split_launch(
                q, k, v, g, beta, scale, NC, cs, cl, *bufs, configs=cfgs, stages=(stage,)))
            if ms is not None and (best is None or ms < best[0]):
                best = (ms, cfg_name(cfg))
        say(f"  {name} best: {best}")
        bests.append(best[0] if best else float("nan"))
    say(f"  sum of the per-kernel bests: {sum(bests):.3f} ms")
    if left() < 20:
        return None
    t_split = bench(lambda: tc._intra_launch(*args, mode="split"))
    picks = [cfg_name(getattr(kern, "best_config", None)) for kern in kernels]
    say(f"  split autotuned total: {t_split:.3f} ms; picks: scores [{picks[0]}] solve [{picks[1]}] "
        f"w/u [{picks[2]}]")
    return t_split


def compare_outputs(args, mode):
    # the fused kernel with its first config: autotuning it would compile all four (~10 s)
    ref = tc._intra_launch(*args, mode="fused", config=tc._kda_intra.configs[0], return_x=True)
    got = tc._intra_launch(*args, mode=mode, return_x=True)
    sync()
    r64 = torch.arange(64, device=DEV)
    low = (r64[None, :] // 16) <= (r64[:, None] // 16)
    errs = []
    for name, a, b in zip(NAMES, ref, got):
        if name == "X":
            a, b = a[..., low], b[..., low]
        errs.append(rel(b, a))
    say(f"  {mode} vs fused outputs (rel): " + "  ".join(f"{n} {e:.1e}" for n, e in zip(NAMES, errs)))
    return max(errs)


def fla():
    try:
        from fla.ops.kda import chunk_kda
        return chunk_kda
    except Exception as e:  # optional anchor
        say(f"fla-core not importable ({type(e).__name__}: {e}); anchor left out")
        return None


def full_row(gen, gate, modes=("split", "splitg")):
    q, k, v, g, beta, h0 = inputs(T_BIG, H_BIG, gate, gen)
    run = lambda: tc.kda_chunk_triton_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True)  # noqa: E731
    res = {}
    for mode in modes:
        if mode != modes[0] and left() < 12:
            say(f"  full forward {mode}: skipped (time)")
            continue
        with intra(mode):
            o, ht, _ = run()
            sync()
            res[mode] = (o, ht, bench(run))
    base = res[modes[0]]
    parts = []
    for mode, (o, ht, ms) in res.items():
        d = "" if mode == modes[0] else (f" ({base[2] / ms:.2f}x, vs {modes[0]} {max(rel(o, base[0]), rel(ht, base[1])):.1e})")
        parts.append(f"{mode} {ms:.3f} ms{d}")
    say(f"  T{T_BIG} H{H_BIG} {gate:11s} full forward: " + "  ".join(parts))
    return {"case": f"T{T_BIG} H{H_BIG} {gate}", **{m: r[2] for m, r in res.items()}}, (q, k, v, g, beta, h0, res)


def fla_row(chunk_kda, data):
    q, k, v, g, beta, h0, res = data
    try:
        fq, fk, fv, fg, fb, fh = (t.clone() for t in (q, k, v, g, beta, h0))
        fo, fht = chunk_kda(fq, fk, fv, fg, fb, initial_state=fh, output_final_state=True)
        ms = bench(lambda: chunk_kda(fq, fk, fv, fg, fb, initial_state=fh, output_final_state=True))
        errs = "  ".join(f"{m} vs fla {max(rel(r[0], fo), rel(r[1], fht)):.1e}" for m, r in res.items())
        speed = "  ".join(f"{m} {ms / r[2]:.2f}x" for m, r in res.items())
        say(f"  fla chunk_kda {ms:.3f} ms; speedup over fla: {speed}; {errs}")
        return ms
    except Exception as e:
        say(f"  fla failed: {type(e).__name__}: {str(e)[:200]}")
        return None


def table(rows, t_intra):
    modes = ("fused", "split", "splitg")
    print("\n| case | " + " | ".join(f"intra {m} ms" for m in modes) + " | " + " | ".join(f"full {m} ms" for m in modes)
          + " | fla ms |", flush=True)
    print("|---" * (2 * len(modes) + 2) + "|", flush=True)
    fmt = lambda x: f"{x:.3f}" if x else "-"  # noqa: E731
    for r in rows:
        ti = [fmt(t_intra.get(m)) if "lower_bound" in r["case"] else "-" for m in modes]
        print(f"| {r['case']} | " + " | ".join(ti) + " | " + " | ".join(fmt(r.get(m)) for m in modes)
              + f" | {fmt(r.get('fla'))} |", flush=True)


def check(gen, modes=("split", "splitg")):
    lens = [37, 0, 150, 113]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEV, dtype=torch.int32)
    cps = [[10, 37], [0], [64, 100, 150], [1, 50]]
    worst = 0.0
    for gate in ("lower_bound", "softplus"):
        q, k, v, g, beta, h0 = inputs(300, 16, gate, gen, N=len(lens))
        f = lambda t: t.float()  # noqa: E731
        ro, rht, rck = kda_chunk_eager(f(q), f(k), f(v), g, beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu, checkpoint_positions=cps)
        for mode in modes:
            with intra(mode):
                o, ht, ck = tc.kda_chunk_triton_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                    cu_seqlens=cu, checkpoint_positions=cps)
            sync()
            e = (rel(o, ro), rel(ht, rht), rel(ck, rck))
            worst = max(worst, *e)
            verdict = "ok" if max(e) < 2e-2 else "FAIL"
            say(f"  bf16 {gate:12s} {mode:6s} rel err o {e[0]:.2e}  final {e[1]:.2e}  ckpt {e[2]:.2e}  "
                f"(tol 0.02) {verdict}")
    return worst


def main():
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
        f"K3NN_KDA_TUNE={os.environ.get('K3NN_KDA_TUNE', '1')}")
    gen = torch.Generator(device=DEV).manual_seed(0)
    q, k, v, g, beta, _ = inputs(T_BIG, H_BIG, "lower_bound", gen)
    NC, cs, cl = plan(T_BIG)
    args = (q, k, v, g, beta, D ** -0.5, NC, cs, cl)
    t_intra = {}
    t_intra["splitg"], t_qk = g_variants(args)
    diff = compare_outputs(args, "splitg")
    say(f"full forward T={T_BIG} H={H_BIG}: K3NN_KDA_INTRA=split / splitg")
    row, data = full_row(gen, "lower_bound")
    rows = [row]
    torch.cuda.empty_cache()
    worst = 0.0
    if left() > 12:
        say("correctness vs kda_chunk_eager (fp32 math on the same inputs), T=300 H=16 varlen + checkpoints + h0")
        worst = check(gen)
    else:
        say("correctness section skipped (time)")
    if left() > 25:
        t_intra["split"] = split_variants(args)
        if left() > 12:
            diff = max(diff, compare_outputs(args, "split"))
    else:
        say("split pipeline skipped (time)")
    if left() > 10:
        say(f"fused _kda_intra at T={T_BIG} H={H_BIG} bounded gate: its first config")
        best = fused_variants(args, tc._kda_intra.configs[:1])
        t_intra["fused"] = best[0] if best else None
    del q, k, v, g, beta
    torch.cuda.empty_cache()
    if left() > 20:
        rows.append(full_row(gen, "softplus")[0])
    else:
        say("softplus full forward skipped (time)")
    if left() > 60:
        chunk_kda = fla()
        if chunk_kda is not None:
            rows[0]["fla"] = fla_row(chunk_kda, data)
    else:
        say(f"fla anchor skipped ({left():.0f} s left < 60 s; see python -m k3nn.bench.kda_prefill)")
    data = None
    table(rows, t_intra)
    ok = worst < 2e-2 and diff < 1e-2
    say(f"done; worst bf16 rel err vs eager {worst:.2e}; split / splitg vs fused intra outputs {diff:.1e}; "
        f"{'ok' if ok else 'FAIL'}")
    fmt = lambda x: f"{x:.3f} ms" if x else "-"  # noqa: E731
    print(f"intra: split {fmt(t_intra.get('split'))}, splitg {fmt(t_intra.get('splitg'))}; "
          f"forward: split {fmt(rows[0].get('split'))}, splitg {fmt(rows[0].get('splitg'))}; "
          f"splitg intra with K3NN_KDA_SPLITG_QK=cumsum {fmt(t_qk)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
