"""The intra-chunk stage of the Triton chunked KDA forward (and of the backward's recompute), fed by a precomputed
chunk-local cumulative decay.

Produces qg, kg, w, u, Aqk, e^{G_last} and X = (I + L)⁻¹ in the fp32 scratch (see :mod:`.triton_chunk`; eager
form: :func:`k3nn.kernels.kda.reference.kda_intra_reference`), in four launches:

1. ``_g_cumsum`` (grid: chunks × heads × key tiles of BK): ``G[c, h, r, :] = Σ_{s ≤ r} g[s]`` over the rows of
   chunk c (the chunk plan's ``c_start`` / ``c_len``: chunks restart at every sequence start and at every
   checkpoint cut), into a temporary fp32 buffer ``G: [NC, H, 64, K]`` (per-chunk rows, like qg). Rows past
   the chunk's length hold G_last (g counts as 0 there), so the consumers need no row masks on G (strip
   cumsums plus chained strip sums). Also writes ``e^{G_last}``.
2. ``_g_scores_rows`` (grid: chunks·4 × heads): one program per row strip i computes the 16×16 blocks
   (i, 0) … (i, i), walking the key channels in tiles of BK, loading strip i's q / k / G once per key tile and
   forming its row factor once:

   * off-diagonal (i > j), anchor ``a = G[16i − 1]`` (the row before strip i): ``(x_i e^{G_i − a}) ·
     (k_j e^{a − G_j})ᵀ``. G decreases within a chunk (g ≤ 0), so for a row r of strip i and a column c of
     strip j, ``G_r ≤ a ≤ G_c``: both factors ≤ 1, operands in the input dtype (tensor cores for bf16/fp16;
     TF32 for fp32).
   * diagonal (i == j), with ``pre = G[16i − 1]`` (0 for the first strip) and ``r = G[16i + 15]``: column
     factor ``e^{r − G} ≤ 1``, row factor ``e^{G − pre} · e^{min(pre − r, SPAN)}`` (capped), recomputed
     pairwise with ``e^{min(G_a − G_b, 0)} ≤ 1`` when the strip's decay exceeds SPAN nats. Every factor finite
     for any gate ≤ 0.

   Writes the Aqk block (scaled, causal) to A and ``L = β ⊙ Akk`` (strictly lower) to the scratch; the
   diagonal programs also write the zero upper blocks of A. (One program per block pair instead was slower;
   gone, docs/perf.md.)
3. ``_split_solve`` (:mod:`.triton_intra_split`): X = (I + L)⁻¹ in place in the scratch.
4. ``_g_wu`` (grid: chunks × heads × feature tiles of BD): ``qg = scale · q ⊙ e^G``,
   ``kg = k ⊙ e^{G_last − G}``, ``w = X (β ⊙ k ⊙ e^G)`` and ``u = X (β ⊙ v)`` (X in the input dtype), straight
   from G (no strip rebuild). (qg and kg written by the cumsum kernel instead was slower, docs/perf.md; the
   kernels keep the ``QK`` switch, always set this way.)

qg, kg and z take one exponential of G; the scores take differences of chunk-level G. The score and w/u
products take ``DOT_PREC`` (:func:`k3nn.kernels.precision.dot_precision`: IEEE for fp32 inputs while torch does not
allow TF32), passed by ``_run``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tuning_cache import AUTOTUNE_KW
from .triton_common import _SPAN, PRUNE, _interp, _ld, _st
from .triton_intra_split import (
    _bst,
    _ld_rows,
    _pairwise_diag,
    _run,
    _split_solve,
    _store_diag,
    _strip_setup,
    _xcol,
)

__all__ = ["g_buffer", "g_kernels", "intra_g_launch"]


def _cumsum_configs():
    if _interp():
        return [triton.Config({"BK": 16}, num_warps=4)]
    cfgs = [triton.Config({"BK": bk}, num_warps=w, num_stages=1) for bk, w in ((64, 4), (32, 2), (128, 4))]
    return cfgs


def _score_configs():
    if _interp():
        return [triton.Config({"BK": 16}, num_warps=4)]
    cfgs = [triton.Config({"BK": bk}, num_warps=w, num_stages=s)
            for bk, w, s in ((32, 2, 2), (64, 2, 2), (64, 4, 2), (32, 4, 2), (128, 4, 1))]
    return cfgs


def _wu_configs():
    if _interp():
        return [triton.Config({"BD": 16}, num_warps=4)]
    cfgs = [triton.Config({"BD": bd}, num_warps=w, num_stages=1) for bd, w in ((64, 4), (128, 8), (64, 8), (128, 4))]
    return cfgs


@triton.jit
def _g_qk(q, k, G_s, gl, bos, L, pid_h, SQK, qg_out, kg_out, ob, s: tl.constexpr, d0, scale,
          K: tl.constexpr, BD: tl.constexpr):
    """qg = scale·q·e^G and kg = k·e^{G_last − G} of strip s (stored)."""
    q_s = _ld(q, bos, L, pid_h, SQK, s, d0, K, BD)
    k_s = _ld(k, bos, L, pid_h, SQK, s, d0, K, BD)
    _st(qg_out, ob, s, d0, q_s * tl.exp(G_s) * scale, K, BD)
    _st(kg_out, ob, s, d0, k_s * tl.exp(gl[None, :] - G_s), K, BD)


@triton.jit
def _g_cumsum_kernel(g, q, k, chunk_start, chunk_len, G_out, egl_out, qg_out, kg_out, scale, H, SQK,
                     K: tl.constexpr, BK: tl.constexpr, QK: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_h = tl.program_id(1)
    kb = tl.program_id(2) * BK
    bos = tl.load(chunk_start + pid_c)
    L = tl.load(chunk_len + pid_c)
    ob = (pid_c * H + pid_h).to(tl.int64)
    g0 = _ld(g, bos, L, pid_h, H * K, 0, kb, K, BK)  # rows past L load 0: G stays at G_last there
    g1 = _ld(g, bos, L, pid_h, H * K, 1, kb, K, BK)
    g2 = _ld(g, bos, L, pid_h, H * K, 2, kb, K, BK)
    g3 = _ld(g, bos, L, pid_h, H * K, 3, kb, K, BK)
    r0 = tl.sum(g0, 0)
    r1 = r0 + tl.sum(g1, 0)
    r2 = r1 + tl.sum(g2, 0)
    r3 = r2 + tl.sum(g3, 0)
    G0 = tl.cumsum(g0, 0)
    G1 = tl.cumsum(g1, 0) + r0[None, :]
    G2 = tl.cumsum(g2, 0) + r1[None, :]
    G3 = tl.cumsum(g3, 0) + r2[None, :]
    _st(G_out, ob, 0, kb, G0, K, BK)
    _st(G_out, ob, 1, kb, G1, K, BK)
    _st(G_out, ob, 2, kb, G2, K, BK)
    _st(G_out, ob, 3, kb, G3, K, BK)
    rk = kb + tl.arange(0, BK)
    tl.store(egl_out + ob * K + rk, tl.exp(r3), mask=rk < K)
    if QK:  # qg and kg here (elementwise in G) instead of in the w/u kernel
        _g_qk(q, k, G0, r3, bos, L, pid_h, SQK, qg_out, kg_out, ob, 0, kb, scale, K, BK)
        _g_qk(q, k, G1, r3, bos, L, pid_h, SQK, qg_out, kg_out, ob, 1, kb, scale, K, BK)
        _g_qk(q, k, G2, r3, bos, L, pid_h, SQK, qg_out, kg_out, ob, 2, kb, scale, K, BK)
        _g_qk(q, k, G3, r3, bos, L, pid_h, SQK, qg_out, kg_out, ob, 3, kb, scale, K, BK)


@triton.jit
def _g_strip(Gc, row0, rd, mk, K: tl.constexpr):
    """Rows row0..row0+15 of one chunk's G tile (``Gc``: [64, K] fp32), channels ``rd``."""
    r = row0 + tl.arange(0, 16)
    return tl.load(Gc + r[:, None] * K + rd[None, :], mask=mk[None, :], other=0.0)


