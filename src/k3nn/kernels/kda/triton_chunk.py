"""Triton chunked KDA forward (chunk 64), varlen, fp32 states and in-pass checkpoint export.

Two kernels per call:

1. ``_kda_intra`` (grid: chunks × heads, fully parallel). Per 64-token chunk, with ``G`` the chunk-local
   cumulative log decay (fp32, in registers only):

   * ``Aqk[i, j] = scale · Σ_d q_id k_jd e^{G_id − G_jd}`` (j ≤ i) and ``L[i, j] = β_i Σ_d k_id k_jd e^{G_id − G_jd}``
     (j < i), as ten 16×16 blocks per matrix. The key channels are walked once in blocks of BKB; per block the
     four 16-row strips are loaded once and G is built from strip cumsums plus running prefixes (``G_end(s)``,
     G at the last row of strip s).
     Off-diagonal block (strip i, strip j < i): ``(x_i e^{G − G_end(i−1)}) · e^{G_end(i−1) − G_end(j)} ·
     (k_j e^{G_end(j) − G})``: every factor ≤ 1, so these dots take operands in the input dtype (bf16/fp16
     tensor cores, as fla does) without any risk of overflow.
     Diagonal block s (fp32 dot): reference ``G_end(s)``, column factor ``e^{G_end(s) − G_j} ≤ 1``, row factor
     ``e^{G_i − G_end(s)} ≥ 1`` capped at e^SPAN. When the strip's decay exceeds ``_SPAN`` nats (only the
     unbounded softplus gate gets there; K3's bounded gate spans < 80) that block is recomputed pairwise with
     ``e^{G_i − G_j} ≤ 1``, so no factor can overflow for any gate ≤ 0.
   * ``X = (I + L)⁻¹``: each diagonal 16×16 block as ``(I − L)(I + L²)(I + L⁴)(I + L⁸)`` (L is nilpotent; fp32
     "ieee" dots), the off-diagonal blocks by blockwise substitution, all in registers; X goes once through a
     per-chunk scratch tile to become one [64, 64] operand.
   * ``w = X (β ⊙ k ⊙ e^G)`` (the right factor is written to w's buffer in the first pass and multiplied in
     place), ``u = X (β ⊙ v)``, ``qg = scale · q ⊙ e^G``, ``kg = k ⊙ e^{G_last − G}``, ``e^{G_last}``.

2. ``_kda_recur`` (grid: sequences × heads × V blocks). Walks the chunks of one sequence with the state
   ``h [K, BV]`` in fp32 registers: ``v' = u − w h``, ``o = qg h + Aqk v'``, ``h ← e^{G_last} ⊙ h + kgᵀ v'``.
   Output is written here (no per-chunk state round trip through memory). Chunk boundaries are every 64
   tokens from each sequence start *and* at every requested checkpoint position, so a checkpoint is just
   the state at a chunk start, stored by the same kernel (masked store; no second pass).

``K3NN_KDA_INTRA`` picks how step 1 runs (:func:`intra_fill`; same outputs to fp32 rounding):

* ``splitg`` (the default, :mod:`.triton_intra_g`): four launches — the chunk-local cumulative decay G once (an
  fp32 temporary the size of g), then score blocks per 16×16 block pair, the inverse in place, and w/u per
  feature tile, all reading G;
* ``split`` (:mod:`.triton_intra_split`): the same three stages rebuilding G from g in each (no temporary);
* ``fused``: the one ``_kda_intra`` program per chunk and head described above.

On the H200 (B=1 T=8192 H=96, bounded gate, bf16) the intra stage takes 2.16 / 2.73 / 3.05 ms and the whole forward
2.72 / 3.28 / 3.62 ms (bench/results/logs/h200-s4-run3-2026-11-30.log, h200-s4-run6-2026-11-30.log); a
row-strip design (one program per 16 rows, whole-strip score dots) measured 3.54 ms and was dropped. The
backward's intra recompute follows the same knob.

Inputs must satisfy ``g ≤ 0`` (a log decay; both Kimi gates do). bf16/fp16 inputs use tensor-core dots with
operands in the input dtype: the off-diagonal intra blocks, ``X z`` / ``X (β v)`` (X rounded to the input
dtype), and in the recurrence the state cast for ``w h`` / ``qg h`` (fla does the same); the diagonal intra
blocks and the inverse stay fp32. fp32 inputs stay fp32: every product takes ``DOT_PREC``
(:func:`k3nn.kernels.precision.dot_precision`: IEEE fp32 while torch does not allow TF32, else TF32; the inverse
is IEEE fp32 always).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..precision import dot_precision
from ..registry import triton_interpreting, triton_ready
from .api import normalise_checkpoints, seq_lengths

__all__ = ["kda_chunk_triton_fwd", "build_chunk_plan", "supports_kda_chunk"]

BT = 64  # chunk
BC = 16  # sub-chunk (strip)
_SPAN = 80.0  # nats of decay across a diagonal 16-block above which it is recomputed pairwise


def _interp() -> bool:
    return triton_interpreting()


def _tune() -> bool:
    """Autotune over several configs (``K3NN_KDA_TUNE=0``: the first one only, e.g. for quick GPU tests)."""
    return os.environ.get("K3NN_KDA_TUNE", "1") != "0"


def _intra_configs():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return [triton.Config({"BKB": 32, "BVB": 32}, num_warps=4)]
    # BKB: key channels per pass-1 step (the live strip tiles scale with it); few configs, compile time counts.
    # First: the fastest on the H200 at T=8K H=96 (3.11 ms against 3.93 / 4.57 / 3.93 for the others)
    cfgs = [triton.Config({"BKB": bk, "BVB": bv}, num_warps=w, num_stages=1)
            for bk, bv, w in ((32, 32, 4), (16, 32, 4), (32, 64, 8), (64, 64, 8))]
    return cfgs if _tune() else cfgs[:1]


def _recur_configs(stages=(2, 3)):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return [triton.Config({"BV": 32}, num_warps=4)]
    cfgs = [triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv in (32, 64) for w in (4, 8) for s in stages]
    # BV 16: four times the programs of BV 64, for few heads (the chunk loop is sequential per program)
    cfgs += [triton.Config({"BV": 16}, num_warps=4, num_stages=s) for s in stages]
    return cfgs if _tune() else cfgs[:1]


@triton.jit
def _inv16(Lb):
    """(I + Lb)⁻¹ for a strictly lower 16×16 block in registers: Lb is nilpotent (Lb¹⁶ = 0), so the inverse is
    (I − Lb)(I + Lb²)(I + Lb⁴)(I + Lb⁸): six dependent fp32 dots instead of 15 sequential substitution steps."""
    r = tl.arange(0, 16)
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    L2 = tl.dot(Lb, Lb, input_precision="ieee")
    L4 = tl.dot(L2, L2, input_precision="ieee")
    X = tl.dot(eye - Lb, eye + L2, input_precision="ieee")
    L8 = tl.dot(L4, L4, input_precision="ieee")
    X = tl.dot(X, eye + L4, input_precision="ieee")
    return tl.dot(X, eye + L8, input_precision="ieee")


@triton.jit
def _ld(x, bos, L, pid_h, H, s: tl.constexpr, kb, D: tl.constexpr, BD: tl.constexpr):
    """Rows 16s..16s+15 of the chunk, channels [kb, kb + BD) of x [tokens, H, D] as fp32 (zeros outside)."""
    r = s * 16 + tl.arange(0, 16)
    rd = kb + tl.arange(0, BD)
    off = ((bos + r).to(tl.int64) * H + pid_h)[:, None] * D + rd[None, :]
    return tl.load(x + off, mask=(r < L)[:, None] & (rd < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _st(x, ob, s: tl.constexpr, kb, val, D: tl.constexpr, BD: tl.constexpr):
    """Store a [16, BD] strip into rows 16s.. of the per-chunk buffer x [chunk·H, 64, D]."""
    r = s * 16 + tl.arange(0, 16)
    rd = kb + tl.arange(0, BD)
    tl.store(x + ob * 64 * D + r[:, None] * D + rd[None, :], val.to(x.dtype.element_ty),
             mask=(r < 64)[:, None] & (rd < D)[None, :])


@triton.jit
def _blk_st(x, ro: tl.constexpr, co: tl.constexpr, val):
    r = tl.arange(0, 16)
    tl.store(x + (ro + r)[:, None] * 64 + co + r[None, :], val.to(x.dtype.element_ty))


@triton.jit
def _inverse_offdiag(X00, X11, X22, X33, L10, L20, L21, L30, L31, L32):
    """Off-diagonal 16×16 blocks of (I + L)⁻¹ from the inverted diagonal blocks Xii and the strictly lower
    blocks Lij of one 64-token chunk (blockwise forward substitution, fp32): (X10, X20, X21, X30, X31, X32)."""
    X10 = -tl.dot(X11, tl.dot(L10, X00, input_precision="ieee"), input_precision="ieee")
    X21 = -tl.dot(X22, tl.dot(L21, X11, input_precision="ieee"), input_precision="ieee")
    X32 = -tl.dot(X33, tl.dot(L32, X22, input_precision="ieee"), input_precision="ieee")
    X20 = -tl.dot(X22, tl.dot(L20, X00, input_precision="ieee") + tl.dot(L21, X10, input_precision="ieee"),
                  input_precision="ieee")
    X31 = -tl.dot(X33, tl.dot(L31, X11, input_precision="ieee") + tl.dot(L32, X21, input_precision="ieee"),
                  input_precision="ieee")
    X30 = -tl.dot(X33, tl.dot(L30, X00, input_precision="ieee") + tl.dot(L31, X10, input_precision="ieee")
                  + tl.dot(L32, X20, input_precision="ieee"), input_precision="ieee")
    return X10, X20, X21, X30, X31, X32


@triton.jit
def _store_inverse(Xp, X00, X11, X22, X33, X10, X20, X21, X30, X31, X32):
    """The ten lower blocks of a chunk's (I + L)⁻¹ into the [64, 64] tile at ``Xp``."""
    _blk_st(Xp, 0, 0, X00)
    _blk_st(Xp, 16, 16, X11)
    _blk_st(Xp, 32, 32, X22)
    _blk_st(Xp, 48, 48, X33)
    _blk_st(Xp, 16, 0, X10)
    _blk_st(Xp, 32, 0, X20)
    _blk_st(Xp, 32, 16, X21)
    _blk_st(Xp, 48, 0, X30)
    _blk_st(Xp, 48, 16, X31)
    _blk_st(Xp, 48, 32, X32)


