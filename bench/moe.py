"""MoE benchmark (H200): fused Triton MoE vs a ``torch._grouped_mm`` composition, and MXFP4 weight bandwidth.

Shapes: K3 routed experts in latent width (3584 → 3072 → 3584, SiTU-GLU β 4/25), top-16, ``--experts`` experts.

* ``moe`` rows — the latent MoE core for T tokens: route (sigmoid + bias + top-k + renormalise on given
  router logits) → sort by expert → up/gate GEMM → SiTU → down GEMM → weighted top-k combine → RMSNorm.
  k3nn: align + two fused Triton GEMMs + the deferred-finalization kernel. Anchor: argsort + gather +
  ``torch._grouped_mm`` (w1|w3 concatenated) + eager SiTU + ``torch._grouped_mm`` + weighted ``index_add_`` +
  RMSNorm. Both bf16, same inputs, checked against the eager reference first.
* ``moe-mxfp4`` rows — MXFP4 expert weights decoded in-kernel at 1–16 tokens, timed in a CUDA graph:
  ``k3nn_ms`` = the two expert GEMMs (alignment precomputed), bandwidth = bytes of the experts actually
  touched (packed + scales) / that time; ``layer_ms`` = the whole layer (route, align, GEMMs, finalize).
  ``--mx-modes``: ``auto`` (the dispatcher: the decode GEMV at ≤ ``KernelTuning.moe_gemv_pairs`` pairs),
  ``gemv``, or a grouped-GEMM decode (``scaled``, ``split``, ``join``).
"""

from __future__ import annotations

import argparse
import signal

import torch

from k3nn.kernels.moe.align import moe_align
from k3nn.kernels.moe.reference import moe_experts_reference
from k3nn.kernels.moe.triton_fused import block_m_for, fused_expert_outputs, moe_finalize_triton
from k3nn.layers.mlp import situ_glu
from k3nn.layers.moe import route
from k3nn.quant.mxfp4 import MXFP4Weight, mxfp4_quantize

from bench.common import bench_ms, graph_bench_ms, print_table, rel_err, write_results

D_LAT, INTER, TOPK = 3584, 3072, 16
BETA, LIN_BETA = 4.0, 25.0


def _rms(u, g, eps=1e-5):
    uf = u.float()
    return (uf * torch.rsqrt(uf.pow(2).mean(-1, keepdim=True) + eps) * g.float()).to(u.dtype)


def k3nn_layer(logits, bias, z, w1, w3, w2, gain, mx_mode=None):
    ids, w = route(logits, bias, TOPK, True, 1.0)
    y = fused_expert_outputs(z, w1, w3, w2, ids, "situ", BETA, LIN_BETA, mx_mode=mx_mode)
    return moe_finalize_triton(y, w, gain, 1e-5)


def grouped_mm_layer(logits, bias, z, w13_t, w2_t, gain):
    """The anchor: the best plain-PyTorch composition around ``torch._grouped_mm``."""
    T = z.shape[0]
    E = w13_t.shape[0]
    ids, w = route(logits, bias, TOPK, True, 1.0)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // TOPK
    counts = torch.zeros(E, dtype=torch.int32, device=z.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    xs = z[tok]
    h = torch._grouped_mm(xs, w13_t, offs=offs)
    a = situ_glu(h[:, :INTER], h[:, INTER:], BETA, LIN_BETA)
    ys = torch._grouped_mm(a, w2_t, offs=offs)
    u = torch.zeros(T, z.shape[1], dtype=torch.float32, device=z.device)
    u.index_add_(0, tok, ys.float() * w.reshape(-1)[order, None])
    return _rms(u, gain).to(z.dtype)


def reference_layer(logits, bias, z, w1, w3, w2, gain):
    ids, w = route(logits, bias, TOPK, True, 1.0)
    u = moe_experts_reference(z, w1, w3, w2, ids, w, "situ", BETA, LIN_BETA)
    return _rms(u, gain)


def _touched_bytes(ids: torch.Tensor, w1: MXFP4Weight, w3: MXFP4Weight, w2: MXFP4Weight) -> int:
    n = torch.unique(ids).numel()
    per = sum(w[0].nbytes() for w in (w1, w3, w2))
    return n * per


def main(argv=None):
    ap = argparse.ArgumentParser(prog="k3nn bench moe")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", type=int, nargs="*", default=[256, 1024, 4096, 8192])
    ap.add_argument("--mx-tokens", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--mx-modes", nargs="*", choices=["auto", "gemv", "scaled", "split", "join"],
                    default=["auto", "scaled"], help="auto: what the layer uses (the GEMV at decode sizes)")
    ap.add_argument("--skip-bf16", action="store_true")
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "the moe benchmark needs a CUDA GPU"
    rows: list[dict] = []
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit("SIGTERM")))
    try:
        _run(args, rows)
    finally:  # a time limit still leaves the rows measured so far
        if rows:
            path = write_results("moe", rows, {"experts": args.experts, "top_k": TOPK, "d_latent": D_LAT,
                                               "inter": INTER})
            print_table(rows, ["case", "k3nn_ms", "anchor_ms", "speedup", "tflops", "tbps", "frac_copy_bw"])
            print(f"wrote {path}")
    from k3nn.kernels.moe import triton_fused as tf
    for name, kern in [*(("up-" + k, v) for k, v in tf._UP.items()), *(("down-" + k, v) for k, v in tf._DOWN.items())]:
        for key, cfg in getattr(kern, "cache", {}).items():
            print("tuned", name, key, cfg)
    return rows