@triton.jit
def _g_row(Gc, row, rd, mk, K: tl.constexpr):
    """Row ``row`` (≥ 0) of one chunk's G tile, channels ``rd``."""
    return tl.load(Gc + row * K + rd, mask=mk, other=0.0)


@triton.jit
def _g_diag_tile(q, k, Gc, bos, L, pid_h, SQK, i, arow, kb, K: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr,
                 DOT_PREC: tl.constexpr):
    """Diagonal block (i, i) over key tile kb, with ``pre = G[16i − 1]`` (0 for
    the first strip) and ``r = G[16i + 15]`` (capped row factor, pairwise beyond SPAN nats). Returns the block's
    (Akk, Aqk) contributions and, for the off-diagonal blocks of the same row strip, ``pre``, the row factor
    ``e^{G_i − pre}`` and the strip's q and k (fp32)."""
    rd = kb + tl.arange(0, BK)
    mk = rd < K
    G_s = _g_strip(Gc, i * 16, rd, mk, K)
    pre = tl.where(i > 0, _g_row(Gc, arow, rd, mk, K), 0.0)  # 0 before the first strip
    r = _g_row(Gc, i * 16 + 15, rd, mk, K)
    q_s = _ld_rows(q, bos, L, pid_h, SQK, i * 16, 64, 16, kb, K, BK)
    k_s = _ld_rows(k, bos, L, pid_h, SQK, i * 16, 64, 16, kb, K, BK)
    ea = tl.exp(G_s - pre[None, :])
    kbb = k_s * tl.exp(r[None, :] - G_s)
    ed = tl.exp(tl.minimum(pre - r, SPAN))[None, :]
    dA = tl.dot(k_s * ea * ed, tl.trans(kbb), input_precision=DOT_PREC)
    dQ = tl.dot(q_s * ea * ed, tl.trans(kbb), input_precision=DOT_PREC)
    if tl.max(pre - r, 0) > SPAN:
        dA, dQ = _pairwise_diag(q_s, k_s, G_s, dA, dQ)
    return dA, dQ, pre, ea, q_s, k_s


