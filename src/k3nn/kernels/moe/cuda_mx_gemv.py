"""MXFP4 expert GEMV in CUDA for decode-sized MoE batches (``torch.utils.cpp_extension``, built on first use,
never at import). Same contract as :func:`.triton_mx_gemv.mx_gemv_experts`; the default decode GEMV where
it builds (``KernelTuning.moe_gemv="auto"``; ``"cuda"`` insists, ``"triton"`` opts out); checked against the
eager reference by ``tests/gpu/test_moe_gpu.py`` on the H200.

Weights: packed u8 [E, N, K/2] (two E2M1 per byte, low nibble = even k), E8M0 scales u8 [E, N, K/32]; x, h, y
bf16 or fp16. One CTA computes 16·RT output rows of one expert for the valid rows of one alignment block
(``align.py``, ``block_m`` ∈ {1, 2, 4, 8}, at most 2·NT rows: NT = ceil(block_m/2) n8 tiles is a template
parameter that sizes shared memory); its RT·KS warps split the rows (RT tiles of 16) and K (KS slices of whole
128-k groups = four MX blocks). Each CTA runs only NR ∈ {1, 2, 4} ≤ NT n8 tiles, picked at run time from the
block's last valid row, and stages only those 2·NR activation rows: with :func:`cuda_block_m` sizing blocks to
hold a whole expert (one read of its weights), a block of one or two pairs costs one mma per 16 k, not four.

Per CTA::

    prologue   first weight loads in flight; E8M0 bytes of the CTA's rows → shared memory (raw bytes, decoded
               at use: 0 → 2^-127, 255 → NaN); [down with PDL: griddepcontrol.wait]; the block's 2·NR activation
               rows → shared memory as fp16, each row scaled by 2^(BIAS − e) with 2^e ≤ max|a| < 2^(e+1)
               (bf16/fp16 values stay exact), in the decode's pair order
    loop       per lane and group: one 16-byte load (= one MX block, 32 E2M1) per row and matrix, U groups per
               batch (PF: the next batch is loaded before the current one is used)
    decode     per 32-bit word (8 E2M1) four half2, exact:
               DEC 0  bit placement into fp16 (value · 2^-14; code 1 is the fp16 subnormal 2^-15)
                      x_m = ((w << s_m) & 0x0E000E00) | ((w << s_m + 3) & 0x80008000), s = 9, 5, 1, -3
               DEC 1  bit placement into e4m3 bytes (value · 2^-6), then the sm_89+ e4m3x2 → f16x2 convert
    mma        m16n8k16 f16 → f32 (tensor cores, exact products): A = rows g and g+8 of the warp's tile, the
               k-slots of quad lane q hold block q of the group; B column 4t + j = token t, block j, non-zero only
               on lanes with q = g mod 4 — so each accumulator column is the dot product of ONE MX block
    scale      after the group's 8 mmas (per matrix and token pair): one fp32 FMA per accumulator with its block's
               2^(s−127); a shuffle adds the lane pair's other two blocks
    epilogue   K slices summed in shared memory, · 2^e per token (NaN when the row holds Inf/NaN), GLU
               (SiLU/SiTU, ``triton_common._act``) → h in sorted-row order; down: y scattered to flat pair ids

The fp16 activation rounding is exact for bf16 inputs (8 significant bits) and for fp16 inputs, apart from values
below 2^-14 · 2^-(BIAS+1) of the row's max (subnormal in fp16). Products are exact in fp32, each block's sum
is accumulated in fp32 by the tensor core and scaled in fp32.

Launch shape ``CudaGemvConfig(row_tiles, k_split, unroll, prefetch, decode)``; ``mx_gemv_experts_cuda`` and
``mx_gemv_linear_cuda`` take one (default ``DEFAULT_CONFIG``). Every config used must be in the built set:
:func:`build` compiles a set of configs (bf16/fp16, NT ∈ {1, 2, 4}, GLU on/off as template instances) into one
module, the kernels in a torch-free ``.cu`` (nvcc) and the binding in a ``.cpp`` (host compiler) so the two
compile in parallel. Launches are CUDA-graph capturable: no host syncs, no allocation except the ``h`` buffer.

Programmatic dependent launch (sm_90+, ``KernelTuning.moe_cuda_pdl``, default True): every up CTA executes
``griddepcontrol.launch_dependents`` first, and the down kernel goes through ``cudaLaunchKernelEx`` with
programmatic stream serialization, so its CTAs start as up CTAs retire, issue their first weight loads and stage
their scales, and only then ``griddepcontrol.wait`` (returns once the whole up grid has completed and its h
writes are visible) before reading h. The alignment arrays they read before the wait were written by a kernel
that completed before the up kernel started. Registers: at most 128 per thread (two 256-thread CTAs per SM); the
four-tile branch of the NT = 4 instance runs without prefetch to fit (a few spill bytes in the GLU kernel).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import os
import time
from typing import NamedTuple

import torch

from ...quant.mxfp4 import MXFP4Weight
from ..cuda_ext import smem_per_block as _smem_limit
from ..cuda_ext import PDL_SOURCE, toolchain_reason
from ..registry import current_tuning

__all__ = ["CudaGemvConfig", "DEFAULT_CONFIG", "CUDA_SOURCE", "available", "supports", "build", "cuda_block_m",
           "pdl_enabled", "mx_gemv_experts_cuda", "mx_gemv_linear_cuda", "last_build_seconds"]


class CudaGemvConfig(NamedTuple):
    """Launch shape: ``row_tiles`` 16-row tiles per CTA, ``k_split`` warps sharing each tile's K (CTA =
    row_tiles·k_split warps), ``unroll`` 128-k groups per load batch, ``prefetch`` (next batch loaded before the
    current one is decoded), ``decode`` 0 (fp16 bit placement) or 1 (e4m3 bytes + hardware convert, sm_89+)."""

    row_tiles: int = 1
    k_split: int = 2
    unroll: int = 2
    prefetch: bool = True
    decode: int = 0

    def name(self) -> str:
        return (f"r{16 * self.row_tiles} ks{self.k_split} u{self.unroll}{' pf' if self.prefetch else ''}"
                f"{' e4m3' if self.decode else ''}")


#: the best of eight launch shapes on the H200 at 1, 4 and 16 tokens (bench/gpu/moe_mx.py,
#: bench/results/logs/h200-s5-run1-2026-11-30.log): 64 rows and two K slices per CTA, two groups per batch with
#: prefetch, e4m3 decode — 57.1% / 61.6% / 45.7% of copy bandwidth (block_m 2 everywhere, no PDL) against
#: 55.6% / 61.2% / 45.3% for 32 rows. Below sm_89 (no e4m3 convert) :func:`supports` declines decode 1 and the
#: Triton GEMV runs.
DEFAULT_CONFIG = CudaGemvConfig(row_tiles=4, k_split=2, unroll=2, prefetch=True, decode=1)

_NTS = (1, 2, 4)  # n8 tiles of the mma = ceil(block_m / 2)
_DTYPES = {torch.bfloat16: ("bf16", "__nv_bfloat16"), torch.float16: ("fp16", "__half")}

ARGS_SOURCE = r"""
#include <cstdint>
namespace k3mx {
__ARGS__
}  // namespace k3mx
"""

CUDA_SOURCE = r"""
#include <cstdint>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace k3mx {
__ARGS__
__BODY__
}  // namespace k3mx
"""

_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
__ARGS_SOURCE__
namespace k3mx {
cudaError_t dispatch(int cfg, int dtype, int nt, int glu, const Args& p, cudaStream_t stream);
}

void mx_gemv_launch(int64_t cfg, bool glu, torch::Tensor a, torch::Tensor w1, torch::Tensor s1, torch::Tensor w3,
                    torch::Tensor s3, torch::Tensor out, torch::Tensor sorted, torch::Tensor eid,
                    torch::Tensor num_rows, int64_t bm, int64_t top_k, int64_t num_pairs, bool a_by_token,
                    int64_t act, bool cap, bool scale_vec, double beta, double linear_beta, bool pdl) {
  TORCH_CHECK(a.is_cuda() && a.stride(-1) == 1 && a.stride(0) % 8 == 0, "mx_gemv_launch: bad activations");
  TORCH_CHECK(w1.scalar_type() == torch::kUInt8 && s1.scalar_type() == torch::kUInt8, "mx_gemv_launch: u8 weights");
  TORCH_CHECK(sorted.scalar_type() == torch::kInt && eid.scalar_type() == torch::kInt &&
              num_rows.scalar_type() == torch::kInt, "mx_gemv_launch: int32 alignment");
  k3mx::Args p;
  p.a = a.data_ptr();
  p.stride_a = a.stride(0);
  p.w1 = w1.data_ptr<uint8_t>();
  p.s1 = s1.data_ptr<uint8_t>();
  p.w3 = w3.data_ptr<uint8_t>();
  p.s3 = s3.data_ptr<uint8_t>();
  p.wse = w1.stride(0);
  p.wsn = w1.stride(1);
  p.sse = s1.stride(0);
  p.ssn = s1.stride(1);
  p.out = out.data_ptr();
  p.stride_o = out.stride(0);
  p.sorted = sorted.data_ptr<int>();
  p.eid = eid.data_ptr<int>();
  p.num_rows = num_rows.data_ptr<int>();
  p.nb = (int)eid.numel();
  p.bm = (int)bm;
  p.N = (int)w1.size(1);
  p.K = (int)w1.size(2) * 2;
  p.top_k = (int)top_k;
  p.num_pairs = (int)num_pairs;
  p.a_by_token = a_by_token;
  p.act = (int)act;
  p.cap = cap;
  p.scale_vec = scale_vec;
  p.pdl = pdl;
  p.beta = (float)beta;
  p.linear_beta = (float)linear_beta;
  TORCH_CHECK(bm == 1 || bm == 2 || bm == 4 || bm == 8, "mx_gemv_launch: block_m must be 1, 2, 4 or 8");
  const int nt = bm <= 2 ? 0 : (bm == 4 ? 1 : 2);
  int dt;
  if (a.scalar_type() == torch::kBFloat16) dt = 0;
  else if (a.scalar_type() == torch::kHalf) dt = 1;
  else TORCH_CHECK(false, "mx_gemv_launch: activations must be bf16 or fp16, got ", a.scalar_type());
  TORCH_CHECK(out.scalar_type() == a.scalar_type(), "mx_gemv_launch: out dtype must match the activations");
  if (p.nb == 0 || p.N == 0) return;
  c10::cuda::CUDAGuard guard(a.device());
  const cudaError_t err = k3mx::dispatch((int)cfg, dt, nt, glu ? 1 : 0, p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "mx_gemv_launch: ", err == cudaErrorNotSupported ?
              "this (config, dtype, block_m) was not built" : cudaGetErrorString(err));
}
"""

