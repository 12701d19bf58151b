"""Triton AttnRes kernels: the fused depth mix and the two phases of paper Algorithm 1, one launch each.

One program handles one (query, token row): it walks the S sources with an online softmax over depth,
holding the fp32 accumulator and the current source row (d ≤ 16384) in registers, so every source row
is read from memory exactly once and no stacked copy of the sources is ever made (their base pointers
travel as a tuple argument). Per source: one load (issued from a ring up to 8 sources ahead, optionally pinned
in that order), the row sums Σv·q and Σv² (optionally as one joined reduction), one rescale::

    s = (v · q) / sqrt(mean(v²) + eps);  M = max(m, s)
    acc = e^{m−M} acc + e^{s−M} v;  l = e^{m−M} l + e^{s−M}

``attnres_mix`` can also run as a persistent kernel (:func:`_mix_stream_kernel`, ``stream=True``): a grid of
``ctas`` programs per SM, each mixing rows p, p + G, ... with its load ring and its L2 prefetch window running
across row boundaries. The L2 prefetch (``l2_ahead``, GPU only: inline PTX, off under the interpreter) asks for
source rows ahead of the register ring, so the bytes in flight from DRAM no longer cost registers. Named
schedules (the measured defaults): :data:`MIX_SCHEDULES`; ``schedule=`` or keyword knobs pick others per call.

Modes (constexpr): ``attnres_mix`` (normalise and store h), phase 1 (Q queries, store the unnormalised
state o, m, l; the Q programs of a token are adjacent so its source rows are served from L2 after the
first), phase 2 (start from a stored state, optionally add the residual update to the partial first and
apply the following RMSNorm to h). fp32 math throughout; bf16 / fp16 / fp32 I/O.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..pdl import gdc_launch_dependents, gdc_wait, pdl_launch
from ..registry import triton_ready
from .reference import AttnResPhase2Output

__all__ = ["attnres_mix_triton", "attnres_phase1_triton", "attnres_phase2_triton", "mix_supports",
           "phase1_supports", "phase2_supports", "MAX_D", "MAX_SOURCES", "MIX_SCHEDULES"]

MAX_D = 16384  # the whole row (accumulator + current source) lives in registers
MAX_SOURCES = 32
MAX_PREFETCH = 8  # load-ring slots in the kernel
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # no inline asm under the interpreter
_alloc = torch.empty  # every output buffer comes from here (tests swap in a NaN-filled allocator)
_last_kernel = None  # the compiled kernel of the latest launch (its n_regs / n_spills for the variant sweep)


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """fp32 → ``dtype``, round-to-nearest-even. bf16 is rounded by hand: the interpreter's cast truncates,
    the GPU's rounds; doing it explicitly makes both bit-identical to torch."""
    if dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def _ld(base, offs, mask, EVICT: tl.constexpr):
    """One source row (base: scalar pointer to the row, offs: int32 lane offsets)."""
    if EVICT:  # streamed exactly once: let it leave L2 first
        return tl.load(base + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        return tl.load(base + offs, mask=mask, other=0.0)


@triton.jit
def _l2_prefetch(row_ptr, nbytes, valid, KIND: tl.constexpr, LANES: tl.constexpr):
    """Ask L2 to fetch the ``nbytes`` bytes at ``row_ptr`` (a scalar pointer) ahead of their loads (GPU only).

    A hint with no result and no registers held: the bytes in flight from DRAM are no longer bounded by the
    register ring, and the ring's own loads then hit L2. KIND 1: one ``prefetch.global.L2`` per 32-byte sector
    (LANES ≥ sectors); 2: one per 128-byte line; 3: one ``cp.async.bulk.prefetch.L2`` for the whole row, issued
    by lane 0 of a LANES = 32·num_warps vector (one owner thread; needs a 16-byte aligned row, nbytes % 16 = 0)."""
    lane = tl.arange(0, LANES)
    base = row_ptr.to(tl.int64)
    if KIND == 3:
        go = (lane < valid.to(tl.int32)).to(tl.int32)  # lane 0 when valid
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.b32 $0, 0; }",
            "=r,l,r,r", [base + lane * 0, go, nbytes + lane * 0], dtype=tl.int32, is_pure=False, pack=1)
    else:
        off = lane * (32 if KIND == 1 else 128)
        go = (off < valid.to(tl.int32) * nbytes).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
            "=r,l,r", [base + off, go], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["N", "Q"])  # one compile for decode (N = 1) and prefill
