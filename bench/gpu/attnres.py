"""AttnRes fused mix on the GPU: correctness of every entry point, then bandwidth of the kernel variants.

    python3 -m bench.gpu.attnres [--budget 400] [--variants a,b,...] [--tokens 8192,64,1]

1. bf16 correctness vs the eager references (k3nn.kernels.attnres.reference, k3nn.layers.attnres) for the
   mix, phase 1 and phase 2 at S = 1, 5, 9 and d = 7168 and an odd d (masked tail), and every named mix
   schedule (triton_mix.MIX_SCHEDULES) at S = 2 and 9, d = 7168 and 4099, plus a source 2 bytes off 16-byte
   alignment (the bulk L2 prefetch falls back to per-sector requests).
2. Copy bandwidth measured in this process (bench.common.device_meta), then the mix at T = 8192 (CUDA
   events, inputs far larger than L2) and the decode shapes T = 1, 64 (CUDA graph, inputs rotated past L2)
   for S = 9, 5, 2 and each schedule: us, TB/s for (S + 1)·T·d·2 bytes (every source read once, h written
   once), fraction of copy bandwidth, and the compiled kernel's registers / spills. The last lines name the
   fastest schedule per (T, S): the default (triton_mix._mix_config / DEFAULT_SCHEDULES) should be set from
   them. Candidate schedules are keyword knobs of attnres_mix_triton: add them to VARIANTS to time them.
   Compilation dominates (about 1-3 s per schedule and S); --budget stops starting new timings after that
   many seconds (default 400).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time

import torch

from k3nn.kernels.attnres import triton_mix as tm
from k3nn.kernels.attnres.reference import (
    attnres_phase1_reference,
    attnres_phase2_reference,
)
from k3nn.layers.attnres import attnres_mix_reference

from bench.common import bench_ms, device_meta, graph_bench_ms, rel_err

T0 = time.time()
BUDGET_S = 400.0  # stop starting new timings after this (--budget)
D = 7168
ODD_D = 4099
DT = torch.bfloat16
DEV = "cuda"

# name -> keyword overrides of attnres_mix_triton ({} = the default schedule); see triton_mix.MIX_SCHEDULES.
VARIANTS = dict(tm.MIX_SCHEDULES)


def say(*a) -> None:
    print(f"[{time.time() - T0:5.1f}s]", *a, flush=True)


def over_budget() -> bool:
    return time.time() - T0 > BUDGET_S


def weights(d: int, q: int | None, g: torch.Generator):
    shape = (d,) if q is None else (q, d)
    qw = (torch.randn(shape, device=DEV, generator=g) / math.sqrt(d) * 3).to(DT)
    nw = (0.5 + torch.rand(shape, device=DEV, generator=g)).to(DT)
    return qw, nw


def sources(T: int, d: int, S: int, g: torch.Generator) -> list[torch.Tensor]:
    return [(torch.randn(T, d, device=DEV, generator=g) * (1 + j)).to(DT) for j in range(S)]


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-2) -> bool:
    e = rel_err(out, ref)
    ok = e < tol
    if not ok:
        say(f"FAIL {name}: rel err {e:.3e}")
    return ok


def correctness() -> bool:
    g = torch.Generator(device=DEV).manual_seed(0)
    ok = True
    n = 0
    for d, S in ((D, 1), (D, 5), (D, 9), (ODD_D, 5)):
        T = 37
        src = sources(T, d, S, g)
        qw, nw = weights(d, None, g)
        ok &= check(f"mix d={d} S={S}", tm.attnres_mix_triton(src, qw, nw), attnres_mix_reference(src, qw, nw, 1e-5))
        n += 1
        if S == 9 and d == D:
            ok &= check_variants(src, qw, nw, f"S={S} d={d}")
            n += len(VARIANTS)
        QW, QN = weights(d, 3, g)
        o, m, l = tm.attnres_phase1_triton(src, QW, QN, 1e-5, torch.float32)
        ro, rm, rl = attnres_phase1_reference(src, QW, QN, 1e-5, torch.float32)
        ok &= check(f"phase1 o d={d} S={S}", o, ro, 1e-3) & check(f"phase1 m d={d} S={S}", m, rm, 1e-4)
        ok &= check(f"phase1 l d={d} S={S}", l, rl, 1e-4)
        part, upd = sources(T, d, 2, g)
        pw = (0.5 + torch.rand(d, device=DEV, generator=g)).to(DT)
        combos = ((True, True, True), (True, False, False), (False, False, False))
        for has_part, has_upd, post in combos if d == D else combos[:1]:
            args = (o[1], m[1], l[1], part if has_part else None, QW[1], QN[1], 1e-5)
            kw = dict(update=upd if has_upd else None, post_norm_weight=pw if post else None, dtype=DT)
            out = tm.attnres_phase2_triton(*args, **kw)
            ref = attnres_phase2_reference(*args, **kw)
            tag = f"phase2 d={d} S={S} partial={has_part} update={has_upd} post={post}"
            ok &= check(tag + " mix", out.mix, ref.mix)
            if post:
                ok &= check(tag + " normed", out.normed, ref.normed)
            if has_part:  # two-phase == one softmax over all sources
                allsrc = src + [ref.partial]
                ok &= check(tag + " vs one softmax", out.mix, attnres_mix_reference(allsrc, QW[1], QN[1], 1e-5))
            n += 1
    for d, S, T in ((D, 2, 300), (ODD_D, 9, 37), (ODD_D, 2, 5)):
        src = sources(T, d, S, g)
        qw, nw = weights(d, None, g)
        ok &= check_variants(src, qw, nw, f"S={S} d={d} T={T}")
        n += len(VARIANTS)
    # a source whose rows start 2 bytes off 16-byte alignment: the bulk L2 prefetch must step back to sectors
    src = sources(37, D, 5, g)
    buf = torch.empty(37 * D + 1, device=DEV, dtype=DT)
    src[2] = buf[1:].view(37, D).copy_(src[2])
    qw, nw = weights(D, None, g)
    ok &= check_variants(src, qw, nw, "S=5 misaligned source", names=[k for k, v in VARIANTS.items()
                                                                    if v.get("l2_kind") == 3][:4])
    say(f"correctness: {'all ok' if ok else 'FAILURES'} ({n} cases)")
    return ok


def check_variants(src, qw, nw, tag: str, names=None) -> bool:
    """Every schedule against eager; bit differences from the default (reduction trees) are only noted."""
    ok = True
    ref = attnres_mix_reference(src, qw, nw, 1e-5)
    base = tm.attnres_mix_triton(src, qw, nw)
    diff = []
    for name in names or VARIANTS:
        out = tm.attnres_mix_triton(src, qw, nw, **VARIANTS[name])
        ok &= check(f"mix {tag} variant {name}", out, ref)
        if not torch.equal(out, base):
            diff.append(name)
    if diff:
        say(f"note: {tag}: {', '.join(diff)} differ from the default in some bits")
    return ok


def kernel_regs() -> str:
    k = tm._last_kernel
    regs, spills = getattr(k, "n_regs", None), getattr(k, "n_spills", None)
    return f"{regs}/{spills}" if regs is not None else "?"


def time_mix(meta: dict, rows: list[dict], tokens: list[int], names: list[str] | None) -> None:
    g = torch.Generator(device=DEV).manual_seed(1)
    qw, nw = weights(D, None, g)
    copy = meta.get("copy_tbps") or float("nan")
    plan = [(T, S, names or list(VARIANTS)) for T in tokens for S in (9, 5, 2)]
    for T, S, todo in plan:
        if over_budget():
            say(f"budget: skipping T={T} S={S}")
            continue
        nbytes = (S + 1) * T * D * 2
        graph = T <= 64
        nsets = 1 if not graph else max(1, min(1000, math.ceil((128 << 20) / nbytes)))
        sets = [sources(T, D, S, g) for _ in range(nsets)]
        ref = attnres_mix_reference(sets[0], qw, nw, 1e-5)
        for name in todo:
            if over_budget():
                say(f"budget: skipping T={T} S={S} {name} and later variants")
                break
            kw = VARIANTS[name]
            e = rel_err(tm.attnres_mix_triton(sets[0], qw, nw, 1e-5, **kw), ref)
            regs = kernel_regs()
            if graph:
                it = itertools.cycle(sets)
                ms = graph_bench_ms(lambda it=it, kw=kw: tm.attnres_mix_triton(next(it), qw, nw, 1e-5, **kw),
                                    inner=nsets, rep=5)
            else:
                x = sets[0]
                ms = bench_ms(lambda x=x, kw=kw: tm.attnres_mix_triton(x, qw, nw, 1e-5, **kw), warmup=5, rep=30)
            tbps = nbytes / ms / 1e9
            rows.append(dict(T=T, S=S, variant=name, ms=ms, tbps=tbps, frac=tbps / copy, err=e, regs=regs))
            say(f"T={T:5d} S={S} {name:26s} {ms * 1e3:9.2f} us  {tbps:6.3f} TB/s  {tbps / copy:6.1%} of copy"
                f"  regs/spills {regs}  err {e:.1e}")
        del sets
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    global BUDGET_S, VARIANTS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds after which no new timing starts")
    ap.add_argument("--variants", default="", help="comma-separated schedule names (default: all)")
    ap.add_argument("--tokens", default="8192,64,1", help="token counts to time")
    ap.add_argument("--skip-correctness", action="store_true")
    args = ap.parse_args(argv)
    BUDGET_S = args.budget
    names = [v for v in args.variants.split(",") if v] or None
    if names:
        unknown = [v for v in names if v not in VARIANTS]
        if unknown:
            print(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}", flush=True)
            return 2
        VARIANTS = {k: VARIANTS[k] for k in ["default", *names] if k in VARIANTS}
        names = list(VARIANTS)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", flush=True)
        return 2
    import triton

    say(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}")
    ok = True if args.skip_correctness else correctness()
    meta = device_meta()
    say(f"copy {meta.get('copy_tbps')} TB/s (1 GiB each way)")
    rows: list[dict] = []
    time_mix(meta, rows, [int(t) for t in args.tokens.split(",") if t], names)
    print("\n    T  S  variant                          us    TB/s  frac_copy  regs/spills", flush=True)
    for r in rows:
        print(f"{r['T']:5d}  {r['S']}  {r['variant']:26s} {r['ms'] * 1e3:9.2f}  {r['tbps']:6.3f}  {r['frac']:7.1%}"
              f"    {r['regs']}", flush=True)
    print("\nbest per (T, S):", flush=True)
    for key, grp in itertools.groupby(sorted(rows, key=lambda r: (r["T"], r["S"], r["ms"])),
                                      key=lambda r: (r["T"], r["S"])):
        grp = list(grp)
        dflt = next((r for r in grp if r["variant"] == "default"), None)
        print(f"  T={key[0]:5d} S={key[1]}: {grp[0]['variant']:26s} {grp[0]['frac']:6.1%} of copy"
              + (f"  (default {dflt['frac']:6.1%})" if dflt else ""), flush=True)
    say("done" + ("" if ok else " (CORRECTNESS FAILURES above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