@triton.jit
def _strip(q_s, k_s, G_s, pre, r, Gl, b_s, qg_out, kg_out, w_out, ob, s: tl.constexpr, kb, scale,
           K: tl.constexpr, BKB: tl.constexpr, SPAN: tl.constexpr, DOT_PREC: tl.constexpr):
    """One 16-row strip of one key block. ``pre``: G at the row before the strip, ``r``: G at its last row.

    Writes qg = scale·q·e^G, kg = k·e^{G_last − G} and z = β·k·e^G (into w_out; turned into w after the
    inverse). Returns the off-diagonal operands ``ka = k·e^{G − pre}``, ``qa = q·e^{G − pre}`` (row side of
    later strips' blocks, ≤ 1) and ``kb = k·e^{r − G}`` (column side, ≤ 1), and the diagonal 16×16 block of
    Akk and Aqk (fp32; reference r, so the row factor is ≥ 1 and capped at e^SPAN; pairwise exact when the
    strip's decay exceeds SPAN)."""
    ea = tl.exp(G_s - pre[None, :])
    eb = tl.exp(r[None, :] - G_s)
    epre = tl.exp(pre)
    _st(qg_out, ob, s, kb, q_s * ea * (epre * scale)[None, :], K, BKB)
    _st(kg_out, ob, s, kb, k_s * eb * tl.exp(Gl - r)[None, :], K, BKB)
    ka = k_s * ea
    _st(w_out, ob, s, kb, ka * (epre[None, :] * b_s[:, None]), K, BKB)
    qa = q_s * ea
    kbb = k_s * eb
    ed = tl.exp(tl.minimum(pre - r, SPAN))[None, :]
    dA = tl.dot(ka * ed, tl.trans(kbb), input_precision=DOT_PREC)
    dQ = tl.dot(qa * ed, tl.trans(kbb), input_precision=DOT_PREC)
    if tl.max(pre - r, 0) > SPAN:
        # pairwise exact diagonal block: e^{G_i − G_j} ≤ 1 for j ≤ i, never overflows
        r16 = tl.arange(0, 16)
        for j in range(16):
            sel = r16[:, None] == j
            kj = tl.sum(tl.where(sel, k_s, 0.0), 0)
            Gj = tl.sum(tl.where(sel, G_s, 0.0), 0)
            e = tl.exp(tl.minimum(G_s - Gj[None, :], 0.0))
            hit = r16[None, :] == j
            dA = tl.where(hit, tl.sum(k_s * kj[None, :] * e, 1)[:, None], dA)
            dQ = tl.where(hit, tl.sum(q_s * kj[None, :] * e, 1)[:, None], dQ)
    return ka, qa, kbb, dA, dQ


