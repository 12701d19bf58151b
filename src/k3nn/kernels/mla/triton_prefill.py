"""Triton causal flash attention for MLA prefill on decompressed K/V (forward only).

One program takes ``BLOCK_M`` queries of one (sequence, head) and walks the keys in ``BLOCK_N`` tiles with an
online softmax in base 2 (log2 e folded into the scale); nothing of size ``[T, L]`` is ever formed. The score of
a tile is two products, ``q_nope · k_noneᵀ + q_rope · k_ropeᵀ``: the rope key is one row per token shared by every
head (MLA's MQA rope), read from its own ``[.., L, dr]`` tensor instead of being broadcast into each head.

Keys left of the block's first query (``j ≤ q_start + start_m``) are visible to every query of the block and run
without masks; only the tiles that cross the diagonal (and a key mask, when given) pay for the comparisons.
Query blocks are scheduled last-first, so the longest rows start first.

Masking matches :func:`k3nn.kernels.mla.prefill.mla_attention_reference`: query ``t`` sits at key index
``q_start + t``; key ``j`` is visible iff ``j ≤ q_start + t`` and (``key_mask[j]`` or ``j == q_start + t``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..precision import dot_precision
from ..registry import triton_interpreting

__all__ = ["mla_attention_triton", "default_config"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _tile(acc, m_i, l_i, q_n, q_r, kn_base, kr_base, v_base, km_base, start_n, qi, Lk,
          s_kn, s_kr, s_v, qk_scale,
          BLOCK_N: tl.constexpr, BDN: tl.constexpr, BDR: tl.constexpr, BDV: tl.constexpr,
          DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
          MASKED: tl.constexpr, HAS_KM: tl.constexpr, IEEE: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    dn = tl.arange(0, BDN)
    in_n = offs_n < Lk
    # the tile's first row in int64 (L · H · D passes 2^31 elements at K3 widths), rows within it in int32
    n0 = tl.cast(start_n, tl.int64)
    rn = tl.arange(0, BLOCK_N)
    kn_base = kn_base + n0 * s_kn
    kr_base = kr_base + n0 * s_kr
    v_base = v_base + n0 * s_v
    if MASKED or BDN != DN:
        kn = tl.load(kn_base + rn[:, None] * s_kn + dn[None, :], mask=in_n[:, None] & (dn[None, :] < DN),
                     other=0.0)
    else:
        kn = tl.load(kn_base + rn[:, None] * s_kn + dn[None, :])
    if IEEE:
        s = tl.dot(q_n, tl.trans(kn), input_precision="ieee")
    else:
        s = tl.dot(q_n, tl.trans(kn))
    if DR > 0:
        dr = tl.arange(0, BDR)
        if MASKED or BDR != DR:
            kr = tl.load(kr_base + rn[:, None] * s_kr + dr[None, :],
                         mask=in_n[:, None] & (dr[None, :] < DR), other=0.0)
        else:
            kr = tl.load(kr_base + rn[:, None] * s_kr + dr[None, :])
        if IEEE:
            s += tl.dot(q_r, tl.trans(kr), input_precision="ieee")
        else:
            s += tl.dot(q_r, tl.trans(kr))
    # scores stay unscaled; the row max is kept in scaled base-2 units so p = exp2(s·scale − m) is one FMA + exp2
    if MASKED or HAS_KM:
        vis = in_n[None, :]
        if MASKED:
            vis = vis & (offs_n[None, :] <= qi[:, None])
        if HAS_KM:
            km = tl.load(km_base + offs_n, mask=in_n, other=0)
            vis = vis & ((km[None, :] != 0) | (offs_n[None, :] == qi[:, None]))
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
    p = tl.math.exp2(s * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    dv = tl.arange(0, BDV)
    if MASKED or BDV != DV:
        v = tl.load(v_base + rn[:, None] * s_v + dv[None, :], mask=in_n[:, None] & (dv[None, :] < DV), other=0.0)
    else:
        v = tl.load(v_base + rn[:, None] * s_v + dv[None, :])
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


# per-request lengths, and the strides that scale with them (batch strides, the key mask's row stride = L): one
# compile for every length, whatever its divisibility
@triton.jit(do_not_specialize=["T", "L", "s_qn_b", "s_qr_b", "s_kn_b", "s_kr_b", "s_v_b", "s_o_b", "s_lse_b",
                               "s_km_b"])
def _mla_attn_fwd(Qn, Qr, Kn, Kr, V, O, LSE, KM, CUQ, CUK, QS,
                  s_qn_b, s_qn_t, s_qn_h, s_qr_b, s_qr_t, s_qr_h,
                  s_kn_b, s_kn_l, s_kn_h, s_kr_b, s_kr_l,
                  s_v_b, s_v_l, s_v_h, s_o_b, s_o_t, s_o_h, s_lse_b, s_lse_t, s_km_b,
                  T, L, H, qk_scale,
                  DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
                  BDN: tl.constexpr, BDR: tl.constexpr, BDV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  VARLEN: tl.constexpr, HAS_KM: tl.constexpr, STORE_LSE: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    if VARLEN:
        q0 = tl.load(CUQ + b).to(tl.int64)
        Tq = (tl.load(CUQ + b + 1) - q0).to(tl.int32)
        k0 = tl.load(CUK + b).to(tl.int64)
        Lk = (tl.load(CUK + b + 1) - k0).to(tl.int32)
        q_start = Lk - Tq
        bq = 0
    else:
        q0 = 0
        k0 = 0
        Tq = T
        Lk = L
        q_start = tl.load(QS + b)
        bq = b.to(tl.int64)
    num_m = tl.cdiv(Tq, BLOCK_M)
    if pid_m >= num_m:
        return
    start_m = (num_m - 1 - pid_m) * BLOCK_M  # the longest rows first
    offs_m = start_m + tl.arange(0, BLOCK_M)
    in_m = offs_m < Tq
    rows = q0 + offs_m.to(tl.int64)
    qi = q_start + offs_m  # each query's own key index
    dn = tl.arange(0, BDN)
    q_n = tl.load(Qn + bq * s_qn_b + h * s_qn_h + rows[:, None] * s_qn_t + dn[None, :],
                  mask=in_m[:, None] & (dn[None, :] < DN), other=0.0)
    if DR > 0:
        dr = tl.arange(0, BDR)
        q_r = tl.load(Qr + bq * s_qr_b + h * s_qr_h + rows[:, None] * s_qr_t + dr[None, :],
                      mask=in_m[:, None] & (dr[None, :] < DR), other=0.0)
    else:
        q_r = q_n  # unused
    kn_base = Kn + bq * s_kn_b + h.to(tl.int64) * s_kn_h + k0 * s_kn_l
    kr_base = Kr + bq * s_kr_b + k0 * s_kr_l
    v_base = V + bq * s_v_b + h.to(tl.int64) * s_v_h + k0 * s_v_l
    km_base = KM + bq * s_km_b

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BDV], dtype=tl.float32)
    # keys [0, full) are visible to every query of the block (and inside [0, Lk)): no causal masks there
    hi = tl.minimum(Lk, q_start + start_m + BLOCK_M)
    full = tl.maximum(tl.minimum(q_start + start_m + 1, Lk), 0) // BLOCK_N * BLOCK_N
    hi = tl.maximum(hi, full)
    for start_n in range(0, full, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q_n, q_r, kn_base, kr_base, v_base, km_base, start_n, qi, Lk,
                              s_kn_l, s_kr_l, s_v_l, qk_scale, BLOCK_N, BDN, BDR, BDV, DN, DR, DV,
                              False, HAS_KM, IEEE)
    for start_n in range(full, hi, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q_n, q_r, kn_base, kr_base, v_base, km_base, start_n, qi, Lk,
                              s_kn_l, s_kr_l, s_v_l, qk_scale, BLOCK_N, BDN, BDR, BDV, DN, DR, DV,
                              True, HAS_KM, IEEE)
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    dv = tl.arange(0, BDV)
    tl.store(O + bq * s_o_b + h * s_o_h + rows[:, None] * s_o_t + dv[None, :], o.to(O.dtype.element_ty),
             mask=in_m[:, None] & (dv[None, :] < DV))
    if STORE_LSE:
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        tl.store(LSE + bq * s_lse_b + h + rows * s_lse_t, lse, mask=in_m)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(max(int(n), 1)))


def default_config(dn: int, dr: int, dv: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for these head dims: one tile per call, no autotuning (a first
    call must not pay for a sweep; ``bench/gpu/mla_prefill.py`` measures the candidates)."""
    if triton_interpreting():
        return 16, 16, 4, 1
    wide = _pow2(dn) + _pow2(dr) > 256 or _pow2(dv) > 128 or dtype == torch.float32
    if wide:
        return 64, 64, 4, 2
    return 128, 64, 8, 3


