"""Fused MoE in Triton: grouped GEMMs over expert-sorted tokens, bf16/fp16/fp32 or MXFP4 expert weights.

Pipeline (all on device, no host sync)::

    align   topk_ids → sorted flat ids padded per expert to BLOCK_M, one expert id per block   (align.py;
            one launch for decode-sized batches)
    up      h[r]  = act(x[tok(r)] W1_eᵀ, x[tok(r)] W3_eᵀ)   rows r in sorted order; SiLU/SiTU in the epilogue
    down    y[f]  = h[r] W2_eᵀ                              scattered back to flat id f = token·k + slot
    final   out[t] = Σ_j w[t,j] y[t,j]  (+ RMSNorm · gain for the latent tail: deferred finalization)

MXFP4 weights (packed u8 [E, N, K/2], E8M0 scale u8 [E, N, K/32]) are decoded in-kernel (Hopper has no FP4
MMA). Default for bf16/fp16 activations: ``tl.dot_scaled`` (the compiler's E2M1 upcast; note its E8M0 byte 0
decodes as 0 instead of 2^-127, i.e. weights below 1e-37 flush to zero). fp32 activations, or
``mx_mode="split"``: a hand-written decode (nibbles → E2M1 bits → fp32 × 2^(s−127), exact for every scale)
feeding two dots per tile (even / odd k). Static SASS count on sm_90 (loop body, per packed weight byte):
≈12–14 instructions for ``scaled``, ≈40 for ``split`` — the decode is issue-bound below the HBM rate.
Routing weights are applied late (after W2), as K3's SiTU contract requires.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from ...quant.mxfp4 import MXFP4Weight
from ..pdl import gdc_launch_dependents, gdc_wait, pdl_launch
from ..registry import autotune_prune, current_tuning
from ..tuning_cache import AUTOTUNE_KW
from .align import MoEAlignment, align_for
from .triton_common import _act, _e2m1_to_f32

__all__ = ["fused_expert_outputs", "fused_moe_experts", "moe_finalize_triton", "pick_block_m", "block_m_for",
           "step_token_counts", "use_gemv"]

log = logging.getLogger(__name__)
_INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
#: MXFP4 decode: "scaled" = tl.dot_scaled (the compiler's E2M1 upcast; fp16/bf16 activations), "split" =
#: even/odd-k halves decoded by hand (two dots per tile), "join" = nibbles interleaved in registers; the
#: ``mx_mode`` argument of :func:`fused_expert_outputs` picks one for a call
MX_MODES = {"join": 0, "split": 1, "scaled": 2}
MX_DEFAULT = "scaled"
# MXFP4 with at most ``KernelTuning.moe_gemv_pairs`` (token, slot) pairs (default 64) and no explicit
# ``mx_mode``: the CUDA-core weight-streaming GEMV (triton_mx_gemv.py) instead of the grouped tensor-core GEMMs.
# At K3 shapes, top-16, the word-decode GEMV is faster than the grouped kernel up to 4 tokens (64 pairs); at 16
# tokens (256 pairs) the grouped kernel is faster (docs/perf.md). (The end-to-end first-step logits of k3_slice
# differ from eager by 0.1-0.6 in bf16 with or without the GEMV: MoE routing flips on near-tied router scores,
# bench/gpu/diag_decode.py; the op agrees with eager to 4e-3.) 0 turns it off.
# ``KernelTuning.moe_cuda_gemv_pairs`` (default 1024): the same limit for the CUDA GEMV (cuda_mx_gemv), which is
# faster than the grouped kernel up to 64 tokens (1024 pairs: 0.95× its time; 0.61× at 512 pairs; docs/perf.md).
# ``KernelTuning.moe_gemv`` (read at each call) picks the implementation of that GEMV: "auto" (the default: the
# CUDA GEMV where it builds and takes the inputs, else the Triton one, silently), "triton" (triton_mx_gemv) or
# "cuda" (cuda_mx_gemv; where it is unavailable or does not take the inputs — no GPU/nvcc, fp32 activations,
# misaligned weights — one warning and the Triton GEMV). "auto" prefers the CUDA GEMV because it streams the
# touched experts' weights faster than the Triton one at every decode size (docs/perf.md).


def gemv_impl() -> str:
    """The MXFP4 decode GEMV implementation in force: ``KernelTuning.moe_gemv`` (default "auto")."""
    return current_tuning().moe_gemv


_CUDA_GEMV_WARNED: set[str] = set()


def _cuda_gemv_possible() -> bool:
    """Whether the decode GEMV would try the CUDA kernel (requested or ``auto``, and it can be built here)."""
    if gemv_impl() == "triton":
        return False
    from . import cuda_mx_gemv as cm

    return cm.available() is None and (cm.DEFAULT_CONFIG.decode == 0 or torch.cuda.get_device_capability() >= (8, 9))


def _use_cuda_gemv(x, w1, w3, w2, num_pairs: int, num_experts: int) -> bool:
    """Whether this GEMV call runs the CUDA kernel (requested or ``auto``, and it takes these inputs)."""
    impl = gemv_impl()
    if impl == "triton":
        return False
    from . import cuda_mx_gemv as cm

    why = cm.available() or cm.supports(x, w1, w3, w2, block_m=cm.cuda_block_m(num_pairs, num_experts))
    if why and impl == "cuda" and why not in _CUDA_GEMV_WARNED:
        _CUDA_GEMV_WARNED.add(why)
        log.warning("fused MoE: KernelTuning.moe_gemv='cuda' but the CUDA GEMV cannot run here (%s); using the "
                    "Triton GEMV", why)
    return why is None


_SCALED_BROKEN = False


def _mx_mode(dtype: torch.dtype, mode: str | None) -> int:
    m = MX_MODES[mode or MX_DEFAULT]
    if m == 2 and _SCALED_BROKEN:
        m = 1
    if m == 2 and dtype == torch.float32:  # dot_scaled takes bf16/fp16 activations only
        m = 1
    return m


_CONFIGS = {  # (BLOCK_N, BLOCK_K, warps, stages), per (kind, kernel); checked for register spills on sm_90
    ("small", "up"): ((64, 128, 4, 4), (128, 128, 8, 3), (64, 256, 4, 3)),  # BLOCK_M 16: weight-bandwidth bound
    ("small", "down"): ((128, 128, 4, 3), (64, 128, 4, 4), (128, 256, 8, 3)),
    ("mid", "up"): ((128, 64, 8, 3), (64, 128, 4, 3), (128, 64, 4, 4)),  # BLOCK_M 32 / 64
    ("mid", "down"): ((128, 64, 4, 4), (128, 64, 8, 3), (256, 64, 8, 3)),
    ("large", "up"): ((128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4)),  # BLOCK_M 128: compute bound
    ("large", "down"): ((128, 64, 8, 3), (256, 64, 8, 3), (128, 128, 8, 3)),
}


def _configs(kind: str, which: str):
    if _INTERP:
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    cfgs = _CONFIGS[(kind, which)]  # KernelTuning.autotune=False: the first only (autotune_prune)
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st) for bn, bk, w, st in cfgs]


@triton.jit
def _load_w_tile(w_ptr, s_ptr, e, offs_n, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
                 MXFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """Weight tile W_e[offs_n, offs_k] as [BLOCK_K, BLOCK_N] in DTYPE (decoding MXFP4 in registers)."""
    nmask = offs_n < N
    if MXFP4:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte columns of this K tile
        bmask = nmask[:, None] & (kb[None, :] < K // 2)
        byte = tl.load(w_ptr + e * stride_we + offs_n[:, None] * stride_wn + kb[None, :], mask=bmask, other=0)
        byte = byte.to(tl.int32)
        code = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_N, BLOCK_K))  # even k in the low nibble
        val = _e2m1_to_f32(code)
        kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        smask = nmask[:, None] & (kg[None, :] < K // 32)
        s = tl.load(s_ptr + e * stride_se + offs_n[:, None] * stride_sn + kg[None, :], mask=smask, other=127)
        s = s.to(tl.int32)
        sbits = tl.where(s == 255, 0x7FC00000, tl.where(s == 0, 1 << 22, s << 23))
        sc = sbits.to(tl.float32, bitcast=True)  # [BN, BK/32]
        val = tl.reshape(tl.reshape(val, (BLOCK_N, BLOCK_K // 32, 32)) * sc[:, :, None], (BLOCK_N, BLOCK_K))
        tile = tl.trans(val.to(DTYPE))
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
                       mask=nmask[None, :] & (offs_k[:, None] < K), other=0.0)
    return tile


@triton.jit
def _mx_split_tiles(w_ptr, s_ptr, e, offs_n, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """MXFP4 tile as two [BLOCK_K/2, BLOCK_N] halves: even k (low nibbles) and odd k (high nibbles), scaled."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    nmask = offs_n < N
    m = nmask[None, :] & (kb[:, None] < K // 2)
    byte = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + kb[:, None], mask=m, other=0).to(tl.int32)
    s = tl.load(s_ptr + e * stride_se + offs_n[None, :] * stride_sn + kb[:, None] // 16, mask=m, other=127)
    s = s.to(tl.int32)
    sc = tl.where(s == 255, 0x7FC00000, tl.where(s == 0, 1 << 22, s << 23)).to(tl.float32, bitcast=True)
    lo = _e2m1_to_f32(byte & 15) * sc
    hi = _e2m1_to_f32(byte >> 4) * sc
    return lo.to(DTYPE), hi.to(DTYPE)


@triton.jit
def _mx_packed_tiles(w_ptr, s_ptr, e, offs_n, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Raw MXFP4 operands for ``tl.dot_scaled``: bytes [BLOCK_K/2, BLOCK_N] (k-packed), scales [BLOCK_N, BLOCK_K/32]."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    nmask = offs_n < N
    byte = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + kb[:, None],
                   mask=nmask[None, :] & (kb[:, None] < K // 2), other=0)
    kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    sc = tl.load(s_ptr + e * stride_se + offs_n[:, None] * stride_sn + kg[None, :],
                 mask=nmask[:, None] & (kg[None, :] < K // 32), other=127)
    return byte, sc


@triton.jit
def _pid_mn(num_rows_ptr, NUM_BLOCKS, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    gsize = tl.minimum(NUM_BLOCKS - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % gsize
    pid_n = (pid % per_group) // gsize
    return pid_m, pid_n


def _make_up(kind):
    @triton.autotune(**AUTOTUNE_KW, configs=_configs(kind, "up"), prune_configs_by={"early_config_prune": autotune_prune},
                     key=["N", "K", "MXFP4", "MX_MODE", "BLOCK_M", "ACT"])
    @triton.jit(do_not_specialize=["NUM_BLOCKS", "num_pairs"])  # per-request counts: one compile for all
    def _moe_up(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, sorted_ptr, eid_ptr, num_rows_ptr,
                NUM_BLOCKS, N, K, top_k, num_pairs,
                stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                beta, linear_beta,
                ACT: tl.constexpr, CAP_UP: tl.constexpr, MXFP4: tl.constexpr, MX_MODE: tl.constexpr, AFMT: tl.constexpr, PREC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        pid_m, pid_n = _pid_mn(num_rows_ptr, NUM_BLOCKS, N, BLOCK_M, BLOCK_N, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
        e = tl.load(eid_ptr + pid_m).to(tl.int64)
        if e < 0:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        flat = tl.load(sorted_ptr + rows)
        valid = flat < num_pairs
        tok = (flat // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        DT = x_ptr.dtype.element_ty
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if MXFP4 and MX_MODE == 2:  # tl.dot_scaled: the compiler's own E2M1 upcast
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(x_ptr + tok[:, None] * stride_xm + offs_k[None, :],
                            mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
                b1, sc1 = _mx_packed_tiles(w1_ptr, s1_ptr, e, offs_n, k0, N, K, stride_we, stride_wn, stride_se,
                                           stride_sn, BLOCK_N, BLOCK_K)
                acc_g = tl.dot_scaled(a, None, AFMT, b1, sc1, "e2m1", acc_g)
                b3, sc3 = _mx_packed_tiles(w3_ptr, s3_ptr, e, offs_n, k0, N, K, stride_we, stride_wn, stride_se,
                                           stride_sn, BLOCK_N, BLOCK_K)
                acc_u = tl.dot_scaled(a, None, AFMT, b3, sc3, "e2m1", acc_u)
            elif MXFP4 and MX_MODE == 1:  # even/odd k halves: no nibble interleave in registers
                kh = k0 + 2 * tl.arange(0, BLOCK_K // 2)
                am = valid[:, None] & (kh[None, :] < K)
                a0 = tl.load(x_ptr + tok[:, None] * stride_xm + kh[None, :], mask=am, other=0.0)
                a1 = tl.load(x_ptr + tok[:, None] * stride_xm + kh[None, :] + 1, mask=am, other=0.0)
                lo, hi = _mx_split_tiles(w1_ptr, s1_ptr, e, offs_n, k0, N, K, stride_we, stride_wn, stride_se,
                                         stride_sn, BLOCK_N, BLOCK_K, DT)
                acc_g = tl.dot(a1, hi, tl.dot(a0, lo, acc_g, input_precision=PREC), input_precision=PREC)
                lo, hi = _mx_split_tiles(w3_ptr, s3_ptr, e, offs_n, k0, N, K, stride_we, stride_wn, stride_se,
                                         stride_sn, BLOCK_N, BLOCK_K, DT)
                acc_u = tl.dot(a1, hi, tl.dot(a0, lo, acc_u, input_precision=PREC), input_precision=PREC)
            else:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(x_ptr + tok[:, None] * stride_xm + offs_k[None, :],
                            mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
                b1 = _load_w_tile(w1_ptr, s1_ptr, e, offs_n, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
                                  MXFP4, BLOCK_N, BLOCK_K, DT)
                acc_g = tl.dot(a, b1, acc_g, input_precision=PREC)
                b3 = _load_w_tile(w3_ptr, s3_ptr, e, offs_n, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
                                  MXFP4, BLOCK_N, BLOCK_K, DT)
                acc_u = tl.dot(a, b3, acc_u, input_precision=PREC)
        h = _act(acc_g, acc_u, ACT, beta, linear_beta, CAP_UP)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_n[None, :], h.to(DT),
                 mask=(offs_n[None, :] < N))

    return _moe_up


def _make_down(kind):
    @triton.autotune(**AUTOTUNE_KW, configs=_configs(kind, "down"), prune_configs_by={"early_config_prune": autotune_prune},
                     key=["N", "K", "MXFP4", "MX_MODE", "BLOCK_M"])
    @triton.jit(do_not_specialize=["NUM_BLOCKS", "num_pairs"])
    def _moe_down(h_ptr, w_ptr, s_ptr, y_ptr, sorted_ptr, eid_ptr, num_rows_ptr,
                  NUM_BLOCKS, N, K, num_pairs,
                  stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                  MXFP4: tl.constexpr, MX_MODE: tl.constexpr, AFMT: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        pid_m, pid_n = _pid_mn(num_rows_ptr, NUM_BLOCKS, N, BLOCK_M, BLOCK_N, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
        e = tl.load(eid_ptr + pid_m).to(tl.int64)
        if e < 0:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        flat = tl.load(sorted_ptr + rows)
        valid = flat < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        DT = h_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        hrow = h_ptr + rows[:, None].to(tl.int64) * stride_hm
        for k0 in range(0, K, BLOCK_K):
            if MXFP4 and MX_MODE == 2:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(hrow + offs_k[None, :], mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
                b, sc = _mx_packed_tiles(w_ptr, s_ptr, e, offs_n, k0, N, K, stride_we, stride_wn, stride_se,
                                         stride_sn, BLOCK_N, BLOCK_K)
                acc = tl.dot_scaled(a, None, AFMT, b, sc, "e2m1", acc)
            elif MXFP4 and MX_MODE == 1:
                kh = k0 + 2 * tl.arange(0, BLOCK_K // 2)
                am = valid[:, None] & (kh[None, :] < K)
                a0 = tl.load(hrow + kh[None, :], mask=am, other=0.0)
                a1 = tl.load(hrow + kh[None, :] + 1, mask=am, other=0.0)
                lo, hi = _mx_split_tiles(w_ptr, s_ptr, e, offs_n, k0, N, K, stride_we, stride_wn, stride_se,
                                         stride_sn, BLOCK_N, BLOCK_K, DT)
                acc = tl.dot(a1, hi, tl.dot(a0, lo, acc, input_precision=PREC), input_precision=PREC)
            else:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(hrow + offs_k[None, :], mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
                b = _load_w_tile(w_ptr, s_ptr, e, offs_n, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
                                 MXFP4, BLOCK_N, BLOCK_K, DT)
                acc = tl.dot(a, b, acc, input_precision=PREC)
        tl.store(y_ptr + flat[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(DT),
                 mask=valid[:, None] & (offs_n[None, :] < N))

    return _moe_down


_UP = {k: _make_up(k) for k in ("small", "mid", "large")}
_DOWN = {k: _make_down(k) for k in ("small", "mid", "large")}


@triton.jit
def _finalize_kernel(y_ptr, w_ptr, g_ptr, out_ptr, D, stride_yt, stride_yk, stride_wt, stride_ot, eps,
                     K: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    # the K slots unrolled: their loads are independent and issue together (a loop over a run-time top_k waited
    # for each slot's load in turn: 9 µs for one token at K3's width, now one round trip)
    if PDL:  # launched as a programmatic dependent (kernels/pdl.py): no earlier kernel's data is read before this
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(K):
        wj = tl.load(w_ptr + t * stride_wt + j).to(tl.float32)
        acc += wj * tl.load(y_ptr + t * stride_yt + j * stride_yk + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:  # our loads are done: a programmatic dependent (a skinny GEMM) may start its weight prefetch
        gdc_launch_dependents()
    if HAS_NORM:
        r = 1.0 / tl.sqrt(tl.sum(acc * acc, 0) / D + eps)
        acc = acc * r * tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_finalize_triton(expert_out: torch.Tensor, topk_weights: torch.Tensor, norm_weight: torch.Tensor | None = None,
                        eps: float = 1e-5, out_dtype: torch.dtype | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, k, D] per-slot expert outputs → Σ_j w_j y_j (fp32 accumulate), then RMSNorm·gain if ``norm_weight``."""
    N, k, D = expert_out.shape
    y = expert_out if expert_out.stride(-1) == 1 else expert_out.contiguous()
    w = topk_weights if topk_weights.stride(-1) == 1 else topk_weights.contiguous()  # read as fp32 in the kernel
    if out is None:
        out = torch.empty(N, D, dtype=out_dtype or expert_out.dtype, device=expert_out.device)
    if N == 0:
        return out
    has_norm = norm_weight is not None
    block_d = triton.next_power_of_2(D) if has_norm else min(triton.next_power_of_2(D), 1024)
    grid = (N, triton.cdiv(D, block_d))
    _finalize_kernel[grid](y, w, norm_weight if has_norm else w, out, D, y.stride(0), y.stride(1), w.stride(0),
                           out.stride(0), eps, K=k, HAS_NORM=has_norm, BLOCK_D=block_d,
                           num_warps=min(32, max(4, block_d // 256)), **pdl_launch(y))
    return out


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    if _INTERP:
        return 16
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 24:
        return 16
    if per_expert <= 96:
        return 32
    if per_expert <= 384:
        return 64
    return 128


_GEMV_BROKEN = False


def use_gemv(num_pairs: int, mxfp4: bool, mx_mode: str | None = None) -> bool:
    """Whether ``fused_expert_outputs`` takes the decode GEMV (triton_mx_gemv) for this call."""
    if _GEMV_BROKEN and mx_mode != "gemv":
        return False
    if not mxfp4:
        return False
    if mx_mode == "gemv":
        return True
    t = current_tuning()
    limit = t.moe_cuda_gemv_pairs if _cuda_gemv_possible() else t.moe_gemv_pairs
    return mx_mode is None and num_pairs <= limit


def block_m_for(num_pairs: int, num_experts: int, mxfp4: bool, mx_mode: str | None = None) -> int:
    """The alignment block size ``fused_expert_outputs`` uses (pass a matching ``align`` to skip re-aligning)."""
    if use_gemv(num_pairs, mxfp4, mx_mode):
        if _cuda_gemv_possible():
            from . import cuda_mx_gemv as cm

            return cm.cuda_block_m(num_pairs, num_experts)
        from .triton_mx_gemv import gemv_block_m

        return gemv_block_m(num_pairs, num_experts)
    return pick_block_m(num_pairs, num_experts)


def step_token_counts(num_experts: int, top_k: int, mxfp4: bool, max_tokens: int) -> list[int]:
    """Token counts (≤ ``max_tokens``) of MoE steps that together meet every kernel specialisation a step of
    up to ``max_tokens`` tokens can bring: the first count of each distinct (GEMV or grouped GEMMs, alignment
    block size, one-launch or chunked alignment, power-of-two bucket of the pairs). Running one step of each
    compiles (and tunes) everything ``fused_expert_outputs`` will need; what changes between two counts of one
    class are launch arguments only."""
    from .align import ONE_LAUNCH_PAIRS

    seen: set = set()
    counts = []
    for t in range(1, int(max_tokens) + 1):
        P = t * top_k
        key = (use_gemv(P, mxfp4), block_m_for(P, num_experts, mxfp4), P <= ONE_LAUNCH_PAIRS,
               triton.next_power_of_2(P))
        if key not in seen:
            seen.add(key)
            counts.append(t)
    return counts


def _wparts(w):
    if isinstance(w, MXFP4Weight):
        return w.packed, w.scale, True
    return w, None, False


def fused_expert_outputs(x: torch.Tensor, w1, w3, w2, topk_ids: torch.Tensor, activation: str = "silu",
                         beta: float = 4.0, linear_beta: float | None = 25.0,
                         align: MoEAlignment | None = None, out: torch.Tensor | None = None,
                         mx_mode: str | None = None, gemv_cfg=None) -> torch.Tensor:
    """Per-slot expert outputs, unweighted: [N, k, D] with ``y[n, j] = E_{ids[n,j]}(x[n])`` in x.dtype.

    MXFP4 weights at decode sizes (``mx_mode="gemv"``, or no ``mx_mode`` and ≤ ``KernelTuning.moe_gemv_pairs``
    pairs) go to the weight-streaming GEMV (``triton_mx_gemv``, or ``cuda_mx_gemv`` per ``KernelTuning.moe_gemv``);
    ``gemv_cfg``: its (up, down) config pair."""
    N, D = x.shape
    k = topk_ids.shape[1]
    E, I = w1.shape[0], w1.shape[1]
    P = N * k
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(N, k, D, dtype=x.dtype, device=x.device) if out is None else out
    if P == 0:
        return y
    if mx_mode not in (None, "gemv") and mx_mode not in MX_MODES:
        raise ValueError(f"fused MoE: unknown mx_mode {mx_mode!r}")
    if use_gemv(P, isinstance(w1, MXFP4Weight), mx_mode):
        from .triton_mx_gemv import gemv_block_m, mx_gemv_experts

        cu, cd = gemv_cfg if gemv_cfg is not None else (None, None)
        if _use_cuda_gemv(x, w1, w3, w2, P, E):  # moe_gemv auto|cuda; build/launch errors propagate
            from .cuda_mx_gemv import CudaGemvConfig, cuda_block_m, mx_gemv_experts_cuda

            gbm = cuda_block_m(P, E)
            al = align if align is not None and align.block_m == gbm else align_for(topk_ids, E, gbm)
            cc = [c if isinstance(c, CudaGemvConfig) else None for c in (cu, cd)]
            mx_gemv_experts_cuda(x, w1, w3, w2, al, y.view(P, D), P, k, 0 if activation == "silu" else 1,
                                 linear_beta is not None, float(beta if beta is not None else 1.0),
                                 float(linear_beta if linear_beta is not None else 1.0), cc[0], cc[1])
            return y
        gbm = gemv_block_m(P, E)
        al = align if align is not None and align.block_m == gbm else align_for(topk_ids, E, gbm)
        try:
            mx_gemv_experts(x, w1, w3, w2, al, y.view(P, D), P, k, 0 if activation == "silu" else 1,
                            linear_beta is not None, float(beta if beta is not None else 1.0),
                            float(linear_beta if linear_beta is not None else 1.0), cu, cd)
            return y
        except Exception as err:  # a Triton build that cannot compile it: the grouped GEMMs, same contract
            if mx_mode == "gemv" or _INTERP or isinstance(err, ValueError):
                raise
            global _GEMV_BROKEN
            _GEMV_BROKEN = True
            log.warning("fused MoE: the MXFP4 decode GEMV failed (%s: %s); using the grouped GEMMs",
                        type(err).__name__, str(err).splitlines()[0] if str(err) else "")
    if mx_mode == "gemv":
        mx_mode = None
    bm = pick_block_m(P, E)
    al = align if align is not None and align.block_m == bm else align_for(topk_ids, E, bm)
    nb = al.expert_ids.numel()
    kind = "small" if bm <= 16 else ("mid" if bm <= 64 else "large")
    mx_mode = _mx_mode(x.dtype, mx_mode)
    afmt = "fp16" if x.dtype == torch.float16 else "bf16"
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays fp32 (no silent TF32)
    group_m = 1 if bm <= 16 else 8
    p1, s1, mx = _wparts(w1)
    p3, s3, _ = _wparts(w3)
    p2, s2, _ = _wparts(w2)
    for t in (p1, p3, p2):
        if t.stride(-1) != 1:
            raise ValueError("fused MoE: expert weights must be contiguous in their last dim")
    if p1.stride() != p3.stride() or (mx and s1.stride() != s3.stride()):
        raise ValueError("fused MoE: w1 and w3 must share strides")
    h = torch.empty(nb * bm, I, dtype=x.dtype, device=x.device)
    se1 = (s1.stride(0), s1.stride(1)) if mx else (0, 0)
    act = 0 if activation == "silu" else 1
    cap = linear_beta is not None
    se2 = (s2.stride(0), s2.stride(1)) if mx else (0, 0)
    y2 = y.view(P, D)
    grid_up = lambda meta: (nb * triton.cdiv(I, meta["BLOCK_N"]),)  # noqa: E731
    grid_dn = lambda meta: (nb * triton.cdiv(D, meta["BLOCK_N"]),)  # noqa: E731

    def launch(mode: int) -> None:
        _UP[kind][grid_up](x, p1, p3, s1 if mx else p1, s3 if mx else p3, h, al.sorted_ids, al.expert_ids,
                           al.num_rows, nb, I, D, k, P, x.stride(0), p1.stride(0), p1.stride(1), se1[0], se1[1],
                           h.stride(0), float(beta if beta is not None else 1.0), float(linear_beta if cap else 1.0),
                           ACT=act, CAP_UP=cap, MXFP4=mx, MX_MODE=mode, AFMT=afmt, PREC=prec, BLOCK_M=bm,
                           GROUP_M=group_m)
        _DOWN[kind][grid_dn](h, p2, s2 if mx else p2, y2, al.sorted_ids, al.expert_ids, al.num_rows,
                             nb, D, I, P, h.stride(0), p2.stride(0), p2.stride(1), se2[0], se2[1], y2.stride(0),
                             MXFP4=mx, MX_MODE=mode, AFMT=afmt, PREC=prec, BLOCK_M=bm, GROUP_M=group_m)

    if mx and mx_mode == 2 and not _INTERP:
        try:
            launch(2)
        except Exception as err:  # a Triton build whose dot_scaled cannot lower this: same numerics via "split"
            global _SCALED_BROKEN
            _SCALED_BROKEN = True
            log.warning("fused MoE: tl.dot_scaled failed to compile (%s: %s); using the 'split' MXFP4 decode",
                        type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            launch(1)
    else:
        launch(mx_mode)
    return y


def fused_moe_experts(x, w1, w3, w2, topk_ids, topk_weights, activation="silu", beta=4.0, linear_beta=25.0):
    """The ``triton`` backend of ``moe_experts``: fused expert outputs, then the weighted top-k reduction."""
    y = fused_expert_outputs(x, w1, w3, w2, topk_ids, activation, beta, linear_beta)
    return moe_finalize_triton(y, topk_weights, None, out_dtype=x.dtype)
