"""CUDA absorbed MLA decode over the paged latent cache, split-KV (``torch.utils.cpp_extension.load_inline``,
built on first use, never at import).

Same contract as :func:`k3nn.ops.mla_decode` (see :mod:`.reference`), for the K3 dims: latent r = 512, rope
dr = 64 (one 576-wide cache row per token), bf16 or fp16 inputs, fp32 accumulation.

Stage 1, grid ``[ceil(Tq·H / 16), splits, B]``, 128 threads (4 warps) per CTA. A CTA takes 16 query rows of one
request (rows are ``(t, h)`` pairs; all share every key row — MQA) and one contiguous slice of the request's
keys (``ceil(ceil(seq_len / splits) / 32) · 32`` keys per split). Its Q tile ``[16, 576]`` sits in shared
memory; key tiles of 32 tokens come in through the block table with ``cp.async`` into two buffers (the next
tile loads while this one is used; rows past the slice are zero-filled, never read). Per tile:

* scores ``S[16, 32] = Q·Kᵀ`` with ``mma.sync.m16n8k16`` (bf16/fp16 → fp32): each warp takes 144 of the 576
  columns, the four partial tiles are summed through shared memory;
* online softmax in fp32 and base 2 (log2 e folded into the scale), masked per row by its visible length;
  one row per 8 threads, each keeping a partial row sum;
* ``O[16, 512] += P·V`` with P rounded to the input dtype: each warp owns 128 output columns (16 ``m16n8``
  accumulators in registers), all warps read P from shared memory; the value is the first 512 columns of the
  same key tile.

With one split stage 1 writes o and lse; otherwise it writes fp32 partials (o only for rows that saw a key) and
stage 2, grid ``[Tq·H, B]``, merges them exactly (``lse = log Σ exp lse_s``, ``o = Σ exp(lse_s − lse) o_s``).
A row that sees no key ends with o = 0 and lse = −inf.

The split count depends only on ``B``, ``Tq·H``, the block table's width and the device (about one wave of
CTAs, two per SM), never on lengths read from the device, and the launches allocate only through
``torch.empty``: calls can be captured in a CUDA graph.

Availability: CUDA, nvcc (``CUDA_HOME`` or on PATH) and sm_80+. The registry keeps it opt-in
(``K3NN_MLA_CUDA=1``, see :func:`enabled`) until it has been checked against the reference on a GPU
(``tests/gpu/test_mla_gpu.py``), so ``auto`` keeps choosing the Triton kernel meanwhile.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import os
import shutil
import time

import torch

__all__ = [
    "BLOCK_N",
    "MAX_SPLITS",
    "ROWS",
    "SMEM_BYTES",
    "available",
    "build",
    "default_num_splits",
    "enabled",
    "kernel_source",
    "mla_decode_cuda",
    "supports",
]

R, DR = 512, 64  # the only dims compiled
ROWS, BLOCK_N = 16, 32  # query rows and keys per CTA tile
MAX_SPLITS = 256
_QLD = R + DR + 8  # shared-memory row stride (elements) of the Q and KV tiles
_SLD, _PLD = BLOCK_N + 4, BLOCK_N + 8
#: dynamic shared memory per CTA (mirrors the offsets in the CUDA source)
SMEM_BYTES = ROWS * _QLD * 2 + 2 * BLOCK_N * _QLD * 2 + 4 * ROWS * _SLD * 4 + ROWS * _PLD * 2 + 3 * ROWS * 4

_IN_CODES = {torch.bfloat16: 0, torch.float16: 1}
_OUT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_LOG2E = 1.4426950408889634

PARAMS_SOURCE = r"""
struct MlaParams {
  const void* q_lat;
  const void* q_rope;
  const void* kv;
  const int* bt;
  const int* seq;
  const int* vis;  // nullptr: seq - Tq + 1 + t
  void* out;
  float* lse;
  float* o_part;    // [B, M, splits, 512] fp32 (splits > 1)
  float* lse_part;  // [B, M, splits] fp32 (splits > 1)
  long long s_qlb, s_qlt, s_qlh, s_qrb, s_qrt, s_qrh;
  long long s_kvb, s_kvr, s_btb, s_visb;
  long long s_ob, s_ot, s_oh, s_lb, s_lt, s_lh;
  float scale_log2;
  int B, Tq, H, M, page, splits;
};
"""

CUDA_SOURCE = r"""
#include <cstdint>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace k3mla {
__PARAMS__

