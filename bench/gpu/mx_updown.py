#!/usr/bin/env python3
"""Launch shapes of the CUDA MXFP4 expert GEMV's two kernels timed apart: the up kernel (w1 | w3 + GLU, K = 3584)
and the down kernel (w2, K = 3072) differ in their bytes per load batch (two matrices against one), so each may
want its own shape. One GPU check:

    python3 -m bench.gpu.mx_updown [--configs RT,KS,U,PF,DEC ...] [--experts 128] [--tokens 1,4,16]

K3 routed experts (3584 → 3072 gate+up → 3584, SiTU-GLU β 4/25), top-16, bf16, random MXFP4 weights. Every
config is built once (bf16 only) in one module. For each token count and config it checks the pair (up with the
default shape, down with the config) against the eager reference, then times in CUDA graphs (alignment
precomputed): the up kernel alone, the down kernel alone (no PDL), and the pair as the model runs it (default up +
this down, and this up + default down, with PDL). % of copy counts the touched experts' packed weights and scales.
The last lines name the best up and down shapes per token count.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from k3nn.kernels.moe import cuda_mx_gemv as cmx
from k3nn.kernels.moe.align import align_for
from k3nn.kernels.moe.reference import moe_expert_outputs_reference
from k3nn.kernels.moe.triton_fused import fused_expert_outputs, pick_block_m

from bench.common import device_meta, graph_bench_ms, rel_err
from bench.gpu.moe_mx import BETA, D, I, LIN, TOPK, make_weights

print = functools.partial(print, flush=True)

CONFIGS = ["4,2,2,1,1", "4,2,4,1,1", "4,2,3,1,1", "4,2,4,0,1", "4,2,6,0,1", "2,4,3,1,1", "2,2,4,1,1", "4,4,3,1,1"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="*", default=CONFIGS, metavar="RT,KS,U,PF,DEC")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--budget", type=float, default=150.0, help="stop starting new cases after this many s")
    ap.add_argument("--grouped", action="store_true", help="also time the grouped tensor-core GEMMs per token count")
    args = ap.parse_args()
    t0 = time.time()
    E, dev = args.experts, "cuda"
    cfgs = [cmx.CudaGemvConfig(*(int(v) for v in c.split(","))) for c in args.configs]
    if cmx.DEFAULT_CONFIG not in cfgs:
        cfgs.insert(0, cmx.DEFAULT_CONFIG)
    configs = tuple(cfgs)
    meta = device_meta()
    copy = meta["copy_tbps"]
    print(f"{meta['gpu']} torch {meta['torch']}: copy {copy} TB/s")
    cmx.build(configs, ("bf16",))
    print(f"{len(configs)} configs built in {cmx.last_build_seconds:.1f}s  [t={time.time() - t0:.0f}s]")
    q1, q3, q2 = make_weights(dev, E)
    up_b = q1[0].nbytes() + q3[0].nbytes()
    dn_b = q2[0].nbytes()
    g = torch.Generator(device=dev).manual_seed(1)
    best = []
    for T in (int(t) for t in args.tokens.split(",")):
        z = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
        ids = torch.randn(T, E, device=dev, generator=g).topk(TOPK, dim=1).indices
        touched = torch.unique(ids).numel()
        P = T * TOPK
        al = align_for(ids, E, cmx.cuda_block_m(P, E))
        nb = al.expert_ids.numel()
        h = torch.empty(nb * al.block_m, I, dtype=z.dtype, device=dev)
        y = torch.empty(P, D, dtype=z.dtype, device=dev)
        ref = moe_expert_outputs_reference(z, q1, q3, q2, ids, "situ", BETA, LIN).float().reshape(P, D)
        mc = (configs, ("bf16",))
        print(f"-- T={T}: {touched} experts, up {touched * up_b / 1e6:.1f} MB, down {touched * dn_b / 1e6:.1f} MB")
        rows = []
        for c in cfgs:
            if time.time() - t0 > args.budget:
                print(f"   {c.name()}: skipped (budget)")
                continue

            def up(c=c):
                cmx._launch(mc, c, True, z, q1, q3, h, al, TOPK, P, True, 1, True, BETA, LIN)

            def down(c=c):
                cmx._launch(mc, c, False, h, q2, q2, y, al, TOPK, P, False, 1, True, BETA, LIN, False)

            def pair_dn(c=c):
                cmx.mx_gemv_experts_cuda(z, q1, q3, q2, al, y, P, TOPK, 1, True, BETA, LIN, cmx.DEFAULT_CONFIG, c,
                                         configs=configs, dtypes=("bf16",))

            def pair_up(c=c):
                cmx.mx_gemv_experts_cuda(z, q1, q3, q2, al, y, P, TOPK, 1, True, BETA, LIN, c, cmx.DEFAULT_CONFIG,
                                         configs=configs, dtypes=("bf16",))

            def pair(c=c):
                cmx.mx_gemv_experts_cuda(z, q1, q3, q2, al, y, P, TOPK, 1, True, BETA, LIN, c, c,
                                         configs=configs, dtypes=("bf16",))

            try:
                y.fill_(float("nan"))
                up()
                down()
                torch.cuda.synchronize()
                err = rel_err(y.float(), ref)
                if not err < 2e-2:
                    print(f"   {c.name()}: MISMATCH rel_err {err:.2e}")
                    continue
                us = [graph_bench_ms(f, inner=20, rep=10) * 1e3 for f in (up, down, pair_dn, pair_up, pair)]
            except Exception as ex:
                print(f"   {c.name()}: FAILED {type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}")
                continue
            fu, fd = touched * up_b / us[0] / 1e6 / copy, touched * dn_b / us[1] / 1e6 / copy
            fp = touched * (up_b + dn_b) / us[2] / 1e6 / copy
            rows.append((c, *us))
            print(f"   {c.name():18s} up {us[0]:6.1f} us {fu:6.1%} | down {us[1]:6.1f} us {fd:6.1%} | "
                  f"pair(def up) {us[2]:6.1f} us {fp:6.1%} | pair(def down) {us[3]:6.1f} us | pair {us[4]:6.1f} us "
                  f"{touched * (up_b + dn_b) / us[4] / 1e6 / copy:6.1%} | rel_err {err:.1e}")
        if args.grouped:  # the grouped tensor-core GEMMs (tl.dot_scaled), what batches above the GEMV limit take
            ala = align_for(ids, E, pick_block_m(P, E))
            y3 = y.view(T, TOPK, D)

            def grouped():
                fused_expert_outputs(z, q1, q3, q2, ids, "situ", BETA, LIN, align=ala, out=y3, mx_mode="scaled")

            grouped()
            torch.cuda.synchronize()
            err = rel_err(y.float(), ref)
            us = graph_bench_ms(grouped, inner=5, rep=5) * 1e3
            fp = touched * (up_b + dn_b) / us / 1e6 / copy
            print(f"   {'grouped dot_scaled':18s} pair {us:7.1f} us {fp:6.1%} of copy | rel_err {err:.1e}")
            if rows:
                print(f"   GEMV pair / grouped: {rows[0][3] / us:.2f}x the time ({cfgs[0].name()})")
        if rows:
            bu, bd = min(rows, key=lambda r: r[1]), min(rows, key=lambda r: r[2])
            bp = min(rows, key=lambda r: r[3])
            best.append(f"best T={T} E={E}: up {bu[0].name()} {bu[1]:.1f} us; down {bd[0].name()} {bd[2]:.1f} us; "
                        f"pair with default up: {bp[0].name()} {bp[3]:.1f} us (default {rows[0][3]:.1f})")
    print("\n".join(best))
    print(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
