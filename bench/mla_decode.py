"""mla-decode: absorbed MLA decode over the paged latent cache (bf16, kv_lora 512 + rope 64, block 64).

Per case, in one run: k3nn's decode as ``auto`` picks it (the CUDA warp-group kernel for batched calls on sm_90,
the Triton split-KV kernel otherwise; ``--backend`` pins one) checked against the eager reference, then timed in a
CUDA graph next to plain PyTorch absorbed decode (contiguous cache, and paged cache gathered through the block
table) and FlashMLA's SM90 dense decode (``sgl-flash-mla``, ``use_legacy=True``) when it imports. Inputs
rotate over enough copies to exceed L2. Bandwidth counts the bytes a decode must move:
``B·L·576·2`` (cache) + ``B·Tq·H·(576 + 512)·2`` (queries, outputs).

    k3nn bench mla-decode [--cases B,L,H,Tq ...] [--splits N] [--backend auto|triton|cuda] [--no-flashmla]
"""

from __future__ import annotations

import argparse
import math

import torch

from bench.common import device_meta, graph_bench_ms, print_table, rel_err, write_results

R, DR, BS = 512, 64, 64
SCALE = (128 + 64) ** -0.5
DEFAULT_CASES = ["64,8192,64,1", "64,8192,96,1", "1,32768,64,1", "1,32768,96,1", "64,8192,64,2"]


def _flashmla():
    try:
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata
    except Exception as e:  # noqa: BLE001 - report why and carry on without the anchor
        return None, f"{type(e).__name__}: {e}"
    return (flash_mla_with_kvcache, get_mla_metadata), None


def _torch_absorbed(q, kv, Tq, H):
    """Plain PyTorch absorbed decode: q [B, Tq, H, 576] against kv [B, L, 576] (one shared key/value row)."""
    B = q.shape[0]
    s = torch.bmm(q.reshape(B, Tq * H, R + DR), kv.transpose(1, 2)).float() * SCALE
    p = s.softmax(-1).to(kv.dtype)
    return torch.bmm(p, kv[..., :R]).view(B, Tq, H, R)


