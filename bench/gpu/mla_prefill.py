"""MLA prefill attention on the GPU: correctness of ``ops.mla_attention`` (Triton) against the eager reference, then
every tile candidate of the Triton kernel against torch SDPA (each backend that accepts the call) at Kimi dims
(qk 192 = nope 128 + rope 64, v 128), causal, one sequence; plus the chunked case (queries at an offset into a
longer key range). Prints TFLOP/s of the causal product next to the bf16 matmul ceiling measured in the run.

    python -m bench.gpu.mla_prefill [--lengths 8192,32768,131072] [--heads 32] [--quick]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from k3nn.kernels.mla.prefill import mla_attention_reference
from k3nn.kernels.mla.triton_prefill import default_config, mla_attention_triton

from bench.common import bench_ms, device_meta, rel_err

CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3),
           (64, 128, 4, 2), (128, 128, 8, 3), (64, 32, 4, 4)]


def inputs(T, L, H, gen):
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, kv, kr = r(1, T, H, 192), r(1, L, H, 256), r(1, L, 64)
    return q[..., :128], q[..., 128:], kv[..., :128], kr, kv[..., 128:]


def check(gen):
    worst = 0.0
    for T, L, H, km in [(1, 1, 2, False), (77, 77, 3, False), (300, 1000, 2, True), (1024, 1024, 4, False),
                        (129, 4000, 2, False)]:
        args = inputs(T, L, H, gen)
        mask = (torch.rand(1, L, generator=gen, device="cuda") > 0.2) if km else None
        ref, lref = mla_attention_reference(*(a.float() for a in args), 192 ** -0.5, key_mask=mask, return_lse=True)
        o, lse = mla_attention_triton(*args, 192 ** -0.5, key_mask=mask, return_lse=True)
        e, el = rel_err(o, ref), rel_err(lse, lref)
        worst = max(worst, e)
        print(f"check T={T} L={L} H={H} mask={km}: o rel err {e:.2e}, lse {el:.2e}", flush=True)
    # varlen
    cu = torch.tensor([0, 100, 100, 900, 1500], device="cuda")
    args = inputs(1500, 1500, 2, gen)
    ref = mla_attention_reference(*(a.float() for a in args), 192 ** -0.5, cu_seqlens=cu)
    o = mla_attention_triton(*args, 192 ** -0.5, cu_seqlens=cu)
    print(f"check varlen: o rel err {rel_err(o, ref):.2e}", flush=True)
    # fp32 with TF32 off: IEEE products
    torch.backends.cuda.matmul.allow_tf32 = False
    args = inputs(500, 700, 2, gen)
    ref = mla_attention_reference(*(a.double() for a in args), 192 ** -0.5)
    o = mla_attention_triton(*(a.float() for a in args), 192 ** -0.5)
    print(f"check fp32 (tf32 off) vs fp64: o rel err {rel_err(o, ref):.2e}", flush=True)
    return worst


def sdpa_variants(qn, qr, kn, kr, v, causal_offset):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H = qn.shape[2]
    q = torch.cat([qn, qr], -1).transpose(1, 2)
    k = torch.cat([kn, kr[:, :, None].expand(-1, -1, H, -1)], -1).transpose(1, 2)
    vv = v.transpose(1, 2)
    out = {}
    for name, be in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        if causal_offset:
            from torch.nn.attention.bias import causal_lower_right

            bias = causal_lower_right(q.shape[2], k.shape[2])
            fn = lambda be=be: _sdpa(be, q, k, vv, attn_mask=bias)  # noqa: E731
        else:
            fn = lambda be=be: _sdpa(be, q, k, vv, is_causal=True)  # noqa: E731
        try:
            fn()
            out[name] = fn
        except Exception as e:  # a backend that refuses these dims
            print(f"  sdpa {name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
    return out


def _sdpa(be, q, k, v, **kw):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([be]):
        return F.scaled_dot_product_attention(q, k, v, scale=192 ** -0.5, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="the default tile and SDPA only")
    args = ap.parse_args()
    meta = device_meta()
    print(f"# {meta}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    check(gen)
    H = args.heads
    cases = [(T, T) for T in map(int, args.lengths.split(","))] + [(32768, 131072)]
    table = []
    for T, L in cases:
        a = inputs(T, L, H, gen)
        flops = H * (192 + 128) * (T * T + 2 * T * (L - T))  # causal part + the full context part
        rep = 200 if T <= 32768 else 600
        res = {}
        cfgs = [default_config(128, 64, 128, torch.bfloat16)] + ([] if args.quick else CONFIGS)
        for cfg in dict.fromkeys(cfgs):
            try:
                ms = bench_ms(lambda cfg=cfg: mla_attention_triton(*a, 192 ** -0.5, config=cfg), warmup=50, rep=rep)
                res[f"triton{cfg}"] = ms
            except Exception as e:
                print(f"  triton {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
        for name, fn in sdpa_variants(*a, causal_offset=L != T).items():
            res[f"sdpa-{name}"] = bench_ms(fn, warmup=50, rep=rep)
        if L == T and "sdpa-cudnn" in res:
            ref = sdpa_variants(*a, causal_offset=False)["cudnn"]().transpose(1, 2)
            print(f"  T={T}: triton vs cudnn rel err {rel_err(mla_attention_triton(*a, 192 ** -0.5), ref):.2e}")
        for k, ms in sorted(res.items(), key=lambda kv: kv[1]):
            tf = flops / ms / 1e9
            table.append((f"T={T} L={L} H={H}", k, ms, tf, tf / meta["bf16_tflops"]))
            print(f"T={T} L={L} H={H} {k:28s} {ms:9.3f} ms {tf:7.1f} TFLOP/s {tf / meta['bf16_tflops']:.2f}", flush=True)
        del a
        torch.cuda.empty_cache()
    print("\ncase | impl | ms | TFLOP/s | of bf16 peak")
    for row in table:
        print(f"{row[0]} | {row[1]} | {row[2]:.3f} | {row[3]:.1f} | {row[4]:.2f}")


if __name__ == "__main__":
    main()
