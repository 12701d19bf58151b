#!/usr/bin/env python3
"""MXFP4 expert weight bandwidth at decode batch sizes (issue 5), one self-contained GPU check.

    python3 -m bench.gpu.moe_mx [--cuda RT,KS,U,PF,DEC ...] [--triton all|default|none]

K3 routed experts (3584 → 3072 gate+up → 3584, SiTU-GLU β 4/25), 128 experts, top-16, bf16 activations, random
MXFP4 weights. For 1, 4 and 16 tokens:

1. correctness of every variant vs the eager reference on dequantised bf16 weights (rel. Frobenius error and
   max |diff| / max |ref|);
2. copy bandwidth measured in this process, then each variant timed in a CUDA graph (alignment precomputed):
   µs, TB/s of the packed weight + scale bytes of the experts actually touched, fraction of copy bandwidth.

Variants: ``old`` = the grouped tensor-core GEMMs (tl.dot_scaled, autotuned), ``gemv*`` = triton_mx_gemv with
(BLOCK_N, BLOCK_K, VEC, warps, prefetch, decode, split_a) and rows per program ``bm``; ``word``: DECODE=2 (32-bit
word decode); ``cuda r16 ks2 u2 pf`` = cuda_mx_gemv (KernelTuning.moe_gemv="cuda") with 16·RT rows per CTA, KS warps
splitting K, U 128-k groups per load batch, PF prefetch, DEC 1 = e4m3 decode (``--cuda`` replaces the default
set; all CUDA configs are built once, in one module, before timing: the nvcc time is printed). Each CUDA config
runs as an A/B of the alignment block size (``cuda_block_m`` rules: ``one-block`` = 8 rows, the default;
``poisson`` = 2 / 4 / 8 at 1 / 4 / 16 tokens; ``mean-bm`` = ≈ pairs per touched expert, the earlier rule) and the
launch (``+pdl`` = the down kernel launched as a programmatic dependent of the up kernel); runs that repeat an
earlier block size and launch are skipped. ``--triton
default`` (the default) times only the grouped kernel and the dispatcher's Triton GEMV (after the CUDA
variants), ``all`` every Triton variant. Stops starting new variants after ``--budget`` seconds (default
95) so the whole run stays under two minutes. The last lines (``summary T=...``) name the best variant per token
count and the two A/B gains.
"""

from __future__ import annotations

import functools
import time

T_START = time.time()

import torch

from k3nn.kernels.moe import cuda_mx_gemv as cmx
from k3nn.kernels.moe.align import align_for
from k3nn.kernels.moe.reference import moe_expert_outputs_reference
from k3nn.kernels.moe.triton_fused import fused_expert_outputs, pick_block_m
from k3nn.kernels.moe.triton_mx_gemv import GemvConfig, gemv_block_m, mx_gemv_experts
from k3nn.quant.mxfp4 import MXFP4Weight

from bench.common import device_meta, graph_bench_ms, rel_err

print = functools.partial(print, flush=True)

E, D, I, TOPK = 128, 3584, 3072, 16
BETA, LIN = 4.0, 25.0
TOKENS = (1, 4, 16)
BUDGET_S = 95.0  # --budget