def _run(args, rows):
    dev = "cuda"
    E = args.experts
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    w1 = (torch.randn(E, INTER, D_LAT, device=dev, generator=g) / D_LAT ** 0.5).to(bf)
    w3 = (torch.randn(E, INTER, D_LAT, device=dev, generator=g) / D_LAT ** 0.5).to(bf)
    w2 = (torch.randn(E, D_LAT, INTER, device=dev, generator=g) / INTER ** 0.5).to(bf)
    gain = (1 + 0.1 * torch.randn(D_LAT, device=dev, generator=g)).to(bf)
    bias = 0.05 * torch.randn(E, device=dev, generator=g)

    def inputs(T):
        logits = torch.randn(T, E, device=dev, generator=g)
        z = torch.randn(T, D_LAT, device=dev, generator=g).to(bf)
        return logits, z

    if not args.skip_bf16:
        w13_t = torch.cat([w1, w3], 1).transpose(1, 2)  # [E, D, 2I] column-major: grouped_mm's layout
        w2_t = w2.transpose(1, 2)
        for T in args.tokens:
            logits, z = inputs(T)
            ref = reference_layer(logits, bias, z, w1, w3, w2, gain)
            out = k3nn_layer(logits, bias, z, w1, w3, w2, gain)
            anc = grouped_mm_layer(logits, bias, z, w13_t, w2_t, gain)
            err, aerr = rel_err(out, ref), rel_err(anc, ref)
            if not (err < 2e-2 and aerr < 2e-2):
                print(f"MISMATCH T={T}: k3nn rel_err {err}, anchor rel_err {aerr}; not timed")
                continue
            ms = bench_ms(lambda: k3nn_layer(logits, bias, z, w1, w3, w2, gain))
            ams = bench_ms(lambda: grouped_mm_layer(logits, bias, z, w13_t, w2_t, gain))
            flops = 2 * 3 * T * TOPK * INTER * D_LAT
            rows.append({"case": f"moe bf16 T={T} E={E} k={TOPK} {D_LAT}->{INTER}->{D_LAT} situ+norm",
                         "suite": "moe", "k3nn_ms": round(ms, 4), "anchor": "torch._grouped_mm composition",
                         "anchor_ms": round(ams, 4), "speedup": round(ams / ms, 3),
                         "tflops": round(flops / ms / 1e9, 1), "anchor_tflops": round(flops / ams / 1e9, 1),
                         "rel_err": err, "anchor_rel_err": aerr})
            print(rows[-1])
        del w13_t, w2_t
        torch.cuda.empty_cache()

    if args.mx_tokens:
        def q(w):  # expert by expert: bounded temporaries
            parts = [mxfp4_quantize(w[e]) for e in range(w.shape[0])]
            return MXFP4Weight(torch.stack([p.packed for p in parts]), torch.stack([p.scale for p in parts]))

        q1, q3, q2 = q(w1), q(w3), q(w2)
        del w1, w3, w2
        torch.cuda.empty_cache()
        for T in args.mx_tokens:
            logits, z = inputs(T)
            ids, _ = route(logits, bias, TOPK, True, 1.0)
            nbytes = _touched_bytes(ids, q1, q3, q2)
            ref = reference_layer(logits, bias, z, q1, q3, q2, gain)
            for mode in args.mx_modes:
                sp = None if mode == "auto" else mode
                out = k3nn_layer(logits, bias, z, q1, q3, q2, gain, mx_mode=sp)
                err = rel_err(out, ref)
                if not err < 2e-2:
                    print(f"MISMATCH mxfp4 T={T} {mode}: rel_err {err}; not timed")
                    continue
                # weight bandwidth of the two expert GEMMs (alignment precomputed), and the whole layer
                al = moe_align(ids, E, block_m_for(ids.numel(), E, True, sp))
                ms = graph_bench_ms(lambda: fused_expert_outputs(z, q1, q3, q2, ids, "situ", BETA, LIN_BETA,
                                                                 align=al, mx_mode=sp))
                layer_ms = graph_bench_ms(lambda: k3nn_layer(logits, bias, z, q1, q3, q2, gain, mx_mode=sp))
                rows.append({"case": f"moe-mxfp4 T={T} E={E} k={TOPK} experts_touched={torch.unique(ids).numel()} "
                                     f"decode={mode} (expert GEMMs)",
                             "suite": "moe-mxfp4", "k3nn_ms": round(ms, 4), "layer_ms": round(layer_ms, 4),
                             "bytes": nbytes, "tbps": round(nbytes / ms / 1e9, 3), "rel_err": err})
                print(rows[-1])


if __name__ == "__main__":
    main()