constexpr int R = 512, DR = 64, D = R + DR;
constexpr int ROWS = 16, BN = 32, NWARP = 4, NT = 32 * NWARP;
constexpr int QLD = D + 8;     // Q / KV row stride in shared memory: 1168 B, ldmatrix rows hit distinct banks
constexpr int SLD = BN + 4;    // fp32 partial scores
constexpr int PLD = BN + 8;    // probabilities (80 B rows)
constexpr int KW = D / NWARP;  // score depth per warp (144)
constexpr int CW = R / NWARP;  // output columns per warp (128)
constexpr int CHUNKS = D / 8;  // 16-byte chunks per cache row (72)
constexpr int Q_BYTES = ROWS * QLD * 2;
constexpr int KV_BYTES = 2 * BN * QLD * 2;
constexpr int SP_BYTES = NWARP * ROWS * SLD * 4;
constexpr int P_BYTES = ROWS * PLD * 2;
constexpr int SMEM_BYTES = Q_BYTES + KV_BYTES + SP_BYTES + P_BYTES + 3 * ROWS * 4;
constexpr float LN2 = 0.6931471805599453f;
static_assert(BN * 4 == NT, "one thread per quarter cache row in the tile loader");
static_assert(CHUNKS % 4 == 0 && KW % 16 == 0 && CW % 16 == 0, "tile shape");

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