@triton.autotune(configs=_intra_configs(), key=["K", "V", "DOT_PREC"])
@triton.jit
def _kda_intra(q, k, v, g, beta, chunk_start, chunk_len,
               qg_out, kg_out, w_out, u_out, A_out, egl_out, scratch,
               scale, H,
               K: tl.constexpr, V: tl.constexpr, BKB: tl.constexpr, BVB: tl.constexpr, SPAN: tl.constexpr,
               DOT_PREC: tl.constexpr):
    # One program per (chunk, head). Pass 1 walks the key channels in blocks of BKB: the four 16-row strips
    # are loaded once, their cumulative decay G built from strip cumsums plus running prefixes, and every
    # 16×16 block of Akk/Aqk accumulated from them (ten blocks each; nothing recomputed per strip). The
    # off-diagonal blocks (i > j) use the end of strip j as reference, so both factors are ≤ 1 and the dots
    # run on the input dtype (tensor cores for bf16/fp16); the diagonal blocks stay fp32.
    pid_c = tl.program_id(0)
    pid_h = tl.program_id(1)
    bos = tl.load(chunk_start + pid_c)
    L = tl.load(chunk_len + pid_c)
    ob = (pid_c * H + pid_h).to(tl.int64)
    cd = q.dtype.element_ty
    r16 = tl.arange(0, 16)
    b0 = tl.load(beta + (bos + r16).to(tl.int64) * H + pid_h, mask=r16 < L, other=0.0).to(tl.float32)
    b1 = tl.load(beta + (bos + 16 + r16).to(tl.int64) * H + pid_h, mask=16 + r16 < L, other=0.0).to(tl.float32)
    b2 = tl.load(beta + (bos + 32 + r16).to(tl.int64) * H + pid_h, mask=32 + r16 < L, other=0.0).to(tl.float32)
    b3 = tl.load(beta + (bos + 48 + r16).to(tl.int64) * H + pid_h, mask=48 + r16 < L, other=0.0).to(tl.float32)
    z16 = tl.zeros([16, 16], dtype=tl.float32)
    A00, A11, A22, A33, A10, A20, A21, A30, A31, A32 = z16, z16, z16, z16, z16, z16, z16, z16, z16, z16
    Q00, Q11, Q22, Q33, Q10, Q20, Q21, Q30, Q31, Q32 = z16, z16, z16, z16, z16, z16, z16, z16, z16, z16
    for kb in range(0, K, BKB):
        g0 = _ld(g, bos, L, pid_h, H, 0, kb, K, BKB)
        g1 = _ld(g, bos, L, pid_h, H, 1, kb, K, BKB)
        g2 = _ld(g, bos, L, pid_h, H, 2, kb, K, BKB)
        g3 = _ld(g, bos, L, pid_h, H, 3, kb, K, BKB)
        r0 = tl.sum(g0, 0)
        r1 = r0 + tl.sum(g1, 0)
        r2 = r1 + tl.sum(g2, 0)
        r3 = r2 + tl.sum(g3, 0)  # = G at the chunk's last row (rows past L load g = 0)
        rk = kb + tl.arange(0, BKB)
        tl.store(egl_out + ob * K + rk, tl.exp(r3), mask=rk < K)
        p0 = tl.zeros_like(r0)
        q0 = _ld(q, bos, L, pid_h, H, 0, kb, K, BKB)
        k0 = _ld(k, bos, L, pid_h, H, 0, kb, K, BKB)
        G0 = tl.cumsum(g0, 0)
        _ka0, _qa0, kb0, d, e = _strip(q0, k0, G0, p0, r0, r3, b0,
                                       qg_out, kg_out, w_out, ob, 0, kb, scale, K, BKB, SPAN, DOT_PREC)
        A00 += d
        Q00 += e
        q1 = _ld(q, bos, L, pid_h, H, 1, kb, K, BKB)
        k1 = _ld(k, bos, L, pid_h, H, 1, kb, K, BKB)
        G1 = tl.cumsum(g1, 0) + r0[None, :]
        ka1, qa1, kb1, d, e = _strip(q1, k1, G1, r0, r1, r3, b1,
                                       qg_out, kg_out, w_out, ob, 1, kb, scale, K, BKB, SPAN, DOT_PREC)
        A11 += d
        Q11 += e
        q2 = _ld(q, bos, L, pid_h, H, 2, kb, K, BKB)
        k2 = _ld(k, bos, L, pid_h, H, 2, kb, K, BKB)
        G2 = tl.cumsum(g2, 0) + r1[None, :]
        ka2, qa2, kb2, d, e = _strip(q2, k2, G2, r1, r2, r3, b2,
                                       qg_out, kg_out, w_out, ob, 2, kb, scale, K, BKB, SPAN, DOT_PREC)
        A22 += d
        Q22 += e
        q3 = _ld(q, bos, L, pid_h, H, 3, kb, K, BKB)
        k3 = _ld(k, bos, L, pid_h, H, 3, kb, K, BKB)
        G3 = tl.cumsum(g3, 0) + r2[None, :]
        ka3, qa3, _kb3, d, e = _strip(q3, k3, G3, r2, r3, r3, b3,
                                       qg_out, kg_out, w_out, ob, 3, kb, scale, K, BKB, SPAN, DOT_PREC)
        A33 += d
        Q33 += e
        # block (i, j), i > j: (x e^{G − Gend(i−1)}) (e^{Gend(i−1) − Gend(j)}) (k e^{Gend(j) − G}), all ≤ 1
        c0 = tl.trans(kb0.to(cd))
        c1 = tl.trans(kb1.to(cd))
        c2 = tl.trans(kb2.to(cd))
        f = tl.exp(r1 - r0)[None, :]
        c20 = tl.trans((kb0 * f).to(cd))
        f = tl.exp(r2 - r1)[None, :]
        c31 = tl.trans((kb1 * f).to(cd))
        f = tl.exp(r2 - r0)[None, :]
        c30 = tl.trans((kb0 * f).to(cd))
        ka1 = ka1.to(cd)
        qa1 = qa1.to(cd)
        ka2 = ka2.to(cd)
        qa2 = qa2.to(cd)
        ka3 = ka3.to(cd)
        qa3 = qa3.to(cd)
        A10 += tl.dot(ka1, c0, input_precision=DOT_PREC)
        Q10 += tl.dot(qa1, c0, input_precision=DOT_PREC)
        A20 += tl.dot(ka2, c20, input_precision=DOT_PREC)
        Q20 += tl.dot(qa2, c20, input_precision=DOT_PREC)
        A21 += tl.dot(ka2, c1, input_precision=DOT_PREC)
        Q21 += tl.dot(qa2, c1, input_precision=DOT_PREC)
        A30 += tl.dot(ka3, c30, input_precision=DOT_PREC)
        Q30 += tl.dot(qa3, c30, input_precision=DOT_PREC)
        A31 += tl.dot(ka3, c31, input_precision=DOT_PREC)
        Q31 += tl.dot(qa3, c31, input_precision=DOT_PREC)
        A32 += tl.dot(ka3, c2, input_precision=DOT_PREC)
        Q32 += tl.dot(qa3, c2, input_precision=DOT_PREC)

    # Aqk (scaled, causal) out; the upper blocks are written as zeros
    Ap = A_out + ob * 64 * 64
    causal = r16[:, None] >= r16[None, :]
    _blk_st(Ap, 0, 0, tl.where(causal, Q00 * scale, 0.0))
    _blk_st(Ap, 16, 16, tl.where(causal, Q11 * scale, 0.0))
    _blk_st(Ap, 32, 32, tl.where(causal, Q22 * scale, 0.0))
    _blk_st(Ap, 48, 48, tl.where(causal, Q33 * scale, 0.0))
    _blk_st(Ap, 16, 0, Q10 * scale)
    _blk_st(Ap, 32, 0, Q20 * scale)
    _blk_st(Ap, 32, 16, Q21 * scale)
    _blk_st(Ap, 48, 0, Q30 * scale)
    _blk_st(Ap, 48, 16, Q31 * scale)
    _blk_st(Ap, 48, 32, Q32 * scale)
    _blk_st(Ap, 0, 16, z16)
    _blk_st(Ap, 0, 32, z16)
    _blk_st(Ap, 0, 48, z16)
    _blk_st(Ap, 16, 32, z16)
    _blk_st(Ap, 16, 48, z16)
    _blk_st(Ap, 32, 48, z16)

    # X = (I + L)⁻¹, L = β ⊙ strictly lower Akk: diagonal blocks by _inv16, the rest by block substitution
    strict = r16[:, None] > r16[None, :]
    X00 = _inv16(tl.where(strict, A00 * b0[:, None], 0.0))
    X11 = _inv16(tl.where(strict, A11 * b1[:, None], 0.0))
    X22 = _inv16(tl.where(strict, A22 * b2[:, None], 0.0))
    X33 = _inv16(tl.where(strict, A33 * b3[:, None], 0.0))
    L10 = A10 * b1[:, None]
    L20 = A20 * b2[:, None]
    L21 = A21 * b2[:, None]
    L30 = A30 * b3[:, None]
    L31 = A31 * b3[:, None]
    L32 = A32 * b3[:, None]
    X10, X20, X21, X30, X31, X32 = _inverse_offdiag(X00, X11, X22, X33, L10, L20, L21, L30, L31, L32)
    # through scratch into one [64, 64] tile, so that w and u are single 64-row dots
    Xp = scratch + ob * 64 * 64
    _store_inverse(Xp, X00, X11, X22, X33, X10, X20, X21, X30, X31, X32)
    tl.debug_barrier()  # also orders pass 1's z stores before the loads below
    r64 = tl.arange(0, 64)
    X = tl.load(Xp + r64[:, None] * 64 + r64[None, :], mask=(r64[None, :] // 16) <= (r64[:, None] // 16),
                other=0.0).to(cd)
    b_all = tl.load(beta + (bos + r64).to(tl.int64) * H + pid_h, mask=r64 < L, other=0.0).to(tl.float32)

    # w = X z with z = β ⊙ k ⊙ e^G (stored by pass 1 in w's place), u = X (β ⊙ v)
    for kb in range(0, K, BKB):
        rk = kb + tl.arange(0, BKB)
        ow = ob * 64 * K + r64[:, None] * K + rk[None, :]
        mw = (rk < K)[None, :] & (r64 < 64)[:, None]
        z = tl.load(w_out + ow, mask=mw, other=0.0)
        w = tl.dot(X, z.to(cd), input_precision=DOT_PREC)
        tl.debug_barrier()  # every thread has read this block of z before any overwrites it
        tl.store(w_out + ow, w.to(w_out.dtype.element_ty), mask=mw)
    tok = (bos + r64).to(tl.int64)
    for vb in range(0, V, BVB):
        rv = vb + tl.arange(0, BVB)
        mv = rv < V
        v_b = tl.load(v + (tok * H + pid_h)[:, None] * V + rv[None, :], mask=(r64 < L)[:, None] & mv[None, :],
                      other=0.0).to(tl.float32)
        u = tl.dot(X, (v_b * b_all[:, None]).to(cd), input_precision=DOT_PREC)
        tl.store(u_out + ob * 64 * V + r64[:, None] * V + rv[None, :], u.to(u_out.dtype.element_ty),
                 mask=mv[None, :] & (r64[:, None] < 64))


@triton.jit
def _kda_recur_kernel(qg, kg, w, u, A, egl, chunk_start, chunk_len, seq_lo, seq_hi, export_slot,
               o, h0, ht, ckpt, H,
               K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, HAS_CKPT: tl.constexpr, DOT_PREC: tl.constexpr):
    n = tl.program_id(0)
    pid_h = tl.program_id(1)
    iv = tl.program_id(2)
    rk = tl.arange(0, BK)
    rv = iv * BV + tl.arange(0, BV)
    r64 = tl.arange(0, 64)
    mk = rk < K
    mv = rv < V
    mkv = mk[:, None] & mv[None, :]
    soff = ((n * H + pid_h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :]
    if HAS_INIT:
        h = tl.load(h0 + soff, mask=mkv, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BK, BV], dtype=tl.float32)
    lo = tl.load(seq_lo + n)
    hi = tl.load(seq_hi + n)
    dt = w.dtype.element_ty
    for c in range(lo, hi):
        if HAS_CKPT:
            slot = tl.load(export_slot + c)
            coff = ((tl.maximum(slot, 0).to(tl.int64) * H + pid_h) * K + rk[:, None]) * V + rv[None, :]
            tl.store(ckpt + coff, h, mask=mkv & ((rk[:, None] * 0 + slot) >= 0))
        bos = tl.load(chunk_start + c)
        L = tl.load(chunk_len + c)
        ob = (c * H + pid_h).to(tl.int64)
        offk = ob * 64 * K + r64[:, None] * K + rk[None, :]
        b_w = tl.load(w + offk, mask=mk[None, :], other=0.0)
        b_q = tl.load(qg + offk, mask=mk[None, :], other=0.0)
        b_k = tl.load(kg + offk, mask=mk[None, :], other=0.0)
        b_u = tl.load(u + ob * 64 * V + r64[:, None] * V + rv[None, :], mask=mv[None, :], other=0.0)
        b_A = tl.load(A + ob * 64 * 64 + r64[:, None] * 64 + r64[None, :])
        b_e = tl.load(egl + ob * K + rk, mask=mk, other=0.0)
        hb = h.to(dt)
        vn = b_u.to(tl.float32) - tl.dot(b_w, hb, input_precision=DOT_PREC)
        vnb = vn.to(dt)
        # the state update first (the loop-carried chain), the output after it (nothing waits on it)
        h = h * b_e[:, None] + tl.dot(tl.trans(b_k), vnb, input_precision=DOT_PREC)
        b_o = tl.dot(b_q, hb, input_precision=DOT_PREC) + tl.dot(b_A, vnb, input_precision=DOT_PREC)
        tok = (bos + r64).to(tl.int64)
        tl.store(o + (tok * H + pid_h)[:, None] * V + rv[None, :], b_o.to(o.dtype.element_ty),
                 mask=(r64[:, None] < L) & mv[None, :])
    if STORE_FINAL:
        tl.store(ht + soff, h, mask=mkv)


_kda_recur = triton.autotune(configs=_recur_configs(), key=["K", "V", "H", "DOT_PREC"])(_kda_recur_kernel)
# fp32 operands: pipelined stages do not fit in shared memory, so a separate tuner without them
_kda_recur_f32 = triton.autotune(configs=_recur_configs((1,)), key=["K", "V", "H", "DOT_PREC"])(_kda_recur_kernel)


@functools.lru_cache(maxsize=64)
def _plan_cached(lengths: tuple, offsets: tuple, cuts: tuple, device: str):
    starts, lens, lo, hi, slot = [], [], [], [], []
    cut_map = {}
    for (n, p), m in cuts:
        cut_map.setdefault(n, {})[p] = m
    for n, (Ln, off) in enumerate(zip(lengths, offsets)):
        lo.append(len(starts))
        cm = cut_map.get(n, {})
        bounds = sorted(set(range(0, Ln, BT)) | {p for p in cm if 0 < p < Ln})
        for a_i, a in enumerate(bounds):
            b = bounds[a_i + 1] if a_i + 1 < len(bounds) else Ln
            starts.append(off + a)
            lens.append(b - a)
            slot.append(cm.get(a, -1) if a > 0 else -1)
        hi.append(len(starts))
    dev = torch.device(device)
    mk = lambda x: torch.tensor(x if x else [0], dtype=torch.int32).to(dev, non_blocking=True)  # noqa: E731
    return len(starts), mk(starts), mk(lens), mk(lo), mk(hi), mk(slot)


def build_chunk_plan(B: int, T: int, cu_seqlens, ckpts, device):
    """Chunk table: (start token in the flattened B·T axis, length ≤ 64), per sequence its chunk range, and
    per chunk the checkpoint slot to fill with the state at its start (−1: none). Cached per layout."""
    lengths = seq_lengths(T, B, cu_seqlens)
    if cu_seqlens is None:
        offsets = [b * T for b in range(B)]
    else:
        offsets = cu_seqlens.tolist()[:-1]
    uniq: dict = {}
    for key in ckpts:
        uniq.setdefault(key, len(uniq))
    cuts = tuple(sorted(uniq.items()))
    return _plan_cached(tuple(lengths), tuple(offsets), cuts, str(device)), lengths, uniq


def supports_kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                       cu_seqlens=None, checkpoint_positions=None):
    r = triton_ready(q, k, v, g, beta)
    if r:
        return r
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} not supported (float32, float16, bfloat16)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q, k, v must share one dtype"
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        return "bfloat16 tl.dot is not exact under the Triton interpreter"
    if v.shape[-1] > 256:
        return f"V must be <= 256, got {v.shape[-1]}"
    return None