# name → (GemvConfig or None for the old path, rows per program: None = what the dispatcher picks)
VARIANTS = [
    ("old(scaled)", None, None),
    ("gemv ... word split-a (default)", GemvConfig(8, 512, 16, 2, True, 2, True), None),  # the Triton default
    ("gemv n16 k512 v16 w4", GemvConfig(16, 512, 16, 4, True, 0), None),
    ("gemv n8 k512 v16 w2", GemvConfig(8, 512, 16, 2, True, 0), None),  # DEFAULT_CONFIG (byte decode)
    # DECODE=2: 32-bit word decode, two fp16 patterns per lane (≈ 30% fewer SASS instructions per K step)
    ("gemv n8 k512 v16 w2 word", GemvConfig(8, 512, 16, 2, True, 2), None),
    ("gemv ... word split-a", GemvConfig(8, 512, 16, 2, True, 2, True), None),
    ("gemv n16 k512 v16 w4 word", GemvConfig(16, 512, 16, 4, True, 2, True), None),
    ("gemv n32 k512 v16 w8 word", GemvConfig(32, 512, 16, 8, True, 2, True), None),
    ("gemv ... no-prefetch", GemvConfig(16, 512, 16, 4, False, 0), None),
    ("gemv ... arith-decode", GemvConfig(16, 512, 16, 4, True, 1), None),
    ("gemv n32 k512 v16 w8", GemvConfig(32, 512, 16, 8, True, 0), None),
    ("gemv n16 k256 v8 w4", GemvConfig(16, 256, 8, 4, True, 0), None),
    ("gemv ... split-a", GemvConfig(16, 512, 16, 4, True, 0, True), None),
    ("gemv n16 k512 bm=4", GemvConfig(16, 512, 16, 4, True, 0), 4),
]


TRITON_DEFAULT = ("old(scaled)", "gemv ... word split-a (default)")

# CUDA launch shapes (CudaGemvConfig: row_tiles, k_split, unroll, prefetch, decode) timed by default; up has 28
# groups of 128 k per row, down 24, so k_split·unroll ∈ {2, 4, 14, 28} / {2, 3, 4, 6, 8, 12} wastes no slots.
CUDA_CFGS = [
    cmx.CudaGemvConfig(4, 2, 2, True, 1),  # DEFAULT_CONFIG
    cmx.CudaGemvConfig(2, 2, 2, True, 1),
]
# (label, cuda_block_m rule, PDL): decisive first; "one-block" (block_m 8) + PDL is the default
CUDA_AB = [("one-block+pdl", "one-block", True), ("poisson+pdl", "poisson", True), ("one-block", "one-block", False),
           ("mean-bm", "mean", False)]


