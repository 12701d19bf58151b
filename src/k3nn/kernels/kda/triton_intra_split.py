"""Split intra-chunk pipeline of the Triton chunked KDA forward (``K3NN_KDA_INTRA=split``).

Produces exactly what ``_kda_intra`` (:mod:`.triton_chunk`) produces: qg, kg, w, u, Aqk, e^{G_last} and
X = (I + L)⁻¹ in the fp32 scratch (same layouts and dtypes), in three launches with more programs and fewer
live registers each:

1. ``_split_scores`` (grid: chunks·10 × heads): one program per 16×16 block pair (i ≥ j) of a chunk, walking
   the key channels in tiles of BK. It only needs strips j..i of the inputs: with ``c`` the strip-local
   cumulative log decay and ``s`` a strip's total, an off-diagonal block (i > j) is
   ``(x_i e^{c_i}) · e^{M} · (k_j e^{s_j − c_j})ᵀ`` with ``M`` the decay of the strips strictly between (every
   factor ≤ 1: operands in the input dtype, as the fused kernel); a diagonal block uses the column factor
   ``e^{s − c} ≤ 1`` and the row factor ``e^{c − s}`` capped at e^SPAN, and is recomputed pairwise
   (``e^{c_a − c_b} ≤ 1``) when the strip's decay exceeds SPAN nats, as in ``_kda_intra``. Writes the Aqk
   block (scaled, causal) to A and ``L = β ⊙ Akk`` (strictly lower) to the scratch; the diagonal programs
   also write the zero upper blocks of A.
2. ``_split_solve`` (grid: chunks × heads): X = (I + L)⁻¹ in place in the scratch. The four diagonal 16×16
   blocks are solved together by forward substitution (15 row steps on a [4, 16, 16] tile), the
   off-diagonal blocks by blockwise substitution (fp32 "ieee" dots). Only the block-lower part is
   written, like the fused kernel.
3. ``_split_wu`` (grid: chunks × heads × feature tiles of BD): program t takes key channels and value
   channels [t·BD, (t+1)·BD): G from the four strips (the fused kernel's chained strip sums), qg, kg, e^{G_last},
   ``w = X (β ⊙ k ⊙ e^G)`` and ``u = X (β ⊙ v)`` (X in the input dtype, as the fused kernel).

Numerics equal the fused kernel's up to fp32 rounding: the diagonal inverse is substituted instead of the
doubling product, and the scores use strip-local sums instead of differences of chunk-level ones (slightly
more accurate for long decays). The inverse stays fp32 throughout; the score and w/u products take ``DOT_PREC``
(:func:`k3nn.kernels.precision.dot_precision`: IEEE for fp32 inputs while torch does not allow TF32).

The solve runs in place, so its autotuner restores the scratch between timing runs; the other two are
idempotent.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from ..precision import dot_precision

from .triton_chunk import _SPAN, _inverse_offdiag, _ld, _st, _store_inverse, _tune

__all__ = ["intra_split_launch", "split_kernels"]

NPAIR = 10  # 16×16 blocks (i ≥ j) of a 64-token chunk


def _interp() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _score_configs():
    if _interp():
        return [triton.Config({"BK": 16}, num_warps=4)]
    cfgs = [triton.Config({"BK": bk}, num_warps=w, num_stages=s)
            for bk, w, s in ((64, 2, 2), (32, 2, 2), (64, 4, 2), (128, 4, 1))]
    return cfgs if _tune() else cfgs[:1]


def _solve_configs():
    if _interp():
        return [triton.Config({}, num_warps=4)]
    cfgs = [triton.Config({}, num_warps=w, num_stages=1) for w in (2, 4, 1)]
    return cfgs if _tune() else cfgs[:1]


def _wu_configs():
    if _interp():
        return [triton.Config({"BD": 16}, num_warps=4)]
    cfgs = [triton.Config({"BD": bd}, num_warps=w, num_stages=1) for bd, w in ((32, 4), (64, 4), (64, 8), (32, 2))]
    return cfgs if _tune() else cfgs[:1]


@triton.jit
def _ld_rows(x, bos, L, pid_h, H, row0, hi, NR: tl.constexpr, kb, D: tl.constexpr, BD: tl.constexpr):
    """Chunk rows row0..row0+NR−1 (only those < hi and < L; zeros elsewhere), channels [kb, kb + BD) of
    x [tokens, H, D] as fp32."""
    r = row0 + tl.arange(0, NR)
    rd = kb + tl.arange(0, BD)
    off = ((bos + r).to(tl.int64) * H + pid_h)[:, None] * D + rd[None, :]
    return tl.load(x + off, mask=((r < L) & (r < hi))[:, None] & (rd < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _bst(p, rows, co, val):
    """Store a 16×16 block at rows ``rows``, columns co.. of a per-chunk [64, 64] tile."""
    tl.store(p + rows[:, None] * 64 + co + tl.arange(0, 16)[None, :], val.to(p.dtype.element_ty))


@triton.jit
def _block_pair(pid):
    """(chunk, i, j) of a scores program: ten 16×16 block pairs (i ≥ j) per chunk, p = pid % 10 numbering
    0..3 the diagonal blocks (p, p), 4..6 (j + 1, j), 7..8 (j + 2, j), 9 (3, 0)."""
    p = pid % 10
    far2 = (p >= 7).to(tl.int32)
    far3 = (p >= 9).to(tl.int32)
    diag = p < 4
    j = tl.where(diag, p, p - 4 - 3 * far2 - 2 * far3)
    i = tl.where(diag, p, j + 1 + far2 + far3)
    return pid // 10, i, j


@triton.jit
def _pairwise_diag(q_s, k_s, c, dA, dQ):
    """Replace a diagonal block's scores by the exact pairwise form, ``e^{c_a − c_b} ≤ 1`` for b ≤ a (c: the
    strip rows' cumulative decay, any common offset): never overflows, whatever the strip's decay."""
    r16 = tl.arange(0, 16)
    for jj in range(16):
        sel = r16[:, None] == jj
        kj = tl.sum(tl.where(sel, k_s, 0.0), 0)
        cj = tl.sum(tl.where(sel, c, 0.0), 0)
        e = tl.exp(tl.minimum(c - cj[None, :], 0.0))
        hit = r16[None, :] == jj
        dA = tl.where(hit, tl.sum(k_s * kj[None, :] * e, 1)[:, None], dA)
        dQ = tl.where(hit, tl.sum(q_s * kj[None, :] * e, 1)[:, None], dQ)
    return dA, dQ


@triton.jit
def _store_diag(Ap, Lp, i, accA, accQ, b_i, scale):
    """Diagonal block i: L = β ⊙ Akk strictly lower, Aqk (scaled) causal, and the zero blocks right of it."""
    r16 = tl.arange(0, 16)
    ri = i * 16 + r16
    strict = r16[:, None] > r16[None, :]
    causal = r16[:, None] >= r16[None, :]
    _bst(Lp, ri, i * 16, tl.where(strict, accA * b_i[:, None], 0.0))
    _bst(Ap, ri, i * 16, tl.where(causal, accQ * scale, 0.0))
    r64 = tl.arange(0, 64)
    tl.store(Ap + ri[:, None] * 64 + r64[None, :], tl.zeros([16, 64], dtype=Ap.dtype.element_ty),
             mask=(r64 >= (i + 1) * 16)[None, :] & (ri < 64)[:, None])


@triton.jit
def _strip_setup(chunk_start, chunk_len, beta, A_out, L_out, pid_c, pid_h, i, H):
    """Row strip i of one chunk and head: (first token, chunk length, chunk-head index, the strip's rows, their β,
    this chunk-head's [64, 64] Aqk and L blocks)."""
    bos = tl.load(chunk_start + pid_c)
    L = tl.load(chunk_len + pid_c)
    ob = (pid_c * H + pid_h).to(tl.int64)
    ri = i * 16 + tl.arange(0, 16)
    b_i = tl.load(beta + (bos + ri).to(tl.int64) * H + pid_h, mask=ri < L, other=0.0).to(tl.float32)
    return bos, L, ob, ri, b_i, A_out + ob * 4096, L_out + ob * 4096


@triton.jit
def _split_scores_kernel(q, k, g, beta, chunk_start, chunk_len, A_out, L_out, scale, H,
                         K: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_h = tl.program_id(1)
    pid_c, i, j = _block_pair(tl.program_id(0))
    bos, L, ob, ri, b_i, Ap, Lp = _strip_setup(chunk_start, chunk_len, beta, A_out, L_out, pid_c, pid_h, i, H)
    cd = q.dtype.element_ty
    accA = tl.zeros([16, 16], dtype=tl.float32)
    accQ = tl.zeros([16, 16], dtype=tl.float32)
    if i == j:
        for kb in range(0, K, BK):
            g_s = _ld_rows(g, bos, L, pid_h, H, i * 16, 64, 16, kb, K, BK)
            q_s = _ld_rows(q, bos, L, pid_h, H, i * 16, 64, 16, kb, K, BK)
            k_s = _ld_rows(k, bos, L, pid_h, H, i * 16, 64, 16, kb, K, BK)
            c = tl.cumsum(g_s, 0)
            s = tl.sum(g_s, 0)
            ea = tl.exp(c)
            eb = tl.exp(s[None, :] - c)
            ka = k_s * ea
            qa = q_s * ea
            kbb = k_s * eb
            ed = tl.exp(tl.minimum(-s, SPAN))[None, :]
            dA = tl.dot(ka * ed, tl.trans(kbb), input_precision=DOT_PREC)
            dQ = tl.dot(qa * ed, tl.trans(kbb), input_precision=DOT_PREC)
            if tl.max(-s, 0) > SPAN:
                dA, dQ = _pairwise_diag(q_s, k_s, c, dA, dQ)
            accA += dA
            accQ += dQ
        _store_diag(Ap, Lp, i, accA, accQ, b_i, scale)
    else:
        for kb in range(0, K, BK):
            g_i = _ld_rows(g, bos, L, pid_h, H, i * 16, 64, 16, kb, K, BK)
            q_i = _ld_rows(q, bos, L, pid_h, H, i * 16, 64, 16, kb, K, BK)
            k_i = _ld_rows(k, bos, L, pid_h, H, i * 16, 64, 16, kb, K, BK)
            g_j = _ld_rows(g, bos, L, pid_h, H, j * 16, 64, 16, kb, K, BK)
            k_j = _ld_rows(k, bos, L, pid_h, H, j * 16, 64, 16, kb, K, BK)
            g_m = _ld_rows(g, bos, L, pid_h, H, j * 16 + 16, i * 16, 32, kb, K, BK)  # strips strictly between
            ea = tl.exp(tl.cumsum(g_i, 0))
            c_j = tl.cumsum(g_j, 0)
            col = k_j * tl.exp(tl.sum(g_j, 0)[None, :] - c_j) * tl.exp(tl.sum(g_m, 0))[None, :]
            colT = tl.trans(col.to(cd))
            accA += tl.dot((k_i * ea).to(cd), colT, input_precision=DOT_PREC)
            accQ += tl.dot((q_i * ea).to(cd), colT, input_precision=DOT_PREC)
        _bst(Lp, ri, j * 16, accA * b_i[:, None])
        _bst(Ap, ri, j * 16, accQ * scale)


@triton.jit
def _sub16(X3, a, s4, t: tl.constexpr):
    """Block t of a [4, 16, 16] stack as a [16, 16] tile (exact: a sum of zeros and one value)."""
    return tl.sum(tl.where(s4 == t, X3, 0.0), 0)


@triton.jit
def _ld_blk(p, ro: tl.constexpr, co: tl.constexpr):
    r = tl.arange(0, 16)
    return tl.load(p + (ro + r)[:, None] * 64 + co + r[None, :])


@triton.jit
def _solve_blocks(Xp):
    """The ten lower 16×16 blocks of (I + L)⁻¹ from the strictly lower L in the fp32 [64, 64] tile at ``Xp``
    (fp32): the four diagonal blocks together by forward substitution (15 row steps on a [4, 16, 16] tile), the
    rest by blockwise substitution. Returns (X00, X11, X22, X33, X10, X20, X21, X30, X31, X32)."""
    s4 = tl.arange(0, 4)[:, None, None]
    a = tl.arange(0, 16)[None, :, None]
    b = tl.arange(0, 16)[None, None, :]
    L3 = tl.load(Xp + (16 * s4 + a) * 64 + 16 * s4 + b)  # the four diagonal blocks of L (strictly lower)
    X3 = tl.where(a == b, 1.0, 0.0) + tl.zeros([4, 16, 16], dtype=tl.float32)
    for r in range(1, 16):
        # row r of every diagonal block: X_r = e_r − Σ_{c<r} L_rc X_c (rows c < r are final)
        lr = tl.sum(tl.where(a == r, L3, 0.0), 1)  # [4, 16]: L_r,c
        acc = tl.sum(lr[:, :, None] * X3, 1)  # [4, 16]: Σ_c L_rc X_c,:
        X3 = tl.where(a == r, X3 - acc[:, None, :], X3)
    X00 = _sub16(X3, a, s4, 0)
    X11 = _sub16(X3, a, s4, 1)
    X22 = _sub16(X3, a, s4, 2)
    X33 = _sub16(X3, a, s4, 3)
    L10 = _ld_blk(Xp, 16, 0)
    L20 = _ld_blk(Xp, 32, 0)
    L21 = _ld_blk(Xp, 32, 16)
    L30 = _ld_blk(Xp, 48, 0)
    L31 = _ld_blk(Xp, 48, 16)
    L32 = _ld_blk(Xp, 48, 32)
    X10, X20, X21, X30, X31, X32 = _inverse_offdiag(X00, X11, X22, X33, L10, L20, L21, L30, L31, L32)
    return X00, X11, X22, X33, X10, X20, X21, X30, X31, X32


@triton.jit
def _split_solve_kernel(X, H):
    pid_c = tl.program_id(0)
    pid_h = tl.program_id(1)
    ob = (pid_c * H + pid_h).to(tl.int64)
    Xp = X + ob * 4096
    X00, X11, X22, X33, X10, X20, X21, X30, X31, X32 = _solve_blocks(Xp)
    tl.debug_barrier()  # every L block is read before X overwrites it
    _store_inverse(Xp, X00, X11, X22, X33, X10, X20, X21, X30, X31, X32)


@triton.jit
def _xcol(Xp, r64, s: tl.constexpr):
    """Column block s of X: [64, 16] (rows above the block are zero)."""
    r16 = tl.arange(0, 16)
    return tl.load(Xp + r64[:, None] * 64 + s * 16 + r16[None, :], mask=(r64 >= s * 16)[:, None], other=0.0)


@triton.jit
def _zstrip(q_s, k_s, G_s, pre, r, Gl, b_s, qg_out, kg_out, ob, s: tl.constexpr, kb, scale,
            K: tl.constexpr, BD: tl.constexpr):
    """qg, kg of one strip (stored) and its z = β·k·e^G (returned), with the fused kernel's operations."""
    ea = tl.exp(G_s - pre[None, :])
    eb = tl.exp(r[None, :] - G_s)
    epre = tl.exp(pre)
    _st(qg_out, ob, s, kb, q_s * ea * (epre * scale)[None, :], K, BD)
    _st(kg_out, ob, s, kb, k_s * eb * tl.exp(Gl - r)[None, :], K, BD)
    return k_s * ea * (epre[None, :] * b_s[:, None])


@triton.jit
def _split_wu_kernel(q, k, v, g, beta, chunk_start, chunk_len, X, qg_out, kg_out, w_out, u_out, egl_out,
                     scale, H, K: tl.constexpr, V: tl.constexpr, BD: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_h = tl.program_id(1)
    d0 = tl.program_id(2) * BD
    bos = tl.load(chunk_start + pid_c)
    L = tl.load(chunk_len + pid_c)
    ob = (pid_c * H + pid_h).to(tl.int64)
    cd = q.dtype.element_ty
    r64 = tl.arange(0, 64)
    Xp = X + ob * 4096
    X0 = _xcol(Xp, r64, 0).to(cd)
    X1 = _xcol(Xp, r64, 1).to(cd)
    X2 = _xcol(Xp, r64, 2).to(cd)
    X3 = _xcol(Xp, r64, 3).to(cd)
    r16 = tl.arange(0, 16)
    b0 = tl.load(beta + (bos + r16).to(tl.int64) * H + pid_h, mask=r16 < L, other=0.0).to(tl.float32)
    b1 = tl.load(beta + (bos + 16 + r16).to(tl.int64) * H + pid_h, mask=16 + r16 < L, other=0.0).to(tl.float32)
    b2 = tl.load(beta + (bos + 32 + r16).to(tl.int64) * H + pid_h, mask=32 + r16 < L, other=0.0).to(tl.float32)
    b3 = tl.load(beta + (bos + 48 + r16).to(tl.int64) * H + pid_h, mask=48 + r16 < L, other=0.0).to(tl.float32)
    rd = d0 + tl.arange(0, BD)
    if d0 < K:
        g0 = _ld(g, bos, L, pid_h, H, 0, d0, K, BD)
        g1 = _ld(g, bos, L, pid_h, H, 1, d0, K, BD)
        g2 = _ld(g, bos, L, pid_h, H, 2, d0, K, BD)
        g3 = _ld(g, bos, L, pid_h, H, 3, d0, K, BD)
        r0 = tl.sum(g0, 0)
        r1 = r0 + tl.sum(g1, 0)
        r2 = r1 + tl.sum(g2, 0)
        r3 = r2 + tl.sum(g3, 0)
        tl.store(egl_out + ob * K + rd, tl.exp(r3), mask=rd < K)
        z0 = _zstrip(_ld(q, bos, L, pid_h, H, 0, d0, K, BD), _ld(k, bos, L, pid_h, H, 0, d0, K, BD),
                     tl.cumsum(g0, 0), tl.zeros_like(r0), r0, r3, b0, qg_out, kg_out, ob, 0, d0, scale, K, BD)
        z1 = _zstrip(_ld(q, bos, L, pid_h, H, 1, d0, K, BD), _ld(k, bos, L, pid_h, H, 1, d0, K, BD),
                     tl.cumsum(g1, 0) + r0[None, :], r0, r1, r3, b1, qg_out, kg_out, ob, 1, d0, scale, K, BD)
        z2 = _zstrip(_ld(q, bos, L, pid_h, H, 2, d0, K, BD), _ld(k, bos, L, pid_h, H, 2, d0, K, BD),
                     tl.cumsum(g2, 0) + r1[None, :], r1, r2, r3, b2, qg_out, kg_out, ob, 2, d0, scale, K, BD)
        z3 = _zstrip(_ld(q, bos, L, pid_h, H, 3, d0, K, BD), _ld(k, bos, L, pid_h, H, 3, d0, K, BD),
                     tl.cumsum(g3, 0) + r2[None, :], r2, r3, r3, b3, qg_out, kg_out, ob, 3, d0, scale, K, BD)
        w = tl.dot(X0, z0.to(cd), input_precision=DOT_PREC)
        w = tl.dot(X1, z1.to(cd), w, input_precision=DOT_PREC)
        w = tl.dot(X2, z2.to(cd), w, input_precision=DOT_PREC)
        w = tl.dot(X3, z3.to(cd), w, input_precision=DOT_PREC)
        tl.store(w_out + ob * 64 * K + r64[:, None] * K + rd[None, :], w.to(w_out.dtype.element_ty),
                 mask=(rd < K)[None, :] & (r64 < 64)[:, None])
    if d0 < V:
        v0 = _ld(v, bos, L, pid_h, H, 0, d0, V, BD) * b0[:, None]
        v1 = _ld(v, bos, L, pid_h, H, 1, d0, V, BD) * b1[:, None]
        v2 = _ld(v, bos, L, pid_h, H, 2, d0, V, BD) * b2[:, None]
        v3 = _ld(v, bos, L, pid_h, H, 3, d0, V, BD) * b3[:, None]
        u = tl.dot(X0, v0.to(cd), input_precision=DOT_PREC)
        u = tl.dot(X1, v1.to(cd), u, input_precision=DOT_PREC)
        u = tl.dot(X2, v2.to(cd), u, input_precision=DOT_PREC)
        u = tl.dot(X3, v3.to(cd), u, input_precision=DOT_PREC)
        tl.store(u_out + ob * 64 * V + r64[:, None] * V + rd[None, :], u.to(u_out.dtype.element_ty),
                 mask=(rd < V)[None, :] & (r64 < 64)[:, None])


_split_scores = triton.autotune(configs=_score_configs(), key=["K", "DOT_PREC"])(_split_scores_kernel)
_split_solve = triton.autotune(configs=_solve_configs(), key=[], restore_value=["X"])(_split_solve_kernel)
_split_wu = triton.autotune(configs=_wu_configs(), key=["K", "V", "DOT_PREC"])(_split_wu_kernel)


def split_kernels():
    """The three autotuned kernels, in launch order (benchmarks list and time their configs)."""
    return _split_scores, _split_solve, _split_wu


def _run(kern, grid, args, kw, config, dtype):
    """Launch ``kern`` (autotuned, or with ``config``); ``dtype``: the activations' (a kernel with a ``DOT_PREC``
    argument gets :func:`~k3nn.kernels.precision.dot_precision`: fp32 products follow torch's TF32 setting)."""
    if "DOT_PREC" in kern.arg_names:
        kw = {**kw, "DOT_PREC": dot_precision(dtype)}
    if config is None:
        kern[grid](*args, **kw)
    else:
        g = grid(config.kwargs) if callable(grid) else grid
        kern.fn[g](*args, **kw, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def intra_split_launch(q, k, v, g, beta, scale, NC, c_start, c_len, qg, kg, w, u, A, egl, X, configs=None,
                       stages=(0, 1, 2)):
    """Fill the fused kernel's outputs (qg, kg, w, u, A, egl and X in the fp32 scratch) with the three split
    kernels. ``configs``: an optional triple of ``triton.Config`` (None entries: autotuned) to run instead
    of the tuned choices; ``stages``: which of the three kernels to launch (benchmarks time them one by one)."""
    _, _, H, K = q.shape
    V = v.shape[-1]
    configs = configs or (None, None, None)
    if 0 in stages:
        _run(_split_scores, (NC * 10, H), (q, k, g, beta, c_start, c_len, A, X, scale, H),
             {"K": K, "SPAN": _SPAN}, configs[0], q.dtype)
    if 1 in stages:
        _run(_split_solve, (NC, H), (X, H), {}, configs[1], q.dtype)
    if 2 in stages:
        grid = lambda META: (NC, H, triton.cdiv(max(K, V), META["BD"]))
        _run(_split_wu, grid, (q, k, v, g, beta, c_start, c_len, X, qg, kg, w, u, egl, scale, H),
             {"K": K, "V": V}, configs[2], q.dtype)