INTRA_MODES = ("fused", "split", "splitg")


def intra_mode() -> str:
    """``K3NN_KDA_INTRA``: ``splitg`` (the default, fastest on the H200), ``split`` or ``fused``; see the module
    docstring."""
    m = os.environ.get("K3NN_KDA_INTRA", "splitg").strip().lower() or "splitg"
    if m not in INTRA_MODES:
        raise ValueError(f"K3NN_KDA_INTRA must be one of {INTRA_MODES}, got {m!r}")
    return m


def intra_fill(q, k, v, g, beta, scale, NC, c_start, c_len, qg, kg, w, u, A, egl, X, config=None, mode=None):
    """Run the intra-chunk stage of ``mode`` (default: :func:`intra_mode`) into the given buffers (layouts of
    :func:`_intra_launch`; X: the fp32 [NC, H, 64, 64] scratch, left holding (I + L)⁻¹ in its block-lower part).
    ``config``: a ``triton.Config`` to run instead of the autotuned choice (fused), or a tuple of them, one per
    kernel (split: three, splitg: four; None entries autotuned)."""
    _, _, H, K = q.shape
    V = v.shape[-1]
    mode = mode or intra_mode()
    if mode == "split":
        from .triton_intra_split import intra_split_launch

        intra_split_launch(q, k, v, g, beta, scale, NC, c_start, c_len, qg, kg, w, u, A, egl, X, configs=config)
    elif mode == "splitg":
        from .triton_intra_g import intra_g_launch

        intra_g_launch(q, k, v, g, beta, scale, NC, c_start, c_len, qg, kg, w, u, A, egl, X, configs=config)
    else:
        args = (q, k, v, g, beta, c_start, c_len, qg, kg, w, u, A, egl, X, scale, H)
        if config is None:
            _kda_intra[(NC, H)](*args, K=K, V=V, SPAN=_SPAN, DOT_PREC=dot_precision(q.dtype))
        else:
            _kda_intra.fn[(NC, H)](*args, K=K, V=V, SPAN=_SPAN, **config.kwargs, num_warps=config.num_warps,
                                   num_stages=config.num_stages, DOT_PREC=dot_precision(q.dtype))