def parse_args():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuda", nargs="*", default=None, metavar="RT,KS,U,PF,DEC",
                    help="CUDA configs to time (default: the built-in set); --cuda alone: no CUDA GEMV")
    ap.add_argument("--triton", choices=("all", "default", "none"), default="default")
    ap.add_argument("--experts", type=int, default=E,
                    help=f"routed experts (default {E}; K3 has 896: at 16 tokens about one pair per touched expert)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="stop starting new variants after this many s")
    return ap.parse_args()


def elapsed() -> float:
    return time.time() - T_START


def make_weights(dev, experts: int | None = None):
    """Random MXFP4 w1, w3 [experts, I, D] and w2 [experts, D, I] (default: the ``--experts`` count)."""
    g = torch.Generator(device=dev).manual_seed(0)
    n_exp = experts or E

    def mx(n, k):  # random codes, scales 2^-9..2^-6: O(1) outputs for O(1) inputs
        packed = torch.randint(0, 256, (n_exp, n, k // 2), generator=g, device=dev, dtype=torch.uint8)
        scale = torch.randint(118, 122, (n_exp, n, k // 32), generator=g, device=dev, dtype=torch.uint8)
        return MXFP4Weight(packed, scale)

    return mx(I, D), mx(I, D), mx(D, I)


def cuda_bm(rule, P):
    return cmx.cuda_block_m(P, E, rule)


def run_variant(cfg, bm, z, q1, q3, q2, ids, pdl=None):
    """A zero-argument callable computing the expert outputs y [T, k, D] with alignment precomputed."""
    T = z.shape[0]
    P = T * TOPK
    y = torch.empty(T, TOPK, D, dtype=z.dtype, device=z.device)
    if cfg is None:
        al = align_for(ids, E, pick_block_m(P, E))
        return (lambda: fused_expert_outputs(z, q1, q3, q2, ids, "situ", BETA, LIN, align=al, out=y,
                                             mx_mode="scaled")), y
    if isinstance(cfg, cmx.CudaGemvConfig):
        al = align_for(ids, E, cuda_bm(bm or "one-block", P))
        y2 = y.view(P, D)
        return (lambda: cmx.mx_gemv_experts_cuda(z, q1, q3, q2, al, y2, P, TOPK, 1, True, BETA, LIN, cfg, cfg,
                                                 configs=tuple(CUDA_CFGS), dtypes=("bf16",), pdl=pdl)), y
    al = align_for(ids, E, bm or gemv_block_m(P, E))
    y2 = y.view(P, D)
    return (lambda: mx_gemv_experts(z, q1, q3, q2, al, y2, P, TOPK, 1, True, BETA, LIN, cfg, cfg)), y


def main():
    global BUDGET_S, CUDA_CFGS, E
    args = parse_args()
    BUDGET_S = args.budget
    if args.experts < TOPK:
        raise SystemExit(f"--experts must be at least top-k = {TOPK}, got {args.experts}")
    E = args.experts
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    dev = "cuda"
    meta = device_meta()
    copy = meta["copy_tbps"]
    print(f"{meta['gpu']} torch {meta['torch']} triton {meta['triton']}: copy {copy} TB/s, "
          f"bf16 {meta['bf16_tflops']} TFLOP/s  [t={elapsed():.0f}s]")
    variants = [v + (None,) for v in VARIANTS
                if args.triton == "all" or (args.triton == "default" and v[0] in TRITON_DEFAULT)]
    if args.cuda is not None:
        CUDA_CFGS = [cmx.CudaGemvConfig(*(int(v) for v in c.split(","))) for c in args.cuda]
    why = cmx.available()
    if CUDA_CFGS and why is None and torch.cuda.get_device_capability() < (8, 9):
        CUDA_CFGS = [c for c in CUDA_CFGS if c.decode == 0]
    if CUDA_CFGS and why is None:
        try:
            cmx.build(tuple(CUDA_CFGS), ("bf16",))
            print(f"CUDA GEMV: {len(CUDA_CFGS)} configs x 3 block sizes x up/down built in "
                  f"{cmx.last_build_seconds:.1f}s (nvcc + host binding; 0 = cached)  [t={elapsed():.0f}s]")
            cuda_v = [(f"cuda {c.name()} {lab}", c, rule, pdl) for c in CUDA_CFGS for lab, rule, pdl in CUDA_AB]
            variants = cuda_v + variants
        except Exception as ex:  # a build failure must not hide the Triton numbers
            print(f"CUDA GEMV build FAILED {type(ex).__name__}: {str(ex)[-2000:]}")
    elif CUDA_CFGS:
        print(f"CUDA GEMV unavailable: {why}")
    q1, q3, q2 = make_weights(dev)
    per_expert = sum(w[0].nbytes() for w in (q1, q3, q2))
    g = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for T in TOKENS:
        z = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
        ids = torch.randn(T, E, device=dev, generator=g).topk(TOPK, dim=1).indices
        touched = torch.unique(ids).numel()
        nbytes = touched * per_expert
        ref = moe_expert_outputs_reference(z, q1, q3, q2, ids, "situ", BETA, LIN).float()
        P = T * TOPK
        load = torch.bincount(ids.flatten(), minlength=E)
        print(f"-- T={T}: {touched} experts touched (max {load.max().item()} pairs), {nbytes / 1e6:.1f} MB of "
              f"weights; gemv block_m {gemv_block_m(P, E)}, cuda block_m {cmx.cuda_block_m(P, E)} (poisson "
              f"{cmx.cuda_block_m(P, E, 'poisson')}, mean {cmx.cuda_block_m(P, E, 'mean')})  [t={elapsed():.0f}s]")
        done = set()
        for name, cfg, bm, pdl in variants:
            if isinstance(cfg, cmx.CudaGemvConfig):
                key = (cfg, cuda_bm(bm, P), bool(pdl))
                if key in done:
                    continue  # the same block size and launch as an earlier variant at this token count
                done.add(key)
                bmx = cuda_bm(bm, P)
                blocks = int(((load + bmx - 1) // bmx).sum())
                name = f"{name} bm{bmx}"
            elif bm is not None and (T < 16 or bm == gemv_block_m(P, E)):
                continue  # only where it differs from the dispatcher's choice and rows per expert can reach it
            if elapsed() > BUDGET_S:
                print(f"   {name}: skipped (time budget)")
                continue
            try:
                fn, y = run_variant(cfg, bm, z, q1, q3, q2, ids, pdl)
                fn()
                torch.cuda.synchronize()
                err = rel_err(y.float(), ref)
                mx_err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                ok = err < 2e-2
                us = graph_bench_ms(fn, inner=20, rep=10) * 1e3 if ok else float("nan")
            except Exception as ex:  # a variant that fails to compile must not hide the others
                print(f"   {name}: FAILED {type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}")
                continue
            tbps = nbytes / us / 1e6 if ok else float("nan")
            rows.append((T, name, us, tbps, tbps / copy, err, mx_err, ok))
            extra = (f"  ({blocks / touched:.2f} blocks/expert)" if isinstance(cfg, cmx.CudaGemvConfig) else "")
            print(f"   {name:40s} {us:9.1f} us  {tbps:6.3f} TB/s  {tbps / copy:6.1%} of copy  "
                  f"rel_err {err:.2e} max_rel {mx_err:.2e}{'' if ok else '  MISMATCH (not timed)'}{extra}"
                  f"  [t={elapsed():.0f}s]")
    print(f"\nMXFP4 experts, K3 dims, E={E} top-{TOPK}, copy {copy} TB/s (floor 60%, goal 80%)")
    print(f"{'T':>3} | {'variant':40s} | {'us':>9} | {'TB/s':>6} | {'frac':>6} | {'rel_err':>8} | {'max_rel':>8}")
    for T, name, us, tbps, frac, err, mx_err, ok in rows:
        print(f"{T:>3} | {name:40s} | {us:9.1f} | {tbps:6.3f} | {frac:6.1%} | {err:8.1e} | {mx_err:8.1e}"
              f"{'' if ok else ' MISMATCH'}")
    for T in TOKENS:
        best = [r for r in rows if r[0] == T and r[7] and r[1] != "old(scaled)"]
        old = [r for r in rows if r[0] == T and r[1] == "old(scaled)" and r[7]]
        if best:
            b = min(best, key=lambda r: r[2])
            print(f"best T={T}: {b[1]} {b[4]:.1%} of copy" + (f" ({old[0][2] / b[2]:.2f}x vs old)" if old else ""))
    for T in TOKENS:  # the A/B per CUDA config: PDL vs none, one block per expert vs the smaller rules
        cb = {r[1]: r for r in rows if r[0] == T and r[7] and r[1].startswith("cuda")}
        if not cb:
            continue
        b = min(cb.values(), key=lambda r: r[2])
        ab = []
        for c in CUDA_CFGS:
            one_pdl, poisson_pdl, one, mean = (
                next((r for n, r in cb.items() if n.startswith(f"cuda {c.name()} {lab} ")), None)
                for lab in ("one-block+pdl", "poisson+pdl", "one-block", "mean-bm"))
            parts = [f"pdl {one[2] / one_pdl[2] - 1:+.1%}"] if one and one_pdl else []
            if one_pdl and poisson_pdl:
                parts.append(f"one-block vs poisson {poisson_pdl[2] / one_pdl[2] - 1:+.1%}")
            if one and mean:
                parts.append(f"one-block vs mean {mean[2] / one[2] - 1:+.1%}")
            if parts:
                ab.append(f"r{16 * c.row_tiles}: " + ", ".join(parts))
        print(f"summary T={T}: best {b[1]} {b[4]:.1%} of copy ({b[2]:.1f} us)"
              + (f"; speedups {'; '.join(ab)}" if ab else ""))
    print(f"done in {elapsed():.0f}s")


if __name__ == "__main__":
    main()