@triton.jit
def _g_offdiag(k, Gc, bos, L, pid_h, SQK, j: tl.constexpr, kb, rd, mk, a, ki_e, qi_e, accA, accQ,
               K: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr):
    """Block (i, j), j < i, of one key tile added to its accumulators: ``(x_i e^{G_i − a}) · (k_j e^{a − G_j})ᵀ``
    with the row factors ``ki_e`` / ``qi_e`` already formed (shared by every j of row strip i)."""
    cd = ki_e.dtype
    G_j = _g_strip(Gc, j * 16, rd, mk, K)
    k_j = _ld_rows(k, bos, L, pid_h, SQK, j * 16, 64, 16, kb, K, BK)
    colT = tl.trans((k_j * tl.exp(a - G_j)).to(cd))  # ≤ 1: columns before the anchor
    return accA + tl.dot(ki_e, colT, input_precision=DOT_PREC), accQ + tl.dot(qi_e, colT, input_precision=DOT_PREC)


@triton.jit
def _g_scores_rows_kernel(q, k, G, beta, chunk_start, chunk_len, A_out, L_out, scale, H, SQK,
                          K: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr, DOT_PREC: tl.constexpr):
    """Score blocks by row strip: one program per chunk, head and row strip i computes blocks (i, 0) … (i, i) —
    strip i's q, k and G are loaded once per key tile, and its row factor ``e^{G_i − a}`` (a = G[16i − 1], which is
    also the diagonal block's ``pre``) is computed once for the diagonal and every off-diagonal block."""
    pid_h = tl.program_id(1)
    pid_c = tl.program_id(0) // 4
    i = 3 - tl.program_id(0) % 4  # the longest rows first
    bos, L, ob, ri, b_i, Ap, Lp = _strip_setup(chunk_start, chunk_len, beta, A_out, L_out, pid_c, pid_h, i, H)
    cd = q.dtype.element_ty
    accA = tl.zeros([16, 16], dtype=tl.float32)
    accQ = tl.zeros([16, 16], dtype=tl.float32)
    accA0 = tl.zeros([16, 16], dtype=tl.float32)
    accQ0 = tl.zeros([16, 16], dtype=tl.float32)
    accA1 = tl.zeros([16, 16], dtype=tl.float32)
    accQ1 = tl.zeros([16, 16], dtype=tl.float32)
    accA2 = tl.zeros([16, 16], dtype=tl.float32)
    accQ2 = tl.zeros([16, 16], dtype=tl.float32)
    Gc = G + ob * 64 * K
    arow = tl.maximum(i * 16 - 1, 0)  # the row before strip i (the anchor; the diagonal's ``pre``)
    for kb in range(0, K, BK):
        rd = kb + tl.arange(0, BK)
        mk = rd < K
        dA, dQ, pre, ea, q_s, k_s = _g_diag_tile(q, k, Gc, bos, L, pid_h, SQK, i, arow, kb, K, BK, SPAN, DOT_PREC)
        accA += dA
        accQ += dQ
        if i > 0:  # off-diagonal blocks: anchor a = pre, row factor e^{G_i − a} = ea (≤ 1)
            a = pre[None, :]
            ki_e = (k_s * ea).to(cd)
            qi_e = (q_s * ea).to(cd)
            accA0, accQ0 = _g_offdiag(k, Gc, bos, L, pid_h, SQK, 0, kb, rd, mk, a, ki_e, qi_e, accA0, accQ0, K, BK,
                                      DOT_PREC)
            if i > 1:
                accA1, accQ1 = _g_offdiag(k, Gc, bos, L, pid_h, SQK, 1, kb, rd, mk, a, ki_e, qi_e, accA1, accQ1,
                                          K, BK, DOT_PREC)
                if i > 2:
                    accA2, accQ2 = _g_offdiag(k, Gc, bos, L, pid_h, SQK, 2, kb, rd, mk, a, ki_e, qi_e, accA2, accQ2,
                                              K, BK, DOT_PREC)
    _store_diag(Ap, Lp, i, accA, accQ, b_i, scale)
    if i > 0:
        _bst(Lp, ri, 0, accA0 * b_i[:, None])
        _bst(Ap, ri, 0, accQ0 * scale)
        if i > 1:
            _bst(Lp, ri, 16, accA1 * b_i[:, None])
            _bst(Ap, ri, 16, accQ1 * scale)
            if i > 2:
                _bst(Lp, ri, 32, accA2 * b_i[:, None])
                _bst(Ap, ri, 32, accQ2 * scale)