def _intra_launch(q, k, v, g, beta, scale, NC, c_start, c_len, config=None, mode=None, return_x=False):
    """Intra-chunk quantities of NC chunks (contiguous inputs); returns (qg, kg, w, u, A, egl), plus the fp32
    X = (I + L)⁻¹ scratch with ``return_x``. ``mode``: ``fused`` / ``split`` / ``splitg`` (default:
    :func:`intra_mode`).
    ``config``: a ``triton.Config`` to run instead of the autotuned choice (fused), or a triple of them
    (split / splitg: a tuple of them, None entries autotuned) — benchmarks time each variant this way."""
    _, _, H, K = q.shape
    V = v.shape[-1]
    dt, dev = q.dtype, q.device
    qg = torch.empty(NC, H, 64, K, dtype=dt, device=dev)
    kg = torch.empty_like(qg)
    w = torch.empty_like(qg)
    u = torch.empty(NC, H, 64, V, dtype=dt, device=dev)
    A = torch.empty(NC, H, 64, 64, dtype=dt, device=dev)
    egl = torch.empty(NC, H, K, dtype=torch.float32, device=dev)
    scratch = torch.empty(NC, H, 64, 64, dtype=torch.float32, device=dev)
    intra_fill(q, k, v, g, beta, scale, NC, c_start, c_len, qg, kg, w, u, A, egl, scratch, config=config, mode=mode)
    out = (qg, kg, w, u, A, egl)
    return out + (scratch,) if return_x else out


