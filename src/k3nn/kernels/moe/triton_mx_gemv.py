"""MXFP4 expert GEMV for decode-sized batches: weight streaming on CUDA cores, no tensor cores.

At 1–16 tokens each touched expert sees 1–3 rows, so the expert GEMMs are a stream over the packed weights
(packed u8 [E, N, K/2], E8M0 scales u8 [E, N, K/32]) with almost no reuse. This kernel gives every program a
narrow output tile (``BLOCK_N`` weight rows) of one ``BM``-row block of the alignment (``align.py`` with
``block_m = BM``, 1, 2 or 4) and walks K in ``BLOCK_K`` steps; there are E_touched · blocks · N/BLOCK_N
programs, thousands at K3 shapes, so enough bytes are in flight without split-K.

Data flow per K step (one weight matrix; the up kernel does w1 and w3 together and shares the activations)::

    bytes  [BLOCK_N, SG, VEC] u8         VEC contiguous bytes per thread (one 16-byte load when VEC = 16),
                                          SG = BLOCK_K / (2·VEC) sub-groups; a scale group is 16 bytes
    lo/hi  nibbles → fp16 bit patterns → fp32, each value · 2^-14 (exact: E2M1 is a 2-bit-exponent float,
           placed in fp16's exponent/mantissa; code 1 is the fp16 subnormal 2^-15)
    part   Σ_VEC lo·a_even + hi·a_odd     per row, within the thread (FMA chain, no shuffles)
    acc   += part · 2^(s-113)              the scale (and the 2^14) once per sub-group and row;
                                          s > 240: · 2^14 · 2^(s-127) (two exact steps, no overflow)

and after the loop one cross-thread sum over SG. The epilogue applies the GLU activation (up: SiLU/SiTU,
``triton_common._act``) and stores h in the sorted row order, or (down) scatters y to flat pair ids — the
same buffers and contract as the grouped-GEMM kernels, which stay in use for prefill.

Scales decode exactly for every byte: 0 → 2^-127, 255 → NaN. ``DECODE=1`` uses the arithmetic E2M1 decode
of ``triton_fused`` instead of the fp16 bit pattern (an A/B switch for the GPU; same values).

``DECODE=2`` (word decode, ``_mx_gemv_words_kernel``) reads the packed bytes as 32-bit words, VEC/4 per thread
and sub-group, and builds two fp16 bit patterns per 32-bit lane with one mask/shift expression (bytes b0..b3
of a word hold elements 8i..8i+7, little-endian; e_t below is element 8i+t)::

    x0 = (w << 9 & 0x0E000E00) | (w << 12 & 0x80008000)    halves (e0, e4): low nibbles of b0, b2
    x1 = (w << 5 & 0x0E000E00) | (w <<  8 & 0x80008000)    (e1, e5): high nibbles of b0, b2
    x2 = (w << 1 & 0x0E000E00) | (w <<  4 & 0x80008000)    (e2, e6): low nibbles of b1, b3
    x3 = (w >> 3 & 0x0E000E00) | (w       & 0x80008000)    (e3, e7): high nibbles of b1, b3

then each half → fp16 → fp32 (the same value · 2^-14 as ``DECODE=0``), eight FMAs against the activations
a[8i+t] and the same per-sub-group scale step; about half the integer work per element of ``DECODE=0``. The
activations of a row are loaded once per K step for w1 and w3 together: eight stride-8 gathers, or with
``SPLIT_A`` one contiguous 2·VEC run per sub-group split into the eight phases in registers. Needs VEC ≥ 4 and
4-byte aligned rows (K/2 is a multiple of 16 for every MXFP4 matrix; a misaligned view falls back to
``DECODE=0``); the K tail is masked per word (exact, K is a multiple of 32).
``PREFETCH`` double-buffers the weight bytes in registers (next K step loaded before the current one is used).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_common import _act, _e2m1_to_f32

__all__ = ["GemvConfig", "mx_gemv_experts", "mx_gemv_linear", "gemv_block_m", "DEFAULT_CONFIG"]


class GemvConfig(tuple):
    """(BLOCK_N, BLOCK_K, VEC, num_warps, PREFETCH, DECODE, SPLIT_A) for one kernel. DECODE: 0 fp16 bit pattern
    per byte, 1 arithmetic, 2 two fp16 patterns per 32-bit word (VEC ≥ 4). SPLIT_A: activations loaded as
    contiguous 2·VEC runs and split into even/odd k (DECODE=2: the eight k mod 8 phases) in registers (vector
    loads) instead of two (eight) strided gathers."""

    __slots__ = ()

    def __new__(cls, block_n=16, block_k=512, vec=16, num_warps=4, prefetch=True, decode=0, split_a=False):
        return super().__new__(cls, (block_n, block_k, vec, num_warps, prefetch, decode, split_a))

    block_n = property(lambda s: s[0])
    block_k = property(lambda s: s[1])
    vec = property(lambda s: s[2])
    num_warps = property(lambda s: s[3])
    prefetch = property(lambda s: s[4])
    decode = property(lambda s: s[5])
    split_a = property(lambda s: s[6])


#: (8, 512, 16, 2) with the 32-bit word decode and split activations: the fastest of the twelve schedules
#: bench/gpu/moe_mx.py times at K3 shapes and 1–4 tokens, ahead of the grouped tl.dot_scaled kernel there; 16
#: tokens stay on the grouped kernel, see ``KernelTuning.moe_gemv_pairs`` (figures in docs/perf.md). The
#: interpreter gets wider, shorter tiles (fewer programs).
DEFAULT_CONFIG = (GemvConfig(64, 64, 16, 4) if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
                  else GemvConfig(8, 512, 16, 2, True, 2, True))


def gemv_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per program: ≈ the mean rows per touched expert, as 1, 2 or 4."""
    per = num_pairs / max(1, min(num_experts, num_pairs))
    return 1 if per <= 1.25 else (2 if per <= 2.5 else 4)


