"""Row-strip intra-chunk pipeline of the Triton chunked KDA forward (``K3NN_KDA_INTRA=rows``).

Produces exactly what ``_kda_intra`` (:mod:`.triton_chunk`) produces: qg, kg, w, u, Aqk, e^{G_last} and
X = (I + L)⁻¹ in the fp32 scratch (same layouts and dtypes; X in the block-lower part), in two launches:

1. ``_rows_scores`` (grid: chunks·4 × heads): one program per 16-row strip i of a chunk, walking the key
   channels in tiles of BK. A whole row strip of Aqk and of Akk is one dot each, ``[16, BK] × [BK, 64]``, with
   the causal anchor ``pre`` = G at the row before the strip (depends on earlier rows only):

   * row operand ``x_r e^{G_r − pre}`` (≤ 1; the strip-local cumulative decay),
   * column operand ``k_c e^{pre − G_c}`` for the columns of the earlier strips (≤ 1; the exponent is the
     suffix sum of g over rows c+1 … 16i−1, one reverse scan), zero for the strip's own and later columns.

   Both factors are ≤ 1, so these dots take operands in the input dtype (bf16/fp16 tensor cores, as the fused
   kernel's off-diagonal blocks). The strip's own 16×16 diagonal block is the fused kernel's fp32 dot (column
   factor ``e^{s − c} ≤ 1``, row factor ``e^{c − s}`` capped at e^SPAN; recomputed pairwise, ``e^{c_a − c_b} ≤ 1``,
   in a key tile where the strip decays more than SPAN nats, which only the unbounded softplus gate reaches),
   accumulated over the key tiles and moved into its band once at the end (an exact 0/1 selection dot).
   The same program writes the strip's qg = scale·q·e^G, kg = k·e^{G_last − G} and z = β·k·e^G (into w's
   buffer), the Aqk rows (scaled, causal, zeros above the diagonal) and L = β ⊙ strictly lower Akk rows into
   the fp32 scratch; strip 0 writes e^{G_last}.
   Exps per key tile: one per element of the [64, BK] column tile (strips 1–3) plus two per strip element; the
   strips of a chunk run as neighbouring programs, so the shared column loads hit L2.
2. ``_rows_solve_wu`` (grid: chunks × heads): X = (I + L)⁻¹ from the scratch (the split pipeline's solve:
   diagonal blocks by forward substitution, the rest blockwise, fp32), X back into the scratch (the backward
   reads it), then ``w = X z`` in place and ``u = X (β ⊙ v)`` as single [64, 64] × [64, BD] dots (X in the
   input dtype, as the fused kernel).

Numerics equal the fused kernel's up to fp32 rounding; the decay exponents come from strip-local sums and
suffix sums instead of differences of chunk-level prefixes (slightly more accurate for long decays).

The second kernel works in place (scratch and w), so its autotuner restores both between timing runs.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .triton_chunk import _SPAN, _store_inverse, _tune
from .triton_intra_split import _run, _solve_blocks

__all__ = ["intra_rows_launch", "rows_kernels"]


def _interp() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _score_configs():
    if _interp():
        return [triton.Config({"BK": 16}, num_warps=4)]
    # BK: key channels per step; the [64, BK] fp32 decay tile and the [16, 64] accumulators set the registers
    cfgs = [triton.Config({"BK": bk}, num_warps=w, num_stages=s)
            for bk, w, s in ((32, 2, 2), (64, 4, 2), (32, 4, 2), (128, 8, 1))]
    return cfgs if _tune() else cfgs[:1]


def _solve_wu_configs():
    if _interp():
        return [triton.Config({"BD": 16}, num_warps=4)]
    cfgs = [triton.Config({"BD": bd}, num_warps=w, num_stages=1) for bd, w in ((64, 4), (128, 8), (32, 4))]
    return cfgs if _tune() else cfgs[:1]


@triton.jit
def _rows_scores_kernel(q, k, g, beta, chunk_start, chunk_len, qg_out, kg_out, w_out, A_out, L_out, egl_out,
                        scale, H, K: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr):
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_c = pid // 4
    i = pid % 4
    lo = i * 16  # first chunk row of the strip
    bos = tl.load(chunk_start + pid_c)
    L = tl.load(chunk_len + pid_c)
    ob = (pid_c * H + pid_h).to(tl.int64)
    cd = q.dtype.element_ty
    r16 = tl.arange(0, 16)
    r64 = tl.arange(0, 64)
    ri = lo + r16
    mi = ri < L
    m64 = r64 < L
    below = r64 < lo  # columns of the earlier strips
    b_i = tl.load(beta + (bos + ri).to(tl.int64) * H + pid_h, mask=mi, other=0.0).to(tl.float32)
    tok_i = ((bos + ri).to(tl.int64) * H + pid_h) * K
    tok64 = ((bos + r64).to(tl.int64) * H + pid_h) * K
    accQ = tl.zeros([16, 64], dtype=tl.float32)
    accA = tl.zeros([16, 64], dtype=tl.float32)
    dQ = tl.zeros([16, 16], dtype=tl.float32)
    dA = tl.zeros([16, 16], dtype=tl.float32)
    ob_rows = ob * 64 * K + ri[:, None] * K
    for kb in range(0, K, BK):
        rk = kb + tl.arange(0, BK)
        mk = rk < K
        g_all = tl.load(g + tok64[:, None] + rk[None, :], mask=m64[:, None] & mk[None, :], other=0.0).to(tl.float32)
        k_lo = tl.load(k + tok64[:, None] + rk[None, :], mask=(m64 & below)[:, None] & mk[None, :],
                       other=0.0).to(tl.float32)
        ms = mi[:, None] & mk[None, :]
        g_s = tl.load(g + tok_i[:, None] + rk[None, :], mask=ms, other=0.0).to(tl.float32)
        q_s = tl.load(q + tok_i[:, None] + rk[None, :], mask=ms, other=0.0).to(tl.float32)
        k_s = tl.load(k + tok_i[:, None] + rk[None, :], mask=ms, other=0.0).to(tl.float32)
        # decay sums: pre = G before the strip, post = G_last − pre, s = the strip's own, c = strip-local prefix
        g_lo = tl.where(below[:, None], g_all, 0.0)
        pre = tl.sum(g_lo, 0)
        post = tl.sum(tl.where(below[:, None], 0.0, g_all), 0)
        c = tl.cumsum(g_s, 0)
        s = tl.sum(g_s, 0)
        ea = tl.exp(c)  # e^{G − pre} ≤ 1
        eb = tl.exp(s[None, :] - c)  # e^{G_end − G} ≤ 1
        qa = q_s * ea
        ka = k_s * ea
        kbb = k_s * eb
        if lo > 0:  # strip 0 has no earlier columns
            # off-diagonal columns: k_c e^{pre − G_c}, the exponent a suffix sum of g over rows c+1 .. lo−1 (≤ 0)
            col = k_lo * tl.exp(tl.cumsum(g_lo, 0, reverse=True) - g_lo)
            colT = tl.trans(col.to(cd))
            accQ += tl.dot(qa.to(cd), colT)
            accA += tl.dot(ka.to(cd), colT)
        # diagonal block: fp32, row factor e^{G − G_end} capped at e^SPAN; pairwise exact past SPAN
        ed = tl.exp(tl.minimum(-s, SPAN))[None, :]
        bA = tl.dot(ka * ed, tl.trans(kbb))
        bQ = tl.dot(qa * ed, tl.trans(kbb))
        if tl.max(-s, 0) > SPAN:
            # pairwise exact: e^{c_a − c_b} ≤ 1 for b ≤ a, never overflows
            for jj in range(16):
                sel = r16[:, None] == jj
                kj = tl.sum(tl.where(sel, k_s, 0.0), 0)
                cj = tl.sum(tl.where(sel, c, 0.0), 0)
                e = tl.exp(tl.minimum(c - cj[None, :], 0.0))
                hit = r16[None, :] == jj
                bA = tl.where(hit, tl.sum(k_s * kj[None, :] * e, 1)[:, None], bA)
                bQ = tl.where(hit, tl.sum(q_s * kj[None, :] * e, 1)[:, None], bQ)
        dA += bA
        dQ += bQ
        # the strip's qg, kg and z = β k e^G (w's buffer; turned into w by the second kernel)
        epre = tl.exp(pre)
        o = ob_rows + rk[None, :]
        tl.store(qg_out + o, (qa * (epre * scale)[None, :]).to(qg_out.dtype.element_ty), mask=mk[None, :])
        tl.store(kg_out + o, (kbb * tl.exp(post - s)[None, :]).to(kg_out.dtype.element_ty), mask=mk[None, :])
        tl.store(w_out + o, (ka * (epre[None, :] * b_i[:, None])).to(w_out.dtype.element_ty), mask=mk[None, :])
        tl.store(egl_out + ob * K + rk, tl.exp(pre + post), mask=mk & ((rk * 0 + i) == 0))
    # the diagonal block into its band (exact: one 1 per column of the selection)
    sel = (r64[None, :] == ri[:, None]).to(tl.float32)
    accQ += tl.dot(dQ, sel, input_precision="ieee")
    accA += tl.dot(dA, sel, input_precision="ieee")
    o = ob * 4096 + ri[:, None] * 64 + r64[None, :]
    tl.store(A_out + o, tl.where(r64[None, :] <= ri[:, None], accQ * scale, 0.0).to(A_out.dtype.element_ty))
    tl.store(L_out + o, tl.where(r64[None, :] < ri[:, None], accA * b_i[:, None], 0.0))


@triton.jit
def _rows_solve_wu_kernel(v, beta, chunk_start, chunk_len, X, w_out, u_out, H,
                          K: tl.constexpr, V: tl.constexpr, BD: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_h = tl.program_id(1)
    bos = tl.load(chunk_start + pid_c)
    L = tl.load(chunk_len + pid_c)
    ob = (pid_c * H + pid_h).to(tl.int64)
    Xp = X + ob * 4096
    X00, X11, X22, X33, X10, X20, X21, X30, X31, X32 = _solve_blocks(Xp)
    tl.debug_barrier()  # every L block is read before X overwrites it
    _store_inverse(Xp, X00, X11, X22, X33, X10, X20, X21, X30, X31, X32)
    tl.debug_barrier()
    cd = w_out.dtype.element_ty
    r64 = tl.arange(0, 64)
    Xt = tl.load(Xp + r64[:, None] * 64 + r64[None, :], mask=(r64[None, :] // 16) <= (r64[:, None] // 16),
                 other=0.0).to(cd)
    # w = X z, z (= β ⊙ k ⊙ e^G) written in w's place by the first kernel
    for kb in range(0, K, BD):
        rk = kb + tl.arange(0, BD)
        ow = ob * 64 * K + r64[:, None] * K + rk[None, :]
        mw = (rk < K)[None, :] & (r64 < 64)[:, None]
        z = tl.load(w_out + ow, mask=mw, other=0.0)
        w = tl.dot(Xt, z.to(cd))
        tl.debug_barrier()  # every thread has read this tile of z before any overwrites it
        tl.store(w_out + ow, w.to(w_out.dtype.element_ty), mask=mw)
    # u = X (β ⊙ v)
    b_all = tl.load(beta + (bos + r64).to(tl.int64) * H + pid_h, mask=r64 < L, other=0.0).to(tl.float32)
    tok = (bos + r64).to(tl.int64)
    for vb in range(0, V, BD):
        rv = vb + tl.arange(0, BD)
        mv = rv < V
        v_b = tl.load(v + (tok * H + pid_h)[:, None] * V + rv[None, :], mask=(r64 < L)[:, None] & mv[None, :],
                      other=0.0).to(tl.float32)
        u = tl.dot(Xt, (v_b * b_all[:, None]).to(cd))
        tl.store(u_out + ob * 64 * V + r64[:, None] * V + rv[None, :], u.to(u_out.dtype.element_ty),
                 mask=mv[None, :] & (r64[:, None] < 64))


_rows_scores = triton.autotune(configs=_score_configs(), key=["K"])(_rows_scores_kernel)
_rows_solve_wu = triton.autotune(configs=_solve_wu_configs(), key=["K", "V"],
                                 restore_value=["X", "w_out"])(_rows_solve_wu_kernel)


def rows_kernels():
    """The two autotuned kernels, in launch order (benchmarks list and time their configs)."""
    return _rows_scores, _rows_solve_wu


def intra_rows_launch(q, k, v, g, beta, scale, NC, c_start, c_len, qg, kg, w, u, A, egl, X, configs=None,
                      stages=(0, 1)):
    """Fill the fused kernel's outputs (qg, kg, w, u, A, egl and X in the fp32 scratch) with the two row-strip
    kernels. ``configs``: an optional pair of ``triton.Config`` (None entries: autotuned) to run instead of the
    tuned choices; ``stages``: which of the two kernels to launch (benchmarks time them one by one; the second
    one works in place on what the first wrote, so timing it alone repeats it on its own output)."""
    _, _, H, K = q.shape
    V = v.shape[-1]
    configs = configs or (None, None)
    if 0 in stages:
        _run(_rows_scores, (NC * 4, H), (q, k, g, beta, c_start, c_len, qg, kg, w, A, X, egl, scale, H),
             {"K": K, "SPAN": _SPAN}, configs[0])
    if 1 in stages:
        _run(_rows_solve_wu, (NC, H), (v, beta, c_start, c_len, X, w, u, H), {"K": K, "V": V}, configs[1])