def _attnres_kernel(
    src,  # tuple of S pointers, each to [N, D] rows with row stride D
    upd_ptr, newp_ptr,  # HAS_UPDATE: the last source becomes round(src[S-1] + upd), stored to newp
    o_ptr, m_ptr, l_ptr,  # HAS_STATE: incoming state o [N, D], m [N], l [N]
    qw_ptr, nw_ptr, q_stride,  # query weight and norm gain, [Q, D] with row stride q_stride
    out_ptr,  # [Q, N, D]: h (NORMALISE) or the unnormalised o
    m_out_ptr, l_out_ptr,  # WRITE_STATE: [Q, N]
    pw_ptr, y_ptr, post_eps,  # POST_NORM: y = pw * round(rmsnorm(round(h)))
    N, D, Q, eps,
    S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_UPDATE: tl.constexpr, HAS_STATE: tl.constexpr,
    NORMALISE: tl.constexpr, WRITE_STATE: tl.constexpr, POST_NORM: tl.constexpr, PREFETCH: tl.constexpr,
    QV_RELOAD: tl.constexpr, JOIN: tl.constexpr, EVICT: tl.constexpr, ORDERED: tl.constexpr,
    FENCE: tl.constexpr, L2AHEAD: tl.constexpr = 0, L2KIND: tl.constexpr = 1, L2LANES: tl.constexpr = 1,
    ELT: tl.constexpr = 2, PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    q = pid % Q
    row = pid // Q
    # Row offsets are scalars (int64: N·D may pass 2^31); the per-lane offsets stay int32, so the address
    # of every lane is one scalar base plus a small vector (no 64-bit vector index math, fewer registers).
    rbase = row.to(tl.int64) * D
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    qbase = q * q_stride
    if not QV_RELOAD:
        qv = tl.load(qw_ptr + qbase + offs, mask=mask, other=0.0).to(tl.float32)
        qv = qv * tl.load(nw_ptr + qbase + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:  # launched as a programmatic dependent (kernels/pdl.py): only weights are read before this
        gdc_wait()

    if HAS_STATE:
        acc = _ld(o_ptr + rbase, offs, mask, EVICT).to(tl.float32)
        m = tl.load(m_ptr + row).to(tl.float32)
        l = tl.load(l_ptr + row).to(tl.float32)
    # Load ring: source s lives in slot s % (PREFETCH + 1); the load of source j + PREFETCH is issued before
    # the reductions of source j (which end in a barrier), so PREFETCH + 1 rows are in flight per program.
    # PREFETCH = S - 1 issues every load up front. At most 8 sources ahead (slots b0..b8).
    # The compiler treats the loads as free to move and, left alone, hoists every one to the top (S rows of
    # registers live at once: 255 registers at S = 9, 8 warps). ORDERED pins the ring: the row offset of the
    # load issued in step j carries a zero that the compiler cannot prove, derived from the sum of squares of
    # step j - 1 (ss ≥ 0, so ss < 0 is always false), so it cannot be issued before that reduction is done.
    dep = rbase * 0
    # L2AHEAD > 0: sources PREFETCH + 1 .. PREFETCH + L2AHEAD - 1 are prefetched into L2 now, and step j asks
    # for source j + PREFETCH + L2AHEAD (L2AHEAD ≥ S: every source of the row is requested up front).
    for i in tl.static_range(PREFETCH + 1, PREFETCH + L2AHEAD):
        if i < S:
            _l2_prefetch(src[i] + rbase, D * ELT, row < N, L2KIND, L2LANES)
    for i in tl.static_range(PREFETCH):
        if i < S:
            x = _ld(src[i] + rbase, offs, mask, EVICT)
            if i == 0:
                b0 = x
            elif i == 1:
                b1 = x
            elif i == 2:
                b2 = x
            elif i == 3:
                b3 = x
            elif i == 4:
                b4 = x
            elif i == 5:
                b5 = x
            elif i == 6:
                b6 = x
            else:
                b7 = x
    for j in tl.static_range(S):
        if L2AHEAD > 0 and j + PREFETCH + L2AHEAD < S:
            _l2_prefetch(src[j + PREFETCH + L2AHEAD] + rbase, D * ELT, row < N, L2KIND, L2LANES)
        if j + PREFETCH < S:
            x = _ld(src[j + PREFETCH] + (rbase + dep), offs, mask, EVICT)
            if (j + PREFETCH) % (PREFETCH + 1) == 0:
                b0 = x
            elif (j + PREFETCH) % (PREFETCH + 1) == 1:
                b1 = x
            elif (j + PREFETCH) % (PREFETCH + 1) == 2:
                b2 = x
            elif (j + PREFETCH) % (PREFETCH + 1) == 3:
                b3 = x
            elif (j + PREFETCH) % (PREFETCH + 1) == 4:
                b4 = x
            elif (j + PREFETCH) % (PREFETCH + 1) == 5:
                b5 = x
            elif (j + PREFETCH) % (PREFETCH + 1) == 6:
                b6 = x
            elif (j + PREFETCH) % (PREFETCH + 1) == 7:
                b7 = x
            else:
                b8 = x
        if j % (PREFETCH + 1) == 0:
            cur = b0
        elif j % (PREFETCH + 1) == 1:
            cur = b1
        elif j % (PREFETCH + 1) == 2:
            cur = b2
        elif j % (PREFETCH + 1) == 3:
            cur = b3
        elif j % (PREFETCH + 1) == 4:
            cur = b4
        elif j % (PREFETCH + 1) == 5:
            cur = b5
        elif j % (PREFETCH + 1) == 6:
            cur = b6
        elif j % (PREFETCH + 1) == 7:
            cur = b7
        else:
            cur = b8
        if QV_RELOAD:  # fewer live registers (higher occupancy); the query row stays in L1
            qv = tl.load(qw_ptr + qbase + offs, mask=mask, other=0.0).to(tl.float32)
            qv = qv * tl.load(nw_ptr + qbase + offs, mask=mask, other=0.0).to(tl.float32)
        v = cur.to(tl.float32)
        if HAS_UPDATE and j == S - 1:
            u = _ld(upd_ptr + rbase, offs, mask, EVICT).to(tl.float32)
            vr = _cast(v + u, newp_ptr.dtype.element_ty)
            tl.store(newp_ptr + rbase + offs, vr, mask=mask)
            v = vr.to(tl.float32)
        sq = v * v
        if FENCE == 1 and (j > 0 or HAS_STATE):
            # The compiler may otherwise sink every accumulate to the end of the kernel, keeping all S rows
            # live. acc · 0 (= ±0 for finite acc; not folded without fast-math) ties the previous
            # accumulate into this reduction; adding ±0 to v² ≥ 0 leaves ss bit-identical.
            sq = sq + acc * 0.0
        if JOIN:  # both row sums in one reduction (one cross-warp exchange instead of two)
            dot, ss = tl.split(tl.sum(tl.join(v * qv, sq), axis=0))
        else:
            dot = tl.sum(v * qv, axis=0)
            ss = tl.sum(sq, axis=0)
        s = dot * tl.rsqrt(ss / D + eps)
        if ORDERED:
            dep = (ss < 0).to(tl.int64) * 16  # a multiple of 16 keeps the loads 16-byte vectorised
        if j == 0 and not HAS_STATE:
            m = s
            l = tl.full([], 1.0, tl.float32)
            acc = v
        else:
            m_new = tl.maximum(m, s)
            alpha = tl.exp(m - m_new)
            beta = tl.exp(s - m_new)
            acc = acc * alpha + v * beta
            l = l * alpha + beta
            m = m_new
        if FENCE == 2:  # a side-effecting identity: the accumulate must be done before the next barrier
            acc = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=False,
                                            pack=1)

    if PDL:  # our loads are done: a programmatic dependent (a skinny GEMM) may start its weight prefetch
        gdc_launch_dependents()
    obase = (q * N + row).to(tl.int64) * D
    if NORMALISE:
        h = _cast(acc / l, out_ptr.dtype.element_ty)
        tl.store(out_ptr + obase + offs, h, mask=mask)
        if POST_NORM:
            hf = h.to(tl.float32)
            xn = _cast(hf * tl.rsqrt(tl.sum(hf * hf, axis=0) / D + post_eps), out_ptr.dtype.element_ty)
            w = tl.load(pw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + obase + offs, _cast(xn.to(tl.float32) * w, y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + obase + offs, _cast(acc, out_ptr.dtype.element_ty), mask=mask)
    if WRITE_STATE:
        tl.store(m_out_ptr + q * N + row, m)
        tl.store(l_out_ptr + q * N + row, l)


@triton.jit(do_not_specialize=["N"])
def _mix_stream_kernel(
    src,  # tuple of S pointers, each to [N, D] rows with row stride D
    qw_ptr, nw_ptr, out_ptr, N, D, eps,
    S: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, QV_RELOAD: tl.constexpr, JOIN: tl.constexpr,
    EVICT: tl.constexpr, ORDERED: tl.constexpr, FENCE: tl.constexpr, L2AHEAD: tl.constexpr, L2KIND: tl.constexpr,
    L2LANES: tl.constexpr, ELT: tl.constexpr, STORE_EVICT: tl.constexpr, LAZY: tl.constexpr,
):
    """``attnres_mix`` with persistent programs: program p mixes rows p, p + G, p + 2G, ... (G programs).

    The loads form one stream of (row, source) items per program, item k = source k % S of row p + (k // S)·G,
    and the register ring and the L2 prefetch window run across row boundaries: while row r is reduced and
    stored, the first sources of row r + G are already in flight, so no program starts with an empty pipeline
    (a one-row program waits a full DRAM latency before its first reduction, and there are T / #SM of them in
    turn per SM). The ring is a shift register (b0 = oldest), so its slots stay fixed across the row loop.
    Same math, same operation order as :func:`_attnres_kernel` (``attnres_mix`` mode)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    if not QV_RELOAD:
        qv = tl.load(qw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        qv = qv * tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    nbytes = D * ELT
    # items 0 .. PREFETCH - 1 into the ring, PREFETCH + 1 .. PREFETCH + L2AHEAD - 1 into L2
    # (prologue names differ from the loop's: a name bound before the row loop would be carried through it)
    for i in tl.static_range(PREFETCH):
        ri = pid + (i // S) * G
        xi = _ld(src[i % S] + ri.to(tl.int64) * D, offs, offs < (ri < N).to(tl.int32) * D, EVICT)
        if i == 0:
            b0 = xi
        elif i == 1:
            b1 = xi
        elif i == 2:
            b2 = xi
        elif i == 3:
            b3 = xi
        elif i == 4:
            b4 = xi
        elif i == 5:
            b5 = xi
        elif i == 6:
            b6 = xi
        else:
            b7 = xi
    for i in tl.static_range(PREFETCH + 1, PREFETCH + L2AHEAD):
        ri = pid + (i // S) * G
        _l2_prefetch(src[i % S] + ri.to(tl.int64) * D, nbytes, ri < N, L2KIND, L2LANES)
    dep = pid.to(tl.int64) * 0  # ORDERED: an unprovable zero from the previous reduction (see _attnres_kernel)
    for row in range(pid, N, G):
        rbase = (pid * 0 + row).to(tl.int64) * D  # (the interpreter's loop index is a Python int)
        for j in tl.static_range(S):
            # (item indices are written out: a name bound to a constexpr in the unrolled loop becomes a tensor)
            if L2AHEAD > 0:
                r2 = row + ((j + PREFETCH + L2AHEAD) // S) * G
                _l2_prefetch(src[(j + PREFETCH + L2AHEAD) % S] + r2.to(tl.int64) * D, nbytes, r2 < N, L2KIND,
                             L2LANES)
            rk = row + ((j + PREFETCH) // S) * G
            x = _ld(src[(j + PREFETCH) % S] + (rk.to(tl.int64) * D + dep), offs, offs < (rk < N).to(tl.int32) * D,
                    EVICT)
            if PREFETCH == 0:
                cur = x
            else:  # take the oldest slot, shift, append the new load
                cur = b0
                if PREFETCH > 1:
                    b0 = b1
                if PREFETCH > 2:
                    b1 = b2
                if PREFETCH > 3:
                    b2 = b3
                if PREFETCH > 4:
                    b3 = b4
                if PREFETCH > 5:
                    b4 = b5
                if PREFETCH > 6:
                    b5 = b6
                if PREFETCH > 7:
                    b6 = b7
                if PREFETCH == 1:
                    b0 = x
                elif PREFETCH == 2:
                    b1 = x
                elif PREFETCH == 3:
                    b2 = x
                elif PREFETCH == 4:
                    b3 = x
                elif PREFETCH == 5:
                    b4 = x
                elif PREFETCH == 6:
                    b5 = x
                elif PREFETCH == 7:
                    b6 = x
                else:
                    b7 = x
            if QV_RELOAD:
                qv = tl.load(qw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                qv = qv * tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            v = cur.to(tl.float32)
            sq = v * v
            if FENCE == 1 and j > 0:
                sq = sq + acc * 0.0  # noqa: F821  (bound at j = 0 of the unrolled loop)
            if JOIN:
                dot, ss = tl.split(tl.sum(tl.join(v * qv, sq), axis=0))
            else:
                dot = tl.sum(v * qv, axis=0)
                ss = tl.sum(sq, axis=0)
            s = dot * tl.rsqrt(ss / D + eps)
            if ORDERED:
                dep = (ss < 0).to(tl.int64) * 16
            if j == 0:
                m = s
                l = tl.full([], 1.0, tl.float32)
                acc = v
            elif LAZY:
                # Rescale only when the running max moves (a branch every thread takes alike: s and m come out of
                # the block-wide reduction); otherwise alpha = 1 and acc · 1 is exact, so the result is the same
                # as the unconditional form's, one multiply per element fewer on most steps.
                if s > m:
                    alpha = tl.exp(m - s)
                    acc = acc * alpha
                    l = l * alpha
                    m = s
                beta = tl.exp(s - m)
                acc = acc + v * beta
                l = l + beta
            else:
                m_new = tl.maximum(m, s)
                alpha = tl.exp(m - m_new)
                beta = tl.exp(s - m_new)
                acc = acc * alpha + v * beta
                l = l * alpha + beta
                m = m_new
            if FENCE == 2:
                acc = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=False,
                                                pack=1)
        h = _cast(acc / l, out_ptr.dtype.element_ty)
        if STORE_EVICT:
            tl.store(out_ptr + rbase + offs, h, mask=mask, eviction_policy="evict_first")
        else:
            tl.store(out_ptr + rbase + offs, h, mask=mask)


def _num_warps(block_d: int) -> int:
    # One row of accumulator + source per program; 8 warps at d = 7168 (phase 2: one source + the state).
    return max(1, min(16, block_d // 1024))


def _mix_config(block_d: int, n_sources: int) -> dict:
    """Default row-kernel schedule (d = 7168 reasoning, register counts from ptxas for sm_90; bench/gpu/attnres.py
    times the alternatives, docs/perf.md has the figures).

    Up to 2 sources: 4 warps, one row of prefetch. From 3 sources on: 16 warps, a pinned ring of 3 rows ahead
    (ORDERED) with the accumulate tied to the next reduction (FENCE = 2 on the GPU, the one-instruction form; 1
    under the interpreter): about 110 registers, no spills, four 14 KB rows in flight per SM, faster than the
    8-warp, 2-row-prefetch schedule it replaced. Unpinned, the compiler hoists every load and sinks every
    accumulate (S rows live: 255 registers at 8 warps, spills at 16)."""
    if n_sources <= 2:
        return dict(num_warps=max(1, min(16, block_d // 2048)), prefetch=1, qv_reload=False, join=False)
    return dict(num_warps=max(1, min(16, block_d // 512)), prefetch=3, qv_reload=False, join=True, ordered=True,
                fence=1 if _INTERPRET else 2)


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    return t.contiguous().view(-1, d)


# Named mix schedules: keyword overrides of :func:`attnres_mix_triton` ({} = the measured default,
# :func:`_mix_config`), the ones the default takes (DEFAULT_SCHEDULES); bench/gpu/attnres.py times every one.
# "stream-*": persistent programs over rows (_mix_stream_kernel), ``ctas`` of them per SM, every source requested
# into L2 ``l2_ahead`` items ahead of the register ring (l2_kind 1: per 32-byte sector, 2: per 128-byte line, 3:
# one bulk request per row). Any other schedule is a set of keyword knobs of attnres_mix_triton.
_ORD = dict(join=True, ordered=True, fence=2)  # the pinned ring with the accumulate tied (see _mix_config)
MIX_SCHEDULES: dict[str, dict] = {
    "default": {},
    "stream-16w-pf2-l2x4-sec": dict(stream=True, num_warps=16, prefetch=2, l2_ahead=4, l2_kind=1, **_ORD),
    "stream-16w-pf2-l2x4-lazy": dict(stream=True, num_warps=16, prefetch=2, l2_ahead=4, l2_kind=3, lazy=True,
                                     **_ORD),
    "stream-8w-pf1-l2x4-2cta": dict(stream=True, ctas=2, num_warps=8, prefetch=1, l2_ahead=4, l2_kind=3,
                                    maxnreg=128, lazy=True, **_ORD),
}
# The default per source count at prefill sizes (at least STREAM_MIN_ROWS rows): (max S, schedule name)
# pairs, first match wins: the fastest persistent schedule per source count at T = 8192, d = 7168, each well
# ahead of the row kernel (docs/perf.md). Fewer rows keep the row kernel's _mix_config (decode sizes were not
# swept with these schedules).
DEFAULT_SCHEDULES: list[tuple[int, str]] = [(2, "stream-8w-pf1-l2x4-2cta"), (5, "stream-16w-pf2-l2x4-sec"),
                                            (64, "stream-16w-pf2-l2x4-lazy")]
STREAM_MIN_ROWS = 1024
_ROW_KEYS = ("num_warps", "prefetch", "qv_reload", "join", "evict", "ordered", "fence", "maxnreg", "l2_ahead",
             "l2_kind")
_STREAM_KEYS = _ROW_KEYS + ("ctas", "grid", "store_evict", "num_stages", "lazy")


def _mix_schedule(block_d: int, n_sources: int, overrides: dict, n_rows: int | None = None) -> dict:
    """The schedule of one mix call: the measured default for this size, then ``overrides``."""
    name = "default"
    if n_rows is None or n_rows >= STREAM_MIN_ROWS:
        name = next((nm for max_s, nm in DEFAULT_SCHEDULES if n_sources <= max_s), "default")
    named = MIX_SCHEDULES[name]
    cfg = {**_mix_config(block_d, n_sources), "stream": False}
    # a named or explicit stream schedule starts from nothing but its own keys (fence as on the GPU)
    for layer in (named, overrides):
        if layer.get("stream") and not cfg["stream"]:
            cfg = {"stream": True, "num_warps": None, "prefetch": 2, "join": True, "ordered": True,
                   "fence": 1 if _INTERPRET else 2}
        cfg.update(layer)
    return cfg


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _l2_args(srcs, d: int, l2_ahead: int | None, l2_kind: int | None, num_warps: int) -> dict:
    """Constexprs of the L2 prefetch (off under the interpreter: inline asm; it never changes a result)."""
    ahead = 0 if _INTERPRET or not srcs else max(0, int(l2_ahead or 0))
    if not ahead:
        return dict(L2AHEAD=0, L2KIND=1, L2LANES=1, ELT=2)
    elt = srcs[0].element_size()
    nbytes = d * elt
    kind = int(l2_kind or 1)
    if kind == 3 and (nbytes % 16 or any(t.data_ptr() % 16 for t in srcs)):
        kind = 1  # the bulk form needs 16-byte aligned rows
    lanes = (32 * num_warps if kind == 3 else
             triton.next_power_of_2(max(1, -(-nbytes // (32 if kind == 1 else 128)))))
    return dict(L2AHEAD=min(ahead, 64), L2KIND=kind, L2LANES=lanes, ELT=elt)


def _launch_stream(srcs, qw, nw, out, *, n, d, eps, num_warps=None, prefetch=2, qv_reload=False, join=True,
                   evict=True, ordered=True, fence=2, maxnreg=None, l2_ahead=0, l2_kind=3, ctas=1, grid=None,
                   store_evict=False, num_stages=1, lazy=False, stream=True):
    block_d = triton.next_power_of_2(d)
    if n == 0:
        return
    if grid is None:
        grid = ctas * (_sm_count(out.device.index if out.device.index is not None else torch.cuda.current_device())
                       if out.is_cuda else 4)
    grid = max(1, min(n, int(grid)))
    nw_ = num_warps or _num_warps(block_d)
    global _last_kernel
    _last_kernel = _mix_stream_kernel[(grid,)](
        tuple(srcs), qw, nw, out, n, d, float(eps),
        S=len(srcs), BLOCK_D=block_d, PREFETCH=max(0, min(int(prefetch), MAX_PREFETCH)), QV_RELOAD=bool(qv_reload),
        JOIN=bool(join), EVICT=True if evict is None else bool(evict), ORDERED=bool(ordered),
        FENCE=1 if fence == 2 and _INTERPRET else int(fence), STORE_EVICT=bool(store_evict), LAZY=bool(lazy),
        **_l2_args(srcs, d, l2_ahead, l2_kind, nw_),
        num_warps=nw_, num_stages=int(num_stages), **({"maxnreg": int(maxnreg)} if maxnreg else {}))


def _launch(srcs, qw, nw, out, *, n, d, q=1, eps, upd=None, newp=None, state=None, state_out=None,
            post=None, post_eps=1e-5, y=None, normalise=True, num_warps=None, prefetch=1, qv_reload=False,
            join=False, evict=None, ordered=False, fence=0, maxnreg=None, l2_ahead=0, l2_kind=3):
    block_d = triton.next_power_of_2(d)
    if n == 0:
        return
    nw_ = num_warps or _num_warps(block_d)
    o_in, m_in, l_in = state if state is not None else (None, None, None)
    m_out, l_out = state_out if state_out is not None else (None, None)
    global _last_kernel
    _last_kernel = _attnres_kernel[(q * n,)](
        tuple(srcs) if srcs else (out,),  # S = 0 (phase 2 without a partial) never reads it
        upd, newp, o_in, m_in, l_in, qw, nw, qw.stride(0) if qw.dim() == 2 else 0,
        out, m_out, l_out, post, y, float(post_eps), n, d, q, float(eps),
        S=len(srcs), BLOCK_D=block_d, HAS_UPDATE=upd is not None, HAS_STATE=state is not None,
        NORMALISE=normalise, WRITE_STATE=state_out is not None, POST_NORM=post is not None,
        PREFETCH=max(0, min(int(prefetch), MAX_PREFETCH, len(srcs) - 1)), QV_RELOAD=bool(qv_reload), JOIN=bool(join),
        EVICT=(q == 1) if evict is None else bool(evict), ORDERED=bool(ordered),
        FENCE=1 if fence == 2 and _INTERPRET else int(fence), **_l2_args(srcs, d, l2_ahead, l2_kind, nw_),
        **pdl_launch(out), num_warps=nw_, **({"maxnreg": int(maxnreg)} if maxnreg else {}))


# --------------------------------------------------------------------------------------------- supports


def _common_reason(tensors: list[torch.Tensor], d: int) -> str | None:
    r = triton_ready(*tensors)
    if r:
        return r
    if d > MAX_D:
        return f"d={d} > {MAX_D} (the Triton kernel keeps a whole row in registers)"
    for t in tensors:
        if t.dtype not in _DTYPES:
            return f"dtype {t.dtype} not supported (float32, float16, bfloat16)"
    return None


def mix_supports(sources, query_weight, norm_weight, eps=1e-5):
    if len(sources) > MAX_SOURCES:
        return f"{len(sources)} sources > {MAX_SOURCES}"
    return _common_reason([*sources, query_weight, norm_weight], sources[0].shape[-1])


def phase1_supports(sources, query_weight, norm_weight, eps=1e-5, out_dtype=torch.float32):
    if len(sources) > MAX_SOURCES:
        return f"{len(sources)} sources > {MAX_SOURCES}"
    if out_dtype not in _DTYPES:
        return f"out_dtype {out_dtype} not supported (float32, float16, bfloat16)"
    return _common_reason([*sources, query_weight, norm_weight], sources[0].shape[-1])


def phase2_supports(o, m, l, partial, query_weight, norm_weight, eps=1e-5, update=None, post_norm_weight=None,
                    post_norm_eps=1e-5, dtype=None):
    ts = [t for t in (o, m, l, partial, query_weight, norm_weight, update, post_norm_weight) if t is not None]
    if dtype is not None and dtype not in _DTYPES:
        return f"dtype {dtype} not supported (float32, float16, bfloat16)"
    return _common_reason(ts, o.shape[-1])


# --------------------------------------------------------------------------------------------- entry points


def attnres_mix_triton(sources: list[torch.Tensor], query_weight: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float = 1e-5, *, schedule: str | None = None, **knobs) -> torch.Tensor:
    """sources: S tensors [..., d] → h [..., d] in the sources' dtype (see :func:`k3nn.ops.attnres_mix`).

    ``schedule`` names an entry of :data:`MIX_SCHEDULES`; keyword knobs (num_warps, prefetch, qv_reload, join,
    evict, ordered, fence, maxnreg, l2_ahead, l2_kind; with stream=True also ctas, grid, store_evict,
    num_stages) override it or the measured default (:func:`_mix_config`). Every schedule computes the same
    fp32 operations in the same order per row; only reduction trees (warp counts) may move the last bit."""
    d = sources[0].shape[-1]
    over = {k: v for k, v in knobs.items() if v is not None}
    if schedule is not None:
        over = {**MIX_SCHEDULES[schedule], **over}
    cfg = _mix_schedule(triton.next_power_of_2(d), len(sources), over, sources[0].numel() // max(d, 1))
    allowed = _STREAM_KEYS if cfg["stream"] else _ROW_KEYS
    bad = set(cfg) - set(allowed) - {"stream"}
    if bad:
        raise TypeError(f"attnres_mix_triton: unknown knobs {sorted(bad)} for the "
                        f"{'stream' if cfg['stream'] else 'row'} kernel")
    srcs = [_rows(s, d) for s in sources]
    n = srcs[0].shape[0]
    out = _alloc(sources[0].shape, dtype=sources[0].dtype, device=sources[0].device)
    launch = _launch_stream if cfg.pop("stream") else _launch
    launch(srcs, query_weight.contiguous(), norm_weight.contiguous(), out, n=n, d=d, eps=eps, **cfg)
    return out


def attnres_phase1_triton(sources: list[torch.Tensor], query_weight: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float = 1e-5, out_dtype: torch.dtype = torch.float32, *,
                          num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sources: S tensors [..., d]; query_weight, norm_weight: [Q, d] → (o [Q, ..., d], m [Q, ...], l [Q, ...])."""
    shape, d = sources[0].shape, sources[0].shape[-1]
    srcs = [_rows(s, d) for s in sources]
    n, nq = srcs[0].shape[0], query_weight.shape[0]
    dev = sources[0].device
    o = _alloc((nq, *shape), dtype=out_dtype, device=dev)
    m = _alloc((nq, *shape[:-1]), dtype=torch.float32, device=dev)
    l = _alloc((nq, *shape[:-1]), dtype=torch.float32, device=dev)
    cfg = _mix_config(triton.next_power_of_2(d), len(srcs))
    if num_warps is not None:
        cfg["num_warps"] = num_warps
    _launch(srcs, query_weight.contiguous(), norm_weight.contiguous(), o, n=n, d=d, q=nq, eps=eps,
            state_out=(m, l), normalise=False, **cfg)
    return o, m, l


def attnres_phase2_triton(o: torch.Tensor, m: torch.Tensor, l: torch.Tensor, partial: torch.Tensor | None,
                          query_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5,
                          update: torch.Tensor | None = None, post_norm_weight: torch.Tensor | None = None,
                          post_norm_eps: float = 1e-5, dtype: torch.dtype | None = None, *,
                          num_warps: int | None = None) -> AttnResPhase2Output:
    """One query's phase-1 state merged with the intra-block partial (see :func:`k3nn.ops.attnres_phase2`)."""
    d = o.shape[-1]
    shape, dev = o.shape, o.device
    if partial is None and update is not None:
        partial, update = update, None  # "empty + update" is the update itself
    new_partial = None
    srcs: list[torch.Tensor] = []
    if partial is not None:
        if update is not None:
            new_partial = _alloc(shape, dtype=partial.dtype, device=dev)
        srcs = [_rows(partial, d)]
    out_dtype = dtype or (partial.dtype if partial is not None else o.dtype)
    h = _alloc(shape, dtype=out_dtype, device=dev)
    y = None
    if post_norm_weight is not None:
        y = _alloc(shape, dtype=torch.promote_types(out_dtype, post_norm_weight.dtype), device=dev)
        post_norm_weight = post_norm_weight.contiguous()
    n = h.numel() // d if d else 0
    _launch(srcs, query_weight.contiguous(), norm_weight.contiguous(), h, n=n, d=d, eps=eps,
            upd=None if update is None else _rows(update, d), newp=new_partial,
            state=(_rows(o, d), m.contiguous(), l.contiguous()), post=post_norm_weight, post_eps=post_norm_eps,
            y=y, num_warps=num_warps, prefetch=0, fence=1)
    return AttnResPhase2Output(h, y, new_partial if new_partial is not None else partial)
