"""Triton absorbed MLA decode over the paged latent cache, split along the sequence (split-KV).

Stage 1 (grid ``[row groups × SPLIT_V, splits, B]``): a program takes ``BLOCK_H`` query rows of one request
(rows are ``(t, h)`` pairs of its ``Tq`` query tokens × ``H`` heads, so all heads share every key tile it loads —
MQA with one 576-wide key row per token) and one contiguous slice of the request's keys. Per key tile it loads
the ``[BLOCK_N, r + dr]`` rows through the block table once and uses them for both products:
``s = q_lat·cᵀ + q_rope·k_ropeᵀ`` (the 576-long reduction split into the latent and the rope chunk) and
``acc += p·c`` (the value is the first ``r`` columns of the same tile), with an online softmax in base 2 (the
scale is pre-multiplied by log2 e). With ``SPLIT_V = 2`` the ``r`` output columns are halved between two
programs that run next to each other (the second read of a tile hits L2): each computes the full scores but
keeps only half of the accumulator, which halves its registers. Rows that see no key of the slice end with
lse = −inf and o = 0.

Stage 2 (only when there is more than one split): exact LSE merge of the per-split partials
(``lse = log Σ exp lse_s``, ``o = Σ exp(lse_s − lse) o_s``). With one split stage 1 writes the final result.

The plan (``BLOCK_H`` rows × ``BLOCK_N`` keys, warps, stages, rescaling, ``SPLIT_V``, splits) depends only on
``B``, ``Tq·H``, the dims and the device (never on lengths read from the device), so a call can be captured in a
CUDA graph; each request's keys are divided evenly among its splits. On a GPU the first call of a shape (outside
graph capture) times a few plans on its own inputs and keeps the fastest (``K3NN_MLA_NO_TUNE=1``: the
heuristic plan; ``K3NN_MLA_TUNE_VERBOSE=1`` prints the timings).

Why these plans: a decode is bound by reading the cache (576 bf16 per token), so each tile should be read from
HBM once for all heads of its request. With 64 heads in one program (``BLOCK_H = 64``) the dots have M = 64 and
can use the Hopper warp-group MMA with the tile read from shared memory once per product; 8 warps keep the
[64, 512] fp32 accumulator at 128 registers a thread. Smaller row groups re-read each tile per group (from L2)
and pay shared-memory bandwidth per group. Split counts are chosen to fill whole waves of programs.
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
def _mm(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# Integer arguments that vary from shape to shape but never decide vector widths are not specialised on
# (divisibility by 16 / equality to 1), so a new batch size, head count or split count reuses the compiled kernel.
@triton.jit(do_not_specialize=["s_btb", "s_visb", "s_lpb", "s_lpm", "s_lb", "s_lt", "Tq", "H", "M", "NUM_SPLITS"])
def _mla_decode_stage1(
    Q_lat, Q_rope, KV, BT, SEQ, VIS, O_part, LSE_part, O, LSE,
    s_qlb, s_qlt, s_qlh, s_qrb, s_qrt, s_qrh,
    s_kvb, s_kvr, s_btb, s_visb,
    s_opb, s_opm, s_ops, s_lpb, s_lpm,
    s_ob, s_ot, s_oh, s_lb, s_lt,
    qk_scale_log2, Tq, H, M, NUM_SPLITS,
    R: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    HAS_ROPE: tl.constexpr, HAS_VIS: tl.constexpr, FINAL: tl.constexpr, IEEE: tl.constexpr,
    LAZY: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_V: tl.constexpr,
):
    BV: tl.constexpr = BLOCK_R // SPLIT_V  # output columns of this program
    EVEN_R: tl.constexpr = BLOCK_R == R  # no column masks: loads stay 16-byte vectors
    EVEN_DR: tl.constexpr = BLOCK_DR == DR
    pid_g = tl.program_id(0)
    pid_m = pid_g // SPLIT_V
    pid_v = pid_g % SPLIT_V
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

    # Own output columns (value and accumulator) and, with SPLIT_V = 2, the other half (scores only).
    offs_v = pid_v * BV + tl.arange(0, BV)
    q_row = Q_lat + b * s_qlb + t[:, None] * s_qlt + h[:, None] * s_qlh
    if EVEN_R:
        q = tl.load(q_row + offs_v[None, :], mask=m_ok[:, None], other=0.0)
    else:
        q = tl.load(q_row + offs_v[None, :], mask=m_ok[:, None] & (offs_v[None, :] < R), other=0.0)
    if SPLIT_V == 2:
        offs_w = (1 - pid_v) * BV + tl.arange(0, BV)
        if EVEN_R:
            q2 = tl.load(q_row + offs_w[None, :], mask=m_ok[:, None], other=0.0)
        else:
            q2 = tl.load(q_row + offs_w[None, :], mask=m_ok[:, None] & (offs_w[None, :] < R), other=0.0)
    if HAS_ROPE:
        offs_d = tl.arange(0, BLOCK_DR)
        qr_row = Q_rope + b * s_qrb + t[:, None] * s_qrt + h[:, None] * s_qrh
        if EVEN_DR:
            qr = tl.load(qr_row + offs_d[None, :], mask=m_ok[:, None], other=0.0)
        else:
            qr = tl.load(qr_row + offs_d[None, :], mask=m_ok[:, None] & (offs_d[None, :] < DR), other=0.0)

    # Running max in base 2. Finite start value so that "no key yet" needs no special case; with LAZY the
    # accumulator is rescaled only when some row's max grows by more than 8 (p then stays below 2^8).
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        if PAGE % BLOCK_N == 0:  # the whole tile sits in one page: one block id
            blk = tl.load(BT + b * s_btb + n0 // PAGE).to(tl.int64)
            row = blk * s_kvb + ((n0 % PAGE) + tl.arange(0, BLOCK_N)) * s_kvr
        else:
            blk = tl.load(BT + b * s_btb + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            row = blk * s_kvb + (offs_n % PAGE) * s_kvr
        kv_row = KV + row[:, None]
        if EVEN_R:
            c = tl.load(kv_row + offs_v[None, :], mask=n_ok[:, None], other=0.0)
        else:
            c = tl.load(kv_row + offs_v[None, :], mask=n_ok[:, None] & (offs_v[None, :] < R), other=0.0)
        s = _mm(q, tl.trans(c), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), IEEE)
        if SPLIT_V == 2:
            if EVEN_R:
                c2 = tl.load(kv_row + offs_w[None, :], mask=n_ok[:, None], other=0.0)
            else:
                c2 = tl.load(kv_row + offs_w[None, :], mask=n_ok[:, None] & (offs_w[None, :] < R), other=0.0)
            s = _mm(q2, tl.trans(c2), s, IEEE)
        if HAS_ROPE:
            if EVEN_DR:
                kr = tl.load(kv_row + R + offs_d[None, :], mask=n_ok[:, None], other=0.0)
            else:
                kr = tl.load(kv_row + R + offs_d[None, :], mask=n_ok[:, None] & (offs_d[None, :] < DR), other=0.0)
            s = _mm(qr, tl.trans(kr), s, IEEE)
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
            acc = _mm(p.to(c.dtype), c, acc, IEEE)
        else:
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = _mm(p.to(c.dtype), c, acc * alpha[:, None], IEEE)
            m_i = m_new

    has = l_i > 0
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse_ok = m_ok & ((tl.zeros([BLOCK_H], tl.int32) + pid_v) == 0)  # one writer per row
    if EVEN_R:
        o_mask = m_ok[:, None]
    else:
        o_mask = m_ok[:, None] & (offs_v[None, :] < R)
    if FINAL:
        tl.store(O + b * s_ob + t[:, None] * s_ot + h[:, None] * s_oh + offs_v[None, :],
                 o.to(O.dtype.element_ty), mask=o_mask)
        tl.store(LSE + b * s_lb + t * s_lt + h, lse, mask=lse_ok)
    else:
        tl.store(O_part + b * s_opb + offs_m[:, None] * s_opm + pid_s * s_ops + offs_v[None, :], o, mask=o_mask)
        tl.store(LSE_part + b * s_lpb + offs_m * s_lpm + pid_s, lse, mask=lse_ok)


@triton.jit(do_not_specialize=["s_lpb", "s_lpm", "s_lb", "s_lt", "H", "NUM_SPLITS"])
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


# Tiles (BLOCK_H, BLOCK_N, num_warps, num_stages, lazy rescale, SPLIT_V) the GPU tuner chooses among; a plan is
# a tile plus the split count. Earlier H200 runs (bench/results/mla-decode-*): 32×64 lazy tiles with 4 warps
# reached 1.9 TB/s at B=64 L=8K H=64 and 64×32 with 8 warps / 3 stages fit and ran. The 64-row tiles give the
# dots M = 64 (one Hopper warp-group MMA per 64 rows) and read each tile once for 64 heads.
_GPU_TILES = [
    (64, 32, 8, 3, True, 1),   # all 64 heads, [64, 512] accumulator over 8 warps; 2 × 36 KB tiles in flight
    (64, 64, 8, 2, True, 1),   # same, bigger tile (72 KB a stage)
    (64, 32, 4, 3, True, 2),   # one warp group, half the output columns; the column pair shares reads in L2
    (32, 64, 4, 2, True, 1),   # the previous best
    (16, 64, 4, 2, True, 1),   # few rows (Tq·H ≤ 16, e.g. heads sharded by tensor parallelism)
]
_INTERP_TILE = (16, 16, 4, 1, True, 1)
_TUNED: dict[tuple, tuple] = {}
LAST_PLAN: tuple | None = None  # (BLOCK_H, BLOCK_N, num_warps, num_stages, lazy, SPLIT_V, splits) of the latest call


def _programs_per_split(B: int, rows: int, block_h: int, split_v: int = 1) -> int:
    return B * triton.cdiv(rows, block_h) * split_v


def choose_num_splits(B: int, rows: int, device: torch.device, block_h: int = 16, waves: int = 2,
                      split_v: int = 1) -> int:
    """Splits per request so that stage 1 fills about ``waves`` whole waves of programs, one program per SM
    (1 under the interpreter). Rounded down so that the last wave is full rather than nearly empty."""
    if device.type != "cuda":
        return 1
    per = _programs_per_split(B, rows, block_h, split_v)
    target = waves * _sm_count(device.index or 0)
    return max(1, min(160, (target + per // 8) // per))


def _default_tile(M):
    return _GPU_TILES[0] if M >= 48 else _GPU_TILES[3] if M > 16 else _GPU_TILES[4]


def _default_plan(B, M, dev):
    """Heuristic plan (graph capture without a tuned entry, or K3NN_MLA_NO_TUNE)."""
    if dev.type != "cuda":
        return _INTERP_TILE + (1,)
    tile = _default_tile(M)
    return tile + (choose_num_splits(B, M, dev, tile[0], waves=1, split_v=tile[5]),)


def _candidate_tiles(M):
    """(tile, waves) pairs the tuner times for Tq·H = M rows."""
    cap = max(16, triton.next_power_of_2(M))
    out = []
    for tile in _GPU_TILES:
        if tile[0] > cap or (tile[0] < 32 and M > 32) or (tile[5] > 1 and M < 48):
            continue
        out += [(tile, 1), (tile, 2)]
    return out


def _candidates(B, M, dev):
    """Distinct plans (tile + split count) of :func:`_candidate_tiles` for batch ``B``."""
    out = []
    for tile, w in _candidate_tiles(M):
        p = tile + (choose_num_splits(B, M, dev, tile[0], waves=w, split_v=tile[5]),)
        if p not in out:
            out.append(p)
    return out


def _launch(plan, q_lat, qr, kv, bt, sl, vis, out, lse, scale, Tq, H, M, R, DR):
    bh, bn, warps, stages, lazy, sv, S = plan
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
    block_r = triton.next_power_of_2(R)
    sv = sv if block_r >= 32 else 1
    _mla_decode_stage1[(triton.cdiv(M, bh) * sv, S, B)](
        q_lat, qr, kv, bt, sl, vis if vis is not None else sl, o_part, lse_part, out, lse,
        q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), qr.stride(0), qr.stride(1), qr.stride(2),
        kv.stride(0), kv.stride(1), bt.stride(0), vis.stride(0) if vis is not None else 0,
        *sp,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        float(scale) * _LOG2E, Tq, H, M, S,
        R=R, DR=DR, PAGE=kv.shape[1], BLOCK_R=block_r,
        BLOCK_DR=max(16, triton.next_power_of_2(max(DR, 1))),
        HAS_ROPE=DR > 0, HAS_VIS=vis is not None, FINAL=final, IEEE=q_lat.dtype == torch.float32,
        LAZY=lazy, BLOCK_H=bh, BLOCK_N=bn, SPLIT_V=sv, num_warps=warps, num_stages=stages,
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
    """Plan for this shape. On a GPU the first call of a (row count, batch size class, ...) key, outside graph
    capture, times the candidates on its own inputs and keeps the fastest tile and wave count; the split count
    then follows the actual ``B``. ``num_splits`` pins the split count."""
    dev = q_lat.device
    pin = int(num_splits) if num_splits else None
    if dev.type != "cuda":
        return _INTERP_TILE + (pin or 1,)

    def plan_of(tile, w):
        return tile + (pin or choose_num_splits(B, M, dev, tile[0], waves=w, split_v=tile[5]),)

    key = (dev.index, q_lat.dtype, M, R, DR, vis is not None, triton.next_power_of_2(B), pin)
    if key in _TUNED:
        return plan_of(*_TUNED[key])
    if torch.cuda.is_current_stream_capturing() or os.environ.get("K3NN_MLA_NO_TUNE"):
        return plan_of(_default_tile(M), 1)
    torch.cuda.synchronize()  # the timing runs on a side stream: inputs must be ready
    best, best_ms, seen = None, float("inf"), set()
    for tile, w in _candidate_tiles(M):
        c = plan_of(tile, w)
        if c in seen:
            continue
        seen.add(c)
        try:
            ms = _time_plan(lambda c=c: run(c))
        except Exception:  # a tile that does not fit this GPU (shared memory / registers)
            continue
        if os.environ.get("K3NN_MLA_TUNE_VERBOSE"):
            print(f"mla_decode tune B={B} M={M}: plan {c} {ms * 1e3:.1f} us", flush=True)
        if ms < best_ms:
            best, best_ms = (tile, w), ms
    if best is None:  # nothing could be timed: keep the heuristic (its launch reports any real error)
        best = (_default_tile(M), 1)
    _TUNED[key] = best
    return plan_of(*best)


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
