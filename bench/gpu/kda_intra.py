"""GPU check of the Triton chunked KDA forward: the fused intra kernel against the row-strip and split pipelines,
and the full forward per intra mode, at T=8192 H=96 (B=1, K=V=128, bf16).

    PYTHONPATH=src python3 bench/gpu/kda_intra.py

1. Fused ``_kda_intra``, its first config (the best measured so far), the bounded gate.
2. Row-strip pipeline (``K3NN_KDA_INTRA=rows``, :mod:`k3nn.kernels.kda.triton_intra_rows`): the scores kernel
   alone with every config, the solve + w/u kernel with every config (timed as the pair minus the scores
   kernel, since it works in place on what the scores kernel wrote), the autotuned total; its outputs against
   the fused ones (relative difference per output, qg kg w u A egl X).
3. Full forward, bounded gate: fused intra and rows intra (speedup of rows over fused).
4. Correctness against the eager chunk form (fp32 math on the same rounded inputs): one bf16 case per gate,
   T=300 H=16 varlen with checkpoints and an initial state, fused and rows.
5. Time permitting: the split pipeline (``K3NN_KDA_INTRA=split``) per kernel and config, its outputs against
   the fused ones and its full forward; the fused kernel's other configs; the full forward with the softplus
   gate (fused / rows); last, fla-core ``chunk_kda`` as an anchor, only when more than 60 s remain (its own
   autotuning compiles for over a minute; ``python -m k3nn.bench.kda_prefill`` measures it properly).

Timing uses ``triton.testing.do_bench`` with short warm-up / repetition windows; later sections are skipped
when the elapsed time nears the budget (BUDGET_S), so the script stays under ~100 s including compilation.
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
from k3nn.kernels.kda import triton_intra_rows as tr
from k3nn.kernels.kda import triton_intra_split as ts
from k3nn.kernels.kda.chunk_torch import kda_chunk_eager

T0 = time.time()
BUDGET_S = 95.0
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
def intra(mode):
    old = os.environ.get("K3NN_KDA_INTRA")
    os.environ["K3NN_KDA_INTRA"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("K3NN_KDA_INTRA", None)
        else:
            os.environ["K3NN_KDA_INTRA"] = old


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


def rows_variants(args):
    q, k, v, g, beta, scale, NC, cs, cl = args
    bufs = _bufs(q, v, NC)
    k1, k2 = tr.rows_kernels()
    first = (k1.configs[0], k2.configs[0])
    launch = lambda cfgs, stages=(0, 1): tr.intra_rows_launch(  # noqa: E731
        q, k, v, g, beta, scale, NC, cs, cl, *bufs, configs=cfgs, stages=stages)
    say(f"rows pipeline at T={T_BIG} H={H_BIG} bounded gate: every config ({len(k1.configs)} scores, "
        f"{len(k2.configs)} solve+w/u)")
    b1 = None
    for cfg in k1.configs:
        if left() < 15:
            say(f"  scores {cfg_name(cfg)}: skipped (time)")
            continue
        ms = _time("scores", cfg, lambda cfg=cfg: launch((cfg, first[1]), (0,)))
        if ms is not None and (b1 is None or ms < b1[0]):
            b1 = (ms, cfg)
    say(f"  scores best: {b1[0]:.3f} ms [{cfg_name(b1[1])}]" if b1 else "  scores: no config ran")
    b2 = None
    if b1 is not None:
        for cfg in k2.configs:  # works in place on what the scores kernel wrote: the pair, less the scores
            if left() < 15:
                say(f"  solve+wu {cfg_name(cfg)}: skipped (time)")
                continue
            ms = _time("solve+wu", cfg, lambda cfg=cfg: launch((b1[1], cfg)), minus=b1[0])
            if ms is not None and (b2 is None or ms < b2[0]):
                b2 = (ms, cfg)
        say(f"  solve+w/u best: {b2[0]:.3f} ms [{cfg_name(b2[1])}]" if b2 else "  solve+w/u: no config ran")
    if b1 and b2:
        say(f"  sum of the per-kernel bests: {b1[0] + b2[0]:.3f} ms")
    t_rows = bench(lambda: tc._intra_launch(*args, mode="rows"))
    picks = [cfg_name(getattr(kern, "best_config", None)) for kern in (k1, k2)]
    say(f"  rows autotuned total: {t_rows:.3f} ms; picks: scores [{picks[0]}] solve+w/u [{picks[1]}]")
    return t_rows


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
            if left() < 20:
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
    ref = tc._intra_launch(*args, mode="fused", return_x=True)
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


def full_row(gen, gate, modes=("fused", "rows")):
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
    modes = ("fused", "rows", "split")
    print("\n| case | " + " | ".join(f"intra {m} ms" for m in modes) + " | " + " | ".join(f"full {m} ms" for m in modes)
          + " | fla ms |", flush=True)
    print("|---" * (2 * len(modes) + 2) + "|", flush=True)
    fmt = lambda x: f"{x:.3f}" if x else "-"  # noqa: E731
    for r in rows:
        ti = [fmt(t_intra.get(m)) if "lower_bound" in r["case"] else "-" for m in modes]
        print(f"| {r['case']} | " + " | ".join(ti) + " | " + " | ".join(fmt(r.get(m)) for m in modes)
              + f" | {fmt(r.get('fla'))} |", flush=True)


def check(gen, modes=("fused", "rows")):
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
            say(f"  bf16 {gate:12s} {mode:5s} rel err o {e[0]:.2e}  final {e[1]:.2e}  ckpt {e[2]:.2e}  "
                f"(tol 0.02) {verdict}")
    return worst


def main():
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
        f"K3NN_KDA_TUNE={os.environ.get('K3NN_KDA_TUNE', '1')}")
    gen = torch.Generator(device=DEV).manual_seed(0)
    q, k, v, g, beta, _ = inputs(T_BIG, H_BIG, "lower_bound", gen)
    NC, cs, cl = plan(T_BIG)
    args = (q, k, v, g, beta, D ** -0.5, NC, cs, cl)
    fcfgs = tc._kda_intra.configs
    say(f"fused _kda_intra at T={T_BIG} H={H_BIG} bounded gate: its first config (the rest at the end)")
    best = fused_variants(args, fcfgs[:1])
    t_intra = {"fused": best[0] if best else None}
    t_intra["rows"] = rows_variants(args)
    diff = compare_outputs(args, "rows")
    if t_intra["fused"]:
        say(f"intra: fused {t_intra['fused']:.3f} ms, rows autotuned {t_intra['rows']:.3f} ms "
            f"({t_intra['fused'] / t_intra['rows']:.2f}x)")
    say(f"full forward T={T_BIG} H={H_BIG}: K3NN_KDA_INTRA=fused / rows")
    row, data = full_row(gen, "lower_bound")
    rows = [row]
    torch.cuda.empty_cache()
    worst = 0.0
    if left() > 12:
        say("correctness vs kda_chunk_eager (fp32 math on the same inputs), T=300 H=16 varlen + checkpoints + h0")
        worst = check(gen)
    else:
        say("correctness section skipped (time)")
    if left() > 40:
        t_intra["split"] = split_variants(args)
        if t_intra["split"] and left() > 15:
            diff = max(diff, compare_outputs(args, "split"))
            with intra("split"):
                run = lambda: tc.kda_chunk_triton_fwd(data[0], data[1], data[2], data[3], data[4],  # noqa: E731
                                                      initial_state=data[5], output_final_state=True)
                run()
                sync()
                rows[0]["split"] = bench(run)
            say(f"  T{T_BIG} H{H_BIG} lower_bound full forward split {rows[0]['split']:.3f} ms")
    else:
        say("split pipeline skipped (time)")
    if len(fcfgs) > 1 and left() > 25:
        say(f"fused _kda_intra: the other {len(fcfgs) - 1} configs")
        b2 = fused_variants(args, fcfgs[1:])
        if b2 and b2[0] < (t_intra["fused"] or float("inf")):
            t_intra["fused"] = b2[0]
        say(f"  fused best: {min(x for x in (best, b2) if x) if (best or b2) else None}")
    del q, k, v, g, beta
    torch.cuda.empty_cache()
    if left() > 25:
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
    say(f"done; worst bf16 rel err vs eager {worst:.2e}; rows (split) vs fused intra outputs {diff:.1e}; "
        f"{'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
