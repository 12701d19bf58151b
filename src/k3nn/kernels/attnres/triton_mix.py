"""Triton AttnRes kernels: the fused depth mix and the two phases of paper Algorithm 1, one launch each.

One program handles one (query, token row): it walks the S sources with an online softmax over depth,
holding the fp32 accumulator and the current source row (d ≤ 16384) in registers, so every source row
is read from memory exactly once and no stacked copy of the sources is ever made (their base pointers
travel as a tuple argument). Per source: one load (issued from a ring up to 8 sources ahead, optionally pinned
in that order), the row sums Σv·q and Σv² (optionally as one joined reduction), one rescale::

    s = (v · q) / sqrt(mean(v²) + eps);  M = max(m, s)
    acc = e^{m−M} acc + e^{s−M} v;  l = e^{m−M} l + e^{s−M}

Modes (constexpr): ``attnres_mix`` (normalise and store h), phase 1 (Q queries, store the unnormalised
state o, m, l; the Q programs of a token are adjacent so its source rows are served from L2 after the
first), phase 2 (start from a stored state, optionally add the residual update to the partial first and
apply the following RMSNorm to h). fp32 math throughout; bf16 / fp16 / fp32 I/O.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..registry import triton_ready
from .reference import AttnResPhase2Output

__all__ = ["attnres_mix_triton", "attnres_phase1_triton", "attnres_phase2_triton", "mix_supports",
           "phase1_supports", "phase2_supports", "MAX_D", "MAX_SOURCES"]

MAX_D = 16384  # the whole row (accumulator + current source) lives in registers
MAX_SOURCES = 32
MAX_PREFETCH = 8  # load-ring slots in the kernel
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # no inline asm under the interpreter
_alloc = torch.empty  # every output buffer comes from here (tests swap in a NaN-filled allocator)


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
    FENCE: tl.constexpr,
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


def _num_warps(block_d: int) -> int:
    # One row of accumulator + source per program; 8 warps at d = 7168 (phase 2: one source + the state).
    return max(1, min(16, block_d // 1024))


def _mix_config(block_d: int, n_sources: int) -> dict:
    """Default schedule (d = 7168 reasoning, register counts from ptxas for sm_90; see bench/gpu/attnres.py).

    Up to 2 sources: 4 warps, one row of prefetch (H200: 78% of copy BW). From 3 sources on: 16 warps, a
    pinned ring of 3 rows ahead (ORDERED) with the accumulate tied to the next reduction (FENCE = 2 on the GPU, the
    one-instruction form; 1 under the interpreter). H200, T = 8192, d = 7168: 58.6% of copy BW at S = 9 and
    59.5% at S = 5, against 52.7% / 51.7% before (bench/gpu/attnres.py); about
    110 registers, no spills, four 14 KB rows in flight per SM. Unpinned, the compiler hoists every load and
    sinks every accumulate (S rows live: 255 registers at 8 warps, spills at 16)."""
    if n_sources <= 2:
        return dict(num_warps=max(1, min(16, block_d // 2048)), prefetch=1, qv_reload=False, join=False)
    return dict(num_warps=max(1, min(16, block_d // 512)), prefetch=3, qv_reload=False, join=True, ordered=True,
                fence=1 if _INTERPRET else 2)


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    return t.contiguous().view(-1, d)


def _launch(srcs, qw, nw, out, *, n, d, q=1, eps, upd=None, newp=None, state=None, state_out=None,
            post=None, post_eps=1e-5, y=None, normalise=True, num_warps=None, prefetch=1, qv_reload=False,
            join=False, evict=None, ordered=False, fence=0, maxnreg=None):
    block_d = triton.next_power_of_2(d)
    if n == 0:
        return
    o_in, m_in, l_in = state if state is not None else (None, None, None)
    m_out, l_out = state_out if state_out is not None else (None, None)
    _attnres_kernel[(q * n,)](
        tuple(srcs) if srcs else (out,),  # S = 0 (phase 2 without a partial) never reads it
        upd, newp, o_in, m_in, l_in, qw, nw, qw.stride(0) if qw.dim() == 2 else 0,
        out, m_out, l_out, post, y, float(post_eps), n, d, q, float(eps),
        S=len(srcs), BLOCK_D=block_d, HAS_UPDATE=upd is not None, HAS_STATE=state is not None,
        NORMALISE=normalise, WRITE_STATE=state_out is not None, POST_NORM=post is not None,
        PREFETCH=max(0, min(int(prefetch), MAX_PREFETCH, len(srcs) - 1)), QV_RELOAD=bool(qv_reload), JOIN=bool(join),
        EVICT=(q == 1) if evict is None else bool(evict), ORDERED=bool(ordered),
        FENCE=1 if fence == 2 and _INTERPRET else int(fence),
        num_warps=num_warps or _num_warps(block_d), **({"maxnreg": int(maxnreg)} if maxnreg else {}))


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
                       eps: float = 1e-5, *, num_warps: int | None = None, prefetch: int | None = None,
                       qv_reload: bool | None = None, join: bool | None = None, evict: bool | None = None,
                       ordered: bool | None = None, fence: int | None = None, maxnreg: int | None = None
                       ) -> torch.Tensor:
    """sources: S tensors [..., d] → h [..., d] in the sources' dtype (see :func:`k3nn.ops.attnres_mix`).
    The keyword knobs override the measured default schedule (:func:`_mix_config`); results are identical."""
    d = sources[0].shape[-1]
    cfg = _mix_config(triton.next_power_of_2(d), len(sources))
    for k, v in (("num_warps", num_warps), ("prefetch", prefetch), ("qv_reload", qv_reload), ("join", join),
                 ("evict", evict), ("ordered", ordered), ("fence", fence), ("maxnreg", maxnreg)):
        if v is not None:
            cfg[k] = v
    srcs = [_rows(s, d) for s in sources]
    n = srcs[0].shape[0]
    out = _alloc(sources[0].shape, dtype=sources[0].dtype, device=sources[0].device)
    _launch(srcs, query_weight.contiguous(), norm_weight.contiguous(), out, n=n, d=d, eps=eps,
            **cfg)
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