template <typename T> struct Ty;
template <> struct Ty<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <> struct Ty<__half> {
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_out(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_out(__half* p, float v) { *p = __float2half_rn(v); }

// Stage 1: one CTA = 16 query rows of request blockIdx.z × key split blockIdx.y.
template <typename T, typename TO>
__global__ void __launch_bounds__(NT, 2) mla_split_kernel(const MlaParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem);
  uint16_t* kvs = reinterpret_cast<uint16_t*>(smem + Q_BYTES);
  float* sps = reinterpret_cast<float*>(smem + Q_BYTES + KV_BYTES);
  uint16_t* ps = reinterpret_cast<uint16_t*>(smem + Q_BYTES + KV_BYTES + SP_BYTES);
  float* alpha_s = reinterpret_cast<float*>(smem + Q_BYTES + KV_BYTES + SP_BYTES + P_BYTES);
  float* inv_s = alpha_s + ROWS;
  int* lim_s = reinterpret_cast<int*>(inv_s + ROWS);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;  // mma fragment row group / column pair
  const int m0 = blockIdx.x * ROWS, split = blockIdx.y, b = blockIdx.z;
  const int seq = p.seq[b];

  if (tid < ROWS) {
    const int m = m0 + tid;
    int lim = 0;
    if (m < p.M) {
      const int t = m / p.H;
      lim = p.vis ? p.vis[(long long)b * p.s_visb + t] : seq - p.Tq + 1 + t;
      lim = max(0, min(lim, seq));
    }
    lim_s[tid] = lim;
  }
  {  // Q tile [16, 576] = [q_lat | q_rope], zero rows past M
    const uint16_t* ql = static_cast<const uint16_t*>(p.q_lat);
    const uint16_t* qr = static_cast<const uint16_t*>(p.q_rope);
    for (int i = tid; i < ROWS * D; i += NT) {
      const int r = i / D, c = i - r * D, m = m0 + r;
      uint16_t v = 0;
      if (m < p.M) {
        const int t = m / p.H, h = m - t * p.H;
        v = c < R ? ql[b * p.s_qlb + t * p.s_qlt + h * p.s_qlh + c]
                  : qr[b * p.s_qrb + t * p.s_qrt + h * p.s_qrh + (c - R)];
      }
      qs[r * QLD + c] = v;
    }
  }
  __syncthreads();

  int maxlim = 0;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) maxlim = max(maxlim, lim_s[r]);
  const int per = (seq + p.splits - 1) / p.splits;
  const int chunk = (per + BN - 1) / BN * BN;
  const long long start_ll = (long long)split * chunk;
  const int start = (int)min(start_ll, (long long)seq);
  const int end = min(start + chunk, min(seq, maxlim));
  const int ntiles = end > start ? (end - start + BN - 1) / BN : 0;

  // Tile loader: thread -> (cache row ld_row, chunks ld_sub, ld_sub + 4, ...); rows past `end` zero-filled.
  const int ld_row = tid >> 2, ld_sub = tid & 3;
  const uint16_t* kv = static_cast<const uint16_t*>(p.kv);
  const int* bt_row = p.bt + (long long)b * p.s_btb;
  auto issue = [&](int tile, int buf) {
    const int pos = start + tile * BN + ld_row;
    const uint16_t* src = kv;  // valid address even when nothing is read
    int bytes = 0;
    if (pos < end) {
      const int blk = bt_row[pos / p.page];
      src = kv + (long long)blk * p.s_kvb + (long long)(pos % p.page) * p.s_kvr;
      bytes = 16;
    }
    const uint32_t dst = smem_u32(kvs + (buf * BN + ld_row) * QLD) + ld_sub * 16;
    src += ld_sub * 8;
#pragma unroll
    for (int i = 0; i < CHUNKS / 4; ++i) cp_async16(dst + i * 64, src + i * 32, bytes);
  };

  float acc[CW / 8][4];
#pragma unroll
  for (int j = 0; j < CW / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  // softmax state: row sm_row (8 threads per row), columns sm_col .. sm_col + 3 of the tile
  const int sm_row = tid >> 3, sm_col = (tid & 7) * 4;
  const int sm_lim = min(lim_s[sm_row], end);
  float m_run = -1.0e30f, l_part = 0.f;

  if (ntiles > 0) issue(0, 0);
  cp_async_commit();
  for (int it = 0; it < ntiles; ++it) {
    const int buf = it & 1;
    if (it + 1 < ntiles) issue(it + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait1();
    __syncthreads();
    const uint16_t* kt = kvs + buf * BN * QLD;

    {  // partial scores over this warp's 144 columns: 4 n8 tiles of 32 keys
      float sacc[BN / 8][4];
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KW / 16; ++ks) {
        const int k0 = warp * KW + ks * 16;
        uint32_t a[4];
        ldsm_x4(a, smem_u32(qs + (lane & 15) * QLD + k0 + (lane >> 4) * 8));
#pragma unroll
        for (int np = 0; np < BN / 16; ++np) {
          uint32_t bb[4];
          ldsm_x4(bb, smem_u32(kt + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * QLD + k0 + ((lane >> 3) & 1) * 8));
          Ty<T>::mma(sacc[2 * np], a, bb[0], bb[1]);
          Ty<T>::mma(sacc[2 * np + 1], a, bb[2], bb[3]);
        }
      }
      float* spw = sps + warp * ROWS * SLD;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        *reinterpret_cast<float2*>(spw + g * SLD + j * 8 + 2 * tq) = make_float2(sacc[j][0], sacc[j][1]);
        *reinterpret_cast<float2*>(spw + (g + 8) * SLD + j * 8 + 2 * tq) = make_float2(sacc[j][2], sacc[j][3]);
      }
    }
    __syncthreads();

    {  // online softmax (base 2) of row sm_row, columns sm_col .. + 3
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int w = 0; w < NWARP; ++w) {
        const float4 v = *reinterpret_cast<const float4*>(sps + (w * ROWS + sm_row) * SLD + sm_col);
        s[0] += v.x; s[1] += v.y; s[2] += v.z; s[3] += v.w;
      }
      const int n0 = start + it * BN + sm_col;
      float mx = -INFINITY;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[e] = n0 + e < sm_lim ? s[e] * p.scale_log2 : -INFINITY;
        mx = fmaxf(mx, s[e]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      const float m_new = fmaxf(m_run, mx);  // finite: m_run starts at -1e30
      const float alpha = exp2f(m_run - m_new);
      float pe[4], psum = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        pe[e] = exp2f(s[e] - m_new);  // 0 for masked keys
        psum += pe[e];
      }
      l_part = l_part * alpha + psum;
      m_run = m_new;
      *reinterpret_cast<uint2*>(ps + sm_row * PLD + sm_col) = make_uint2(Ty<T>::pack(pe[0], pe[1]), Ty<T>::pack(pe[2], pe[3]));
      if ((tid & 7) == 0) alpha_s[sm_row] = alpha;
    }
    __syncthreads();

    {  // O[:, warp's 128 columns] = alpha · O + P · V
      const float a_lo = alpha_s[g], a_hi = alpha_s[g + 8];
#pragma unroll
      for (int j = 0; j < CW / 8; ++j) {
        acc[j][0] *= a_lo; acc[j][1] *= a_lo; acc[j][2] *= a_hi; acc[j][3] *= a_hi;
      }
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) {
        uint32_t a[4];
        ldsm_x4(a, smem_u32(ps + (lane & 15) * PLD + ks * 16 + (lane >> 4) * 8));
#pragma unroll
        for (int np = 0; np < CW / 16; ++np) {
          uint32_t bb[4];
          ldsm_x4_t(bb, smem_u32(kt + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * QLD + warp * CW + np * 16
                                 + (lane >> 4) * 8));
          Ty<T>::mma(acc[2 * np], a, bb[0], bb[1]);
          Ty<T>::mma(acc[2 * np + 1], a, bb[2], bb[3]);
        }
      }
    }
    __syncthreads();  // the buffer is refilled by the next iteration's loader; P / partials rewritten
  }

  // row totals, lse, 1 / l
  float l = l_part;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  l += __shfl_xor_sync(0xffffffffu, l, 4);
  const bool final_ = p.splits == 1;
  if ((tid & 7) == 0) {
    const bool has = l > 0.f;
    inv_s[sm_row] = has ? 1.f / l : 0.f;
    const float lse = has ? (m_run + log2f(l)) * LN2 : -INFINITY;
    const int m = m0 + sm_row;
    if (m < p.M) {
      if (final_) {
        const int t = m / p.H, h = m - t * p.H;
        p.lse[b * p.s_lb + t * p.s_lt + h * p.s_lh] = lse;
      } else {
        p.lse_part[((long long)b * p.M + m) * p.splits + split] = lse;
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + half * 8, m = m0 + r;
    if (m >= p.M) continue;
    const float inv = inv_s[r];
    if (final_) {
      const int t = m / p.H, h = m - t * p.H;
      TO* orow = static_cast<TO*>(p.out) + b * p.s_ob + t * p.s_ot + h * p.s_oh;
#pragma unroll
      for (int j = 0; j < CW / 8; ++j) {
        const int col = warp * CW + j * 8 + 2 * tq;
        store_out(orow + col, acc[j][2 * half] * inv);
        store_out(orow + col + 1, acc[j][2 * half + 1] * inv);
      }
    } else if (inv > 0.f) {  // partials of rows without keys are never read by the merge
      float* prow = p.o_part + (((long long)b * p.M + m) * p.splits + split) * R;
#pragma unroll
      for (int j = 0; j < CW / 8; ++j) {
        const int col = warp * CW + j * 8 + 2 * tq;
        *reinterpret_cast<float2*>(prow + col) = make_float2(acc[j][2 * half] * inv, acc[j][2 * half + 1] * inv);
      }
    }
  }
}

// Stage 2: exact LSE merge of the splits of row blockIdx.x of request blockIdx.y; 4 columns per thread.
template <typename TO>
__global__ void __launch_bounds__(128) mla_combine_kernel(const MlaParams p) {
  const int m = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const long long row = (long long)b * p.M + m;
  const float* lp = p.lse_part + row * p.splits;
  float mx = -INFINITY;
  for (int s = 0; s < p.splits; ++s) mx = fmaxf(mx, lp[s]);
  float o[4] = {0.f, 0.f, 0.f, 0.f}, tot = 0.f;
  if (mx != -INFINITY) {
    for (int s = 0; s < p.splits; ++s) {
      const float ls = lp[s];
      if (ls == -INFINITY) continue;  // an empty split: its partial output was not written
      const float w = expf(ls - mx);
      tot += w;
      const float4 v = *reinterpret_cast<const float4*>(p.o_part + (row * p.splits + s) * R + tid * 4);
      o[0] += w * v.x; o[1] += w * v.y; o[2] += w * v.z; o[3] += w * v.w;
    }
  }
  const float inv = tot > 0.f ? 1.f / tot : 0.f;
  const int t = m / p.H, h = m - t * p.H;
  TO* orow = static_cast<TO*>(p.out) + b * p.s_ob + t * p.s_ot + h * p.s_oh + tid * 4;
#pragma unroll
  for (int e = 0; e < 4; ++e) store_out(orow + e, o[e] * inv);
  if (tid == 0) p.lse[b * p.s_lb + t * p.s_lt + h * p.s_lh] = tot > 0.f ? mx + logf(tot) : -INFINITY;
}

template <typename T, typename TO>
cudaError_t launch_t(const MlaParams& p, cudaStream_t stream) {
  auto kern = mla_split_kernel<T, TO>;
  static bool raised[64] = {};  // opt-in shared memory limit, once per device
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64 || !raised[dev]) {
    err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    if (err != cudaSuccess) return err;
    if (dev >= 0 && dev < 64) raised[dev] = true;
  }
  const dim3 grid((p.M + ROWS - 1) / ROWS, p.splits, p.B);
  kern<<<grid, NT, SMEM_BYTES, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.splits == 1) return err;
  mla_combine_kernel<TO><<<dim3(p.M, p.B), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

