"""Triton absorbed MLA decode over the paged latent cache, split along the sequence (split-KV).

Stage 1 (grid ``[row groups × SPLIT_V, splits, B]``): a program takes ``BLOCK_H`` query rows of one request
(rows are ``(t, h)`` pairs of its ``Tq`` query tokens × ``H`` heads, so all heads share every key tile it loads —
MQA with one 576-wide key row per token) and one contiguous slice of the request's keys. Per key tile it loads
the ``[BLOCK_N, r + dr]`` rows through the block table once and uses them for both products:
``s = q_lat·cᵀ + q_rope·k_ropeᵀ`` and ``acc += p·c`` (the value is the first ``r`` columns of the same tile),
with an online softmax in base 2 (log2 e is folded into the scale). Rows that see no key of the slice end
with lse = −inf and o = 0.

Stage 2 (only when there is more than one split): exact LSE merge of the per-split partials
(``lse = log Σ exp lse_s``, ``o = Σ exp(lse_s − lse) o_s``). With one split stage 1 writes the final result.

Plans (:class:`Plan`) select the tile and the constexpr variants:

* ``sv = 2`` halves the ``r`` output columns between two programs that run next to each other (the column
  split is the fastest grid index, so the second read of a tile hits L2); each computes the full scores and
  keeps a ``[BLOCK_H, r/2]`` accumulator — half the registers.
* ``ahead`` reads the block id of the next tile one iteration early and carries it, so a tile's address does
  not depend on a load of its own iteration; the pipeliner then keeps ``stages - 1`` tiles in flight instead of
  ``stages - 2``.
* ``opaque`` passes the scores to the softmax through a branch the compiler cannot fold. With ``BLOCK_H = 64``
  over 8 warps (two warp groups) the compiler otherwise lays the score product out with all warps on the 64
  rows — both warp groups compute the whole score tile — because its result feeds another product; behind
  the branch each group computes half of the keys' scores.
* ``lazy`` rescales the accumulator only when a row max grows by more than 8 (p stays below 2^8).
* ``tma`` loads every whole key tile through two tensor descriptors over the pool seen as ``[pages · PAGE,
  r + dr]`` rows (a ``[BLOCK_N, r]`` latent box and a ``[BLOCK_N, dr]`` rope box at one row offset): on Hopper
  the tensor-memory accelerator copies the tile into shared memory with no per-thread address arithmetic. A
  split's last tile, when partial, takes the masked pointer path, so no row past a sequence is ever read (pool
  rows there may hold any bits). With ``sv = 2`` each half of the latent columns is its own ``[BLOCK_N, r/2]``
  box. Needs one page per tile and unpadded column blocks; otherwise the plan runs the pointer path.

The plan depends only on ``B``, ``Tq·H``, the dims and the device (never on lengths read from the device), so a
call can be captured in a CUDA graph; each request's keys are divided evenly among its splits. On a GPU the first
call of a shape (outside capture) times a few plans on its own inputs and keeps the fastest
(:class:`~k3nn.kernels.registry.KernelTuning`: ``autotune=False`` takes the heuristic plan; ``mla_decode_tile=(bh,
bn, warps, stages[, lazy, sv, ahead, opaque, tma])`` that tile, one wave of splits; the timings are logged at
debug level).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..tuning_cache import TuningCache
from ..registry import current_tuning, triton_interpreting

log = logging.getLogger(__name__)

__all__ = ["Plan", "choose_num_splits", "make_plan", "mla_decode_triton", "wave_splits"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _mm(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _softmax_step(s, lim, offs_n, n_ok, m_i, l_i, acc, qk_scale_log2, LAZY: tl.constexpr):
    """Online softmax in base 2 over one key tile: returns (p, m_i, l_i, acc) with acc rescaled to the new max.

    With LAZY the running max moves (and acc is rescaled) only when some row's max grows by more than 8, so p
    stays below 2^8; otherwise every tile rescales."""
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
    else:
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    return p, m_i, l_i, acc


@triton.jit
def _tile_update(q, q2, qr, c, c2, kr, offs_n, n_ok, lim, m_i, l_i, acc, qk_scale_log2, alive,
                 IEEE: tl.constexpr, LAZY: tl.constexpr, OPAQUE: tl.constexpr, HAS_ROPE: tl.constexpr,
                 SPLIT_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """One key tile: scores ``q·cᵀ (+ q2·c2ᵀ) (+ qr·krᵀ)``, online softmax, ``acc += p·c``. Returns (m, l, acc)."""
    s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    if OPAQUE:
        s_r = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    if HAS_ROPE:
        if OPAQUE:
            s_r = _mm(qr, tl.trans(kr), s_r, IEEE)
        else:
            s = _mm(qr, tl.trans(kr), s, IEEE)
    s = _mm(q, tl.trans(c), s, IEEE)
    if SPLIT_V == 2:
        s = _mm(q2, tl.trans(c2), s, IEEE)
    if OPAQUE:
        # The scores reach the softmax through a branch the compiler cannot fold. Seen from a product, its
        # result then feeds no other product, and the compiler spreads the warps of a two-warp-group
        # program over the keys (each group computes half the score tile once) instead of over the rows
        # only (with BLOCK_H = 64, one group's height, both groups would compute the whole tile).
        # (the products are awaited outside the branch: a product's first use inside a branch fails to
        # pipeline)
        s = s * qk_scale_log2
        s_r = s_r * qk_scale_log2
        if alive:
            s = s + s_r
        else:
            s = s_r
        p32, m_i, l_i, acc = _softmax_step(s, lim, offs_n, n_ok, m_i, l_i, acc, 1.0, LAZY)
    else:
        p32, m_i, l_i, acc = _softmax_step(s, lim, offs_n, n_ok, m_i, l_i, acc, qk_scale_log2, LAZY)
    acc = _mm(p32.to(c.dtype), c, acc, IEEE)
    return m_i, l_i, acc


@triton.jit
def _tile_page(bt_row, n0, end, blk_next, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, AHEAD: tl.constexpr):
    """(block id of the one-page tile at key ``n0``, the carried block id for the next tile): with AHEAD the
    id comes from the previous iteration and the next one is read now."""
    if AHEAD:
        blk = blk_next
        n1 = n0 + BLOCK_N
        blk_next = tl.load(bt_row + n1 // PAGE, mask=n1 < end, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + n0 // PAGE).to(tl.int64)
    return blk, blk_next


@triton.jit
def _ptr_tile(KV, row, offs_v, offs_w, offs_d, n_ok, R: tl.constexpr, DR: tl.constexpr, EVEN_R: tl.constexpr,
              EVEN_DR: tl.constexpr, HAS_ROPE: tl.constexpr, SPLIT_V: tl.constexpr):
    """One key tile through masked pointer loads (rows ``row`` of the pool, those past ``n_ok`` read as 0):
    (this program's latent columns, the other half with SPLIT_V = 2, the rope columns). Each column range is
    loaded once; the same tile feeds both products."""
    kv_row = KV + row[:, None]
    if EVEN_R:
        c = tl.load(kv_row + offs_v[None, :], mask=n_ok[:, None], other=0.0)
    else:
        c = tl.load(kv_row + offs_v[None, :], mask=n_ok[:, None] & (offs_v[None, :] < R), other=0.0)
    c2 = c
    if SPLIT_V == 2:
        if EVEN_R:
            c2 = tl.load(kv_row + offs_w[None, :], mask=n_ok[:, None], other=0.0)
        else:
            c2 = tl.load(kv_row + offs_w[None, :], mask=n_ok[:, None] & (offs_w[None, :] < R), other=0.0)
    kr = c
    if HAS_ROPE:
        if EVEN_DR:
            kr = tl.load(kv_row + R + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        else:
            kr = tl.load(kv_row + R + offs_d[None, :], mask=n_ok[:, None] & (offs_d[None, :] < DR), other=0.0)
    return c, c2, kr


# Integers that vary with the batch, the split count and the table width are not specialised (divisible by 16,
# equal to 1): one compile serves every split count and table.
@triton.jit(do_not_specialize=["s_btb", "s_visb", "s_lpb", "s_lpm", "Tq", "H", "M", "NUM_SPLITS"])
def _mla_decode_stage1(
    Q_lat, Q_rope, KV, BT, SEQ, VIS, O_part, LSE_part, O, LSE, KV_DESC, KR_DESC,
    s_qlb, s_qlt, s_qlh, s_qrb, s_qrt, s_qrh,
    s_kvb, s_kvr, s_btb, s_visb,
    s_opb, s_opm, s_ops, s_lpb, s_lpm,
    s_ob, s_ot, s_oh, s_lb, s_lt,
    qk_scale_log2, Tq, H, M, NUM_SPLITS,
    R: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    HAS_ROPE: tl.constexpr, HAS_VIS: tl.constexpr, FINAL: tl.constexpr, IEEE: tl.constexpr,
    LAZY: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_V: tl.constexpr,
    AHEAD: tl.constexpr, OPAQUE: tl.constexpr, TMA: tl.constexpr = False,
):
    BV: tl.constexpr = BLOCK_R // SPLIT_V  # value / output columns of this program
    EVEN_R: tl.constexpr = BLOCK_R == R  # no column masks: loads stay 16-byte vectors
    EVEN_DR: tl.constexpr = BLOCK_DR == DR
    ONE_PAGE: tl.constexpr = PAGE % BLOCK_N == 0  # a tile never crosses a page: one block id per tile
    pid_g = tl.program_id(0)
    pid_m = pid_g // SPLIT_V  # the column split runs fastest: the programs sharing a key tile run together
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

    # Own columns (value, accumulator) and, with SPLIT_V = 2, the other half (scores only).
    offs_v = pid_v * BV + tl.arange(0, BV)
    q_row = Q_lat + b * s_qlb + t[:, None] * s_qlt + h[:, None] * s_qlh
    if EVEN_R:
        q = tl.load(q_row + offs_v[None, :], mask=m_ok[:, None], other=0.0)
    else:
        q = tl.load(q_row + offs_v[None, :], mask=m_ok[:, None] & (offs_v[None, :] < R), other=0.0)
    q2 = q
    qr = q
    offs_w = offs_v
    offs_d = tl.arange(0, BLOCK_DR)
    if SPLIT_V == 2:
        offs_w = (1 - pid_v) * BV + tl.arange(0, BV)
        if EVEN_R:
            q2 = tl.load(q_row + offs_w[None, :], mask=m_ok[:, None], other=0.0)
        else:
            q2 = tl.load(q_row + offs_w[None, :], mask=m_ok[:, None] & (offs_w[None, :] < R), other=0.0)
    if HAS_ROPE:
        qr_row = Q_rope + b * s_qrb + t[:, None] * s_qrt + h[:, None] * s_qrh
        if EVEN_DR:
            qr = tl.load(qr_row + offs_d[None, :], mask=m_ok[:, None], other=0.0)
        else:
            qr = tl.load(qr_row + offs_d[None, :], mask=m_ok[:, None] & (offs_d[None, :] < DR), other=0.0)

    # Running max in base 2 (the scale carries log2 e). Finite start value so that "no key yet" needs no
    # special case.
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BV], tl.float32)
    bt_row = BT + b * s_btb
    blk_next = seq_len.to(tl.int64) * 0  # carried block id of the next tile (AHEAD)
    if AHEAD and ONE_PAGE:
        # The block id of the next tile is read one iteration ahead and carried, so the tile's address does
        # not depend on a load of the same iteration and the pipeliner can issue tiles num_stages - 1 ahead.
        blk_next = tl.load(bt_row + start // PAGE, mask=start < end, other=0).to(tl.int64)
    alive = seq_len >= 0  # always true, but opaque to the compiler (see OPAQUE)
    if TMA:
        # Whole tiles (every row a cached token) come in through the tensor-memory accelerator: one page row
        # range of the pool per tile, no per-thread address arithmetic. A last, partial tile takes the masked
        # pointer path below, so rows past the sequence (any bits, NaN included) are never read.
        full = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, full, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            blk, blk_next = _tile_page(bt_row, n0, end, blk_next, PAGE, BLOCK_N, AHEAD)
            r0 = (blk * PAGE + (n0 % PAGE)).to(tl.int32)
            c = KV_DESC.load([r0, pid_v * BV])  # this program's latent columns
            c2 = c
            if SPLIT_V == 2:  # the other half: scores only
                c2 = KV_DESC.load([r0, (1 - pid_v) * BV])
            kr = c
            if HAS_ROPE:
                kr = KR_DESC.load([r0, R])
            m_i, l_i, acc = _tile_update(q, q2, qr, c, c2, kr, offs_n, n_ok, lim, m_i, l_i, acc, qk_scale_log2,
                                         alive, IEEE, LAZY, OPAQUE, HAS_ROPE, SPLIT_V, BLOCK_H, BLOCK_N)
        if full < end:
            offs_n = full + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            blk = tl.load(bt_row + full // PAGE).to(tl.int64)
            row = blk * s_kvb + ((full % PAGE) + tl.arange(0, BLOCK_N)) * s_kvr
            c, c2, kr = _ptr_tile(KV, row, offs_v, offs_w, offs_d, n_ok, R, DR, EVEN_R, EVEN_DR, HAS_ROPE, SPLIT_V)
            m_i, l_i, acc = _tile_update(q, q2, qr, c, c2, kr, offs_n, n_ok, lim, m_i, l_i, acc, qk_scale_log2,
                                         alive, IEEE, LAZY, OPAQUE, HAS_ROPE, SPLIT_V, BLOCK_H, BLOCK_N)
    else:
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            if ONE_PAGE:
                blk, blk_next = _tile_page(bt_row, n0, end, blk_next, PAGE, BLOCK_N, AHEAD)
                row = blk * s_kvb + ((n0 % PAGE) + tl.arange(0, BLOCK_N)) * s_kvr
            else:
                blk = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
                row = blk * s_kvb + (offs_n % PAGE) * s_kvr
            c, c2, kr = _ptr_tile(KV, row, offs_v, offs_w, offs_d, n_ok, R, DR, EVEN_R, EVEN_DR, HAS_ROPE, SPLIT_V)
            m_i, l_i, acc = _tile_update(q, q2, qr, c, c2, kr, offs_n, n_ok, lim, m_i, l_i, acc, qk_scale_log2,
                                         alive, IEEE, LAZY, OPAQUE, HAS_ROPE, SPLIT_V, BLOCK_H, BLOCK_N)

    has = l_i > 0
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT_V == 1:
        lse_ok = m_ok
    else:
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


@triton.jit(do_not_specialize=["s_opb", "s_opm", "s_lpb", "s_lpm", "H", "NUM_SPLITS"])
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


class Plan(NamedTuple):
    """One way to run the decode. ``bh``/``bn``: query rows × keys per tile; ``warps``/``stages``: Triton launch
    options; ``lazy``: rescale the accumulator only when a row max grows by more than 8 (base 2); ``sv``: output
    columns split over this many programs (1 or 2; each recomputes the scores); ``ahead``: block ids read one
    tile ahead (tiles then pipeline ``stages - 1`` deep, not ``stages - 2``); ``opaque``: scores reach the
    softmax through an opaque branch (two warp groups split the score tile instead of both computing it);
    ``tma``: whole key tiles loaded through tensor descriptors (the tensor-memory accelerator on Hopper; the
    last, partial tile of a split through masked loads; needs one page per tile); ``splits``: key splits per request (more than one adds the LSE merge kernel)."""

    bh: int
    bn: int
    warps: int
    stages: int
    lazy: bool = True
    sv: int = 1
    ahead: bool = False
    opaque: bool = False
    tma: bool = False
    splits: int = 1

    @property
    def tile(self) -> tuple:
        return tuple(self)[:-1]

    def short(self) -> str:
        flags = "".join(f for f, on in (("L", self.lazy), ("A", self.ahead), ("O", self.opaque), ("T", self.tma))
                        if on)
        return (f"{self.bh}x{self.bn}w{self.warps}s{self.stages}{('v' + str(self.sv)) if self.sv > 1 else ''}"
                f"{('-' + flags) if flags else ''}/S{self.splits}")


def make_plan(tile, splits: int) -> Plan:
    """Plan from a tile tuple (any prefix of Plan's fields but ``splits``) and a split count."""
    return Plan(*tuple(tile)[:9], splits=int(splits))


# Tiles (Plan fields but the split count) the GPU tuner times. Compiled for sm_90 with Triton 3.6, a 64-row /
# 8-warp tile (i) computes the whole score tile in both warp groups unless ``opaque`` (the product feeds the value
# product, so the compiler puts all warps on the rows), and (ii) keeps only one tile in flight with two stages and
# block ids read in the loop (the page lookup takes a pipeline stage) — ``ahead`` gives 64×32 tiles with 4 stages
# four buffers (three tiles in flight, 220 KB of shared memory). Without those two, 64-row tiles were slower than
# 32×64 lazy tiles over 4 warps (mma.sync, two programs per SM); with them, and with whole key tiles through
# tensor descriptors (TMA), they are the fastest plans at 64 rows and more (docs/perf.md).
_HOPPER_WIDE_TILE = (64, 64, 8, 2, False, 1, True, True, True)
_GPU_TILES = [
    (32, 64, 4, 2, True),                           # the default below 64 rows
    (32, 32, 4, 3, True, 1, True),                  # 32-key tiles two deep; two programs per SM
    (16, 64, 4, 2, True),                           # few rows (Tq·H <= 32: heads sharded by TP)
    (64, 64, 8, 2, True),                           # the previous 64-row best
    (64, 64, 8, 2, False, 1, True, True),           # score tile split between the warp groups, no spills
    (64, 32, 8, 4, True, 1, True, True),            # + three 32-key tiles in flight
    (64, 32, 8, 4, False, 1, True, True),
    (64, 32, 8, 4, True, 1, True, False),
    # the same tiles with whole key tiles through tensor descriptors (TMA)
    _HOPPER_WIDE_TILE,
    (64, 32, 8, 4, False, 1, True, True, True),
    (64, 32, 8, 3, False, 1, True, True, True),
]
_INTERP_TILE = (16, 16, 4, 1, True)
_TUNED: dict[tuple, tuple] = {}
_DISK = TuningCache("mla-decode-plan")  # the same choices, kept on disk across processes
LAST_PLAN: Plan | None = None  # the plan of the latest call
MAX_SPLITS = 256  # automatic split counts stay at or below this (the merge kernel holds all splits of a row)


def _programs_per_split(B: int, rows: int, block_h: int, split_v: int = 1) -> int:
    return B * triton.cdiv(rows, block_h) * split_v


def choose_num_splits(B: int, rows: int, device: torch.device, block_h: int = 16, waves: float = 2,
                      split_v: int = 1) -> int:
    """Splits per request so that about ``waves`` waves of programs (one per SM) cover the GPU (1 under the
    interpreter)."""
    if device.type != "cuda":
        return 1
    per = _programs_per_split(B, rows, block_h, split_v)
    return max(1, min(128, math.ceil(waves * _sm_count(device.index or 0) / per)))


def wave_splits(B: int, rows: int, device: torch.device, block_h: int, split_v: int = 1,
                waves: float = 1.0) -> int:
    """Largest split count whose programs still fit in ``waves`` whole waves (one program per SM): no
    nearly-empty last wave. At least 1."""
    if device.type != "cuda":
        return 1
    per = _programs_per_split(B, rows, block_h, split_v)
    return max(1, min(MAX_SPLITS, int(waves * _sm_count(device.index or 0)) // per))


def _default_plan(B, M, dev):
    """The plan without tuning (``KernelTuning.autotune`` off, or first seen inside a graph capture). On Hopper, 64 or more
    query rows take the 64-row split-score tile: the best plan in every >= 64-row case of the tile sweep, well
    ahead of the 32-row tile (docs/perf.md)."""
    if dev.type != "cuda":
        return make_plan(_INTERP_TILE, 1)
    if M >= 64 and torch.cuda.get_device_capability(dev)[0] >= 9:
        return make_plan(_HOPPER_WIDE_TILE, wave_splits(B, M, dev, 64))
    bh = 32 if M >= 32 else 16
    return make_plan((bh, 64, 4, 2, True), choose_num_splits(B, M, dev, bh))


def _tile_fits(tile, M) -> bool:
    """Tiles worth timing for Tq·H = M rows: no 64-row tiles for 32 rows or fewer (mostly padding), no
    16-row tiles above 32 rows (each key tile read by M/16 programs)."""
    t = make_plan(tile, 1)
    if t.bh > max(16, triton.next_power_of_2(M)):
        return False
    return not ((t.bh >= 64 and M <= 32) or (t.bh <= 16 and M > 32))


def _candidates(B, M, dev, tiles=None, max_blocks=None):
    """Plans the tuner times: each tile with the split count filling whole waves exactly (one program per SM)
    and the one covering about two waves; plus half and quarter waves (fewer, longer splits: less partial
    output to write and merge, which at B=1 is as much traffic as a short cache), none above ``max_blocks``
    (the block table's width: a split takes at least one page)."""
    out = []
    for tile in tiles or _GPU_TILES:
        if not _tile_fits(tile, M):
            continue
        t = make_plan(tile, 1)
        counts = {wave_splits(B, M, dev, t.bh, t.sv), choose_num_splits(B, M, dev, t.bh, 2, t.sv),
                  wave_splits(B, M, dev, t.bh, t.sv, 0.5), wave_splits(B, M, dev, t.bh, t.sv, 0.25)}
        if max_blocks:
            counts = {min(c, max_blocks) for c in counts}
        for s in sorted(counts):
            p = make_plan(tile, s)
            if p not in out:
                out.append(p)
    return out


def _launch(plan, q_lat, qr, kv, bt, sl, vis, out, lse, scale, Tq, H, M, R, DR):
    plan = make_plan(plan[:-1], plan[-1]) if not isinstance(plan, Plan) else plan
    bh, bn, warps, stages, lazy, sv, ahead, opaque, tma, S = plan
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
    sv = sv if block_r >= 32 else 1  # each half keeps at least 16 columns (the product's minimum depth)
    block_dr = max(16, triton.next_power_of_2(max(DR, 1)))
    descs = _tma_descriptors(kv, bn, block_r, block_dr, R, DR, sv) if tma else None
    _mla_decode_stage1[(triton.cdiv(M, bh) * sv, S, B)](
        q_lat, qr, kv, bt, sl, vis if vis is not None else sl, o_part, lse_part, out, lse,
        *(descs or (kv, kv)),
        q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), qr.stride(0), qr.stride(1), qr.stride(2),
        kv.stride(0), kv.stride(1), bt.stride(0), vis.stride(0) if vis is not None else 0,
        *sp,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        float(scale) * _LOG2E, Tq, H, M, S,
        R=R, DR=DR, PAGE=kv.shape[1], BLOCK_R=block_r, BLOCK_DR=block_dr,
        HAS_ROPE=DR > 0, HAS_VIS=vis is not None, FINAL=final, IEEE=q_lat.dtype == torch.float32,
        LAZY=bool(lazy), BLOCK_H=bh, BLOCK_N=bn, SPLIT_V=sv, AHEAD=bool(ahead), OPAQUE=bool(opaque),
        TMA=descs is not None,
        num_warps=warps, num_stages=stages,
    )
    if not final:
        bsz = max(2, triton.next_power_of_2(S))
        brc = max(16, min(triton.next_power_of_2(R), 8192 // bsz))
        _mla_decode_combine[(M, B, triton.cdiv(R, brc))](
            o_part, lse_part, out, lse, *sp,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            H, R, S, BLOCK_S=bsz, BLOCK_RC=brc, num_warps=4,
        )


def _tma_descriptors(kv, bn, block_r, block_dr, R, DR, sv=1):
    """Tensor descriptors over the pool seen as ``[pages · PAGE, R + DR]`` rows: ``[bn, R / sv]`` latent tiles
    (``sv = 2``: one per column half) and ``[bn, DR]`` rope tiles. None (the pointer path) where a tile cannot be one descriptor box of rows: a tile
    crossing pages, a page stride that is not PAGE rows, padded column blocks, misaligned rows, 2^31 rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    nb, page, width = kv.shape
    rows = nb * page
    if (page % bn or block_r != R or (DR and block_dr != DR) or kv.stride(2) != 1
            or kv.stride(0) != page * kv.stride(1) or (kv.stride(1) * kv.element_size()) % 16 or kv.data_ptr() % 16
            or rows >= 2 ** 31):
        return None
    shape, strides = [rows, width], [kv.stride(1), 1]
    lat = TensorDescriptor(kv, shape, strides, [bn, R // sv])
    rope = TensorDescriptor(kv, shape, strides, [bn, block_dr]) if DR else lat
    return lat, rope


def _time_plan(fn) -> float:
    """Milliseconds per call replayed in a CUDA graph (small decode launches are host-bound otherwise)."""
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=5, return_mode="median"))
    except Exception:
        return float(do_bench(fn, warmup=3, rep=15, return_mode="median"))


def pinned_tile():
    """The tile that ``mla_decode_tile`` of the current :class:`~k3nn.kernels.registry.KernelTuning` pins on the
    GPU (no tuning), as a plan's tile: ``(bh, bn, warps, stages[, lazy, sv, ahead, opaque, tma])`` with the flags
    as bools and ``sv`` (1 or 2) an int; None when nothing is pinned."""
    f = current_tuning().mla_decode_tile
    if f is None:
        return None
    return tuple(f[:4]) + tuple(bool(x) if i != 1 else x for i, x in enumerate(f[4:9]))


def _plan(B, M, R, DR, vis, q_lat, num_splits, run, max_blocks=None):
    """Plan for this shape. On a GPU the first call of a shape (outside graph capture) times the candidates on
    its own inputs and keeps the fastest; ``num_splits`` pins the split count. Shapes are keyed by the batch
    and the block table's width (both rounded up to powers of two): a plan tuned on short caches is not reused
    for caches many times longer."""
    dev = q_lat.device
    pin = int(num_splits) if num_splits else None
    if dev.type != "cuda":
        return make_plan(_INTERP_TILE, pin or 1)
    forced = pinned_tile()
    if forced is not None:
        t = make_plan(forced, 1)
        return make_plan(forced, pin or wave_splits(B, M, dev, t.bh, t.sv))
    key = (dev.index, q_lat.dtype, M, R, DR, vis is not None, triton.next_power_of_2(B), num_splits,
           triton.next_power_of_2(max_blocks or 1))
    if key in _TUNED:
        return _TUNED[key]
    saved = _DISK.get(dev, key)
    if saved is not None:
        try:
            _TUNED[key] = Plan(*saved)
            return _TUNED[key]
        except TypeError:  # a file written by another version of the plan
            pass
    if torch.cuda.is_current_stream_capturing() or not current_tuning().autotune:
        p = _default_plan(B, M, dev)
        return make_plan(p.tile, pin) if pin else p
    cands = _candidates(B, M, dev, max_blocks=max_blocks)
    if pin:
        cands = list(dict.fromkeys(make_plan(c.tile, pin) for c in cands))
    torch.cuda.synchronize()  # the timing runs on a side stream: inputs must be ready
    best, best_ms = None, float("inf")
    for c in cands:
        try:
            ms = _time_plan(lambda c=c: run(c))
        except Exception:  # a tile that does not fit this GPU (shared memory / registers)
            continue
        log.debug("mla_decode tune B=%d M=%d: plan %s %.1f us", B, M, c.short(), ms * 1e3)
        if ms < best_ms:
            best, best_ms = c, ms
    if best is None:  # nothing could be timed: keep the heuristic (its launch reports any real error)
        best = _default_plan(B, M, dev)
        best = make_plan(best.tile, pin) if pin else best
    _TUNED[key] = best
    _DISK.put(dev, key, list(best))
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
    plan = _plan(B, M, R, DR, vis, q_lat, num_splits, lambda p: _launch(p, *args), max_blocks=bt.shape[1])
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