def kda_chunk_triton_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None, checkpoint_positions=None, _force_final=False):
    """Forward only (no autograd); see :func:`k3nn.ops.kda_chunk` for the contract."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    dev = q.device
    ckpts = normalise_checkpoints(checkpoint_positions, seq_lengths(T, B, cu_seqlens))
    (NC, c_start, c_len, s_lo, s_hi, slot), lengths, uniq = build_chunk_plan(B, T, cu_seqlens, ckpts, dev)
    N = len(lengths)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    dt = q.dtype
    BK = max(16, triton.next_power_of_2(K))
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=dev)
    need_final = output_final_state or _force_final or any(p == lengths[n] for n, p in ckpts)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if need_final else None
    ck = torch.empty(max(len(uniq), 1), H, K, V, dtype=torch.float32, device=dev) if ckpts else None
    if NC > 0:
        qg, kg, w, u, A, egl = _intra_launch(q, k, v, g, beta, scale, NC, c_start, c_len)
        h0 = initial_state.float().contiguous() if initial_state is not None else qg
        grid = lambda META: (N, H, triton.cdiv(V, META["BV"]))  # noqa: E731
        recur = _kda_recur_f32 if dt == torch.float32 else _kda_recur
        recur[grid](qg, kg, w, u, A, egl, c_start, c_len, s_lo, s_hi, slot,
                         o, h0, ht if ht is not None else qg, ck if ck is not None else qg, H,
                         K=K, V=V, BK=BK, HAS_INIT=initial_state is not None, STORE_FINAL=ht is not None,
                         HAS_CKPT=bool(ckpts), DOT_PREC=dot_precision(dt))
    elif ht is not None:
        ht.zero_()
    if ht is not None and NC == 0 and initial_state is not None:
        ht.copy_(initial_state)
    # checkpoints at position 0 (the initial state) and at the sequence end (the final state) are not chunk
    # starts; fill them (and duplicates) from what the kernel produced.
    res_ck = None
    if checkpoint_positions is not None:
        interior = all(0 < p < lengths[n] for n, p in ckpts)
        if not ckpts:
            res_ck = torch.empty(0, H, K, V, dtype=torch.float32, device=dev)
        elif interior and len(uniq) == len(ckpts):
            res_ck = ck[:len(ckpts)]  # the common case: slots already in the order asked
        else:
            res_ck = torch.empty(len(ckpts), H, K, V, dtype=torch.float32, device=dev)
            for m, (n, p) in enumerate(ckpts):
                if p == 0:
                    res_ck[m] = initial_state[n] if initial_state is not None else 0.0
                elif p == lengths[n]:
                    res_ck[m] = ht[n]
                else:
                    res_ck[m] = ck[uniq[(n, p)]]
    return o, (ht if output_final_state else None), res_ck