// in_dt: 0 bf16, 1 fp16; out_dt: 0 bf16, 1 fp16, 2 fp32 (the input dtype or fp32)
cudaError_t mla_decode_dispatch(const MlaParams& p, int in_dt, int out_dt, cudaStream_t stream) {
  if (in_dt == 0 && out_dt == 0) return launch_t<__nv_bfloat16, __nv_bfloat16>(p, stream);
  if (in_dt == 0 && out_dt == 2) return launch_t<__nv_bfloat16, float>(p, stream);
  if (in_dt == 1 && out_dt == 1) return launch_t<__half, __half>(p, stream);
  if (in_dt == 1 && out_dt == 2) return launch_t<__half, float>(p, stream);
  return cudaErrorNotSupported;
}
}  // namespace k3mla
"""

_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
namespace k3mla {
__PARAMS__
cudaError_t mla_decode_dispatch(const MlaParams& p, int in_dt, int out_dt, cudaStream_t stream);
}

void mla_decode_launch(torch::Tensor q_lat, torch::Tensor q_rope, torch::Tensor kv, torch::Tensor bt,
                       torch::Tensor seq, std::optional<torch::Tensor> vis, torch::Tensor out, torch::Tensor lse,
                       std::optional<torch::Tensor> o_part, std::optional<torch::Tensor> lse_part,
                       double scale_log2, int64_t splits, int64_t in_dt, int64_t out_dt) {
  TORCH_CHECK(q_lat.is_cuda() && q_lat.stride(3) == 1 && q_rope.stride(3) == 1 && kv.stride(2) == 1,
              "mla_decode_launch: inputs must be CUDA tensors with a contiguous last dim");
  TORCH_CHECK(bt.scalar_type() == torch::kInt && seq.scalar_type() == torch::kInt, "mla_decode_launch: int32 indices");
  TORCH_CHECK(lse.scalar_type() == torch::kFloat, "mla_decode_launch: lse must be fp32");
  const c10::cuda::CUDAGuard guard(q_lat.device());
  k3mla::MlaParams p;
  p.q_lat = q_lat.data_ptr();
  p.q_rope = q_rope.data_ptr();
  p.kv = kv.data_ptr();
  p.bt = bt.data_ptr<int>();
  p.seq = seq.data_ptr<int>();
  p.vis = nullptr;
  p.s_visb = 0;
  if (vis.has_value()) {
    TORCH_CHECK(vis->scalar_type() == torch::kInt && vis->stride(1) == 1, "mla_decode_launch: int32 visible_lens");
    p.vis = vis->data_ptr<int>();
    p.s_visb = vis->stride(0);
  }
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.o_part = nullptr;
  p.lse_part = nullptr;
  if (splits > 1) {
    TORCH_CHECK(o_part.has_value() && lse_part.has_value(), "mla_decode_launch: split partials missing");
    p.o_part = o_part->data_ptr<float>();
    p.lse_part = lse_part->data_ptr<float>();
  }
  p.s_qlb = q_lat.stride(0); p.s_qlt = q_lat.stride(1); p.s_qlh = q_lat.stride(2);
  p.s_qrb = q_rope.stride(0); p.s_qrt = q_rope.stride(1); p.s_qrh = q_rope.stride(2);
  p.s_kvb = kv.stride(0); p.s_kvr = kv.stride(1);
  p.s_btb = bt.stride(0);
  p.s_ob = out.stride(0); p.s_ot = out.stride(1); p.s_oh = out.stride(2);
  p.s_lb = lse.stride(0); p.s_lt = lse.stride(1); p.s_lh = lse.stride(2);
  p.scale_log2 = (float)scale_log2;
  p.B = (int)q_lat.size(0); p.Tq = (int)q_lat.size(1); p.H = (int)q_lat.size(2);
  p.M = p.Tq * p.H;
  p.page = (int)kv.size(1);
  p.splits = (int)splits;
  const cudaError_t err = k3mla::mla_decode_dispatch(p, (int)in_dt, (int)out_dt,
                                                     c10::cuda::getCurrentCUDAStream(q_lat.device().index()));
  TORCH_CHECK(err == cudaSuccess, "mla_decode_launch: ", cudaGetErrorString(err));
}
"""