def run_case(B, L, H, Tq, splits, fm, gen, dev="cuda", dt=torch.bfloat16, be="auto"):
    from k3nn.kernels.mla import cuda_decode, triton_decode
    from k3nn.kernels.mla.reference import mla_decode_reference
    from k3nn.kernels.registry import backend
    from k3nn.ops import mla_decode

    nblk = L // BS
    cache_bytes = B * L * (R + DR) * dt.itemsize
    io_bytes = B * Tq * H * (R + DR + R) * dt.itemsize
    copies = min(16, max(1, math.ceil(256e6 / cache_bytes)))
    sets = []
    for _ in range(copies):
        pool = (torch.randn(B * nblk + 8, BS, R + DR, device=dev, generator=gen) * 0.5).to(dt)
        bt = torch.randperm(B * nblk + 8, device=dev, generator=gen)[: B * nblk].view(B, nblk).to(torch.int32)
        q = (torch.randn(B, Tq, H, R + DR, device=dev, generator=gen) * 0.5).to(dt)
        sets.append((pool, bt, q))
    sl = torch.full((B,), L, dtype=torch.int32, device=dev)
    outs = [(torch.empty(B, Tq, H, R, device=dev, dtype=dt), torch.empty(B, Tq, H, device=dev)) for _ in sets]

    pool, bt, q = sets[0]
    o_ref, lse_ref = mla_decode_reference(q[..., :R], q[..., R:], pool, bt, sl, SCALE, out_dtype=torch.float32)
    triton_decode.LAST_PLAN = cuda_decode.LAST_CALL = None
    with backend(be):
        o, lse = mla_decode(q[..., :R], q[..., R:], pool, bt, sl, SCALE, num_splits=splits)
    err, lse_err = rel_err(o, o_ref), (lse - lse_ref).abs().max().item()
    if not (err < 1e-2 and lse_err < 1e-2):
        raise AssertionError(f"k3nn mla_decode wrong at B={B} L={L} H={H} Tq={Tq}: rel err {err:.2e}, "
                             f"lse {lse_err:.2e}")
    plan, call = triton_decode.LAST_PLAN, cuda_decode.LAST_CALL
    if call is not None:
        cfg = f"cuda wgmma rows=64 splits={call[0]}" + (f" cluster={call[1]}" if call[1] > 1 else "")
    else:
        cfg = f"triton plan {plan.short()} {tuple(plan)}" if plan is not None else "eager"

    it = [0]

    def nxt():
        i = it[0] % len(sets)
        it[0] += 1
        return i

    def k3():
        i = nxt()
        p, t, qq = sets[i]
        with backend(be):
            mla_decode(qq[..., :R], qq[..., R:], p, t, sl, SCALE, num_splits=splits, out=outs[i], check=False)

    def contig_fn(kvs):
        def f():
            i = nxt()
            _torch_absorbed(sets[i][2], kvs[i], Tq, H)
        return f

    def paged_fn():
        i = nxt()
        p, t, qq = sets[i]
        _torch_absorbed(qq, p[t.long()].view(B, L, R + DR), Tq, H)

    case = f"B={B} L={L} H={H} Tq={Tq} {str(dt)[6:]} block64" + (f" splits={splits}" if splits else "")
    nbytes = cache_bytes + io_bytes
    ms = graph_bench_ms(k3)
    base = {"case": case, "k3nn_ms": round(ms, 5), "tbps": round(nbytes / ms / 1e9, 3), "rel_err": err,
            "lse_abs_err": lse_err, "copies": copies, "config": cfg}
    rows = []
    kvs = [p[t.long()].view(B, L, R + DR).contiguous() for p, t, _ in sets]
    a_ms = graph_bench_ms(contig_fn(kvs))
    rows.append(dict(base, anchor="torch absorbed, contiguous cache", anchor_ms=round(a_ms, 5),
                     anchor_tbps=round(nbytes / a_ms / 1e9, 3)))
    del kvs
    a_ms = graph_bench_ms(paged_fn)
    rows.append(dict(base, anchor="torch absorbed, paged gather", anchor_ms=round(a_ms, 5),
                     anchor_tbps=round(nbytes / a_ms / 1e9, 3)))
    if fm is not None:
        fwd, get_meta = fm
        metas = [get_meta()[0] for _ in sets]

        def fm_call(i):
            p, t, qq = sets[i]
            return fwd(qq, p.unsqueeze(2), t, sl, R, metas[i], softmax_scale=SCALE, causal=Tq > 1, use_legacy=True)

        fo, flse = fm_call(0)
        f_err = rel_err(fo, o_ref)
        for i in range(1, len(sets)):
            fm_call(i)

        def fm_fn():
            fm_call(nxt())

        a_ms = graph_bench_ms(fm_fn)
        rows.append(dict(base, anchor="FlashMLA sm90 dense (sgl-flash-mla 1.0.0, legacy)", anchor_ms=round(a_ms, 5),
                         anchor_tbps=round(nbytes / a_ms / 1e9, 3), anchor_rel_err=f_err))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="k3nn bench mla-decode")
    ap.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="B,L,H,Tq[,splits]")
    ap.add_argument("--splits", type=int, default=None, help="KV splits per request (default: automatic)")
    ap.add_argument("--backend", default="auto", choices=["auto", "triton", "cuda"],
                    help="k3nn backend (default: what auto picks per case)")
    ap.add_argument("--no-flashmla", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("mla-decode needs a CUDA GPU")
    meta = device_meta()
    fm, why = (None, "disabled") if args.no_flashmla else _flashmla()
    print(f"copy {meta.get('copy_tbps')} TB/s, bf16 {meta.get('bf16_tflops')} TFLOP/s; FlashMLA: {why or 'loaded'}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for c in args.cases:
        v = [int(x) for x in c.split(",")]
        rows += run_case(*v[:4], v[4] if len(v) > 4 else args.splits, fm, gen, be=args.backend)
        torch.cuda.empty_cache()
    path = write_results("mla-decode", rows, {"flashmla": why or "loaded", "splits": args.splits or "auto",
                                              "backend": args.backend})
    print_table(rows, ["case", "k3nn_ms", "tbps", "frac_copy_bw", "anchor", "anchor_ms", "anchor_tbps", "speedup"])
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