_DECL = ("void mx_gemv_launch(int64_t cfg, bool glu, torch::Tensor a, torch::Tensor w1, torch::Tensor s1, "
         "torch::Tensor w3, torch::Tensor s3, torch::Tensor out, torch::Tensor sorted, torch::Tensor eid, "
         "torch::Tensor num_rows, int64_t bm, int64_t top_k, int64_t num_pairs, bool a_by_token, int64_t act, "
         "bool cap, bool scale_vec, double beta, double linear_beta, bool pdl);")

ARGS = r"""struct Args {
  const void* a;            // activations: x [tokens, K] (up, rows gathered by token) or h [rows, K] (down)
  long long stride_a;       // elements
  const uint8_t* w1;        // packed E2M1 [E, N, K/2] (w1 = gate, or the single matrix)
  const uint8_t* s1;        // E8M0 [E, N, K/32]
  const uint8_t* w3;        // up (GLU only)
  const uint8_t* s3;
  long long wse, wsn, sse, ssn;  // byte strides: packed (expert, row), scale (expert, row)
  void* out;                // up: h [nb*bm, N] in sorted-row order; down: y [pairs, N] at flat pair ids
  long long stride_o;
  const int* sorted;        // [nb*bm] flat pair ids, sentinel >= num_pairs
  const int* eid;           // [nb] expert of each block, -1 unused
  const int* num_rows;      // [1]
  int nb, bm, N, K, top_k, num_pairs;
  int a_by_token, act, cap, scale_vec;
  int pdl;                  // launch as a programmatic dependent of the previous kernel (down after up)
  float beta, linear_beta;
};"""
BODY = r"""template <typename T> struct Io;
template <> struct Io<__nv_bfloat16> {
  static constexpr unsigned kBad = 0x7F80u;  // |x| bits >= this: Inf or NaN
  static __device__ __forceinline__ float f(unsigned b) { return __uint_as_float((b & 0xFFFFu) << 16); }
  static __device__ __forceinline__ void st(void* p, long long i, float v) {
    reinterpret_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  }
};
template <> struct Io<__half> {
  static constexpr unsigned kBad = 0x7C00u;
  static __device__ __forceinline__ float f(unsigned b) { return __half2float(__ushort_as_half((unsigned short)(b & 0xFFFFu))); }
  static __device__ __forceinline__ void st(void* p, long long i, float v) {
    reinterpret_cast<__half*>(p)[i] = __float2half_rn(v);
  }
};

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {  // weights: read once, keep out of L1
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// One 32-bit word = E2M1 elements e0..e7 (byte j: e_{2j} low nibble, e_{2j+1} high nibble) -> four half2.
// DEC 0: E2M1 bits placed in fp16 (value * 2^-14, exact; code 1 is the fp16 subnormal 2^-15):
//        x[m] = (e_m, e_{m+4}).
// DEC 1: E2M1 bits placed in e4m3 bytes (value * 2^-6, exact), then the hardware e4m3x2 -> f16x2 convert:
//        x = (e0, e2), (e4, e6), (e1, e3), (e5, e7).
template <int DEC>
__device__ __forceinline__ void decode(uint32_t w, uint32_t (&x)[4]) {
  if constexpr (DEC == 0) {
    x[0] = ((w << 9) & 0x0E000E00u) | ((w << 12) & 0x80008000u);
    x[1] = ((w << 5) & 0x0E000E00u) | ((w << 8) & 0x80008000u);
    x[2] = ((w << 1) & 0x0E000E00u) | ((w << 4) & 0x80008000u);
    x[3] = ((w >> 3) & 0x0E000E00u) | (w & 0x80008000u);
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    const uint32_t ev = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);  // e0 e2 e4 e6
    const uint32_t od = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);         // e1 e3 e5 e7
    asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
        : "=r"(x[0]), "=r"(x[1]) : "r"(ev));
    asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
        : "=r"(x[2]), "=r"(x[3]) : "r"(od));
#else
    x[0] = x[1] = x[2] = x[3] = 0xFFFFFFFFu;  // never launched below sm_89 (host check)
#endif
  }
}

// Position of the activation that pairs with half h (0 low, 1 high) of x[m] inside a group of 8.
template <int DEC>
__device__ __forceinline__ int perm(int m, int h) {
  if constexpr (DEC == 0) return m + 4 * h;
  else return (m >> 1) + 4 * (m & 1) + 2 * h;
}

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float e8m0(unsigned s) {  // 2^(s-127) exactly; 0 -> 2^-127, 255 -> NaN
  return __uint_as_float(s == 0u ? 0x00400000u : (s == 255u ? 0x7FC00000u : s << 23));
}

__device__ __forceinline__ float glu(float g, float u, int act, int cap, float beta, float lb) {
  const float sig = 1.f / (1.f + expf(-g));
  if (act == 0) return g * sig * u;  // SiLU-GLU
  const float a = beta * tanhf(g / beta) * sig;  // SiTU-GLU
  if (cap) u = lb * tanhf(u / lb);
  return a * u;
}

// Programmatic dependent launch (sm_90+; no-ops when the launch carries no programmatic dependency).
__PDL__

template <int NT, int RT, int KS, bool GLU>
struct Smem {
  static constexpr int BMX = 2 * NT, NM = GLU ? 2 : 1, ROWS = 16 * RT;
  static __host__ __device__ int astr(int G) { return G * 128 + 8; }  // halves per staged token row
  static __host__ __device__ int sstr(int G) { return 4 * (G | 1); }  // bytes per E8M0 row (odd word count)
  static __host__ __device__ size_t act_bytes(int G) { return (size_t)BMX * astr(G) * 2; }
  static __host__ __device__ size_t scl_bytes(int G) { return (size_t)NM * ROWS * sstr(G); }
  static __host__ __device__ size_t bytes(int G) {
    return act_bytes(G) + scl_bytes(G) + 4 * ((size_t)KS * RT * NM * BMX * 16 + BMX);
  }
};

// One batch of U groups of weight loads (one 16-byte MX block per lane, row and matrix).
template <int U, int NM, int KS>
__device__ __forceinline__ void load_batch(uint4 (&d)[U][NM][2], const uint4* (&wr)[NM][2], int it, int ks,
                                           int J, int NBLK, int q, bool ok0, bool ok1) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int j = it * U + u, b = 4 * (ks + KS * j) + q;
    const bool v = j < J && b < NBLK;
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      d[u][m][0] = (v && ok0) ? ld_stream(wr[m][0] + b) : make_uint4(0u, 0u, 0u, 0u);
      d[u][m][1] = (v && ok1) ? ld_stream(wr[m][1] + b) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// Steps 5-6 for NR n8 tiles (the block's first 2*NR staged rows): stream the warp's groups, then the quad
// reduction into red[ks][rt][m][row][16]. NR is picked per CTA at run time from the block's valid rows.
template <int NR, int BMX, int NM, int RT, int KS, int U, int PF, int DEC>
__device__ __forceinline__ void stream_rows(uint4 (&cur)[U][NM][2], const uint4* (&wr)[NM][2], bool ok0,
                                            bool ok1, int ks, int rt, int g, int q, int J, int IT, int NBLK,
                                            int ASTR, int SSTR, const __half* act, const uint8_t* scl, float* red) {
  constexpr int ROWS = 16 * RT;
  const bool diag = (g & 3) == q;
  const int tokb = g >> 2;
  const uint4* actv = reinterpret_cast<const uint4*>(act);
  uint4 nxt[U][NM][2];
  float acc[NM][NR][4];
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int nt = 0; nt < NR; ++nt)
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[m][nt][k] = 0.f;

#pragma unroll 1
  for (int it = 0; it < IT; ++it) {
    if (PF) {
      if (it + 1 < IT) load_batch<U, NM, KS>(nxt, wr, it + 1, ks, J, NBLK, q, ok0, ok1);
    } else if (it > 0) {
      load_batch<U, NM, KS>(cur, wr, it, ks, J, NBLK, q, ok0, ok1);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = it * U + u;
      if (j < J) {
        const int gr = ks + KS * j;
        float c[NM][NR][4];
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
          for (int nt = 0; nt < NR; ++nt)
#pragma unroll
            for (int k = 0; k < 4; ++k) c[m][nt][k] = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint4 bq[NR];
#pragma unroll
          for (int nt = 0; nt < NR; ++nt) {
            bq[nt] = make_uint4(0u, 0u, 0u, 0u);
            if (diag) bq[nt] = actv[(2 * nt + tokb) * (ASTR >> 3) + (4 * gr + q) * 4 + i];
          }
#pragma unroll
          for (int m = 0; m < NM; ++m) {
            uint32_t x0[4], x1[4];
            decode<DEC>(word(cur[u][m][0], i), x0);
            decode<DEC>(word(cur[u][m][1], i), x1);
#pragma unroll
            for (int nt = 0; nt < NR; ++nt) {
              mma16816(c[m][nt], x0[0], x1[0], x0[1], x1[1], bq[nt].x, bq[nt].y);
              mma16816(c[m][nt], x0[2], x1[2], x0[3], x1[3], bq[nt].z, bq[nt].w);
            }
          }
        }
#pragma unroll
        for (int m = 0; m < NM; ++m) {  // E8M0 bytes of blocks 4gr + 2(q&1), +1 for rows g and g+8
          const uint8_t* sb = scl + (m * ROWS + rt * 16 + g) * SSTR + 4 * gr + 2 * (q & 1);
          const unsigned u0 = *reinterpret_cast<const unsigned short*>(sb);
          const unsigned u1 = *reinterpret_cast<const unsigned short*>(sb + 8 * SSTR);
          const float s00 = e8m0(u0 & 0xFFu), s01 = e8m0(u0 >> 8), s10 = e8m0(u1 & 0xFFu), s11 = e8m0(u1 >> 8);
#pragma unroll
          for (int nt = 0; nt < NR; ++nt) {
            acc[m][nt][0] = fmaf(c[m][nt][0], s00, acc[m][nt][0]);
            acc[m][nt][1] = fmaf(c[m][nt][1], s01, acc[m][nt][1]);
            acc[m][nt][2] = fmaf(c[m][nt][2], s10, acc[m][nt][2]);
            acc[m][nt][3] = fmaf(c[m][nt][3], s11, acc[m][nt][3]);
          }
        }
      }
    }
    if (PF) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int m = 0; m < NM; ++m) {
          cur[u][m][0] = nxt[u][m][0];
          cur[u][m][1] = nxt[u][m][1];
        }
    }
  }

  // 6. quad reduction into shared memory (rows 2nt, 2nt+1 of each n8 tile)
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int nt = 0; nt < NR; ++nt) {
      float v0 = acc[m][nt][0] + acc[m][nt][1];
      float v1 = acc[m][nt][2] + acc[m][nt][3];
      v0 += __shfl_xor_sync(0xFFFFFFFFu, v0, 1);
      v1 += __shfl_xor_sync(0xFFFFFFFFu, v1, 1);
      if ((q & 1) == 0) {
        float* d = red + (((ks * RT + rt) * NM + m) * BMX + 2 * nt + (q >> 1)) * 16;
        d[g] = v0;
        d[g + 8] = v1;
      }
    }
}

// Registers: at most 128 per thread wherever two 256-thread CTAs (or more smaller ones) fit an SM.
template <int NTHR>
struct MinBlocks {
  static constexpr int value = (512 / NTHR) > 0 ? 512 / NTHR : 1;
};

// One CTA: rows [n0, n0 + 16*RT) of one expert for the valid rows (at most bm <= 2*NT) of one alignment block.
// Warp w: row tile w % RT (16 rows), K slice w / RT (groups ks, ks + KS, ...; a group = 4 MX blocks = 128 k).
// The n8 tile count NR (1, 2 or 4, at most NT) follows the block's valid rows at run time: a block holding one
// or two pairs costs one mma per 16 k whatever bm is, and only its 2*NR rows are staged.
// Tensor-core mapping (mma m16n8k16, f16 in, f32 accumulate), lane = 4*g + q:
//   A: rows g and g+8 of the tile; lane q holds block 4*gr + q of the group (one 16-byte load per row), so the
//      k-slots of quad lane q in every mma are elements of block q only.
//   B: column c = 4*t + j (token t of the tile pair, block j); only lanes with q == g % 4 load activations,
//      the others hold 0, so C[row, 4t + j] = the partial dot product of block j alone.
//   C: lane holds columns 2q, 2q+1 = blocks 2(q&1), 2(q&1)+1 of token q>>1, which get their E8M0 scales after
//      the group's 8 mmas (one FFMA each), then a shuffle with lane q^1 adds the other two blocks.
// PDL: the GLU (up) kernel lets its dependent launch early; the down kernel stages weights and scales before
// griddepcontrol.wait, which returns once the up grid has completed and its h writes are visible.
template <typename T, int NT, int RT, int KS, int U, int PF, int DEC, bool GLU>
__global__ void __launch_bounds__(32 * RT * KS, MinBlocks<32 * RT * KS>::value)
mx_gemv_kernel(const Args p) {
  using S = Smem<NT, RT, KS, GLU>;
  constexpr int NTHR = 32 * RT * KS, BMX = S::BMX, NM = S::NM, ROWS = S::ROWS;
  constexpr int BIAS = DEC == 0 ? 14 : 6;  // decoded weight = E2M1 value * 2^-BIAS
  if constexpr (GLU) pdl_trigger();  // every CTA, before any exit
  const int nb = p.nb, bm = p.bm;
  const int blk = blockIdx.x % nb, tile = blockIdx.x / nb;
  if (blk * bm >= __ldg(p.num_rows)) return;
  const int e = __ldg(p.eid + blk);
  if (e < 0) return;
  const int K = p.K, N = p.N, G = (K + 127) >> 7, NBLK = K >> 5;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rt = warp % RT, ks = warp / RT, g = lane >> 2, q = lane & 3;
  const int n0 = tile * ROWS;
  const int r0 = n0 + rt * 16 + g, r1 = r0 + 8;
  const int J = (G - ks + KS - 1) / KS;  // groups of this warp
  const int IT = (J + U - 1) / U;
  const int ASTR = S::astr(G), SSTR = S::sstr(G);

  extern __shared__ __align__(16) unsigned char smem[];
  __half* act = reinterpret_cast<__half*>(smem);                              // [BMX][ASTR], permuted, scaled
  uint8_t* scl = smem + S::act_bytes(G);                                       // [NM][ROWS][SSTR] E8M0 bytes
  float* red = reinterpret_cast<float*>(scl + S::scl_bytes(G));               // [KS][RT][NM][BMX][16]
  unsigned* amx = reinterpret_cast<unsigned*>(red + KS * RT * NM * BMX * 16);  // [BMX] max |a| bits

  // 1. first weight loads in flight before anything else
  const uint4* wr[NM][2];
  {
    const uint8_t* b0 = p.w1 + (long long)e * p.wse;
    wr[0][0] = reinterpret_cast<const uint4*>(b0 + (long long)r0 * p.wsn);
    wr[0][1] = reinterpret_cast<const uint4*>(b0 + (long long)r1 * p.wsn);
    if constexpr (GLU) {
      const uint8_t* b3 = p.w3 + (long long)e * p.wse;
      wr[NM - 1][0] = reinterpret_cast<const uint4*>(b3 + (long long)r0 * p.wsn);
      wr[NM - 1][1] = reinterpret_cast<const uint4*>(b3 + (long long)r1 * p.wsn);
    }
  }
  const bool ok0 = r0 < N, ok1 = r1 < N;
  uint4 cur[U][NM][2];
  load_batch<U, NM, KS>(cur, wr, 0, ks, J, NBLK, q, ok0, ok1);

  // valid rows of the block (a prefix in align.py; here: the last valid row + 1), the same in every warp
  const unsigned vb = __ballot_sync(0xFFFFFFFFu, lane < bm && __ldg(p.sorted + blk * bm + lane) < p.num_pairs);
  const int nv = 32 - __clz(vb);
  if (nv == 0) return;
  const int nr = nv <= 2 || NT == 1 ? 1 : (nv <= 4 || NT == 2 ? 2 : 4);  // n8 tiles this CTA runs
  const int rows2 = 2 * nr;                                              // activation rows staged

  // 2. E8M0 bytes of the CTA's rows -> shared memory (rows past N and blocks past K read as 1 = 127)
  if (tid < BMX) amx[tid] = 0u;
#pragma unroll 1
  for (int m = 0; m < NM; ++m) {
    const uint8_t* sb = (m == 0 ? p.s1 : p.s3) + (long long)e * p.sse;
    if (p.scale_vec) {  // NBLK % 16 == 0 and 16-byte aligned rows: one 16-byte load per 16 blocks
      const int CPR = NBLK >> 4;
#pragma unroll 2
      for (int i = tid; i < ROWS * CPR; i += NTHR) {
        const int rr = i / CPR, c = i - rr * CPR, n = n0 + rr;
        uint4 v = make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
        if (n < N) v = __ldg(reinterpret_cast<const uint4*>(sb + (long long)n * p.ssn) + c);
        unsigned* d = reinterpret_cast<unsigned*>(scl + (m * ROWS + rr) * SSTR + 16 * c);
        d[0] = v.x;
        d[1] = v.y;
        d[2] = v.z;
        d[3] = v.w;
      }
    } else {
#pragma unroll 4
      for (int i = tid; i < ROWS * NBLK; i += NTHR) {
        const int rr = i / NBLK, b = i - rr * NBLK, n = n0 + rr;
        scl[(m * ROWS + rr) * SSTR + b] = n < N ? __ldg(sb + (long long)n * p.ssn + b) : (uint8_t)127;
      }
    }
    for (int i = tid; i < ROWS * (4 * G - NBLK); i += NTHR) {  // padded blocks of the last group
      const int rr = i / (4 * G - NBLK);
      scl[(m * ROWS + rr) * SSTR + NBLK + (i - rr * (4 * G - NBLK))] = (uint8_t)127;
    }
  }
  if constexpr (!GLU) pdl_wait();  // h (the up kernel's output) is read from here on
  __syncthreads();

  // 3. activations of the staged rows -> shared memory (raw), and max |a| per row
  const int KC = K >> 3, GC = G * 16;  // 8-element chunks: real / padded to whole groups
#pragma unroll 1
  for (int t = 0; t < rows2; ++t) {
    const int row = blk * bm + t;
    const int flat = t < bm ? __ldg(p.sorted + row) : p.num_pairs;
    const bool valid = flat < p.num_pairs;
    const long long arow = p.a_by_token ? (long long)(flat / p.top_k) : (long long)row;
    const uint4* src = reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(p.a) + arow * p.stride_a);
    uint4* dst = reinterpret_cast<uint4*>(act + t * ASTR);
    unsigned mx = 0u;
#pragma unroll 4
    for (int c = tid; c < GC; c += NTHR) {
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (valid && c < KC) v = __ldg(src + c);
      dst[c] = v;
      mx = __vmaxu2(mx, __vmaxu2(__vmaxu2(v.x & 0x7FFF7FFFu, v.y & 0x7FFF7FFFu),
                                 __vmaxu2(v.z & 0x7FFF7FFFu, v.w & 0x7FFF7FFFu)));
    }
    mx = max(mx & 0xFFFFu, mx >> 16);
    mx = __reduce_max_sync(0xFFFFFFFFu, mx);
    if (lane == 0 && mx) atomicMax(amx + t, mx);
  }
  __syncthreads();
  // 4. scale each row by 2^(BIAS - e_t) (max |a| -> [2^BIAS, 2^(BIAS+1)), exact for bf16/fp16 values in the
  //    fp16 normal range), convert to fp16 in the decode's pair order, in place (same thread, same chunks)
#pragma unroll 1
  for (int t = 0; t < rows2; ++t) {
    const unsigned mb = amx[t];
    const float am = Io<T>::f(mb);
    int et = am > 0.f && mb < Io<T>::kBad ? (int)((__float_as_uint(am) >> 23) & 0xFF) - 127 : 0;
    et = max(et, -100);
    const float sc = __uint_as_float((unsigned)(BIAS - et + 127) << 23);
    uint4* dst = reinterpret_cast<uint4*>(act + t * ASTR);
#pragma unroll 2
    for (int c = tid; c < GC; c += NTHR) {
      const uint4 v = dst[c];
      float f[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = Io<T>::f(word(v, k >> 1) >> (16 * (k & 1))) * sc;
      uint32_t o[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const __half2 h = __floats2half2_rn(f[perm<DEC>(m, 0)], f[perm<DEC>(m, 1)]);
        o[m] = *reinterpret_cast<const uint32_t*>(&h);
      }
      dst[c] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  __syncthreads();

  // 5-6. stream the weights with the CTA's n8 tile count (uniform per CTA)
  if (nr == 1) {
    stream_rows<1, BMX, NM, RT, KS, U, PF, DEC>(cur, wr, ok0, ok1, ks, rt, g, q, J, IT, NBLK, ASTR, SSTR,
                                                            act, scl, red);
  } else if (nr == 2) {
    if constexpr (NT >= 2)
      stream_rows<2, BMX, NM, RT, KS, U, PF, DEC>(cur, wr, ok0, ok1, ks, rt, g, q, J, IT, NBLK, ASTR, SSTR,
                                                            act, scl, red);
  } else {
    if constexpr (NT >= 4)  // no prefetch registers: four tiles of accumulators fit 128 registers
      stream_rows<4, BMX, NM, RT, KS, U, 0, DEC>(cur, wr, ok0, ok1, ks, rt, g, q, J, IT, NBLK, ASTR, SSTR,
                                                            act, scl, red);
  }
  __syncthreads();

  // 7. K-slice reduction and epilogue over the valid rows
  for (int i = tid; i < RT * nv * 16; i += NTHR) {
    const int rr = i & 15, t = (i >> 4) % nv, rti = i / (16 * nv);
    const int orow = blk * bm + t;
    const int flat = __ldg(p.sorted + orow);
    const int n = n0 + rti * 16 + rr;
    if (flat >= p.num_pairs || n >= N) continue;
    const unsigned mb = amx[t];
    const float am = Io<T>::f(mb);
    int et = am > 0.f && mb < Io<T>::kBad ? (int)((__float_as_uint(am) >> 23) & 0xFF) - 127 : 0;
    et = max(et, -100);
    const float qt = mb >= Io<T>::kBad ? __uint_as_float(0x7FC00000u) : __uint_as_float((unsigned)(et + 127) << 23);
    float s[NM];
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      float v = 0.f;
#pragma unroll
      for (int k = 0; k < KS; ++k) v += red[(((k * RT + rti) * NM + m) * BMX + t) * 16 + rr];
      s[m] = v * qt;
    }
    if constexpr (GLU) {
      Io<T>::st(p.out, (long long)orow * p.stride_o + n, glu(s[0], s[NM - 1], p.act, p.cap, p.beta, p.linear_beta));
    } else {
      Io<T>::st(p.out, (long long)flat * p.stride_o + n, s[0]);
    }
  }
}

template <typename T, int NT, int RT, int KS, int U, int PF, int DEC, bool GLU>
cudaError_t launch(const Args& p, cudaStream_t stream) {
  using S = Smem<NT, RT, KS, GLU>;
  const int G = (p.K + 127) >> 7;
  const size_t smem = S::bytes(G);
  auto kern = mx_gemv_kernel<T, NT, RT, KS, U, PF, DEC, GLU>;
  if (smem > 48 * 1024) {
    static size_t set = 0;  // raise the opt-in limit once per instantiation (and again for a larger K)
    if (smem > set) {
      cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
      if (err != cudaSuccess) return err;
      set = smem;
    }
  }
  const long long tiles = (p.N + S::ROWS - 1) / S::ROWS;
  const dim3 grid((unsigned)(tiles * p.nb)), block(32 * RT * KS);
  if (p.pdl) return launch_pdl(kern, grid, block, smem, stream, p);  // may start while the up GEMV finishes
  kern<<<grid, block, smem, stream>>>(p);
  return cudaGetLastError();
}
"""

