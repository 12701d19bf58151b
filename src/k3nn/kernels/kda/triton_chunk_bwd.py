"""Triton backward of the chunked KDA (chunk 64), varlen, initial / final state gradients.

Per 64-token chunk and head, with ``G`` the chunk-local cumulative log decay and ``h`` the state at the chunk
start, the forward (:mod:`.triton_chunk`) computes::

    Aqk = scale · tril((q ⊙ e^G)(k ⊙ e^-G)ᵀ)          L = diag(β) · strict_tril((k ⊙ e^G)(k ⊙ e^-G)ᵀ)
    X   = (I + L)⁻¹,  z = β ⊙ k ⊙ e^G,  w = X z,  u = X (β ⊙ v)
    qg  = scale · q ⊙ e^G,  kg = k ⊙ e^{G_last − G}
    v'  = u − w h,   o = qg h + Aqk v',   h⁺ = e^{G_last} ⊙ h + kgᵀ v'

What is saved: only the inputs. The backward recomputes everything else (as fla does), which keeps the
training memory at the inputs' size instead of one fp32 ``[K, V]`` state per chunk and head:

1. The forward's intra-chunk stage again (:func:`.triton_chunk.intra_fill`): qg, kg, w, u, Aqk, e^{G_last} and X
   (its fp32 scratch).
2. ``_kda_bwd_states`` (grid: sequences × heads × V blocks): the forward recurrence once more, storing the
   state at every chunk start ``h`` and the pseudo-values ``v'`` (fp32).
3. ``_kda_bwd_dh`` (same grid, chunks in reverse): with ``dh⁺`` the gradient of the state after the chunk,
   ``dv' = Aqkᵀ do + kg dh⁺`` and ``dh = qgᵀ do + e^{G_last} ⊙ dh⁺ − wᵀ dv'``; stores ``dh⁺`` per chunk,
   ``dv'``, and the gradient of the initial state (``dh`` at each sequence's first chunk; an empty sequence
   passes the final-state gradient straight through).
4. ``_kda_bwd_chunk`` (grid: chunks × heads, fully parallel): everything local to the chunk, in fp32:

   * V side: ``dAqk = do v'ᵀ``, ``dX = dv' (β v)ᵀ``, ``dv = β ⊙ Xᵀ dv'``, ``dβ += Σ_v v ⊙ Xᵀ dv'``;
   * K side (per key block): ``dqg = do hᵀ``, ``dkg = v' dh⁺ᵀ``, ``dw = −dv' hᵀ``, ``de = Σ_v h ⊙ dh⁺``;
     ``dX += dw zᵀ``, ``dz = Xᵀ dw`` and the elementwise chain rule through qg, kg, z, e^{G_last};
   * ``dL = −Xᵀ dX Xᵀ`` (strictly lower), so ``dAkk = diag(β) dL`` and ``dβ_i += Σ_j dL_ij Akk_ij``;
   * the pairwise terms of Aqk and Akk: for ``T_ij = Σ_d x_id y_jd e^{G_id − G_jd}`` with gradient
     ``dT``, ``dx_i = Σ_j dT_ij y_j e^{G_i − G_j}``, ``dy_j = Σ_i dT_ij x_i e^{G_i − G_j}`` and
     ``dG = x ⊙ dx − y ⊙ dy``. Off-diagonal 16-row strips (i in strip s > j's strip t) split the decay as
     ``e^{G_i − G_end(s−1)} · e^{G_end(s−1) − G_end(t)} · e^{G_end(t) − G_j}``, every factor ≤ 1, so the
     products are dots that cannot overflow for any gate ≤ 0; the diagonal 16×16 blocks are summed
     pairwise with ``e^{G_i − G_j} ≤ 1`` exactly;
   * ``dg`` = reverse cumulative sum of ``dG`` over the chunk's rows (G is chunk-local; ``G_last``'s
     gradient enters at the last row).

Steps 2-4 compute in fp32 whatever the input dtype (TF32 dots on the GPU): the chunk quantities of step 1
are stored in the input dtype and upcast on load. Steps 2-3 first took 16-bit operands, as the forward's
recurrence does; on Hopper with Triton 3.6 bf16 then gave NaN gradients from some chunk on and, in a varlen
run, an illegal memory access, while the same kernels on fp32 operands (the fp32 path, same configs) were
correct. Those are the only dots of the backward that were 16-bit; their 16-bit ``B`` operands were
``BV = 16`` columns wide (32-byte rows: the first state config), a shape the forward (BV ≥ 32) never
compiles. On fp32 operands the bf16 backward runs exactly the code the fp32 backward runs, apart from the
loads' element type. Internal buffers are fp32; outputs take the inputs' dtypes.

Selection: under the ``triton`` backend, ``kda_chunk`` with any input requiring grad uses this backward
(:class:`KDAChunkTritonFunction`). It matches fp32 eager autograd to the rounding of its TF32 / bf16 products
and is two orders of magnitude faster than autograd through the chunked PyTorch form
(:class:`k3nn.kernels.kda.chunk_torch.KDAChunkFunction`, which ``kda_recurrent``'s Triton backend keeps);
docs/perf.md has the GPU figures.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..precision import dot_precision
from ..registry import triton_interpreting
from ..tuning_cache import AUTOTUNE_KW
from .triton_chunk import build_chunk_plan, intra_fill, kda_chunk_triton_fwd
from .triton_common import _SPAN, PRUNE

__all__ = ["KDAChunkTritonFunction", "kda_chunk_triton_bwd", "kda_chunk_triton_autograd"]

def _state_configs():
    if triton_interpreting():
        return [triton.Config({"BV": 32}, num_warps=4)]
    # BV 16 first: the sequential chunk loop gets more programs, and the [K, BV] state spills least
    cfgs = [triton.Config({"BV": bv}, num_warps=w, num_stages=1) for bv, w in ((16, 4), (32, 4), (64, 8))]
    return cfgs


def _chunk_configs():
    if triton_interpreting():
        return [triton.Config({"BK": 32, "BV": 32}, num_warps=4)]
    # first: the one that spills least on sm_90 (ptxas: 255 registers, 56 B of stack at K = V = 128)
    cfgs = [triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=1)
            for bk, bv, w in ((32, 32, 8), (64, 32, 8), (32, 32, 4))]
    return cfgs


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _kda_bwd_states_kernel(w, u, kg, egl, seq_lo, seq_hi, h0, hs, vn, H,
                           K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           HAS_INIT: tl.constexpr, DOT_PREC: tl.constexpr):
    """Forward recurrence again: hs[c] = state at chunk c's start (fp32), vn[c] = v' = u − w h (fp32)."""
    n = tl.program_id(0)
    pid_h = tl.program_id(1)
    iv = tl.program_id(2)
    rk = tl.arange(0, BK)
    rv = iv * BV + tl.arange(0, BV)
    r64 = tl.arange(0, 64)
    mk = rk < K
    mv = rv < V
    mkv = mk[:, None] & mv[None, :]
    if HAS_INIT:
        h = tl.load(h0 + ((n * H + pid_h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :], mask=mkv,
                    other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BK, BV], dtype=tl.float32)
    lo = tl.load(seq_lo + n)
    hi = tl.load(seq_hi + n)
    # fp32 operands whatever the input dtype (see the module docstring: the 16-bit dots of this loop, with
    # BV = 16 columns, gave NaNs and faults on Hopper where the same code on fp32 operands is correct)
    for c in range(lo, hi):
        ob = (c * H + pid_h).to(tl.int64)
        tl.store(hs + (ob * K + rk[:, None]) * V + rv[None, :], h, mask=mkv)
        offk = ob * 64 * K + r64[:, None] * K + rk[None, :]
        b_w = tl.load(w + offk, mask=mk[None, :], other=0.0).to(tl.float32)
        b_k = tl.load(kg + offk, mask=mk[None, :], other=0.0).to(tl.float32)
        b_u = tl.load(u + ob * 64 * V + r64[:, None] * V + rv[None, :], mask=mv[None, :], other=0.0)
        b_e = tl.load(egl + ob * K + rk, mask=mk, other=0.0)
        vnew = b_u.to(tl.float32) - tl.dot(b_w, h, input_precision=DOT_PREC)
        tl.store(vn + ob * 64 * V + r64[:, None] * V + rv[None, :], vnew, mask=mv[None, :])
        h = h * b_e[:, None] + tl.dot(tl.trans(b_k), vnew, input_precision=DOT_PREC)


@triton.jit
def _kda_bwd_dh_kernel(qg, kg, w, A, egl, do, chunk_start, chunk_len, seq_lo, seq_hi, dht,
                       dhs, dvn, dh0, H,
                       K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       HAS_DHT: tl.constexpr, DOT_PREC: tl.constexpr):
    """Reverse pass over one sequence's chunks: dhs[c] = gradient of the state after chunk c,
    dvn[c] = dv' = Aqkᵀ do + kg dh⁺, dh0[n] = gradient of the initial state."""
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
    if HAS_DHT:
        dh = tl.load(dht + soff, mask=mkv, other=0.0).to(tl.float32)
    else:
        dh = tl.zeros([BK, BV], dtype=tl.float32)
    lo = tl.load(seq_lo + n)
    hi = tl.load(seq_hi + n)
    for i in range(0, hi - lo):  # fp32 operands, as in _kda_bwd_states_kernel
        c = hi - 1 - i
        ob = (c * H + pid_h).to(tl.int64)
        tl.store(dhs + (ob * K + rk[:, None]) * V + rv[None, :], dh, mask=mkv)
        bos = tl.load(chunk_start + c)
        L = tl.load(chunk_len + c)
        tok = (bos + r64).to(tl.int64)
        b_do = tl.load(do + (tok * H + pid_h)[:, None] * V + rv[None, :], mask=(r64 < L)[:, None] & mv[None, :],
                       other=0.0).to(tl.float32)
        offk = ob * 64 * K + r64[:, None] * K + rk[None, :]
        b_q = tl.load(qg + offk, mask=mk[None, :], other=0.0).to(tl.float32)
        b_k = tl.load(kg + offk, mask=mk[None, :], other=0.0).to(tl.float32)
        b_w = tl.load(w + offk, mask=mk[None, :], other=0.0).to(tl.float32)
        b_A = tl.load(A + ob * 64 * 64 + r64[:, None] * 64 + r64[None, :]).to(tl.float32)
        b_e = tl.load(egl + ob * K + rk, mask=mk, other=0.0)
        dvp = (tl.dot(tl.trans(b_A), b_do, input_precision=DOT_PREC)
               + tl.dot(b_k, dh, input_precision=DOT_PREC))
        tl.store(dvn + ob * 64 * V + r64[:, None] * V + rv[None, :], dvp, mask=mv[None, :])
        dh = (dh * b_e[:, None] + tl.dot(tl.trans(b_q), b_do, input_precision=DOT_PREC)
              - tl.dot(tl.trans(b_w), dvp, input_precision=DOT_PREC))
    tl.store(dh0 + soff, dh, mask=mkv)