_DECL = ("void mla_decode_launch(torch::Tensor q_lat, torch::Tensor q_rope, torch::Tensor kv, torch::Tensor bt, "
         "torch::Tensor seq, std::optional<torch::Tensor> vis, torch::Tensor out, torch::Tensor lse, "
         "std::optional<torch::Tensor> o_part, std::optional<torch::Tensor> lse_part, double scale_log2, "
         "int64_t splits, int64_t in_dt, int64_t out_dt);")

CUDA_SOURCE = CUDA_SOURCE.replace("__PARAMS__", PARAMS_SOURCE)
_CPP_SOURCE = _CPP_SOURCE.replace("__PARAMS__", PARAMS_SOURCE)


def kernel_source() -> str:
    """The complete ``.cu`` text (torch-free: compiles with plain nvcc)."""
    return CUDA_SOURCE


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None when the kernel can be built and run on this machine, else the reason."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None and shutil.which("nvcc") is None:
        return "nvcc / CUDA toolkit not found (CUDA_HOME unset and no nvcc on PATH)"
    cap = torch.cuda.get_device_capability()
    if cap < (8, 0):
        return f"needs sm_80+ (cp.async, ldmatrix, mma.sync m16n8k16), got sm_{cap[0]}{cap[1]}"
    return None


def enabled() -> str | None:
    """The registry's opt-in: None when ``K3NN_MLA_CUDA`` is set to a non-zero value (read per call)."""
    if os.environ.get("K3NN_MLA_CUDA", "0") in ("", "0"):
        return "opt-in: set K3NN_MLA_CUDA=1 (matches the reference on the H200 but is slower than the Triton kernel there)"
    return None