CUDA_SOURCE = CUDA_SOURCE.replace("__ARGS__", ARGS).replace("__BODY__", BODY).replace("__PDL__\n", PDL_SOURCE)
ARGS_SOURCE = ARGS_SOURCE.replace("__ARGS__", ARGS)
_CPP_SOURCE = _CPP_SOURCE.replace("__ARGS_SOURCE__", ARGS_SOURCE)


def _dispatch_source(configs: tuple[CudaGemvConfig, ...], dtypes: tuple[str, ...]) -> str:
    """Explicit instances and the (config, dtype, NT, GLU) → launcher table."""
    lines = ["namespace k3mx {", "using LaunchFn = cudaError_t (*)(const Args&, cudaStream_t);",
             f"static const LaunchFn kTable[{len(configs)}][2][3][2] = {{"]
    for c in configs:
        dts = []
        for tname, ctype in (("bf16", "__nv_bfloat16"), ("fp16", "__half")):
            nts = []
            for nt in _NTS:
                if tname in dtypes:
                    f = [f"&launch<{ctype}, {nt}, {c.row_tiles}, {c.k_split}, {c.unroll}, {int(c.prefetch)}, "
                         f"{c.decode}, {glu}>" for glu in ("false", "true")]
                else:
                    f = ["nullptr", "nullptr"]
                nts.append("{" + ", ".join(f) + "}")
            dts.append("{" + ", ".join(nts) + "}")
        lines.append("  {" + ", ".join(dts) + "},")
    lines += ["};",
              "cudaError_t dispatch(int cfg, int dtype, int nt, int glu, const Args& p, cudaStream_t stream) {",
              f"  if (cfg < 0 || cfg >= {len(configs)}) return cudaErrorNotSupported;",
              "  const LaunchFn f = kTable[cfg][dtype][nt][glu];",
              "  return f ? f(p, stream) : cudaErrorNotSupported;", "}", "}  // namespace k3mx"]
    return "\n".join(lines) + "\n"