def mla_attention_triton(q_nope: torch.Tensor, q_rope: torch.Tensor | None, k_nope: torch.Tensor,
                         k_rope: torch.Tensor | None, v: torch.Tensor, scale: float, q_start: int | None = None,
                         key_mask: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                         cu_seqlens_k: torch.Tensor | None = None, max_seqlen: int | None = None,
                         return_lse: bool = False, config: tuple[int, int, int, int] | None = None,
                         out: tuple[torch.Tensor, torch.Tensor | None] | None = None):
    """See :func:`k3nn.ops.mla_attention` for the contract (arguments already validated there). ``config``:
    (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of :func:`default_config`; ``out``: preallocated
    ``(o, lse or None)`` to write into."""
    B, T, H, DN = q_nope.shape
    L = k_nope.shape[1]
    DV = v.shape[-1]
    DR = 0 if q_rope is None else q_rope.shape[-1]
    if out is not None:
        o, lse = out[0], (out[1] if return_lse else out[0])
    else:
        o = torch.empty(B, T, H, DV, dtype=v.dtype, device=v.device)
        lse = torch.empty(B, T, H, dtype=torch.float32, device=v.device) if return_lse else o
    bm, bn, warps, stages = config or default_config(DN, DR, DV, q_nope.dtype)
    ieee = dot_precision(q_nope.dtype) == "ieee"  # fp32 products follow torch's TF32 setting, read per call
    varlen = cu_seqlens is not None
    if varlen:
        cuq = cu_seqlens.to(torch.int32)
        cuk = cuq if cu_seqlens_k is None else cu_seqlens_k.to(torch.int32)
        n_seq = cuq.numel() - 1
        if max_seqlen is None:
            max_seqlen = int((cuq[1:] - cuq[:-1]).max()) if n_seq else 0
        grid = (triton.cdiv(max(max_seqlen, 1), bm), n_seq * H)
    else:
        cuq = cuk = o  # unused
        grid = (triton.cdiv(T, bm), B * H)
    if q_start is None or not isinstance(q_start, torch.Tensor):
        qs = torch.full((B,), L - T if q_start is None else int(q_start), dtype=torch.int32, device=v.device)
    else:
        qs = q_start.to(device=v.device, dtype=torch.int32)
    qr = q_nope if q_rope is None else q_rope
    kr = k_nope if k_rope is None else k_rope
    km = o if key_mask is None else key_mask
    if key_mask is not None and key_mask.dtype == torch.bool:
        km = key_mask.view(torch.uint8)
    if grid[0] * grid[1] == 0:
        return (o, lse) if return_lse else o
    _mla_attn_fwd[grid](
        q_nope, qr, k_nope, kr, v, o, lse, km, cuq, cuk, qs,
        q_nope.stride(0), q_nope.stride(1), q_nope.stride(2), qr.stride(0), qr.stride(1), qr.stride(2),
        k_nope.stride(0), k_nope.stride(1), k_nope.stride(2), kr.stride(0), kr.stride(1),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        lse.stride(0) if return_lse else 0, lse.stride(1) if return_lse else 0,
        km.stride(0) if key_mask is not None else 0,
        T, L, H, float(scale) * _LOG2E,
        DN=DN, DR=DR, DV=DV, BDN=_pow2(DN), BDR=_pow2(DR) if DR else 16, BDV=_pow2(DV),
        BLOCK_M=bm, BLOCK_N=bn, VARLEN=varlen, HAS_KM=key_mask is not None, STORE_LSE=return_lse, IEEE=ieee,
        num_warps=warps, num_stages=stages)
    return (o, lse) if return_lse else o