@triton.jit
def _rows(x, bos, L, pid_h, H, rows, rk, D: tl.constexpr):
    """Rows ``rows`` (chunk-relative) and channels ``rk`` of x [tokens, H, D] as fp32, zeros outside."""
    off = ((bos + rows).to(tl.int64) * H + pid_h)[:, None] * D + rk[None, :]
    return tl.load(x + off, mask=(rows < L)[:, None] & (rk < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _row(x, bos, L, pid_h, H, row, rk, D: tl.constexpr):
    """One row (chunk-relative) of x [tokens, H, D] as an fp32 vector over ``rk``."""
    off = ((bos + row).to(tl.int64) * H + pid_h) * D + rk
    return tl.load(x + off, mask=(rk < D) & ((rk * 0 + row) < L), other=0.0).to(tl.float32)


@triton.jit
def _tile(p, rows, rk, D: tl.constexpr):
    """[len(rows), len(rk)] tile of a per-chunk fp32 scratch [64, D] starting at ``p``."""
    return tl.load(p + rows[:, None] * D + rk[None, :], mask=(rk < D)[None, :], other=0.0)


@triton.jit
def _tile_st(p, rows, rk, val, D: tl.constexpr):
    tl.store(p + rows[:, None] * D + rk[None, :], val, mask=(rk < D)[None, :])


@triton.jit
def _ldX(X, ob, r64):
    """The forward's X = (I + L)⁻¹ of one chunk, fp32 [64, 64]: block lower triangular (only those blocks
    were written)."""
    return tl.load(X + ob * 4096 + r64[:, None] * 64 + r64[None, :],
                   mask=(r64[None, :] // 16) <= (r64[:, None] // 16), other=0.0)


@triton.jit
def _kda_bwd_chunk_kernel(q, k, v, g, beta, do, chunk_start, chunk_len, X, hs, dhs, vn, dvn,
                          dq, dk, dv, dg, dbeta,
                          sG, sdq, sdk, sdG, sdA, sdL, sdb,
                          scale, H,
                          K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          SPAN: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_h = tl.program_id(1)
    bos = tl.load(chunk_start + pid_c)
    L = tl.load(chunk_len + pid_c)
    ob = (pid_c * H + pid_h).to(tl.int64)
    r64 = tl.arange(0, 64)
    r16 = tl.arange(0, 16)
    tok = (bos + r64).to(tl.int64)
    live = r64 < L
    b = tl.load(beta + tok * H + pid_h, mask=live, other=0.0).to(tl.float32)
    pG = sG + ob * 64 * K
    pdq = sdq + ob * 64 * K
    pdk = sdk + ob * 64 * K
    pdG = sdG + ob * 64 * K
    pA = sdA + ob * 4096
    pL = sdL + ob * 4096
    pb = sdb + ob * 64

    # ---- V side: dAqk, dX (u part), dv, dβ (v part). X (the forward's inverse) is reloaded where it is used
    # rather than held: register pressure, and its loads hit the cache
    dA = tl.zeros([64, 64], dtype=tl.float32)
    dX = tl.zeros([64, 64], dtype=tl.float32)
    db = tl.zeros([64], dtype=tl.float32)
    for vb in range(0, V, BV):
        rv = vb + tl.arange(0, BV)
        mv = rv < V
        m2 = live[:, None] & mv[None, :]
        io = (tok * H + pid_h)[:, None] * V + rv[None, :]
        b_do = tl.load(do + io, mask=m2, other=0.0).to(tl.float32)
        b_v = tl.load(v + io, mask=m2, other=0.0).to(tl.float32)
        co = ob * 64 * V + r64[:, None] * V + rv[None, :]
        b_vn = tl.load(vn + co, mask=mv[None, :], other=0.0)
        b_dvn = tl.load(dvn + co, mask=mv[None, :], other=0.0)
        dA += tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PREC)
        dX += tl.dot(b_dvn, tl.trans(b_v * b[:, None]), input_precision=DOT_PREC)
        y = tl.dot(tl.trans(_ldX(X, ob, r64)), b_dvn, input_precision=DOT_PREC)
        tl.store(dv + io, (y * b[:, None]).to(dv.dtype.element_ty), mask=m2)
        db += tl.sum(b_v * y, 1)
    tl.store(pA + r64[:, None] * 64 + r64[None, :], tl.where(r64[:, None] >= r64[None, :], dA * scale, 0.0))

    # ---- K side: through qg, kg, w (= X z) and e^{G_last}; partial dq, dk, dG to scratch
    for kb in range(0, K, BK):
        rk = kb + tl.arange(0, BK)
        mk = rk < K
        dqg = tl.zeros([64, BK], dtype=tl.float32)
        dkg = tl.zeros([64, BK], dtype=tl.float32)
        dw = tl.zeros([64, BK], dtype=tl.float32)
        de = tl.zeros([BK], dtype=tl.float32)
        for vb in range(0, V, BV):
            rv = vb + tl.arange(0, BV)
            mv = rv < V
            so = (ob * K + rk[:, None]) * V + rv[None, :]
            msk = mk[:, None] & mv[None, :]
            b_h = tl.load(hs + so, mask=msk, other=0.0)
            b_dh = tl.load(dhs + so, mask=msk, other=0.0)
            b_do = tl.load(do + (tok * H + pid_h)[:, None] * V + rv[None, :], mask=live[:, None] & mv[None, :],
                           other=0.0).to(tl.float32)
            co = ob * 64 * V + r64[:, None] * V + rv[None, :]
            b_vn = tl.load(vn + co, mask=mv[None, :], other=0.0)
            b_dvn = tl.load(dvn + co, mask=mv[None, :], other=0.0)
            dqg += tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)
            dkg += tl.dot(b_vn, tl.trans(b_dh), input_precision=DOT_PREC)
            dw -= tl.dot(b_dvn, tl.trans(b_h), input_precision=DOT_PREC)
            de += tl.sum(b_h * b_dh, 1)
        gk = _rows(g, bos, L, pid_h, H, r64, rk, K)
        G = tl.cumsum(gk, 0)
        Gl = tl.sum(gk, 0)
        _tile_st(pG, r64, rk, G, K)
        b_q = _rows(q, bos, L, pid_h, H, r64, rk, K)
        b_k = _rows(k, bos, L, pid_h, H, r64, rk, K)
        eG = tl.exp(G)
        ekg = tl.exp(Gl[None, :] - G)
        z = b_k * eG * b[:, None]
        dX += tl.dot(dw, tl.trans(z), input_precision=DOT_PREC)
        dz = tl.dot(tl.trans(_ldX(X, ob, r64)), dw, input_precision=DOT_PREC)
        kg = b_k * ekg
        db += tl.sum(b_k * eG * dz, 1)
        _tile_st(pdq, r64, rk, eG * dqg * scale, K)
        _tile_st(pdk, r64, rk, b[:, None] * eG * dz + ekg * dkg, K)
        dGl = tl.sum(kg * dkg, 0) + tl.exp(Gl) * de
        dG = z * dz + (b_q * eG * scale) * dqg - kg * dkg + tl.where(r64[:, None] == 63, dGl[None, :], 0.0)
        _tile_st(pdG, r64, rk, dG, K)

    # ---- through the inverse: dL = −Xᵀ dX Xᵀ (strictly lower)
    Xt = tl.trans(_ldX(X, ob, r64))
    dL = -tl.dot(tl.dot(Xt, dX, input_precision="ieee"), Xt, input_precision="ieee")
    dL = tl.where(r64[:, None] > r64[None, :], dL, 0.0)
    tl.store(pL + r64[:, None] * 64 + r64[None, :], dL)
    tl.store(pb + r64, db)
    tl.debug_barrier()

    # ---- pairwise terms of Aqk (dA) and Akk (β_i dL_ij), per key block and 16-row strip
    for kb in range(0, K, BK):
        rk = kb + tl.arange(0, BK)
        mk = rk < K
        for s in tl.static_range(4):
            rs = s * 16 + r16
            q_s = _rows(q, bos, L, pid_h, H, rs, rk, K)
            k_s = _rows(k, bos, L, pid_h, H, rs, rk, K)
            G_s = _tile(pG, rs, rk, K)
            b_s = tl.load(beta + (bos + rs).to(tl.int64) * H + pid_h, mask=rs < L, other=0.0).to(tl.float32)
            Rq = tl.zeros([16, BK], dtype=tl.float32)  # Σ_j dA_ij k_j e^{G_i − G_j}
            Rk = tl.zeros([16, BK], dtype=tl.float32)  # Σ_j dL_ij k_j e^{G_i − G_j}
            C = tl.zeros([16, BK], dtype=tl.float32)  # Σ_i (dA_ij q_i + β_i dL_ij k_i) e^{G_i − G_j}
            if s > 0:
                Gp = tl.load(pG + (s * 16 - 1) * K + rk, mask=mk, other=0.0)  # G at the row before strip s
            else:
                Gp = tl.zeros([BK], dtype=tl.float32)
            if s > 0:
                for t in tl.static_range(4):
                    if t < s:
                        rt = t * 16 + r16
                        Ge = tl.load(pG + (t * 16 + 15) * K + rk, mask=mk, other=0.0)
                        ct = _rows(k, bos, L, pid_h, H, rt, rk, K) * tl.exp(Ge[None, :] - _tile(pG, rt, rk, K))
                        ct = ct * tl.exp(Gp - Ge)[None, :]
                        bA = tl.load(pA + rs[:, None] * 64 + rt[None, :])
                        bL = tl.load(pL + rs[:, None] * 64 + rt[None, :])
                        Rq += tl.dot(bA, ct, input_precision=DOT_PREC)
                        Rk += tl.dot(bL, ct, input_precision=DOT_PREC)
            # diagonal block: row factor e^{G_i − Gp} ≤ 1, column factor e^{Gp − G_j} ≤ e^SPAN (upper entries of
            # dA, dL are zero); a strip decaying by more than SPAN nats is summed pairwise, e^{G_i − G_j} ≤ 1
            a_s = tl.exp(G_s - Gp[None, :])
            Gend = tl.load(pG + (s * 16 + 15) * K + rk, mask=mk, other=0.0)
            if tl.max(Gp - Gend, 0) <= SPAN:
                bA = tl.load(pA + rs[:, None] * 64 + rs[None, :])
                bL = tl.load(pL + rs[:, None] * 64 + rs[None, :])
                ec = tl.exp(Gp[None, :] - G_s)
                kc = k_s * ec
                Rq = (Rq + tl.dot(bA, kc, input_precision=DOT_PREC)) * a_s
                Rk = (Rk + tl.dot(bL, kc, input_precision=DOT_PREC)) * a_s
                C = ec * (tl.dot(tl.trans(bA), q_s * a_s, input_precision=DOT_PREC)
                          + tl.dot(tl.trans(bL), k_s * a_s * b_s[:, None], input_precision=DOT_PREC))
            else:
                Rq = Rq * a_s
                Rk = Rk * a_s
                for jj in range(16):
                    c = s * 16 + jj
                    k_c = _row(k, bos, L, pid_h, H, c, rk, K)
                    G_c = tl.load(pG + c * K + rk, mask=mk, other=0.0)
                    e = tl.exp(tl.minimum(G_s - G_c[None, :], 0.0))
                    colA = tl.load(pA + rs * 64 + c)
                    colL = tl.load(pL + rs * 64 + c)
                    kc = k_c[None, :] * e
                    Rq += colA[:, None] * kc
                    Rk += colL[:, None] * kc
                    cc = tl.sum((colA[:, None] * q_s + (colL * b_s)[:, None] * k_s) * e, 0)
                    C = tl.where(r16[:, None] == jj, cc[None, :], C)
            if s < 3:
                Ge = tl.load(pG + (s * 16 + 15) * K + rk, mask=mk, other=0.0)
                Cc = tl.zeros([16, BK], dtype=tl.float32)
                for i in tl.static_range(4):
                    if i > s:
                        ri = i * 16 + r16
                        Gp = tl.load(pG + (i * 16 - 1) * K + rk, mask=mk, other=0.0)
                        f = tl.exp(_tile(pG, ri, rk, K) - Gp[None, :]) * tl.exp(Gp - Ge)[None, :]
                        b_i = tl.load(beta + (bos + ri).to(tl.int64) * H + pid_h, mask=ri < L,
                                      other=0.0).to(tl.float32)
                        xq = _rows(q, bos, L, pid_h, H, ri, rk, K) * f
                        xk = _rows(k, bos, L, pid_h, H, ri, rk, K) * f * b_i[:, None]
                        bA = tl.load(pA + ri[:, None] * 64 + rs[None, :])
                        bL = tl.load(pL + ri[:, None] * 64 + rs[None, :])
                        Cc += (tl.dot(tl.trans(bA), xq, input_precision=DOT_PREC)
                               + tl.dot(tl.trans(bL), xk, input_precision=DOT_PREC))
                C += Cc * tl.exp(Ge[None, :] - G_s)
            bRk = b_s[:, None] * Rk
            _tile_st(pdq, rs, rk, _tile(pdq, rs, rk, K) + Rq, K)
            _tile_st(pdk, rs, rk, _tile(pdk, rs, rk, K) + bRk + C, K)
            _tile_st(pdG, rs, rk, _tile(pdG, rs, rk, K) + q_s * Rq + k_s * (bRk - C), K)
            tl.store(pb + rs, tl.load(pb + rs) + tl.sum(k_s * Rk, 1))
            tl.debug_barrier()
        # this key block is complete: dg = reverse cumulative sum of dG over the chunk's rows
        dG = _tile(pdG, r64, rk, K)
        dgk = tl.sum(dG, 0)[None, :] - tl.cumsum(dG, 0) + dG
        io = (tok * H + pid_h)[:, None] * K + rk[None, :]
        m2 = live[:, None] & mk[None, :]
        tl.store(dg + io, dgk.to(dg.dtype.element_ty), mask=m2)
        tl.store(dq + io, _tile(pdq, r64, rk, K).to(dq.dtype.element_ty), mask=m2)
        tl.store(dk + io, _tile(pdk, r64, rk, K).to(dk.dtype.element_ty), mask=m2)
    tl.store(dbeta + tok * H + pid_h, tl.load(pb + r64).to(dbeta.dtype.element_ty), mask=live)


_kda_bwd_states = triton.autotune(**AUTOTUNE_KW, configs=_state_configs(), key=["K", "V", "H", "DOT_PREC"],
                                  prune_configs_by=PRUNE)(_kda_bwd_states_kernel)
_kda_bwd_dh = triton.autotune(**AUTOTUNE_KW, configs=_state_configs(), key=["K", "V", "H", "DOT_PREC"],
                              prune_configs_by=PRUNE)(_kda_bwd_dh_kernel)
_kda_bwd_chunk = triton.autotune(**AUTOTUNE_KW, configs=_chunk_configs(), key=["K", "V", "DOT_PREC"],
                                 prune_configs_by=PRUNE)(_kda_bwd_chunk_kernel)


# --------------------------------------------------------------------------------------------- host side


def _buf(*shape, dtype=torch.float32, device="cpu"):
    """Uninitialised on the GPU; NaN-filled under the interpreter so that an unwritten element shows."""
    if triton_interpreting():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def kda_chunk_triton_bwd(do, dht, q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None):
    """Gradients of ``(o, final_state)`` of the chunked KDA.

    Args:
        do: ``[B, T, H, V]`` or None (zero); dht: ``[N, H, K, V]`` or None (zero).
        q, k, v, g, beta, scale, initial_state, cu_seqlens: as in :func:`k3nn.ops.kda_chunk`.
    Returns:
        ``(dq, dk, dv, dg, dbeta, dh0)`` in the dtypes of q, k, v, g, beta; ``dh0`` is fp32 ``[N, H, K, V]``
        (the gradient of the initial state, also when none was given).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    dev = q.device
    (NC, c_start, c_len, s_lo, s_hi, _), lengths, _ = build_chunk_plan(B, T, cu_seqlens, [], dev)
    N = len(lengths)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    dq = _buf(*q.shape, dtype=q.dtype, device=dev)
    dk = _buf(*k.shape, dtype=k.dtype, device=dev)
    dv = _buf(*v.shape, dtype=v.dtype, device=dev)
    dg = _buf(*g.shape, dtype=g.dtype, device=dev)
    db = _buf(*beta.shape, dtype=beta.dtype, device=dev)
    dh0 = _buf(N, H, K, V, device=dev)
    dht = dht.float().contiguous() if dht is not None else None
    if NC == 0:  # no tokens at all: the state passes through untouched
        for t in (dq, dk, dv, dg, db):
            t.zero_()
        dh0.copy_(dht) if dht is not None else dh0.zero_()
        return dq, dk, dv, dg, db, dh0
    do = do.contiguous() if do is not None else torch.zeros_like(v)
    dt = q.dtype
    BK = max(16, triton.next_power_of_2(K))

    # 1. intra-chunk quantities (the forward's kernel); its scratch keeps X = (I + L)⁻¹ in fp32
    qg = _buf(NC, H, 64, K, dtype=dt, device=dev)
    kg = _buf(NC, H, 64, K, dtype=dt, device=dev)
    w = _buf(NC, H, 64, K, dtype=dt, device=dev)
    u = _buf(NC, H, 64, V, dtype=dt, device=dev)
    A = _buf(NC, H, 64, 64, dtype=dt, device=dev)
    egl = _buf(NC, H, K, device=dev)
    X = _buf(NC, H, 64, 64, device=dev)
    intra_fill(q, k, v, g, beta, scale, NC, c_start, c_len, qg, kg, w, u, A, egl, X)  # the forward's intra stage

    # 2. states at chunk starts and pseudo-values v'
    hs = _buf(NC, H, K, V, device=dev)
    vn = _buf(NC, H, 64, V, device=dev)
    h0 = initial_state.float().contiguous() if initial_state is not None else hs
    grid = lambda META: (N, H, triton.cdiv(V, META["BV"]))  # noqa: E731
    prec = {"DOT_PREC": dot_precision(q.dtype)}  # fp32 products follow torch's TF32 setting
    _kda_bwd_states[grid](w, u, kg, egl, s_lo, s_hi, h0, hs, vn, H, K=K, V=V, BK=BK,
                          HAS_INIT=initial_state is not None, **prec)

    # 3. reverse pass: state gradients and dv'
    dhs = _buf(NC, H, K, V, device=dev)
    dvn = _buf(NC, H, 64, V, device=dev)
    _kda_bwd_dh[grid](qg, kg, w, A, egl, do, c_start, c_len, s_lo, s_hi, dht if dht is not None else hs,
                      dhs, dvn, dh0, H, K=K, V=V, BK=BK, HAS_DHT=dht is not None, **prec)

    # 4. per-chunk gradients
    sc = [_buf(NC, H, 64, K, device=dev) for _ in range(4)]
    sA = _buf(NC, H, 64, 64, device=dev)
    sL = _buf(NC, H, 64, 64, device=dev)
    sb = _buf(NC, H, 64, device=dev)
    _kda_bwd_chunk[(NC, H)](q, k, v, g, beta, do, c_start, c_len, X, hs, dhs, vn, dvn, dq, dk, dv, dg, db,
                            *sc, sA, sL, sb, scale, H, K=K, V=V, SPAN=_SPAN, **prec)
    return dq, dk, dv, dg, db, dh0


class KDAChunkTritonFunction(torch.autograd.Function):
    """Triton forward (:func:`kda_chunk_triton_fwd`) and Triton backward (:func:`kda_chunk_triton_bwd`).
    Saves the inputs only; the backward recomputes the chunk quantities and states."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, cu_seqlens, checkpoint_positions):
        o, ht, ck = kda_chunk_triton_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                         output_final_state=True, cu_seqlens=cu_seqlens,
                                         checkpoint_positions=checkpoint_positions)
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.scale, ctx.cu_seqlens = scale, cu_seqlens
        ctx.set_materialize_grads(False)
        if ck is None:
            ck = q.new_empty(0)
        ctx.mark_non_differentiable(ck)
        return o, ht, ck

    @staticmethod
    def backward(ctx, do, dht, _dck):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        dq, dk, dv, dg, db, dh0 = kda_chunk_triton_bwd(do, dht, q, k, v, g, beta, scale=ctx.scale,
                                                       initial_state=h0, cu_seqlens=ctx.cu_seqlens)
        need = ctx.needs_input_grad
        res = [x if n else None for x, n in zip((dq, dk, dv, dg, db), need)]
        res.append(dh0.to(h0.dtype) if h0 is not None and need[5] else None)
        return (*res, None, None, None)


def kda_chunk_triton_autograd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                              cu_seqlens=None, checkpoint_positions=None):
    """The Triton ``kda_chunk`` with the Triton backward (:class:`KDAChunkTritonFunction`).
    Without grad this is the plain Triton forward."""
    from .chunk_torch import kda_chunk_triton

    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    if not grad:
        return kda_chunk_triton(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                checkpoint_positions=checkpoint_positions)
    o, ht, ck = KDAChunkTritonFunction.apply(q, k, v, g, beta, initial_state, scale, cu_seqlens,
                                             checkpoint_positions)
    res = (o, ht if output_final_state else None)
    if checkpoint_positions is not None:
        res = res + (ck,)
    return res