def kernel_source(configs=(DEFAULT_CONFIG,), dtypes=("bf16", "fp16")) -> str:
    """The complete ``.cu`` text for a config set (torch-free: compiles with plain nvcc)."""
    return CUDA_SOURCE + _dispatch_source(tuple(configs), tuple(dtypes))


def _check_config(cfg: CudaGemvConfig) -> None:
    if not (cfg.row_tiles in (1, 2, 4) and cfg.k_split in (1, 2, 3, 4, 8) and 1 <= cfg.unroll <= 8
            and cfg.row_tiles * cfg.k_split <= 16 and cfg.decode in (0, 1)):
        raise ValueError(f"mx_gemv_cuda: bad config {cfg} (row_tiles 1/2/4, k_split 1-4/8, unroll 1-8, "
                         f"≤ 16 warps, decode 0/1)")


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None when the CUDA GEMV can be built and run here, else the reason."""
    return toolchain_reason((8, 0), "mma.sync m16n8k16")


#: seconds the last :func:`build` spent compiling (0 when the module was already loaded)
last_build_seconds = 0.0


@functools.cache
def _build(configs: tuple[CudaGemvConfig, ...], dtypes: tuple[str, ...]):
    global last_build_seconds
    from torch.utils.cpp_extension import load_inline

    cu = kernel_source(configs, dtypes)
    tag = hashlib.sha1((cu + _CPP_SOURCE).encode()).hexdigest()[:12]
    t0 = time.perf_counter()
    kw = {}
    if "no_implicit_headers" in inspect.signature(load_inline).parameters:  # keep torch headers out of the .cu
        kw["no_implicit_headers"] = True
    mod = load_inline(name=f"k3nn_mx_gemv_{tag}", cpp_sources=[_CPP_SOURCE + "\n" + _DECL], cuda_sources=[cu],
                      functions=["mx_gemv_launch"], extra_cflags=["-O2"], extra_cuda_cflags=["-O3"],
                      verbose=os.environ.get("K3NN_BUILD_VERBOSE") == "1", **kw)
    last_build_seconds = time.perf_counter() - t0
    return mod


def build(configs=(DEFAULT_CONFIG,), dtypes=("bf16", "fp16")):
    """Compile (once per process and set; cached on disk by torch) the kernels of ``configs`` for ``dtypes``
    ('bf16', 'fp16'); returns the module. A launch must pass the same ``configs`` tuple (or the default)."""
    configs = tuple(CudaGemvConfig(*c) for c in configs)
    for c in configs:
        _check_config(c)
    bad = [d for d in dtypes if d not in ("bf16", "fp16")]
    if bad:
        raise ValueError(f"mx_gemv_cuda: dtypes must be 'bf16'/'fp16', got {bad}")
    return _build(configs, tuple(dtypes))


def smem_bytes(cfg: CudaGemvConfig, block_m: int, K: int, glu: bool) -> int:
    """Dynamic shared memory of one CTA (mirrors ``Smem`` in the CUDA source)."""
    nt = 1 if block_m <= 2 else (2 if block_m == 4 else 4)
    G, bmx, nm, rows = (K + 127) // 128, 2 * nt, 2 if glu else 1, 16 * cfg.row_tiles
    return bmx * (G * 128 + 8) * 2 + nm * rows * 4 * (G | 1) + 4 * (cfg.k_split * cfg.row_tiles * nm * bmx * 16 + bmx)


def _aligned16(t: torch.Tensor, dims=(0, 1)) -> bool:
    return t.data_ptr() % 16 == 0 and all(t.stride(d) % 16 == 0 for d in dims)


def _poisson_tail(lam: float, b: int) -> float:
    """P(X > b) for X ~ Poisson(lam)."""
    term = total = math.exp(-lam)
    for i in range(1, b + 1):
        term *= lam / i
        total += term
    return max(0.0, 1.0 - total)


BLOCK_RULES = ("one-block", "poisson", "mean")


def cuda_block_m(num_pairs: int, num_experts: int, rule: str = "one-block") -> int:
    """Alignment rows per CTA for the CUDA GEMV, from the launch sizes only (CUDA-graph capturable).

    ``one-block`` (the default): 8, so an expert with up to 8 pairs is ONE block and its weights are read once;
    the kernel runs only the n8 tiles a block's valid rows need, so the padding costs no mma work. On the H200
    (K3 experts, 128 of them, top-16; ``bench/results/logs/h200-s5-run2-2026-11-30.log``) it beat the smaller
    blocks of ``poisson`` at 1 token (61.2% of copy bandwidth against 52.8% with block_m 2) and lost 2 points at
    4 tokens (62.0% against 63.9% with 4). ``poisson``: the smallest of 2, 4, 8 that holds every touched
    expert's pairs in one block unless the routing is far from uniform (E·P(Poisson(P/E) > block_m) ≤ 1/4).
    ``mean``: the earlier rule, ≈ pairs per touched expert (2 at 16 tokens, where 3–6 pair experts then take
    2–3 blocks and re-read their weights: 40.5% against 57.4%)."""
    if rule == "one-block":
        return 8
    if rule == "mean":
        per = num_pairs / max(1, min(num_experts, num_pairs))
        return 2 if per <= 2.5 else (4 if per <= 4.5 else 8)
    if rule != "poisson":
        raise ValueError(f"cuda_block_m: rule must be one of {BLOCK_RULES}, got {rule!r}")
    lam = num_pairs / max(1, num_experts)
    for bm in (2, 4):
        if num_experts * _poisson_tail(lam, bm) <= 0.25:
            return bm
    return 8


def supports(x, w1, w3, w2, *rest, cfg: CudaGemvConfig | None = None, block_m: int = 8, **kw) -> str | None:
    """None when ``mx_gemv_experts_cuda`` takes these inputs, else the reason (checked before the alignment)."""
    cfg = cfg or DEFAULT_CONFIG
    if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
        return "inputs are not CUDA tensors"
    if x.dtype not in _DTYPES:
        return f"x dtype {x.dtype} is not bf16/fp16"
    if not all(isinstance(w, MXFP4Weight) for w in (w1, w3, w2)):
        return "expert weights are not MXFP4"
    for w in (w1, w3, w2):
        if w.packed.dim() != 3 or w.packed.stride(-1) != 1 or w.scale.stride(-1) != 1:
            return "packed weights and scales must be [E, N, K/2] / [E, N, K/32], contiguous in the last dim"
        if not _aligned16(w.packed):
            return "packed weights need 16-byte aligned rows (base and expert/row strides)"
    if w1.packed.stride() != w3.packed.stride() or w1.scale.stride() != w3.scale.stride():
        return "w1 and w3 must share strides"
    if cfg.decode == 1 and torch.cuda.get_device_capability(x.device) < (8, 9):
        return "decode=1 (e4m3 convert) needs sm_89+"
    lim = _smem_limit(x.device)
    for K, glu in ((w1.shape[2], True), (w2.shape[2], False)):
        need = smem_bytes(cfg, block_m, K, glu)
        if need > lim:
            return f"K={K} needs {need} bytes of shared memory per CTA (limit {lim})"
    return None


def _launch(mod_cfg, cfg, glu, a, w, w3, out, al, top_k, num_pairs, a_by_token, act, cap, beta, linear_beta,
            pdl=False):
    configs, dtypes = mod_cfg
    mod = build(configs, dtypes)
    idx = configs.index(cfg)
    svec = (w.shape[2] // 32) % 16 == 0 and _aligned16(w.scale) and _aligned16(w3.scale)
    mod.mx_gemv_launch(idx, glu, a, w.packed, w.scale, w3.packed, w3.scale, out, al.sorted_ids, al.expert_ids,
                       al.num_rows, al.block_m, top_k, num_pairs, a_by_token, act, cap, svec, beta, linear_beta,
                       pdl)


def pdl_enabled(dev) -> bool:
    """Whether the down GEMV is launched as a programmatic dependent of the up GEMV:
    ``KernelTuning.moe_cuda_pdl`` (read at each call; default True) on sm_90+."""
    return current_tuning().moe_cuda_pdl and torch.cuda.get_device_capability(dev) >= (9, 0)


def _module_for(cfg: CudaGemvConfig, configs, dtypes):
    if configs is None:
        configs = (DEFAULT_CONFIG,) if cfg == DEFAULT_CONFIG else (DEFAULT_CONFIG, cfg)
    configs = tuple(CudaGemvConfig(*c) for c in configs)
    if cfg not in configs:
        raise ValueError(f"mx_gemv_cuda: config {cfg} is not in the built set {configs}")
    return configs, tuple(dtypes)


def mx_gemv_experts_cuda(x: torch.Tensor, w1: MXFP4Weight, w3: MXFP4Weight, w2: MXFP4Weight, al, y2: torch.Tensor,
                         num_pairs: int, top_k: int, act: int, cap: bool, beta: float, linear_beta: float,
                         cfg_up: CudaGemvConfig | None = None, cfg_down: CudaGemvConfig | None = None,
                         configs=None, dtypes=("bf16", "fp16"), pdl: bool | None = None) -> None:
    """Up (w1/w3 + GLU, act 0 SiLU / 1 SiTU, ``cap``: linear_beta·tanh(u/linear_beta)) and down (w2) over the
    alignment ``al`` (block_m ∈ {1, 2, 4, 8}); writes y2 [P, D] at flat pair ids (x.dtype). ``configs``: the
    built set the two configs belong to (default: the defaults / the two configs themselves). ``pdl``: launch
    the down kernel as a programmatic dependent of the up kernel (default :func:`pdl_enabled`); two launches,
    no other work."""
    cu, cd = CudaGemvConfig(*(cfg_up or DEFAULT_CONFIG)), CudaGemvConfig(*(cfg_down or DEFAULT_CONFIG))
    if configs is None:
        configs = tuple(dict.fromkeys((DEFAULT_CONFIG, cu, cd)))
    mc = _module_for(cu, configs, dtypes)
    _module_for(cd, configs, dtypes)
    bm = al.block_m
    if bm not in (1, 2, 4, 8):
        raise ValueError(f"mx_gemv_cuda: block_m must be 1, 2, 4 or 8, got {bm}")
    why = supports(x, w1, w3, w2, cfg=cu, block_m=bm)
    if why:
        raise ValueError(f"mx_gemv_cuda: {why}")
    if x.data_ptr() % 16 or x.stride(-1) != 1 or x.stride(0) % 8:
        x = x.contiguous()
    nb = al.expert_ids.numel()
    I = w1.packed.shape[1]
    h = torch.empty(nb * bm, I, dtype=x.dtype, device=x.device)
    _launch(mc, cu, True, x, w1, w3, h, al, top_k, num_pairs, True, act, cap, beta, linear_beta)
    if pdl is None:
        pdl = pdl_enabled(x.device)
    pdl = bool(pdl) and torch.cuda.get_device_capability(x.device) >= (9, 0)
    _launch(mc, cd, False, h, w2, w2, y2, al, top_k, num_pairs, False, act, cap, beta, linear_beta, pdl)


def mx_gemv_linear_cuda(a: torch.Tensor, w: MXFP4Weight, cfg: CudaGemvConfig | None = None, block_m: int = 2,
                        configs=None, dtypes=("bf16", "fp16")) -> torch.Tensor:
    """``a @ W.T`` for one MXFP4 matrix W [N, K] (a [M, K] bf16/fp16) through the down kernel (mirrors
    ``triton_mx_gemv.mx_gemv_linear``): the decode/accumulate path on its own, for tests and micro-benchmarks."""
    from .align import MoEAlignment

    cfg = CudaGemvConfig(*(cfg or DEFAULT_CONFIG))
    if configs is None:
        configs = tuple(dict.fromkeys((DEFAULT_CONFIG, cfg)))
    mc = _module_for(cfg, configs, dtypes)
    if block_m not in (1, 2, 4, 8):
        raise ValueError(f"mx_gemv_cuda: block_m must be 1, 2, 4 or 8, got {block_m}")
    p, s = w.packed[None], w.scale[None]
    W3 = MXFP4Weight(p, s)
    why = supports(a, W3, W3, W3, cfg=cfg, block_m=block_m)
    if why:
        raise ValueError(f"mx_gemv_cuda: {why}")
    if a.data_ptr() % 16 or a.stride(-1) != 1 or a.stride(0) % 8:
        a = a.contiguous()
    M, N = a.shape[0], p.shape[1]
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if M == 0:
        return out
    nb = -(-M // block_m)
    dev = a.device
    sorted_ids = torch.full((nb * block_m,), M, dtype=torch.int32, device=dev)
    sorted_ids[:M] = torch.arange(M, dtype=torch.int32, device=dev)
    al = MoEAlignment(sorted_ids, torch.zeros(nb, dtype=torch.int32, device=dev),
                      torch.tensor([nb * block_m], dtype=torch.int32, device=dev), block_m)
    _launch(mc, cfg, False, a, W3, W3, out, al, 1, M, False, 0, False, 1.0, 1.0)
    return out
