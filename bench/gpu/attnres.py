"""AttnRes fused mix on the GPU: correctness of every entry point, then bandwidth of the kernel variants.

    PYTHONPATH=src python3 bench/gpu/attnres.py            (about 60-90 s, most of it Triton compilation)

1. bf16 correctness vs the eager references (k3nn.kernels.attnres.reference, k3nn.layers.attnres) for the
   mix, phase 1 and phase 2 at S = 1, 5, 9 and d = 7168 and an odd d (masked tail), every variant at S = 9.
2. Copy bandwidth measured in this process (k3nn.bench.common.device_meta), then the mix at T = 8192 (CUDA
   events, inputs far larger than L2) and the decode shapes T = 1, 64 (CUDA graph, inputs rotated past L2)
   for S = 2, 5, 9 and each kernel variant: ms, TB/s for (S + 1)·T·d·2 bytes, fraction of copy bandwidth.
   The last lines name the fastest variant per (T, S): the default schedule (triton_mix._mix_config)
   should be set from them.
"""

from __future__ import annotations

import itertools
import math
import sys
import time

import torch

from k3nn.bench.common import bench_ms, device_meta, graph_bench_ms, rel_err
from k3nn.kernels.attnres import triton_mix as tm
from k3nn.kernels.attnres.reference import (
    attnres_phase1_reference,
    attnres_phase2_reference,
)
from k3nn.layers.attnres import attnres_mix_reference

T0 = time.time()
BUDGET_S = 85.0  # stop starting new timings after this (the whole run must stay under 90 s)
D = 7168
ODD_D = 4099
DT = torch.bfloat16
DEV = "cuda"

# name -> keyword overrides of attnres_mix_triton ({} = the default schedule). prefetch is clipped to S - 1.
VARIANTS = {
    "default": {},
    "old-8w-pf2": dict(num_warps=8, prefetch=2, qv_reload=True, join=True, ordered=False, fence=0),
    "16w-pf2-ord": dict(num_warps=16, prefetch=2, join=True, ordered=True, fence=1),
    "16w-pf3-ord": dict(num_warps=16, prefetch=3, join=True, ordered=True, fence=1),
    "16w-pf4-ord": dict(num_warps=16, prefetch=4, join=True, ordered=True, fence=1),
    "32w-pf3-ord": dict(num_warps=32, prefetch=3, join=True, ordered=True, fence=1),
    "16w-pf3-asm": dict(num_warps=16, prefetch=3, join=True, ordered=True, fence=2),
    "16w-allfirst": dict(num_warps=16, prefetch=8, join=True, ordered=False, fence=1),
    "8w-pf1-ord": dict(num_warps=8, prefetch=1, join=True, ordered=True, fence=1),
    "16w-pf3-noevict": dict(num_warps=16, prefetch=3, join=True, ordered=True, fence=1, evict=False),
}
DECODE_VARIANTS = ["default", "old-8w-pf2", "16w-pf2-ord", "32w-pf3-ord", "8w-pf1-ord"]


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
            ref = attnres_mix_reference(src, qw, nw, 1e-5)
            base = tm.attnres_mix_triton(src, qw, nw)
            for name, kw in VARIANTS.items():  # every schedule is bit-identical to the default
                out = tm.attnres_mix_triton(src, qw, nw, **kw)
                ok &= check(f"mix variant {name}", out, ref)
                if not torch.equal(out, base):
                    say(f"note: variant {name} differs from the default in some bits")
                n += 1
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
    say(f"correctness: {'all ok' if ok else 'FAILURES'} ({n} cases)")
    return ok


def time_mix(meta: dict, rows: list[dict]) -> None:
    g = torch.Generator(device=DEV).manual_seed(1)
    qw, nw = weights(D, None, g)
    copy = meta.get("copy_tbps") or float("nan")
    plan = [(8192, S, list(VARIANTS)) for S in (9, 5, 2)] + \
           [(T, S, DECODE_VARIANTS) for T in (64, 1) for S in (9, 5, 2)]
    for T, S, names in plan:
        if over_budget():
            say(f"budget: skipping T={T} S={S}")
            continue
        nbytes = (S + 1) * T * D * 2
        graph = T <= 64
        nsets = 1 if not graph else max(1, min(1000, math.ceil((128 << 20) / nbytes)))
        sets = [sources(T, D, S, g) for _ in range(nsets)]
        ref = attnres_mix_reference(sets[0], qw, nw, 1e-5)
        for name in names:
            if over_budget():
                say(f"budget: skipping T={T} S={S} {name} and later variants")
                break
            kw = VARIANTS[name]
            e = rel_err(tm.attnres_mix_triton(sets[0], qw, nw, 1e-5, **kw), ref)
            if graph:
                it = itertools.cycle(sets)
                ms = graph_bench_ms(lambda it=it, kw=kw: tm.attnres_mix_triton(next(it), qw, nw, 1e-5, **kw),
                                    inner=nsets, rep=5)
            else:
                x = sets[0]
                ms = bench_ms(lambda x=x, kw=kw: tm.attnres_mix_triton(x, qw, nw, 1e-5, **kw), warmup=5, rep=30)
            tbps = nbytes / ms / 1e9
            rows.append(dict(T=T, S=S, variant=name, ms=ms, tbps=tbps, frac=tbps / copy, err=e))
            say(f"T={T:5d} S={S} {name:16s} {ms * 1e3:9.2f} us  {tbps:6.3f} TB/s  {tbps / copy:6.1%} of copy"
                f"  err {e:.1e}")
        del sets
        torch.cuda.empty_cache()


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", flush=True)
        return 2
    import triton

    say(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}")
    ok = correctness()
    meta = device_meta()
    say(f"copy {meta.get('copy_tbps')} TB/s (1 GiB each way)")
    rows: list[dict] = []
    time_mix(meta, rows)
    print("\n    T  S  variant            us      TB/s  frac_copy", flush=True)
    for r in rows:
        print(f"{r['T']:5d}  {r['S']}  {r['variant']:16s} {r['ms'] * 1e3:8.2f}  {r['tbps']:6.3f}  {r['frac']:7.1%}",
              flush=True)
    print("\nbest per (T, S):", flush=True)
    for key, grp in itertools.groupby(sorted(rows, key=lambda r: (r["T"], r["S"], r["ms"])),
                                      key=lambda r: (r["T"], r["S"])):
        grp = list(grp)
        dflt = next((r for r in grp if r["variant"] == "default"), None)
        print(f"  T={key[0]:5d} S={key[1]}: {grp[0]['variant']:16s} {grp[0]['frac']:6.1%} of copy"
              + (f"  (default {dflt['frac']:6.1%})" if dflt else ""), flush=True)
    say("done" + ("" if ok else " (CORRECTNESS FAILURES above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