@triton.jit
def _g_zstrip(q, k, Gc, gl, bos, L, pid_h, SQK, b_s, qg_out, kg_out, ob, s: tl.constexpr, d0, rd, mk, scale,
              K: tl.constexpr, BD: tl.constexpr, QK: tl.constexpr):
    """z = β·k·e^G of strip s (returned) from the chunk's G tile; with QK also its qg, kg (stored)."""
    G_s = _g_strip(Gc, s * 16, rd, mk, K)
    k_s = _ld(k, bos, L, pid_h, SQK, s, d0, K, BD)
    e = tl.exp(G_s)
    if QK:
        q_s = _ld(q, bos, L, pid_h, SQK, s, d0, K, BD)
        _st(qg_out, ob, s, d0, q_s * e * scale, K, BD)
        _st(kg_out, ob, s, d0, k_s * tl.exp(gl[None, :] - G_s), K, BD)
    return k_s * e * b_s[:, None]


@triton.jit
def _g_wu_kernel(q, k, v, G, beta, chunk_start, chunk_len, X, qg_out, kg_out, w_out, u_out,
                 scale, H, SQK, SV, K: tl.constexpr, V: tl.constexpr, BD: tl.constexpr, QK: tl.constexpr,
                 DOT_PREC: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_h = tl.program_id(1)
    d0 = tl.program_id(2) * BD
    bos = tl.load(chunk_start + pid_c)
    L = tl.load(chunk_len + pid_c)
    ob = (pid_c * H + pid_h).to(tl.int64)
    cd = q.dtype.element_ty
    r64 = tl.arange(0, 64)
    r16 = tl.arange(0, 16)
    Xp = X + ob * 4096
    X0 = _xcol(Xp, r64, 0).to(cd)
    X1 = _xcol(Xp, r64, 1).to(cd)
    X2 = _xcol(Xp, r64, 2).to(cd)
    X3 = _xcol(Xp, r64, 3).to(cd)
    b0 = tl.load(beta + (bos + r16).to(tl.int64) * H + pid_h, mask=r16 < L, other=0.0).to(tl.float32)
    b1 = tl.load(beta + (bos + 16 + r16).to(tl.int64) * H + pid_h, mask=16 + r16 < L, other=0.0).to(tl.float32)
    b2 = tl.load(beta + (bos + 32 + r16).to(tl.int64) * H + pid_h, mask=32 + r16 < L, other=0.0).to(tl.float32)
    b3 = tl.load(beta + (bos + 48 + r16).to(tl.int64) * H + pid_h, mask=48 + r16 < L, other=0.0).to(tl.float32)
    rd = d0 + tl.arange(0, BD)
    if d0 < K:
        mk = rd < K
        Gc = G + ob * 64 * K
        gl = _g_row(Gc, 63, rd, mk, K)  # G_last (rows past the chunk's length repeat it)
        z0 = _g_zstrip(q, k, Gc, gl, bos, L, pid_h, SQK, b0, qg_out, kg_out, ob, 0, d0, rd, mk, scale, K, BD, QK)
        z1 = _g_zstrip(q, k, Gc, gl, bos, L, pid_h, SQK, b1, qg_out, kg_out, ob, 1, d0, rd, mk, scale, K, BD, QK)
        z2 = _g_zstrip(q, k, Gc, gl, bos, L, pid_h, SQK, b2, qg_out, kg_out, ob, 2, d0, rd, mk, scale, K, BD, QK)
        z3 = _g_zstrip(q, k, Gc, gl, bos, L, pid_h, SQK, b3, qg_out, kg_out, ob, 3, d0, rd, mk, scale, K, BD, QK)
        w = tl.dot(X0, z0.to(cd), input_precision=DOT_PREC)
        w = tl.dot(X1, z1.to(cd), w, input_precision=DOT_PREC)
        w = tl.dot(X2, z2.to(cd), w, input_precision=DOT_PREC)
        w = tl.dot(X3, z3.to(cd), w, input_precision=DOT_PREC)
        tl.store(w_out + ob * 64 * K + r64[:, None] * K + rd[None, :], w.to(w_out.dtype.element_ty),
                 mask=mk[None, :] & (r64 < 64)[:, None])
    if d0 < V:
        v0 = _ld(v, bos, L, pid_h, SV, 0, d0, V, BD) * b0[:, None]
        v1 = _ld(v, bos, L, pid_h, SV, 1, d0, V, BD) * b1[:, None]
        v2 = _ld(v, bos, L, pid_h, SV, 2, d0, V, BD) * b2[:, None]
        v3 = _ld(v, bos, L, pid_h, SV, 3, d0, V, BD) * b3[:, None]
        u = tl.dot(X0, v0.to(cd), input_precision=DOT_PREC)
        u = tl.dot(X1, v1.to(cd), u, input_precision=DOT_PREC)
        u = tl.dot(X2, v2.to(cd), u, input_precision=DOT_PREC)
        u = tl.dot(X3, v3.to(cd), u, input_precision=DOT_PREC)
        tl.store(u_out + ob * 64 * V + r64[:, None] * V + rd[None, :], u.to(u_out.dtype.element_ty),
                 mask=(rd < V)[None, :] & (r64 < 64)[:, None])


_g_cumsum = triton.autotune(**AUTOTUNE_KW, configs=_cumsum_configs(), key=["K", "QK"], prune_configs_by=PRUNE)(_g_cumsum_kernel)
_g_scores_rows = triton.autotune(**AUTOTUNE_KW, configs=_score_configs(), key=["K", "DOT_PREC"], prune_configs_by=PRUNE)(
    _g_scores_rows_kernel)
_g_wu = triton.autotune(**AUTOTUNE_KW, configs=_wu_configs(), key=["K", "V", "QK", "DOT_PREC"], prune_configs_by=PRUNE)(
    _g_wu_kernel)


def g_kernels():
    """The four autotuned kernels, in launch order (benchmarks list and time their configs)."""
    return _g_cumsum, _g_scores_rows, _split_solve, _g_wu


def _row_stride(x: torch.Tensor) -> int | None:
    """The token stride of x [B, T, H, D] when its B·T tokens are evenly spaced rows with contiguous heads and
    channels, else None (the strides of size-1 dims do not count)."""
    B, T, H, D = x.shape
    if (D > 1 and x.stride(3) != 1) or (H > 1 and x.stride(2) != D):
        return None
    S = x.stride(1) if T > 1 else (x.stride(0) if B > 1 else H * D)
    if (B > 1 and T > 1 and x.stride(0) != T * S) or (B * T > 1 and S < H * D):
        return None
    return S


def _shared_stride(xs) -> int | None:
    strides = {_row_stride(x) for x in xs}
    return strides.pop() if len(strides) == 1 else None


def token_stride(*xs: torch.Tensor) -> int:
    """The token stride (elements) that the kernels read ``xs`` [B, T, H, D] with: each a row-major [B·T] run of
    tokens whose heads and channels are contiguous, all with the same stride (contiguous, or slices of one wider
    row such as q | k | v). ValueError otherwise (:func:`token_rows` makes them so)."""
    S = _shared_stride(xs)
    if S is None:
        raise ValueError(f"KDA intra-chunk kernels: inputs with strides {[tuple(x.stride()) for x in xs]} are not "
                         f"rows of tokens with contiguous heads and one token stride (call token_rows first)")
    return S


def token_rows(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``xs`` as :func:`token_stride` reads them: unchanged when they already are (e.g. q, k, v split from one
    q | k | v buffer), else contiguous copies."""
    return xs if _shared_stride(xs) is not None else tuple(x.contiguous() for x in xs)


def g_buffer(NC: int, H: int, K: int, device) -> torch.Tensor:
    """The temporary chunk-local cumulative decay: fp32 [NC, H, 64, K]."""
    return torch.empty(NC, H, 64, K, dtype=torch.float32, device=device)


def intra_g_launch(q, k, v, g, beta, scale, NC, c_start, c_len, qg, kg, w, u, A, egl, X, configs=None,
                   stages=(0, 1, 2, 3), G=None):
    """Fill qg, kg, w, u, A, egl and X (in the fp32 scratch) with the four kernels (cumsum, scores, solve, w/u).
    ``configs``: an optional 4-tuple of ``triton.Config`` (None entries: autotuned); ``stages``: which of the four
    kernels to launch; ``G``: the [NC, H, 64, K] fp32 buffer to use (allocated here when None; benchmarks pass one
    so that single stages can be timed)."""
    _, _, H, K = q.shape
    V = v.shape[-1]
    sqk, sv = token_stride(q, k), token_stride(v)
    configs = tuple(configs) if configs else (None, None, None, None)
    if G is None:
        G = g_buffer(NC, H, K, q.device)
    if 0 in stages:
        grid = lambda META: (NC, H, triton.cdiv(K, META["BK"]))
        _run(_g_cumsum, grid, (g, q, k, c_start, c_len, G, egl, qg, kg, scale, H, sqk), {"K": K, "QK": False},
             configs[0], q.dtype)
    if 1 in stages:
        _run(_g_scores_rows, (NC * 4, H), (q, k, G, beta, c_start, c_len, A, X, scale, H, sqk),
             {"K": K, "SPAN": _SPAN}, configs[1], q.dtype)
    if 2 in stages:
        _run(_split_solve, (NC, H), (X, H), {}, configs[2], q.dtype)
    if 3 in stages:
        grid = lambda META: (NC, H, triton.cdiv(max(K, V), META["BD"]))
        _run(_g_wu, grid, (q, k, v, G, beta, c_start, c_len, X, qg, kg, w, u, scale, H, sqk, sv),
             {"K": K, "V": V, "QK": True}, configs[3], q.dtype)