#: seconds the last :func:`build` spent compiling or loading (0 once the module is loaded in this process)
last_build_seconds = 0.0


@functools.lru_cache(maxsize=1)
def build():
    """Compile (once per process; cached on disk by torch under a source hash) and return the module."""
    global last_build_seconds
    from torch.utils.cpp_extension import load_inline

    tag = hashlib.sha1((CUDA_SOURCE + _CPP_SOURCE).encode()).hexdigest()[:12]
    kw = {}
    if "no_implicit_headers" in inspect.signature(load_inline).parameters:  # keep torch headers out of the .cu
        kw["no_implicit_headers"] = True
    t0 = time.perf_counter()
    mod = load_inline(name=f"k3nn_mla_decode_{tag}", cpp_sources=[_CPP_SOURCE + "\n" + _DECL],
                      cuda_sources=[CUDA_SOURCE], functions=["mla_decode_launch"], extra_cflags=["-O2"],
                      extra_cuda_cflags=["-O3", "-std=c++17"],
                      verbose=os.environ.get("K3NN_BUILD_VERBOSE") == "1", **kw)
    last_build_seconds = time.perf_counter() - t0
    return mod


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _smem_limit(dev: torch.device) -> int:
    props = torch.cuda.get_device_properties(dev)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024)


def default_num_splits(B: int, M: int, max_tokens: int, sm_count: int, ctas_per_sm: int = 2) -> int:
    """Splits per request: about one wave of stage-1 CTAs (``ctas_per_sm`` resident per SM), at least four
    32-key tiles per split of the longest possible request (``max_tokens``: the block table's width in tokens),
    at most :data:`MAX_SPLITS`. Depends on shapes only (graph-safe)."""
    per = B * math.ceil(M / ROWS)
    by_wave = (ctas_per_sm * sm_count) // per
    by_len = math.ceil(max(1, max_tokens) / (4 * BLOCK_N))
    return max(1, min(MAX_SPLITS, by_wave, by_len))