@triton.jit
def _nibble(b, HI: tl.constexpr, DECODE: tl.constexpr):
    """E2M1 nibble (low or high) of each byte → its value · 2^-14 in fp32, exactly."""
    b = b.to(tl.int32)
    if DECODE == 0:
        if HI:
            h = ((b << 5) & 0x0E00) | ((b << 8) & 0x8000)  # magnitude bits 4-6 → 9-11, sign bit 7 → 15
        else:
            h = ((b << 9) & 0x0E00) | ((b << 12) & 0x8000)
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        code = (b >> 4) if HI else (b & 15)
        return _e2m1_to_f32(code) * 0.00006103515625


@triton.jit
def _tile(w_ptr, s_ptr, e, offs_n, kk, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
          SG: tl.constexpr, VEC: tl.constexpr):
    """Packed bytes [BN, SG, VEC] of K step k0 and the scale byte of each sub-group [BN, SG]."""
    nm = offs_n < N
    col = k0 // 2 + kk  # [SG, VEC] byte columns
    b = tl.load(w_ptr + e * stride_we + offs_n[:, None, None] * stride_wn + col[None, :, :],
                mask=nm[:, None, None] & (col[None, :, :] < K // 2), other=0)
    g = (k0 // 2 + tl.arange(0, SG) * VEC) // 16  # [SG]: the scale group of each sub-group
    s = tl.load(s_ptr + e * stride_se + offs_n[:, None] * stride_sn + g[None, :],
                mask=nm[:, None] & (g[None, :] < K // 32), other=127)
    return b, s


@triton.jit
def _wtile(w_ptr, s_ptr, e, offs_n, kw, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
           SG: tl.constexpr, VEC: tl.constexpr):
    """Packed 32-bit words [BN, SG, VEC/4] of K step k0 (weight strides in words) and the scale bytes [BN, SG]."""
    nm = offs_n < N
    col = k0 // 8 + kw  # [SG, VEC/4] word columns
    wp = w_ptr.to(tl.pointer_type(tl.uint32)) + e * stride_we
    w = tl.load(wp + offs_n[:, None, None] * stride_wn + col[None, :, :],
                mask=nm[:, None, None] & (col[None, :, :] < K // 8), other=0)
    g = (k0 // 2 + tl.arange(0, SG) * VEC) // 16
    s = tl.load(s_ptr + e * stride_se + offs_n[:, None] * stride_sn + g[None, :],
                mask=nm[:, None] & (g[None, :] < K // 32), other=127)
    return w, s


@triton.jit
def _tiles13(w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, offs_n, cols, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
             GLU: tl.constexpr, SG: tl.constexpr, VEC: tl.constexpr, WORDS: tl.constexpr):
    """K step k0 of w1 and (GLU) w3 with their scale bytes: bytes (``_tile``, cols [SG, VEC]) or 32-bit words
    (``WORDS``: ``_wtile``, cols [SG, VEC/4]); without GLU the w3 pair repeats w1's."""
    if WORDS:
        b1, s1 = _wtile(w1_ptr, s1_ptr, e, offs_n, cols, k0, N, K, stride_we, stride_wn, stride_se, stride_sn, SG,
                        VEC)
    else:
        b1, s1 = _tile(w1_ptr, s1_ptr, e, offs_n, cols, k0, N, K, stride_we, stride_wn, stride_se, stride_sn, SG, VEC)
    b3, s3 = b1, s1
    if GLU:
        if WORDS:
            b3, s3 = _wtile(w3_ptr, s3_ptr, e, offs_n, cols, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
                            SG, VEC)
        else:
            b3, s3 = _tile(w3_ptr, s3_ptr, e, offs_n, cols, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
                           SG, VEC)
    return b1, s1, b3, s3


@triton.jit
def _scales(s):
    """E8M0 byte → (pre, post) with value·2^-14 · pre · post = value · 2^(s-127), both steps exact."""
    s = s.to(tl.int32)
    big = s > 240
    post = tl.where(s == 255, 0x7FC00000, tl.where(big, s, s + 14) << 23).to(tl.float32, bitcast=True)
    pre = tl.where(big, 16384.0, 1.0)
    return pre, post


@triton.jit
def _row_part(a_row, ok, k0, K, kk, lo, hi, SG: tl.constexpr, VEC: tl.constexpr, SPLIT_A: tl.constexpr):
    """Σ over each thread's VEC bytes of lo·a_even + hi·a_odd for one activation row: [BN, SG]."""
    if SPLIT_A:
        kc = k0 + tl.arange(0, SG)[:, None] * (2 * VEC) + tl.arange(0, 2 * VEC)[None, :]  # [SG, 2·VEC] contiguous
        a = tl.load(a_row + kc, mask=kc < tl.where(ok, K, 0), other=0.0).to(tl.float32)
        ae, ao = tl.split(tl.reshape(a, (SG, VEC, 2)))
    else:
        ke = k0 + 2 * kk
        m = ke < tl.where(ok, K, 0)
        ae = tl.load(a_row + ke, mask=m, other=0.0).to(tl.float32)
        ao = tl.load(a_row + ke + 1, mask=m, other=0.0).to(tl.float32)
    return tl.sum(lo * ae[None, :, :] + hi * ao[None, :, :], axis=2)


@triton.jit
def _row_ptrs(a_ptr, sorted_ptr, row, top_k, num_pairs, stride_am, A_BY_TOKEN: tl.constexpr):
    flat = tl.load(sorted_ptr + row)
    ok = flat < num_pairs
    arow = (flat // top_k).to(tl.int64) if A_BY_TOKEN else row.to(tl.int64)
    return a_ptr + arow * stride_am, flat, ok


@triton.jit
def _block_rows(a_ptr, sorted_ptr, r0, top_k, num_pairs, stride_am, A_BY_TOKEN: tl.constexpr, BM: tl.constexpr):
    """Activation pointers, flat ids and validity of the (up to 4) rows of the block starting at sorted row r0;
    rows past BM repeat row 0 (their results are never stored)."""
    a0, f0, ok0 = _row_ptrs(a_ptr, sorted_ptr, r0, top_k, num_pairs, stride_am, A_BY_TOKEN)
    a1, f1, ok1 = a0, f0, ok0
    a2, f2, ok2 = a0, f0, ok0
    a3, f3, ok3 = a0, f0, ok0
    if BM > 1:
        a1, f1, ok1 = _row_ptrs(a_ptr, sorted_ptr, r0 + 1, top_k, num_pairs, stride_am, A_BY_TOKEN)
    if BM > 2:
        a2, f2, ok2 = _row_ptrs(a_ptr, sorted_ptr, r0 + 2, top_k, num_pairs, stride_am, A_BY_TOKEN)
        a3, f3, ok3 = _row_ptrs(a_ptr, sorted_ptr, r0 + 3, top_k, num_pairs, stride_am, A_BY_TOKEN)
    return a0, f0, ok0, a1, f1, ok1, a2, f2, ok2, a3, f3, ok3


@triton.jit
def _store_row(o_ptr, row, flat, ok, offs_n, N, stride_om, g, u, GLU: tl.constexpr, ACT: tl.constexpr,
               CAP_UP: tl.constexpr, beta, linear_beta):
    if GLU:  # up: h in sorted-row order (padding rows are never read by the down kernel)
        v = _act(tl.sum(g, 1), tl.sum(u, 1), ACT, beta, linear_beta, CAP_UP)
        tl.store(o_ptr + row.to(tl.int64) * stride_om + offs_n, v.to(o_ptr.dtype.element_ty), mask=offs_n < N)
    else:  # down: y at the flat pair id
        v = tl.sum(g, 1)
        tl.store(o_ptr + flat.to(tl.int64) * stride_om + offs_n, v.to(o_ptr.dtype.element_ty),
                 mask=offs_n < tl.where(ok, N, 0))


@triton.jit
def _store_rows(o_ptr, r0, f0, ok0, f1, ok1, f2, ok2, f3, ok3, offs_n, N, stride_om, g0, u0, g1, u1, g2, u2, g3, u3,
                GLU: tl.constexpr, ACT: tl.constexpr, CAP_UP: tl.constexpr, BM: tl.constexpr, beta, linear_beta):
    """``_store_row`` for each of the block's BM rows."""
    _store_row(o_ptr, r0, f0, ok0, offs_n, N, stride_om, g0, u0, GLU, ACT, CAP_UP, beta, linear_beta)
    if BM > 1:
        _store_row(o_ptr, r0 + 1, f1, ok1, offs_n, N, stride_om, g1, u1, GLU, ACT, CAP_UP, beta, linear_beta)
    if BM > 2:
        _store_row(o_ptr, r0 + 2, f2, ok2, offs_n, N, stride_om, g2, u2, GLU, ACT, CAP_UP, beta, linear_beta)
        _store_row(o_ptr, r0 + 3, f3, ok3, offs_n, N, stride_om, g3, u3, GLU, ACT, CAP_UP, beta, linear_beta)


@triton.jit
def _mx_gemv_kernel(a_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, o_ptr, sorted_ptr, eid_ptr, num_rows_ptr,
                    NB, N, K, top_k, num_pairs,
                    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                    beta, linear_beta,
                    GLU: tl.constexpr, A_BY_TOKEN: tl.constexpr, ACT: tl.constexpr, CAP_UP: tl.constexpr,
                    BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                    PREFETCH: tl.constexpr, DECODE: tl.constexpr, SPLIT_A: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid % NB  # neighbouring programs: neighbouring blocks (same expert) of one N tile → L2 reuse
    pid_n = pid // NB
    if blk * BM >= tl.load(num_rows_ptr):
        return
    e = tl.load(eid_ptr + blk).to(tl.int64)
    if e < 0:
        return
    SG: tl.constexpr = BLOCK_K // (2 * VEC)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, SG)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [SG, VEC] byte offsets in a K step
    r0 = blk * BM
    a0, f0, ok0, a1, f1, ok1, a2, f2, ok2, a3, f3, ok3 = _block_rows(a_ptr, sorted_ptr, r0, top_k, num_pairs,
                                                                     stride_am, A_BY_TOKEN, BM)
    z = tl.zeros((BLOCK_N, SG), dtype=tl.float32)
    g0, g1, g2, g3 = z, z, z, z
    u0, u1, u2, u3 = z, z, z, z
    if PREFETCH:
        nb1, ns1, nb3, ns3 = _tiles13(w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, offs_n, kk, 0, N, K, stride_we, stride_wn,
                                      stride_se, stride_sn, GLU, SG, VEC, False)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:
            b1, sb1, b3, sb3 = nb1, ns1, nb3, ns3
            nb1, ns1, nb3, ns3 = _tiles13(w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, offs_n, kk, k0 + BLOCK_K, N, K,
                                          stride_we, stride_wn, stride_se, stride_sn, GLU, SG, VEC, False)
        else:
            b1, sb1, b3, sb3 = _tiles13(w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, offs_n, kk, k0, N, K, stride_we,
                                        stride_wn, stride_se, stride_sn, GLU, SG, VEC, False)
        lo1 = _nibble(b1, False, DECODE)
        hi1 = _nibble(b1, True, DECODE)
        pre1, post1 = _scales(sb1)
        g0 += _row_part(a0, ok0, k0, K, kk, lo1, hi1, SG, VEC, SPLIT_A) * pre1 * post1
        if BM > 1:
            g1 += _row_part(a1, ok1, k0, K, kk, lo1, hi1, SG, VEC, SPLIT_A) * pre1 * post1
        if BM > 2:
            g2 += _row_part(a2, ok2, k0, K, kk, lo1, hi1, SG, VEC, SPLIT_A) * pre1 * post1
            g3 += _row_part(a3, ok3, k0, K, kk, lo1, hi1, SG, VEC, SPLIT_A) * pre1 * post1
        if GLU:
            lo3 = _nibble(b3, False, DECODE)
            hi3 = _nibble(b3, True, DECODE)
            pre3, post3 = _scales(sb3)
            u0 += _row_part(a0, ok0, k0, K, kk, lo3, hi3, SG, VEC, SPLIT_A) * pre3 * post3
            if BM > 1:
                u1 += _row_part(a1, ok1, k0, K, kk, lo3, hi3, SG, VEC, SPLIT_A) * pre3 * post3
            if BM > 2:
                u2 += _row_part(a2, ok2, k0, K, kk, lo3, hi3, SG, VEC, SPLIT_A) * pre3 * post3
                u3 += _row_part(a3, ok3, k0, K, kk, lo3, hi3, SG, VEC, SPLIT_A) * pre3 * post3
    _store_rows(o_ptr, r0, f0, ok0, f1, ok1, f2, ok2, f3, ok3, offs_n, N, stride_om, g0, u0, g1, u1, g2, u2, g3, u3,
                GLU, ACT, CAP_UP, BM, beta, linear_beta)


@triton.jit
def _half(x, HI: tl.constexpr):
    """Low or high 16 bits of a uint32 (an fp16 bit pattern) → fp32."""
    if HI:
        x = x >> 16
    return x.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _words(w):
    """uint32 words → (e0, …, e7): elements 8i+t of each word as value · 2^-14 in fp32, exactly."""
    x0 = ((w << 9) & 0x0E000E00) | ((w << 12) & 0x80008000)
    x1 = ((w << 5) & 0x0E000E00) | ((w << 8) & 0x80008000)
    x2 = ((w << 1) & 0x0E000E00) | ((w << 4) & 0x80008000)
    x3 = ((w >> 3) & 0x0E000E00) | (w & 0x80008000)
    return (_half(x0, False), _half(x1, False), _half(x2, False), _half(x3, False),
            _half(x0, True), _half(x1, True), _half(x2, True), _half(x3, True))


@triton.jit
def _acts8(a_row, ok, k0, K, kw, SG: tl.constexpr, VEC: tl.constexpr, SPLIT_A: tl.constexpr):
    """One activation row as (a0, …, a7) [SG, VEC/4], a_t = a[k0 + 8·word + t] in fp32."""
    if SPLIT_A:
        kc = k0 + tl.arange(0, SG)[:, None] * (2 * VEC) + tl.arange(0, 2 * VEC)[None, :]  # [SG, 2·VEC]
        a = tl.load(a_row + kc, mask=kc < tl.where(ok, K, 0), other=0.0).to(tl.float32)
        p0, p1 = tl.split(tl.reshape(a, (SG, VEC // 4, 2, 2, 2)))  # dims (…, t>>2, t>>1 & 1, t & 1)
        q00, q01 = tl.split(p0)
        q10, q11 = tl.split(p1)
        a0, a4 = tl.split(q00)
        a2, a6 = tl.split(q01)
        a1, a5 = tl.split(q10)
        a3, a7 = tl.split(q11)
    else:
        ke = k0 + 8 * kw
        m = ke < tl.where(ok, K, 0)
        a0 = tl.load(a_row + ke, mask=m, other=0.0).to(tl.float32)
        a1 = tl.load(a_row + ke + 1, mask=m, other=0.0).to(tl.float32)
        a2 = tl.load(a_row + ke + 2, mask=m, other=0.0).to(tl.float32)
        a3 = tl.load(a_row + ke + 3, mask=m, other=0.0).to(tl.float32)
        a4 = tl.load(a_row + ke + 4, mask=m, other=0.0).to(tl.float32)
        a5 = tl.load(a_row + ke + 5, mask=m, other=0.0).to(tl.float32)
        a6 = tl.load(a_row + ke + 6, mask=m, other=0.0).to(tl.float32)
        a7 = tl.load(a_row + ke + 7, mask=m, other=0.0).to(tl.float32)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _dot8(e0, e1, e2, e3, e4, e5, e6, e7, a0, a1, a2, a3, a4, a5, a6, a7):
    """Σ over each thread's words of Σ_t e_t · a_t: [BN, SG]."""
    t = e0 * a0[None, :, :] + e1 * a1[None, :, :] + e2 * a2[None, :, :] + e3 * a3[None, :, :]
    t += e4 * a4[None, :, :] + e5 * a5[None, :, :] + e6 * a6[None, :, :] + e7 * a7[None, :, :]
    return tl.sum(t, axis=2)


@triton.jit
def _row_words(a_row, ok, k0, K, kw, e0, e1, e2, e3, e4, e5, e6, e7, f0, f1, f2, f3, f4, f5, f6, f7,
               pre1, post1, pre3, post3, GLU: tl.constexpr, SG: tl.constexpr, VEC: tl.constexpr, SPLIT_A: tl.constexpr):
    """One row's scaled K-step parts for w1 (decoded e) and w3 (decoded f, GLU only), activations loaded once."""
    a0, a1, a2, a3, a4, a5, a6, a7 = _acts8(a_row, ok, k0, K, kw, SG, VEC, SPLIT_A)
    pg = _dot8(e0, e1, e2, e3, e4, e5, e6, e7, a0, a1, a2, a3, a4, a5, a6, a7) * pre1 * post1  # two exact steps
    pu = pg
    if GLU:
        pu = _dot8(f0, f1, f2, f3, f4, f5, f6, f7, a0, a1, a2, a3, a4, a5, a6, a7) * pre3 * post3
    return pg, pu


@triton.jit
def _mx_gemv_words_kernel(a_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, o_ptr, sorted_ptr, eid_ptr, num_rows_ptr,
                          NB, N, K, top_k, num_pairs,
                          stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                          beta, linear_beta,
                          GLU: tl.constexpr, A_BY_TOKEN: tl.constexpr, ACT: tl.constexpr, CAP_UP: tl.constexpr,
                          BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                          PREFETCH: tl.constexpr, SPLIT_A: tl.constexpr):
    """``_mx_gemv_kernel`` with the word decode (DECODE=2); weight strides in 32-bit words."""
    pid = tl.program_id(0)
    blk = pid % NB
    pid_n = pid // NB
    if blk * BM >= tl.load(num_rows_ptr):
        return
    e = tl.load(eid_ptr + blk).to(tl.int64)
    if e < 0:
        return
    SG: tl.constexpr = BLOCK_K // (2 * VEC)
    W: tl.constexpr = VEC // 4
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kw = tl.arange(0, SG)[:, None] * W + tl.arange(0, W)[None, :]  # [SG, W] word offsets in a K step
    r0 = blk * BM
    a0, f0, ok0, a1, f1, ok1, a2, f2, ok2, a3, f3, ok3 = _block_rows(a_ptr, sorted_ptr, r0, top_k, num_pairs,
                                                                     stride_am, A_BY_TOKEN, BM)
    z = tl.zeros((BLOCK_N, SG), dtype=tl.float32)
    g0, g1, g2, g3 = z, z, z, z
    u0, u1, u2, u3 = z, z, z, z
    if PREFETCH:
        nw1, ns1, nw3, ns3 = _tiles13(w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, offs_n, kw, 0, N, K, stride_we, stride_wn,
                                      stride_se, stride_sn, GLU, SG, VEC, True)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:
            w1, sb1, w3, sb3 = nw1, ns1, nw3, ns3
            nw1, ns1, nw3, ns3 = _tiles13(w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, offs_n, kw, k0 + BLOCK_K, N, K,
                                          stride_we, stride_wn, stride_se, stride_sn, GLU, SG, VEC, True)
        else:
            w1, sb1, w3, sb3 = _tiles13(w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, offs_n, kw, k0, N, K, stride_we,
                                        stride_wn, stride_se, stride_sn, GLU, SG, VEC, True)
        x0, x1, x2, x3, x4, x5, x6, x7 = _words(w1)
        pre1, post1 = _scales(sb1)
        y0, y1, y2, y3, y4, y5, y6, y7 = x0, x1, x2, x3, x4, x5, x6, x7
        pre3, post3 = pre1, post1
        if GLU:
            y0, y1, y2, y3, y4, y5, y6, y7 = _words(w3)
            pre3, post3 = _scales(sb3)
        pg, pu = _row_words(a0, ok0, k0, K, kw, x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7,
                            pre1, post1, pre3, post3, GLU, SG, VEC, SPLIT_A)
        g0 += pg
        u0 += pu
        if BM > 1:
            pg, pu = _row_words(a1, ok1, k0, K, kw, x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6,
                                y7, pre1, post1, pre3, post3, GLU, SG, VEC, SPLIT_A)
            g1 += pg
            u1 += pu
        if BM > 2:
            pg, pu = _row_words(a2, ok2, k0, K, kw, x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6,
                                y7, pre1, post1, pre3, post3, GLU, SG, VEC, SPLIT_A)
            g2 += pg
            u2 += pu
            pg, pu = _row_words(a3, ok3, k0, K, kw, x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6,
                                y7, pre1, post1, pre3, post3, GLU, SG, VEC, SPLIT_A)
            g3 += pg
            u3 += pu
    _store_rows(o_ptr, r0, f0, ok0, f1, ok1, f2, ok2, f3, ok3, offs_n, N, stride_om, g0, u0, g1, u1, g2, u2, g3, u3,
                GLU, ACT, CAP_UP, BM, beta, linear_beta)


def _word_aligned(*ws) -> bool:
    """Whether packed tensors can be read as 32-bit words (base and the two leading strides 4-byte aligned)."""
    return all(p.data_ptr() % 4 == 0 and p.stride(0) % 4 == 0 and p.stride(1) % 4 == 0 for p in ws)


def _launch(grid, cfg: GemvConfig, a, p, s, p3, s3, o, al, nb, N, K, top_k, num_pairs, stride_am, stride_om,
            beta, linear_beta, **kw) -> None:
    """One GEMV launch: the word kernel for DECODE=2 (byte kernel with DECODE=0 where the rows are not
    4-byte aligned), else the byte kernel."""
    common = dict(BM=al.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=cfg.vec, PREFETCH=cfg.prefetch,
                  SPLIT_A=cfg.split_a, num_warps=cfg.num_warps, num_stages=1, **kw)
    if cfg.decode == 2 and _word_aligned(p, p3):
        _mx_gemv_words_kernel[grid](
            a, p, s, p3, s3, o, al.sorted_ids, al.expert_ids, al.num_rows, nb, N, K, top_k, num_pairs,
            stride_am, p.stride(0) // 4, p.stride(1) // 4, s.stride(0), s.stride(1), stride_om, beta, linear_beta,
            **common)
    else:
        _mx_gemv_kernel[grid](
            a, p, s, p3, s3, o, al.sorted_ids, al.expert_ids, al.num_rows, nb, N, K, top_k, num_pairs,
            stride_am, p.stride(0), p.stride(1), s.stride(0), s.stride(1), stride_om, beta, linear_beta,
            DECODE=0 if cfg.decode == 2 else cfg.decode, **common)


def _check_cfg(cfg: GemvConfig) -> None:
    bn, bk, vec = cfg.block_n, cfg.block_k, cfg.vec
    for v in (bn, bk, vec):
        if v & (v - 1):
            raise ValueError(f"mx_gemv: BLOCK_N/BLOCK_K/VEC must be powers of two, got {cfg}")
    if not (vec <= 16 and 16 % vec == 0 and bk >= 2 * vec and bk % 32 == 0):
        raise ValueError(f"mx_gemv: need VEC | 16 and BLOCK_K ≥ max(32, 2·VEC), got {cfg}")
    if cfg.decode not in (0, 1, 2) or (cfg.decode == 2 and vec < 4):
        raise ValueError(f"mx_gemv: DECODE must be 0, 1 or 2 (2 needs VEC ≥ 4), got {cfg}")


def mx_gemv_experts(x: torch.Tensor, w1, w3, w2, al, y2: torch.Tensor, num_pairs: int, top_k: int,
                    act: int, cap: bool, beta: float, linear_beta: float,
                    cfg_up: GemvConfig | None = None, cfg_down: GemvConfig | None = None) -> None:
    """Up (GLU) and down expert GEMVs over alignment ``al`` (block_m ∈ {1, 2, 4}); writes y2 [P, D]."""
    bm = al.block_m
    if bm not in (1, 2, 4):
        raise ValueError(f"mx_gemv: block_m must be 1, 2 or 4, got {bm}")
    cu, cd = cfg_up or DEFAULT_CONFIG, cfg_down or DEFAULT_CONFIG
    _check_cfg(cu)
    _check_cfg(cd)
    for w in (w1, w3, w2):
        if w.packed.stride(-1) != 1 or w.scale.stride(-1) != 1:
            raise ValueError("mx_gemv: packed weights and scales must be contiguous in their last dim")
    if w1.packed.stride() != w3.packed.stride() or w1.scale.stride() != w3.scale.stride():
        raise ValueError("mx_gemv: w1 and w3 must share strides")
    nb = al.expert_ids.numel()
    I, D = w1.packed.shape[1], w2.packed.shape[1]
    K1 = w1.packed.shape[2] * 2
    h = torch.empty(nb * bm, I, dtype=x.dtype, device=x.device)
    p1, s1, p3, s3, p2, s2 = w1.packed, w1.scale, w3.packed, w3.scale, w2.packed, w2.scale
    _launch((nb * triton.cdiv(I, cu.block_n),), cu, x, p1, s1, p3, s3, h, al, nb, I, K1, top_k, num_pairs,
            x.stride(0), h.stride(0), beta, linear_beta, GLU=True, A_BY_TOKEN=True, ACT=act, CAP_UP=cap)
    _launch((nb * triton.cdiv(D, cd.block_n),), cd, h, p2, s2, p2, s2, y2, al, nb, D, I, top_k, num_pairs,
            h.stride(0), y2.stride(0), beta, linear_beta, GLU=False, A_BY_TOKEN=False, ACT=act, CAP_UP=cap)


def mx_gemv_linear(a: torch.Tensor, w, cfg: GemvConfig | None = None, block_m: int = 1) -> torch.Tensor:
    """``a @ W.T`` for one MXFP4 matrix W [N, K] (a [M, K], any float dtype) through the down kernel: the
    decode/accumulate path on its own, for tests and micro-benchmarks."""
    from .align import MoEAlignment

    if block_m not in (1, 2, 4):
        raise ValueError(f"mx_gemv: block_m must be 1, 2 or 4, got {block_m}")
    cfg = cfg or DEFAULT_CONFIG
    _check_cfg(cfg)
    a = a if a.stride(-1) == 1 else a.contiguous()
    M = a.shape[0]
    p, s = w.packed[None], w.scale[None]
    N, K = p.shape[1], p.shape[2] * 2
    nb = max(1, -(-M // block_m))
    dev = a.device
    sorted_ids = torch.full((nb * block_m,), M, dtype=torch.int32, device=dev)
    sorted_ids[:M] = torch.arange(M, dtype=torch.int32, device=dev)
    al = MoEAlignment(sorted_ids, torch.zeros(nb, dtype=torch.int32, device=dev),
                      torch.tensor([nb * block_m], dtype=torch.int32, device=dev), block_m)
    out = torch.empty(M, N, dtype=a.dtype, device=dev)
    if M == 0:
        return out
    _launch((nb * triton.cdiv(N, cfg.block_n),), cfg, a, p, s, p, s, out, al, nb, N, K, 1, M, a.stride(0),
            out.stride(0), 1.0, 1.0, GLU=False, A_BY_TOKEN=False, ACT=0, CAP_UP=False)
    return out
