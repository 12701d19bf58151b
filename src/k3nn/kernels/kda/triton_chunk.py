"""Triton chunked KDA forward (chunk 64), varlen, fp32 states and in-pass checkpoint export.

Two kernels per call:

1. ``_kda_intra`` (grid: chunks × heads, fully parallel). Per 64-token chunk, with ``G`` the chunk-local
   cumulative log decay (fp32, in registers only):

   * ``Aqk[i, j] = scale · Σ_d q_id k_jd e^{G_id − G_jd}`` (j ≤ i) and ``L[i, j] = β_i Σ_d k_id k_jd e^{G_id − G_jd}``
     (j < i), computed per 16-row strip ``s`` with the strip's first row ``c_s = G_{16s}`` as reference:
     row factor ``e^{G_i − c_s} ≤ 1``, column factor ``e^{c_s − G_j}`` (≤ 1 for earlier strips, ≥ 1 only
     inside the diagonal 16×16 block). When the decay across the diagonal block exceeds ``_SPAN`` nats
     (only the unbounded softplus gate gets there; K3's bounded gate spans ≤ 75) that block is recomputed
     pairwise with ``e^{G_i − G_j} ≤ 1``, so no factor can overflow for any gate ≤ 0.
   * ``X = (I + L)⁻¹`` by forward substitution on the four diagonal 16×16 blocks, merged blockwise.
   * ``w = X (β ⊙ k ⊙ e^G)``, ``u = X (β ⊙ v)``, ``qg = scale · q ⊙ e^G``, ``kg = k ⊙ e^{G_last − G}``.

2. ``_kda_recur`` (grid: sequences × heads × V blocks). Walks the chunks of one sequence with the state
   ``h [K, BV]`` in fp32 registers: ``v' = u − w h``, ``o = qg h + Aqk v'``, ``h ← e^{G_last} ⊙ h + kgᵀ v'``.
   Output is written here (no per-chunk state round trip through memory). Chunk boundaries are every 64
   tokens from each sequence start *and* at every requested checkpoint position, so a checkpoint is just
   the state at a chunk start, stored by the same kernel (masked store; no second pass).

Inputs must satisfy ``g ≤ 0`` (a log decay; both Kimi gates do). bf16/fp16 inputs use tensor-core dots with
the state cast to the input dtype for ``w h`` / ``qg h`` (fla does the same); fp32 inputs stay fp32 (TF32
dots on the GPU).
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl

from ..registry import triton_interpreting, triton_ready
from .api import normalise_checkpoints, seq_lengths

__all__ = ["kda_chunk_triton_fwd", "build_chunk_plan", "supports_kda_chunk"]

BT = 64  # chunk
BC = 16  # sub-chunk (strip)
_SPAN = 80.0  # nats of decay across a diagonal 16-block above which it is recomputed pairwise


def _interp() -> bool:
    return triton_interpreting()


def _intra_configs():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return [triton.Config({}, num_warps=4)]
    cfgs = [triton.Config({}, num_warps=w, num_stages=1) for w in (4, 8)]
    if "maxnreg" in inspect.signature(triton.Config.__init__).parameters:
        # 8 warps need ~240 registers (one CTA per SM); capped at 128 ptxas spills ~120 bytes and two CTAs fit
        cfgs.append(triton.Config({}, num_warps=8, num_stages=1, maxnreg=128))
    return cfgs


def _recur_configs(stages=(2, 3)):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return [triton.Config({"BV": 32}, num_warps=4)]
    cfgs = [triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv in (32, 64) for w in (4, 8) for s in stages]
    # BV 16: four times the programs of BV 64, for few heads (the chunk loop is sequential per program)
    return cfgs + [triton.Config({"BV": 16}, num_warps=4, num_stages=s) for s in stages]


@triton.jit
def _inv16(L_ptr, off: tl.constexpr):
    """(I + L_bb)⁻¹ for the diagonal 16×16 block at rows/cols ``off`` of a 64×64 strictly lower L (row-major).

    Forward substitution, unrolled, entirely in registers: the block is loaded once (transposed, so that row i
    of L comes out indexed along X's row axis by a masked reduction)."""
    r = tl.arange(0, 16)
    LT = tl.load(L_ptr + (off + r)[None, :] * 64 + off + r[:, None])  # LT[j, i] = L[i, j]
    X = (r[:, None] == r[None, :]).to(tl.float32)
    for i in tl.static_range(1, 16):
        a = tl.sum(tl.where(r[None, :] == i, LT, 0.0), 1)  # a[j] = L[i, j] (0 for j >= i)
        new = -tl.sum(a[:, None] * X, 0)
        new = tl.where(r == i, 1.0, new)
        X = tl.where(r[:, None] == i, new[None, :], X)
    return X


@triton.jit
def _blk(L_ptr, ro: tl.constexpr, co: tl.constexpr):
    r = tl.arange(0, 16)
    return tl.load(L_ptr + (ro + r)[:, None] * 64 + co + r[None, :])


@triton.jit
def _put(X_ptr, ro: tl.constexpr, co: tl.constexpr, x):
    r = tl.arange(0, 16)
    tl.store(X_ptr + (ro + r)[:, None] * 64 + co + r[None, :], x)


@triton.jit
def _strip(q, k, g, bos, pid_h, H, L, kb, s: tl.constexpr, K: tl.constexpr, BKB: tl.constexpr, SPAN: tl.constexpr):
    """Contribution of key channels [kb, kb + BKB) to rows 16s..16s+15 of Akk (unscaled, all 64 columns) and
    of Aqk; the reference is the strip's first row, the diagonal block pairwise when its decay is too wide."""
    r64 = tl.arange(0, 64)
    r16 = tl.arange(0, 16)
    rk = kb + tl.arange(0, BKB)
    mk = rk < K
    mrow = r64 < L
    tok = (bos + r64).to(tl.int64)
    offk = (tok * H + pid_h)[:, None] * K + rk[None, :]
    G = tl.cumsum(tl.load(g + offk, mask=mrow[:, None] & mk[None, :], other=0.0).to(tl.float32), 0)
    k_all = tl.load(k + offk, mask=mrow[:, None] & mk[None, :], other=0.0).to(tl.float32)
    rs = s * 16 + r16
    ms2 = (rs < L)[:, None] & mk[None, :]
    offs = ((bos + rs).to(tl.int64) * H + pid_h)[:, None] * K + rk[None, :]
    g_s = tl.load(g + offs, mask=ms2, other=0.0).to(tl.float32)
    pre = tl.sum(tl.where(r64[:, None] == s * 16 - 1, G, 0.0), 0)  # G at the row before the strip
    G_s = tl.cumsum(g_s, 0) + pre[None, :]
    c = tl.sum(tl.where(r16[:, None] == 0, G_s, 0.0), 0)
    q_s = tl.load(q + offs, mask=ms2, other=0.0).to(tl.float32)
    k_s = tl.load(k + offs, mask=ms2, other=0.0).to(tl.float32)
    ef = tl.exp(G_s - c[None, :])
    ex = tl.where(r64[:, None] < (s + 1) * 16, tl.minimum(c[None, :] - G, SPAN), -float("inf"))
    kc = k_all * tl.exp(ex)
    cA = tl.dot(k_s * ef, tl.trans(kc))
    cQ = tl.dot(q_s * ef, tl.trans(kc))
    span = tl.max(tl.max(c[None, :] - G_s, 1), 0)
    if span > SPAN:
        # pairwise exact diagonal block: e^{G_i - G_j} <= 1 for j <= i, never overflows
        for j in range(16):
            sel = r16[:, None] == j
            kj = tl.sum(tl.where(sel, k_s, 0.0), 0)
            Gj = tl.sum(tl.where(sel, G_s, 0.0), 0)
            e = tl.exp(tl.minimum(G_s - Gj[None, :], 0.0))
            hit = r64[None, :] == s * 16 + j
            cA = tl.where(hit, tl.sum(k_s * kj[None, :] * e, 1)[:, None], cA)
            cQ = tl.where(hit, tl.sum(q_s * kj[None, :] * e, 1)[:, None], cQ)
    return cA, cQ


@triton.autotune(configs=_intra_configs(), key=["K", "V"])
@triton.jit
def _kda_intra(q, k, v, g, beta, chunk_start, chunk_len,
               qg_out, kg_out, w_out, u_out, A_out, egl_out, scratch,
               scale, H,
               K: tl.constexpr, V: tl.constexpr, BKB: tl.constexpr, BVB: tl.constexpr, SPAN: tl.constexpr):
    # Everything is blocked over key channels (BKB) and value channels (BVB): the decay is per channel, and
    # only sums over channels (the dots) couple them, so no [64, K] fp32 tile is ever live (no spills).
    pid_c = tl.program_id(0)
    pid_h = tl.program_id(1)
    bos = tl.load(chunk_start + pid_c)
    L = tl.load(chunk_len + pid_c)
    r64 = tl.arange(0, 64)
    mrow = r64 < L
    tok = (bos + r64).to(tl.int64)
    ob = (pid_c * H + pid_h).to(tl.int64)
    b_all = tl.load(beta + tok * H + pid_h, mask=mrow, other=0.0).to(tl.float32)

    # qg = scale·q·e^G, kg = k·e^{G_last − G}, e^{G_last}
    for kb in range(0, K, BKB):
        rk = kb + tl.arange(0, BKB)
        mk = rk < K
        m2 = mrow[:, None] & mk[None, :]
        offk = (tok * H + pid_h)[:, None] * K + rk[None, :]
        G = tl.cumsum(tl.load(g + offk, mask=m2, other=0.0).to(tl.float32), 0)
        Gl = tl.sum(tl.where(r64[:, None] == L - 1, G, 0.0), 0)
        o64k = ob * 64 * K + r64[:, None] * K + rk[None, :]
        okm = mk[None, :] & (r64[:, None] < 64)
        q_b = tl.load(q + offk, mask=m2, other=0.0).to(tl.float32)
        tl.store(qg_out + o64k, (q_b * tl.exp(G) * scale).to(qg_out.dtype.element_ty), mask=okm)
        k_b = tl.load(k + offk, mask=m2, other=0.0).to(tl.float32)
        tl.store(kg_out + o64k, (k_b * tl.exp(Gl[None, :] - G)).to(kg_out.dtype.element_ty), mask=okm)
        tl.store(egl_out + ob * K + rk, tl.exp(Gl), mask=mk)

    Lp = scratch + ob * 2 * 64 * 64
    Xp = Lp + 64 * 64
    Ap = A_out + ob * 64 * 64
    for s in tl.static_range(4):
        accA = tl.zeros([16, 64], dtype=tl.float32)
        accQ = tl.zeros([16, 64], dtype=tl.float32)
        for kb in range(0, K, BKB):
            cA, cQ = _strip(q, k, g, bos, pid_h, H, L, kb, s, K, BKB, SPAN)
            accA += cA
            accQ += cQ
        rs = s * 16 + tl.arange(0, 16)
        ms = rs < L
        b_s = tl.load(beta + (bos + rs).to(tl.int64) * H + pid_h, mask=ms, other=0.0).to(tl.float32)
        Lm = tl.where((r64[None, :] < rs[:, None]) & ms[:, None], accA * b_s[:, None], 0.0)
        Am = tl.where((r64[None, :] <= rs[:, None]) & ms[:, None], accQ * scale, 0.0)
        tl.store(Lp + rs[:, None] * 64 + r64[None, :], Lm)
        tl.store(Ap + rs[:, None] * 64 + r64[None, :], Am.to(A_out.dtype.element_ty))
    tl.debug_barrier()

    X00 = _inv16(Lp, 0)
    X11 = _inv16(Lp, 16)
    X22 = _inv16(Lp, 32)
    X33 = _inv16(Lp, 48)
    L10 = _blk(Lp, 16, 0)
    L20 = _blk(Lp, 32, 0)
    L21 = _blk(Lp, 32, 16)
    L30 = _blk(Lp, 48, 0)
    L31 = _blk(Lp, 48, 16)
    L32 = _blk(Lp, 48, 32)
    X10 = -tl.dot(X11, tl.dot(L10, X00, input_precision="ieee"), input_precision="ieee")
    X21 = -tl.dot(X22, tl.dot(L21, X11, input_precision="ieee"), input_precision="ieee")
    X20 = -tl.dot(X22, tl.dot(L20, X00, input_precision="ieee") + tl.dot(L21, X10, input_precision="ieee"),
                  input_precision="ieee")
    X32 = -tl.dot(X33, tl.dot(L32, X22, input_precision="ieee"), input_precision="ieee")
    X31 = -tl.dot(X33, tl.dot(L31, X11, input_precision="ieee") + tl.dot(L32, X21, input_precision="ieee"),
                  input_precision="ieee")
    X30 = -tl.dot(X33, tl.dot(L30, X00, input_precision="ieee") + tl.dot(L31, X10, input_precision="ieee")
                  + tl.dot(L32, X20, input_precision="ieee"), input_precision="ieee")
    _put(Xp, 0, 0, X00)
    _put(Xp, 16, 16, X11)
    _put(Xp, 32, 32, X22)
    _put(Xp, 48, 48, X33)
    _put(Xp, 16, 0, X10)
    _put(Xp, 32, 0, X20)
    _put(Xp, 32, 16, X21)
    _put(Xp, 48, 0, X30)
    _put(Xp, 48, 16, X31)
    _put(Xp, 48, 32, X32)
    tl.debug_barrier()
    X = tl.load(Xp + r64[:, None] * 64 + r64[None, :], mask=(r64[None, :] // 16) <= (r64[:, None] // 16),
                other=0.0)

    # w = X (β ⊙ k ⊙ e^G), u = X (β ⊙ v)
    for kb in range(0, K, BKB):
        rk = kb + tl.arange(0, BKB)
        mk = rk < K
        m2 = mrow[:, None] & mk[None, :]
        offk = (tok * H + pid_h)[:, None] * K + rk[None, :]
        G = tl.cumsum(tl.load(g + offk, mask=m2, other=0.0).to(tl.float32), 0)
        k_b = tl.load(k + offk, mask=m2, other=0.0).to(tl.float32)
        w = tl.dot(X, k_b * tl.exp(G) * b_all[:, None])
        tl.store(w_out + ob * 64 * K + r64[:, None] * K + rk[None, :], w.to(w_out.dtype.element_ty),
                 mask=mk[None, :] & (r64[:, None] < 64))
    for vb in range(0, V, BVB):
        rv = vb + tl.arange(0, BVB)
        mv = rv < V
        v_b = tl.load(v + (tok * H + pid_h)[:, None] * V + rv[None, :], mask=mrow[:, None] & mv[None, :],
                      other=0.0).to(tl.float32)
        u = tl.dot(X, v_b * b_all[:, None])
        tl.store(u_out + ob * 64 * V + r64[:, None] * V + rv[None, :], u.to(u_out.dtype.element_ty),
                 mask=mv[None, :] & (r64[:, None] < 64))


@triton.jit
def _kda_recur_kernel(qg, kg, w, u, A, egl, chunk_start, chunk_len, seq_lo, seq_hi, export_slot,
               o, h0, ht, ckpt, H,
               K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, HAS_CKPT: tl.constexpr):
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
        vn = b_u.to(tl.float32) - tl.dot(b_w, hb)
        vnb = vn.to(dt)
        # the state update first (the loop-carried chain), the output after it (nothing waits on it)
        h = h * b_e[:, None] + tl.dot(tl.trans(b_k), vnb)
        b_o = tl.dot(b_q, hb) + tl.dot(b_A, vnb)
        tok = (bos + r64).to(tl.int64)
        tl.store(o + (tok * H + pid_h)[:, None] * V + rv[None, :], b_o.to(o.dtype.element_ty),
                 mask=(r64[:, None] < L) & mv[None, :])
    if STORE_FINAL:
        tl.store(ht + soff, h, mask=mkv)


_kda_recur = triton.autotune(configs=_recur_configs(), key=["K", "V", "H"])(_kda_recur_kernel)
# fp32 operands: pipelined stages do not fit in shared memory, so a separate tuner without them
_kda_recur_f32 = triton.autotune(configs=_recur_configs((1,)), key=["K", "V", "H"])(_kda_recur_kernel)


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
    BVF = max(16, triton.next_power_of_2(V))
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=dev)
    need_final = output_final_state or _force_final or any(p == lengths[n] for n, p in ckpts)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if need_final else None
    ck = torch.empty(max(len(uniq), 1), H, K, V, dtype=torch.float32, device=dev) if ckpts else None
    if NC > 0:
        qg = torch.empty(NC, H, 64, K, dtype=dt, device=dev)
        kg = torch.empty_like(qg)
        w = torch.empty_like(qg)
        u = torch.empty(NC, H, 64, V, dtype=dt, device=dev)
        A = torch.empty(NC, H, 64, 64, dtype=dt, device=dev)
        egl = torch.empty(NC, H, K, dtype=torch.float32, device=dev)
        scratch = torch.empty(NC, H, 2, 64, 64, dtype=torch.float32, device=dev)
        _kda_intra[(NC, H)](q, k, v, g, beta, c_start, c_len, qg, kg, w, u, A, egl, scratch, scale, H,
                            K=K, V=V, BKB=min(32, BK), BVB=min(32, BVF), SPAN=_SPAN)
        h0 = initial_state.float().contiguous() if initial_state is not None else qg
        grid = lambda META: (N, H, triton.cdiv(V, META["BV"]))  # noqa: E731
        recur = _kda_recur_f32 if dt == torch.float32 else _kda_recur
        recur[grid](qg, kg, w, u, A, egl, c_start, c_len, s_lo, s_hi, slot,
                         o, h0, ht if ht is not None else qg, ck if ck is not None else qg, H,
                         K=K, V=V, BK=BK, HAS_INIT=initial_state is not None, STORE_FINAL=ht is not None,
                         HAS_CKPT=bool(ckpts))
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