def supports(q_lat, q_rope, kv_pool, block_table, seq_lens, scale=None, visible_lens=None, num_splits=None,
             out_dtype=None, out=None) -> str | None:
    """None when :func:`mla_decode_cuda` takes this call, else the reason (inputs already checked by
    ``check_mla_decode_inputs``)."""
    if not isinstance(q_lat, torch.Tensor) or q_lat.device.type != "cuda":
        return "inputs are not CUDA tensors"
    if q_lat.dtype not in _IN_CODES:
        return f"dtype {q_lat.dtype} is not supported (bf16, fp16)"
    if q_lat.shape[-1] != R or q_rope.shape[-1] != DR:
        return f"compiled for kv_lora_rank {R} and rope dim {DR}, got {q_lat.shape[-1]} and {q_rope.shape[-1]}"
    want = out_dtype if out_dtype is not None else (out[0].dtype if out is not None else q_lat.dtype)
    if want not in (q_lat.dtype, torch.float32):
        return f"out dtype {want} must be the input dtype {q_lat.dtype} or fp32"
    if out is not None and out[0].dtype != want:
        return f"out[0] dtype {out[0].dtype} differs from out_dtype {want}"
    if kv_pool.stride(-1) != 1 or kv_pool.stride(0) % 8 or kv_pool.stride(1) % 8 or kv_pool.data_ptr() % 16:
        return "kv_pool rows must be contiguous and 16-byte aligned (cp.async)"
    if num_splits is not None and not 1 <= int(num_splits) <= MAX_SPLITS:
        return f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}"
    if q_lat.shape[0] > 65535:
        return f"batch {q_lat.shape[0]} > 65535 (grid z)"
    if block_table.shape[1] * kv_pool.shape[1] >= 2 ** 31:
        return "block table covers more than 2^31 tokens"
    lim = _smem_limit(q_lat.device)
    if SMEM_BYTES > lim:
        return f"needs {SMEM_BYTES} bytes of shared memory per CTA (limit {lim})"
    return None


def mla_decode_cuda(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=None, num_splits=None,
                    out_dtype=None, out=None):
    """``k3nn.ops.mla_decode`` on the CUDA kernel (inputs as checked by ``check_mla_decode_inputs`` and
    :func:`supports`). Returns ``(o [B, Tq, H, 512], lse [B, Tq, H] fp32)``."""
    B, Tq, H, r = q_lat.shape
    M = Tq * H
    dev = q_lat.device
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    bt = block_table if block_table.dtype == torch.int32 and block_table.stride(-1) == 1 else \
        block_table.to(torch.int32).contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    vis = None if visible_lens is None else visible_lens.to(torch.int32).contiguous()
    if out is None:
        o = torch.empty(B, Tq, H, r, dtype=out_dtype or q_lat.dtype, device=dev)
        lse = torch.empty(B, Tq, H, dtype=torch.float32, device=dev)
    else:
        o, lse = out
    S = int(num_splits) if num_splits else default_num_splits(B, M, bt.shape[1] * kv_pool.shape[1],
                                                               _sm_count(dev.index or 0))
    S = max(1, min(MAX_SPLITS, S))
    o_part = lse_part = None
    if S > 1:
        o_part = torch.empty(B, M, S, r, dtype=torch.float32, device=dev)
        lse_part = torch.empty(B, M, S, dtype=torch.float32, device=dev)
    build().mla_decode_launch(q_lat, q_rope, kv_pool, bt, sl, vis, o, lse, o_part, lse_part,
                              float(scale) * _LOG2E, S, _IN_CODES[q_lat.dtype], _OUT_CODES[o.dtype])
    return o, lse
