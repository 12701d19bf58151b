"""Triton absorbed MLA decode over the paged latent cache, split along the sequence (split-KV).

Stage 1 (grid ``[row groups, splits, B]``): a program takes ``BLOCK_H`` query rows of one request (rows are
``(t, h)`` pairs of its ``Tq`` query tokens × ``H`` heads, so all heads share every key tile it loads — MQA
with one 576-wide key row per token) and one contiguous slice of the request's keys. Per key tile it loads
the ``[BLOCK_N, r + dr]`` rows through the block table, computes ``s = q_lat·cᵀ + q_rope·k_ropeᵀ`` and runs an
online softmax in base 2 with the value being the first ``r`` columns of the same tile. Rows that see no key
of the slice end with lse = −inf and o = 0.

Stage 2 (only when there is more than one split): exact LSE merge of the per-split partials
(``lse = log Σ exp lse_s``, ``o = Σ exp(lse_s − lse) o_s``). With one split stage 1 writes the final result.

The tile (``BLOCK_H`` rows × ``BLOCK_N`` keys, warps, stages) and the split count depend only on ``B``,
``Tq·H``, the dims and the device (never on lengths read from the device), so a call can be captured in a CUDA
graph; each request's keys are divided evenly among its splits. On a GPU the first call of a shape times a few
(tile, splits) plans on its own inputs and keeps the fastest (set ``K3NN_MLA_NO_TUNE=1`` for the heuristic).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from ..registry import triton_interpreting

__all__ = ["mla_decode_triton", "choose_num_splits"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _mla_decode_stage1(
    Q_lat, Q_rope, KV, BT, SEQ, VIS, O_part, LSE_part, O, LSE,
    s_qlb, s_qlt, s_qlh, s_qrb, s_qrt, s_qrh,
    s_kvb, s_kvr, s_btb, s_visb,
    s_opb, s_opm, s_ops, s_lpb, s_lpm,
    s_ob, s_ot, s_oh, s_lb, s_lt,
    qk_scale_log2, Tq, H, M, NUM_SPLITS,
    R: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    HAS_ROPE: tl.constexpr, HAS_VIS: tl.constexpr, FINAL: tl.constexpr, IEEE: tl.constexpr,
    LAZY: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_H + tl.arange(0, BLOCK_H)
    m_ok = offs_m < M
    t = offs_m // H
    h = offs_m % H
    seq_len = tl.load(SEQ + b)
    if HAS_VIS:
        lim = tl.load(VIS + b * s_visb + t, mask=m_ok, other=0)
    else:
        lim = seq_len - Tq + 1 + t
    lim = tl.where(m_ok, lim, 0)

    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_s * chunk
    end = tl.minimum(start + chunk, tl.minimum(seq_len, tl.max(lim, 0)))

    offs_r = tl.arange(0, BLOCK_R)
    if BLOCK_R == R:
        r_ok = offs_r < BLOCK_R  # all true, known at compile time: keeps loads vectorised
    else:
        r_ok = offs_r < R
    q = tl.load(Q_lat + b * s_qlb + t[:, None] * s_qlt + h[:, None] * s_qlh + offs_r[None, :],
                mask=m_ok[:, None] & r_ok[None, :], other=0.0)
    if HAS_ROPE:
        offs_d = tl.arange(0, BLOCK_DR)
        if BLOCK_DR == DR:
            d_ok = offs_d < BLOCK_DR
        else:
            d_ok = offs_d < DR
        qr = tl.load(Q_rope + b * s_qrb + t[:, None] * s_qrt + h[:, None] * s_qrh + offs_d[None, :],
                     mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    # Running max in base 2. Finite start value so that "no key yet" needs no special case; with LAZY the
    # accumulator is rescaled only when some row's max grows by more than 8 (p then stays below 2^8).
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        if PAGE % BLOCK_N == 0:  # the whole tile sits in one page: one block id
            blk = tl.load(BT + b * s_btb + n0 // PAGE).to(tl.int64)
            row = blk * s_kvb + (offs_n % PAGE) * s_kvr
        else:
            blk = tl.load(BT + b * s_btb + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            row = blk * s_kvb + (offs_n % PAGE) * s_kvr
        c = tl.load(KV + row[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(c), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(c))
        if HAS_ROPE:
            kr = tl.load(KV + row[:, None] + R + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                s += tl.dot(qr, tl.trans(kr), input_precision="ieee")
            else:
                s += tl.dot(qr, tl.trans(kr))
        s = s * qk_scale_log2
        s = tl.where((offs_n[None, :] < lim[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if LAZY:
            if tl.max(m_new - m_i, 0) > 8.0:
                alpha = tl.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            p = tl.exp2(s - m_i[:, None])
            l_i = l_i + tl.sum(p, 1)
            if IEEE:
                acc += tl.dot(p.to(c.dtype), c, input_precision="ieee")
            else:
                acc += tl.dot(p.to(c.dtype), c)
        else:
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
            m_i = m_new

    has = l_i > 0
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if FINAL:
        tl.store(O + b * s_ob + t[:, None] * s_ot + h[:, None] * s_oh + offs_r[None, :],
                 o.to(O.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])
        tl.store(LSE + b * s_lb + t * s_lt + h, lse, mask=m_ok)
    else:
        tl.store(O_part + b * s_opb + offs_m[:, None] * s_opm + pid_s * s_ops + offs_r[None, :], o,
                 mask=m_ok[:, None] & r_ok[None, :])
        tl.store(LSE_part + b * s_lpb + offs_m * s_lpm + pid_s, lse, mask=m_ok)


@triton.jit
def _mla_decode_combine(
    O_part, LSE_part, O, LSE,
    s_opb, s_opm, s_ops, s_lpb, s_lpm, s_ob, s_ot, s_oh, s_lb, s_lt,
    H, R, NUM_SPLITS,
    BLOCK_S: tl.constexpr, BLOCK_RC: tl.constexpr,
):
    """One (row, request, column chunk) per program: all splits of the chunk in one tile."""
    m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_r = tl.program_id(2)
    t = m // H
    h = m % H
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    lses = tl.load(LSE_part + b * s_lpb + m * s_lpm + offs_s, mask=s_ok, other=float("-inf"))
    mx = tl.max(lses, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(lses - mx)  # 0 for empty splits (whose partial outputs are 0)
    tot = tl.sum(w, 0)
    w = w * tl.where(tot > 0, 1.0 / tl.where(tot > 0, tot, 1.0), 0.0)
    offs_r = pid_r * BLOCK_RC + tl.arange(0, BLOCK_RC)
    r_ok = offs_r < R
    part = tl.load(O_part + b * s_opb + m * s_opm + offs_s[:, None] * s_ops + offs_r[None, :],
                   mask=s_ok[:, None] & r_ok[None, :], other=0.0)
    o = tl.sum(part * w[:, None], 0)
    tl.store(O + b * s_ob + t * s_ot + h * s_oh + offs_r, o.to(O.dtype.element_ty), mask=r_ok)
    if pid_r == 0:
        tl.store(LSE + b * s_lb + t * s_lt + h, tl.where(tot > 0, mx + tl.log(tl.where(tot > 0, tot, 1.0)),
                                                         float("-inf")))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# (BLOCK_H, BLOCK_N, num_warps, num_stages, lazy rescale) tried on the GPU; the interpreter uses a small one.
# Measured on the H200 (bench/results/mla-decode-*): 32×64 lazy tiles win at B=64; 64×32 with 3 stages is
# close at B=1; 64-row tiles with 8 warps and eager rescaling lose everywhere.
_GPU_TILES = [(16, 64, 4, 2, False), (16, 64, 4, 2, True), (32, 64, 4, 2, True), (32, 64, 4, 3, True),
              (32, 64, 8, 2, True), (64, 32, 8, 3, True)]
_INTERP_TILE = (16, 16, 4, 1, True)
_TUNED: dict[tuple, tuple] = {}
LAST_PLAN: tuple | None = None  # (BLOCK_H, BLOCK_N, num_warps, num_stages, lazy, splits) of the latest call


def choose_num_splits(B: int, rows: int, device: torch.device, block_h: int = 16, waves: int = 2) -> int:
    """Splits per request so that about ``waves`` waves of programs cover the GPU (1 under the interpreter)."""
    if device.type != "cuda":
        return 1
    groups = B * triton.cdiv(rows, block_h)
    return max(1, min(128, triton.cdiv(waves * _sm_count(device.index or 0), groups)))


def _default_plan(B, M, dev):
    if dev.type != "cuda":
        return _INTERP_TILE + (1,)
    bh = 32 if M >= 32 else 16
    tile = (bh, 64, 4, 2, True)
    return tile + (choose_num_splits(B, M, dev, bh),)


def _candidates(B, M, dev):
    out = []
    for tile in _GPU_TILES:
        if tile[0] > max(16, triton.next_power_of_2(M)):
            continue
        s1 = choose_num_splits(B, M, dev, tile[0], waves=1)
        for s in sorted({s1, choose_num_splits(B, M, dev, tile[0], waves=2)}):
            out.append(tile + (s,))
    return out


def _launch(plan, q_lat, qr, kv, bt, sl, vis, out, lse, scale, Tq, H, M, R, DR):
    bh, bn, warps, stages, lazy, S = plan
    B = q_lat.shape[0]
    dev = q_lat.device
    final = S == 1
    if final:
        o_part, lse_part = out, lse  # unused
        sp = (0, 0, 0, 0, 0)
    else:
        o_part = torch.empty(B, M, S, R, dtype=torch.float32, device=dev)
        lse_part = torch.empty(B, M, S, dtype=torch.float32, device=dev)
        sp = (o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1))
    _mla_decode_stage1[(triton.cdiv(M, bh), S, B)](
        q_lat, qr, kv, bt, sl, vis if vis is not None else sl, o_part, lse_part, out, lse,
        q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), qr.stride(0), qr.stride(1), qr.stride(2),
        kv.stride(0), kv.stride(1), bt.stride(0), vis.stride(0) if vis is not None else 0,
        *sp,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        float(scale) * _LOG2E, Tq, H, M, S,
        R=R, DR=DR, PAGE=kv.shape[1], BLOCK_R=triton.next_power_of_2(R),
        BLOCK_DR=max(16, triton.next_power_of_2(max(DR, 1))),
        HAS_ROPE=DR > 0, HAS_VIS=vis is not None, FINAL=final, IEEE=q_lat.dtype == torch.float32,
        LAZY=lazy, BLOCK_H=bh, BLOCK_N=bn, num_warps=warps, num_stages=stages,
    )
    if not final:
        bsz = max(2, triton.next_power_of_2(S))
        brc = max(16, min(triton.next_power_of_2(R), 8192 // bsz))
        _mla_decode_combine[(M, B, triton.cdiv(R, brc))](
            o_part, lse_part, out, lse, *sp,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            H, R, S, BLOCK_S=bsz, BLOCK_RC=brc, num_warps=4,
        )


def _time_plan(fn) -> float:
    """Milliseconds per call replayed in a CUDA graph (small decode launches are host-bound otherwise)."""
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=5, return_mode="median"))
    except Exception:
        return float(do_bench(fn, warmup=3, rep=15, return_mode="median"))


def _plan(B, M, R, DR, vis, q_lat, num_splits, run):
    """Tile and split count for this shape. On a GPU the first call of a shape (outside graph capture) times
    the candidates on its own inputs and keeps the fastest; ``num_splits`` pins the split count."""
    dev = q_lat.device
    if dev.type != "cuda":
        p = _INTERP_TILE + (1,)
        return p[:5] + (int(num_splits),) if num_splits else p
    key = (dev.index, q_lat.dtype, M, R, DR, vis is not None, triton.next_power_of_2(B), num_splits)
    if key in _TUNED:
        return _TUNED[key]
    cands = _candidates(B, M, dev)
    if num_splits:
        cands = sorted({c[:5] + (int(num_splits),) for c in cands})
    if torch.cuda.is_current_stream_capturing() or os.environ.get("K3NN_MLA_NO_TUNE"):
        p = _default_plan(B, M, dev)
        return p[:5] + (int(num_splits),) if num_splits else p
    torch.cuda.synchronize()  # the timing runs on a side stream: inputs must be ready
    best, best_ms = None, float("inf")
    for c in cands:
        try:
            ms = _time_plan(lambda: run(c))
        except Exception:  # a tile that does not fit this GPU (shared memory / registers)
            continue
        if os.environ.get("K3NN_MLA_TUNE_VERBOSE"):
            print(f"mla_decode tune B={B} M={M}: plan {c} {ms * 1e3:.1f} us", flush=True)
        if ms < best_ms:
            best, best_ms = c, ms
    if best is None:  # nothing could be timed: keep the heuristic (its launch reports any real error)
        best = _default_plan(B, M, dev)
        best = best[:5] + (int(num_splits),) if num_splits else best
    _TUNED[key] = best
    return best


def mla_decode_triton(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=None,
                      num_splits=None, out_dtype=None, out=None):
    B, Tq, H, R = q_lat.shape
    DR = q_rope.shape[-1]
    M = Tq * H
    dev = q_lat.device
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_rope = q_rope if DR == 0 or q_rope.stride(-1) == 1 else q_rope.contiguous()
    kv = kv_pool if kv_pool.stride(-1) == 1 else kv_pool.contiguous()
    bt = block_table.to(torch.int32).contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    vis = None if visible_lens is None else visible_lens.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(B, Tq, H, R, dtype=out_dtype or q_lat.dtype, device=dev)
        lse = torch.empty(B, Tq, H, dtype=torch.float32, device=dev)
    else:
        out, lse = out
    qr = q_rope if DR else q_lat  # placeholder pointer when there is no rope part
    args = (q_lat, qr, kv, bt, sl, vis, out, lse, scale, Tq, H, M, R, DR)
    global LAST_PLAN
    plan = _plan(B, M, R, DR, vis, q_lat, num_splits, lambda p: _launch(p, *args))
    LAST_PLAN = plan
    _launch(plan, *args)
    return out, lse


def supports_triton(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=None, num_splits=None,
                    out_dtype=None, out=None):
    if q_lat.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q_lat.dtype} is not supported (fp16, bf16, fp32)"
    if triton_interpreting() and q_lat.dtype == torch.bfloat16:
        return "bf16 tl.dot is not exact under the Triton interpreter"
    if q_lat.shape[-1] > 1024:
        return f"kv_lora_rank {q_lat.shape[-1]} > 1024"
    if num_splits is not None and not 1 <= int(num_splits) <= 256:
        return f"num_splits must be in [1, 256], got {num_splits}"
    if out is not None and (out[0].stride(-1) != 1 or out[1].stride(-1) != 1):
        return "out tensors need a contiguous last dimension"
    if math.prod(kv_pool.shape[:2]) * kv_pool.shape[2] >= 2 ** 62:
        return "pool too large"
    return None
