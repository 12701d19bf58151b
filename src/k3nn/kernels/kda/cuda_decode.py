"""CUDA fused KDA decode (``torch.utils.cpp_extension.load_inline``, built on first use, never at import).

Same contract as :mod:`.decode` (head dim 128, fp32 state ``[N, H, 128, 128]`` K-first, updated in place in
the cache slots ``state_indices``). Three kernels share one prologue (conv + SiLU of the head's q | k | v
channels, the decay exp(g), β) and one conv-state rewrite; roundings follow the eager reference (conv output,
SiLU output, L2-normed q and k, raw o rounded to the activation dtype; RMSNorm and the sigmoid gate in fp32):

* ``block``: one 256-thread block per (request, head); thread ``tid`` holds state column ``tid % 128`` for rows
  ``64·(tid // 128) …`` in registers, scalar coalesced loads with streaming hints issued before the prologue,
  the two row halves meet in shared memory for the two K reductions.
* ``regs``: one block per (request, head) of ``NW`` warps (8 or 16); warp ``w`` owns state rows
  ``w·128/NW …`` and lane ``l`` columns ``4l … 4l+3``, so every load and store of the state is a 16-byte vector
  and a warp moves whole 512-byte rows. The K reductions meet in shared memory (``[NW, 128]`` partials, summed
  in the same order by every warp, so each warp holds the whole output row): the L2 norms and the RMSNorm are
  warp-local shuffles, three block barriers per token.
* ``persistent`` (the batched case): grid ≈ one CTA per SM, each looping over (request, head) items
  ``blockIdx.x, blockIdx.x + grid, …``. The 64 KB state tiles of its next ``STAGES`` items (2 or 3) stream
  into shared memory with 1-D bulk async copies (``cp.async.bulk`` … ``mbarrier::complete_tx``, L2
  ``evict_first``) while it computes the current one; the current tile goes from shared memory into the
  ``regs`` layout, its buffer is handed straight back to the copy engine for the item ``STAGES`` ahead, and the
  updated state leaves with 16-byte streaming stores (``st.global.cs.v4``) that nothing waits for. The prologue
  inputs of the next item are prefetched into L2 and its cache slot loaded one item ahead, so the per-item
  critical path (prologue, three barriers) stays short of the time its 128 KB of state traffic takes at copy
  bandwidth. The math is the ``regs`` kernel's. Shared memory: ``STAGES·64 KB`` + partials (:func:`smem_bytes`),
  one CTA per SM.

T > 1 (verify windows) runs in every kernel: a token loop over the state held in registers.

Knobs (read per call): ``K3NN_KDA_CUDA_VARIANT`` = ``persistent`` (default) | ``regs`` | ``block``;
``K3NN_KDA_CUDA_WARPS`` = 8 | 16 (``regs`` / ``persistent``; default 8 and 16); ``K3NN_KDA_CUDA_STAGES`` = 2 |
3 (``persistent``, default 2); ``K3NN_KDA_CUDA_GRID`` (``persistent`` CTAs, default the SM count);
``K3NN_KDA_CUDA_ORDER`` = ``bh`` (default) | ``hb`` (``block`` / ``regs``: grid (H, B), the heads of one request
launched together, as the Triton ``head`` path's default order).

H200 (``bench/results/logs/h200-s5-run2-2026-11-30.log``, T=1, H=96, CUDA graph): all three pass the GPU tests
against eager; at B=64 the persistent kernel moves the state at 68.1% of copy bandwidth (16 warps, 2 stages;
280 µs), ``regs`` 47–56%, ``block`` 56%, against 72% for the Triton ``head`` kernel then and 75% for fla's bare
recurrence; at B=1 ``regs`` takes 8.5 µs against 7.1 µs for the Triton ``split`` kernel. Launched heads first
(``K3NN_KDA_CUDA_ORDER=hb``, h200-s6-run4) ``regs`` gains 1–3% (57% with 8 warps), ``block`` reaches 56%, the
persistent kernel 68–70%, while the Triton ``head`` path now reaches 80.7%. So the CUDA kernels stay opt-in.

Availability: CUDA and nvcc. Opt-in: ``K3NN_KDA_CUDA=1`` takes the CUDA kernel for every call it supports.
``K3NN_KDA_CUDA_AUTO=1`` (or :data:`AUTO_DEFAULT`) lets ``auto`` take it only for B·H ≥
``K3NN_KDA_CUDA_AUTO_MIN`` (default :data:`AUTO_MIN_BH`); smaller calls stay on the Triton ``split`` path.
"""

from __future__ import annotations

import functools
import os

import torch

from ..cuda_ext import RAISE_SMEM_SOURCE, load_inline_module, toolchain_reason
from ..cuda_ext import sm_count as _sm_count
from ..cuda_ext import smem_per_block as _smem_limit

__all__ = [
    "AUTO_DEFAULT",
    "AUTO_MIN_BH",
    "CUDA_SOURCE",
    "VARIANTS",
    "auto_enabled",
    "auto_reason",
    "available",
    "build",
    "kda_fused_decode_cuda",
    "kernel_source",
    "plan",
    "smem_bytes",
    "supports",
]

D = 128
VARIANTS = ("persistent", "regs", "block")
_VARIANT_CODES = {"block": 0, "regs": 1, "persistent": 2}
_DT_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: ``auto`` (the registry's default route) takes the CUDA kernel without ``K3NN_KDA_CUDA=1`` when this is True
#: or ``K3NN_KDA_CUDA_AUTO=1``, for calls with B·H >= AUTO_MIN_BH (B=64, H=96 is 6144).
AUTO_DEFAULT = False
AUTO_MIN_BH = 2048
_DEFAULT_WARPS = {"regs": 8, "persistent": 16}
_DEFAULT_STAGES = 2  # 280.2 vs 283.6 µs at B=64 H=96 (h200-s5-run2)


def smem_bytes(warps: int, stages: int) -> int:
    """Dynamic shared memory of the persistent kernel (mirrors ``persist_smem_bytes`` in the CUDA source):
    ``stages`` fp32 [128, 128] tiles, two [warps, 128] fp32 partial buffers, q, k, v, exp(g), normalised k and q, mbarriers."""
    return stages * D * D * 4 + 2 * warps * D * 4 + 6 * D * 4 + 8 * stages


PARAMS_SOURCE = r"""
struct KdaParams {
  const void* qkv;      // [B, Tn, 3*H*D] act
  const void* f;        // [B, Tn, H*D] act
  const void* bl;       // [B, Tn, H] act
  const void* gate;     // [B, Tn, H*D] act
  const void* conv_w;   // [3*H*D, W] act
  const float* A_log;   // [H]
  const float* dt_bias; // [H*D]
  const float* norm_w;  // [D]
  float* S;             // [N, H, D, D] fp32, in place
  void* conv_state;     // [N, W-1, 3*H*D] act, in place
  const long long* idx; // [B] or nullptr (slots 0..B-1)
  void* y;              // [B, Tn, H, D] act
  int B, Tn, H, W, grid;
  int heads_first;      // block / regs: grid (H, B) instead of (B, H), the heads of a request run together
  float scale, lower_bound, eps;
  int softplus;
};
"""

CUDA_SOURCE = r"""
#include <cstdint>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace k3kda {
__PARAMS__

constexpr int D = 128;  // head dim (K = V)
constexpr int TILE_BYTES = D * D * 4;

__host__ __device__ constexpr int persist_smem_bytes(int nw, int stages) {
  return stages * TILE_BYTES + 2 * nw * D * 4 + 6 * D * 4 + 8 * stages;
}

// ---- activation dtype <-> fp32 (explicit intrinsics: the extension build disables implicit conversions)
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <typename T> __device__ __forceinline__ float round_t(float x) { return to_f(from_f<T>(x)); }

__device__ __forceinline__ float sigm(float x) {
  const float e = expf(-fabsf(x));
  return x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float4 operator*(float4 a, float s) { return make_float4(a.x * s, a.y * s, a.z * s, a.w * s); }
__device__ __forceinline__ float4 fma4(float4 a, float s, float4 c) {  // a * s + c
  return make_float4(fmaf(a.x, s, c.x), fmaf(a.y, s, c.y), fmaf(a.z, s, c.z), fmaf(a.w, s, c.w));
}
__device__ __forceinline__ float4 add4(float4 a, float4 b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }

// ---- shared prologue: token t of request b, head h. Conv over [conv_state rows (W-1) ; new tokens] + SiLU of
// the head's q | k | v channels into qs / ks / vs (rounded like the reference), exp(g) over K into es.
// Channel c of the head is always handled by thread c % NT (conv_rewrite relies on it). For W <= WMAX the
// window of each channel stays in registers (Taps): its loads are issued together, and conv_rewrite writes the
// new conv rows from the last token's window without reading them again.
constexpr int WMAX = 4;
template <int NT>
struct Taps {
  static constexpr int CPT = (3 * D + NT - 1) / NT;  // channels per thread
  float x[CPT][WMAX];
};

template <typename T, int NT>
__device__ __forceinline__ void conv_gate_head(const KdaParams& p, int b, int h, int t, long long slot,
                                               float* qs, float* ks, float* vs, float* es, Taps<NT>& tp) {
  constexpr int CPT = Taps<NT>::CPT;
  constexpr int GOFF = NT >= 4 * D ? 3 * D : 0;  // threads computing exp(g): idle conv threads when there are
  const int tid = threadIdx.x;
  const long long C = (long long)p.H * D, C3 = 3 * C;
  const long long row = (long long)b * p.Tn + t;
  const T* xb = static_cast<const T*>(p.qkv) + (long long)b * p.Tn * C3;
  const T* cs = static_cast<const T*>(p.conv_state) + slot * (long long)(p.W - 1) * C3;
  const T* cw = static_cast<const T*>(p.conv_w);
  const int gi = tid - GOFF;
  const bool gthr = gi >= 0 && gi < D;
  float xg = 0.f;
  if (gthr) xg = to_f(static_cast<const T*>(p.f)[row * C + (long long)h * D + gi]) + p.dt_bias[h * D + gi];
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = tid + i * NT;
    if (c < 3 * D) {
      const int grp = c / D, d = c % D;
      const long long ch = grp * C + (long long)h * D + d;
      float acc = 0.f;
      if (p.W <= WMAX) {
        float wv[WMAX];
#pragma unroll
        for (int w = 0; w < WMAX; ++w) {
          const int r = t + w;  // row of [conv_state (W-1 rows) ; new tokens]
          tp.x[i][w] = 0.f;
          wv[w] = 0.f;
          if (w < p.W) {
            tp.x[i][w] = r < p.W - 1 ? to_f(cs[(long long)r * C3 + ch]) : to_f(xb[(long long)(r - (p.W - 1)) * C3 + ch]);
            wv[w] = to_f(cw[ch * p.W + w]);
          }
        }
#pragma unroll
        for (int w = 0; w < WMAX; ++w)
          if (w < p.W) acc += wv[w] * tp.x[i][w];
      } else {
        for (int w = 0; w < p.W; ++w) {
          const int r = t + w;
          const float xv = r < p.W - 1 ? to_f(cs[(long long)r * C3 + ch]) : to_f(xb[(long long)(r - (p.W - 1)) * C3 + ch]);
          acc += to_f(cw[ch * p.W + w]) * xv;
        }
      }
      const float xv = round_t<T>(acc);
      const float sv = round_t<T>(xv * sigm(xv));
      (grp == 0 ? qs : (grp == 1 ? ks : vs))[d] = sv;
    }
  }
  if (gthr) {
    const float a = expf(p.A_log[h]);
    const float g = p.softplus ? -a * (xg > 20.f ? xg : log1pf(expf(xg))) : p.lower_bound * sigm(a * xg);
    es[gi] = expf(g);
  }
}

// L2 prefetch of what conv_gate_head / token_in will read for request b, head h, token 0 (the persistent kernel
// calls it one item ahead, so that the next prologue's loads hit L2 instead of waiting on loaded HBM queues).
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
}
template <typename T, int NT>
__device__ __forceinline__ void prefetch_head(const KdaParams& p, int b, int h, long long slot) {
  constexpr int GOFF = NT >= 4 * D ? 3 * D : 0;
  const int tid = threadIdx.x;
  const long long C = (long long)p.H * D, C3 = 3 * C;
  const long long row = (long long)b * p.Tn;
  const T* xb = static_cast<const T*>(p.qkv) + (long long)b * p.Tn * C3;
  const T* cs = static_cast<const T*>(p.conv_state) + slot * (long long)(p.W - 1) * C3;
  // one thread per 64 channels (a 128-byte line of bf16) of the q | k | v blocks
  if (tid < 3 * D / 64 * WMAX) {
    const int c = (tid % (3 * D / 64)) * 64, r = tid / (3 * D / 64);  // window row r of token 0
    const long long ch = (c / D) * C + (long long)h * D + c % D;
    if (r < p.W) prefetch_l2(r < p.W - 1 ? cs + (long long)r * C3 + ch : xb + ch);
  }
  const int gi = tid - GOFF;
  if (gi >= 0 && gi < D && gi % 32 == 0) {
    prefetch_l2(static_cast<const T*>(p.f) + row * C + (long long)h * D + gi);
    prefetch_l2(static_cast<const T*>(p.gate) + row * C + (long long)h * D + gi);
  }
  if (tid == 0) prefetch_l2(static_cast<const T*>(p.bl) + row * p.H + h);
}

// conv state: new row i = window row Tn + i, i.e. tap i + 1 of the last token's window. Each channel is read and
// written by one thread (the one that read it in conv_gate_head), and row Tn + i is never a row already
// rewritten (Tn >= 1).
template <typename T, int NT>
__device__ __forceinline__ void conv_rewrite(const KdaParams& p, int b, int h, long long slot, const Taps<NT>& tp) {
  const long long C = (long long)p.H * D, C3 = 3 * C;
  const T* xb = static_cast<const T*>(p.qkv) + (long long)b * p.Tn * C3;
  T* cs = static_cast<T*>(p.conv_state) + slot * (long long)(p.W - 1) * C3;
#pragma unroll
  for (int i = 0; i < Taps<NT>::CPT; ++i) {
    const int c = threadIdx.x + i * NT;
    if (c < 3 * D) {
      const int grp = c / D, d = c % D;
      const long long ch = grp * C + (long long)h * D + d;
      if (p.W <= WMAX) {
#pragma unroll
        for (int k = 0; k < WMAX - 1; ++k)
          if (k < p.W - 1) cs[(long long)k * C3 + ch] = from_f<T>(tp.x[i][k + 1]);
      } else {
        for (int k = 0; k < p.W - 1; ++k) {
          const int r = p.Tn + k;
          const T v = r < p.W - 1 ? cs[(long long)r * C3 + ch] : xb[(long long)(r - (p.W - 1)) * C3 + ch];
          cs[(long long)k * C3 + ch] = v;
        }
      }
    }
  }
}

// ================================ block: 256 threads, a column per thread ================================
constexpr int NT_BLOCK = 256;
constexpr int KH = D / 2;  // state rows held per thread

// every thread gets the sum over the block
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < NT_BLOCK / 32; ++i) s += red[i];
  return s;
}

template <typename T>
__global__ void __launch_bounds__(NT_BLOCK) kda_block_kernel(const KdaParams p) {
  const int b = p.heads_first ? blockIdx.y : blockIdx.x, h = p.heads_first ? blockIdx.x : blockIdx.y;
  const int tid = threadIdx.x;
  const int j = tid & (D - 1), half = tid >> 7;
  const int H = p.H;
  const long long C = (long long)H * D;
  const long long slot = p.idx ? p.idx[b] : (long long)b;
  __shared__ float qs[D], ks[D], vs[D], es[D], part[2][D], red[NT_BLOCK / 32];
  float* Sp = p.S + (slot * H + h) * (long long)D * D;  // [K, V] row-major
  float st[KH];
#pragma unroll
  for (int r = 0; r < KH; ++r) st[r] = __ldcs(Sp + (long long)(half * KH + r) * D + j);  // streamed: evict first
  Taps<NT_BLOCK> tp;
  for (int t = 0; t < p.Tn; ++t) {
    const long long row = (long long)b * p.Tn + t;
    conv_gate_head<T, NT_BLOCK>(p, b, h, t, slot, qs, ks, vs, es, tp);
    __syncthreads();
    const float qv = tid < D ? qs[tid] : 0.f, kv = tid < D ? ks[tid] : 0.f;
    const float qn = block_sum(qv * qv, red);
    const float kn = block_sum(kv * kv, red);
    const float beta = sigm(to_f(static_cast<const T*>(p.bl)[row * H + h]));
    if (tid < D) {
      qs[tid] = round_t<T>(qv / sqrtf(qn + 1e-6f)) * p.scale;
      ks[tid] = round_t<T>(kv / sqrtf(kn + 1e-6f));
    }
    __syncthreads();
    float pp = 0.f;
#pragma unroll
    for (int r = 0; r < KH; ++r) {
      st[r] *= es[half * KH + r];
      pp += st[r] * ks[half * KH + r];
    }
    part[half][j] = pp;
    __syncthreads();
    const float u = beta * (vs[j] - (part[0][j] + part[1][j]));
    float po = 0.f;
#pragma unroll
    for (int r = 0; r < KH; ++r) {
      st[r] += ks[half * KH + r] * u;
      po += st[r] * qs[half * KH + r];
    }
    __syncthreads();  // every thread has read part[] before it is reused
    part[half][j] = po;
    __syncthreads();
    const float o = round_t<T>(part[0][j] + part[1][j]);
    const float ss = block_sum(half == 0 ? o * o : 0.f, red);
    if (half == 0) {
      const float gt = to_f(static_cast<const T*>(p.gate)[row * C + (long long)h * D + j]);
      static_cast<T*>(p.y)[(row * H + h) * D + j] = from_f<T>(o * rsqrtf(ss / D + p.eps) * p.norm_w[j] * sigm(gt));
    }
    __syncthreads();  // before the shared vectors are overwritten by the next token
  }
#pragma unroll
  for (int r = 0; r < KH; ++r) __stcs(Sp + (long long)(half * KH + r) * D + j, st[r]);
  conv_rewrite<T, NT_BLOCK>(p, b, h, slot, tp);
}

// ====================== regs / persistent: NW warps, a warp per 128/NW rows, 4 columns per lane ======================
// Shared scratch of one CTA: partial sums of the two K reductions and the head's q, k, v, exp(g) for one token.
template <int NW>
struct Scratch {
  float* part0;  // [NW, D]
  float* part1;  // [NW, D]
  float* qs;
  float* ks;
  float* vs;
  float* es;
  float* kn;  // normalised k, q·scale (each warp writes its own rows)
  float* qn;
};

// Per-token values loaded before the prologue, so that their latency overlaps the conv loads: β's logit and,
// for warp 0 (which writes y), the lane's 4 output-gate logits.
template <typename T>
struct TokenIn {
  float b;
  float g[4];
};
template <typename T>
__device__ __forceinline__ TokenIn<T> token_in(const KdaParams& p, int b, int h, int t) {
  TokenIn<T> in;
  const long long row = (long long)b * p.Tn + t;
  const int lane = threadIdx.x & 31;
  in.b = to_f(static_cast<const T*>(p.bl)[row * p.H + h]);
#pragma unroll
  for (int i = 0; i < 4; ++i) in.g[i] = 0.f;
  if (threadIdx.x < 32) {
    const T* gp = static_cast<const T*>(p.gate) + row * (long long)p.H * D + (long long)h * D + 4 * lane;
#pragma unroll
    for (int i = 0; i < 4; ++i) in.g[i] = to_f(gp[i]);
  }
  return in;
}

// One token of the recurrence for the state rows this thread holds (st: rows w*RPW + r, columns 4*lane ...).
// Expects conv_gate_head's outputs in sc.qs / ks / vs / es behind a block barrier. Block barriers: two. The
// vectors may be overwritten (next token / item) by any thread once it has passed the second one.
template <typename T, int NW>
__device__ __forceinline__ void recur_token(const KdaParams& p, float4 (&st)[D / NW], const Scratch<NW>& sc,
                                            int b, int h, int t, const TokenIn<T>& in) {
  constexpr int RPW = D / NW;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const long long row = (long long)b * p.Tn + t;
  // L2 norms: every warp sums the whole vector (same order in every warp)
  const float4 q4 = reinterpret_cast<const float4*>(sc.qs)[lane];
  const float4 k4 = reinterpret_cast<const float4*>(sc.ks)[lane];
  const float qn = warp_sum(q4.x * q4.x + q4.y * q4.y + q4.z * q4.z + q4.w * q4.w);
  const float kn = warp_sum(k4.x * k4.x + k4.y * k4.y + k4.z * k4.z + k4.w * k4.w);
  const float rq = sqrtf(qn + 1e-6f), rk = sqrtf(kn + 1e-6f);
  const float beta = sigm(in.b);
  if (lane < RPW) {  // this warp's rows of the normalised k and q (rounded like the reference), for all lanes
    const int kr = w * RPW + lane;
    sc.kn[kr] = round_t<T>(sc.ks[kr] / rk);
    sc.qn[kr] = round_t<T>(sc.qs[kr] / rq) * p.scale;
  }
  __syncwarp();
  float4 pp = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int kr = w * RPW + r;
    st[r] = st[r] * sc.es[kr];
    pp = fma4(st[r], sc.kn[kr], pp);
  }
  reinterpret_cast<float4*>(sc.part0)[w * (D / 4) + lane] = pp;
  __syncthreads();
  float4 acc = reinterpret_cast<const float4*>(sc.part0)[lane];
#pragma unroll
  for (int i = 1; i < NW; ++i) acc = add4(acc, reinterpret_cast<const float4*>(sc.part0)[i * (D / 4) + lane]);
  const float4 v4 = reinterpret_cast<const float4*>(sc.vs)[lane];
  const float4 u = make_float4(beta * (v4.x - acc.x), beta * (v4.y - acc.y), beta * (v4.z - acc.z), beta * (v4.w - acc.w));
  float4 po = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int kr = w * RPW + r;
    st[r] = fma4(u, sc.kn[kr], st[r]);
    po = fma4(st[r], sc.qn[kr], po);
  }
  reinterpret_cast<float4*>(sc.part1)[w * (D / 4) + lane] = po;
  __syncthreads();
  if (w == 0) {  // the raw o (rounded like the reference) and the gated RMSNorm over the whole row, in warp 0
    float4 o = reinterpret_cast<const float4*>(sc.part1)[lane];
#pragma unroll
    for (int i = 1; i < NW; ++i) o = add4(o, reinterpret_cast<const float4*>(sc.part1)[i * (D / 4) + lane]);
    const float ov[4] = {round_t<T>(o.x), round_t<T>(o.y), round_t<T>(o.z), round_t<T>(o.w)};
    const float ss = warp_sum(ov[0] * ov[0] + ov[1] * ov[1] + ov[2] * ov[2] + ov[3] * ov[3]);
    const float rs = rsqrtf(ss / D + p.eps);
    T* yp = static_cast<T*>(p.y) + (row * p.H + h) * D + 4 * lane;
#pragma unroll
    for (int i = 0; i < 4; ++i) yp[i] = from_f<T>(ov[i] * rs * __ldg(p.norm_w + 4 * lane + i) * sigm(in.g[i]));
  }
}

template <int NW>
__device__ __forceinline__ void store_state(float* Sp, const float4 (&st)[D / NW]) {
  constexpr int RPW = D / NW;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < RPW; ++r) __stcs(reinterpret_cast<float4*>(Sp + (long long)(w * RPW + r) * D) + lane, st[r]);
}

template <int NW> struct RegsBounds { static constexpr int min_blocks = NW == 8 ? 2 : 1; };

template <typename T, int NW>
__global__ void __launch_bounds__(32 * NW, RegsBounds<NW>::min_blocks) kda_regs_kernel(const KdaParams p) {
  constexpr int NT = 32 * NW, RPW = D / NW;
  const int b = p.heads_first ? blockIdx.y : blockIdx.x, h = p.heads_first ? blockIdx.x : blockIdx.y;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const long long slot = p.idx ? p.idx[b] : (long long)b;
  __shared__ __align__(16) float part0[NW * D], part1[NW * D], qs[D], ks[D], vs[D], es[D], kn[D], qn[D];
  const Scratch<NW> sc{part0, part1, qs, ks, vs, es, kn, qn};
  float* Sp = p.S + (slot * p.H + h) * (long long)D * D;
  float4 st[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) st[r] = __ldcs(reinterpret_cast<const float4*>(Sp + (long long)(w * RPW + r) * D) + lane);
  Taps<NT> tp;
  for (int t = 0; t < p.Tn; ++t) {
    const TokenIn<T> in = token_in<T>(p, b, h, t);
    conv_gate_head<T, NT>(p, b, h, t, slot, qs, ks, vs, es, tp);
    __syncthreads();
    recur_token<T, NW>(p, st, sc, b, h, t, in);
  }
  store_state<NW>(Sp, st);
  conv_rewrite<T, NT>(p, b, h, slot, tp);
}

// ============================ persistent: bulk async copies of the next tiles ============================
// sm_90 PTX (cp.async.bulk, mbarrier expect_tx); an older target in the build gets a trapping stub instead.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define K3KDA_BULK 1
#else
#define K3KDA_BULK 0
#endif
__device__ __forceinline__ unsigned smem_u32(const void* ptr) {
  return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar), "r"(parity) : "memory");
}
// one state tile (64 KB, 16-byte aligned) global -> shared, completion counted on `bar`; L2 evict-first
__device__ __forceinline__ void tile_load(unsigned dst, const float* src, unsigned bar) {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  mbar_expect_tx(bar, TILE_BYTES);
  constexpr int PIECES = 4, PIECE = TILE_BYTES / PIECES;
#pragma unroll
  for (int i = 0; i < PIECES; ++i)
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
        ::"r"(dst + i * PIECE), "l"(reinterpret_cast<const char*>(src) + i * PIECE), "r"(PIECE), "r"(bar), "l"(policy)
        : "memory");
}

template <typename T, int NW, int STAGES>
__global__ void __launch_bounds__(32 * NW, 1) kda_persistent_kernel(const KdaParams p) {
#if !K3KDA_BULK
  __trap();
#else
  constexpr int NT = 32 * NW, RPW = D / NW;
  extern __shared__ __align__(128) unsigned char smem[];
  float* tiles = reinterpret_cast<float*>(smem);  // [STAGES, D, D]
  float* part0 = tiles + STAGES * D * D;
  float* part1 = part0 + NW * D;
  float* qs = part1 + NW * D;
  float* ks = qs + D;
  float* vs = ks + D;
  float* es = vs + D;
  float* kn = es + D;
  float* qn = kn + D;
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(qn + D);
  const Scratch<NW> sc{part0, part1, qs, ks, vs, es, kn, qn};
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int items = p.B * p.H, G = p.grid;
  auto slot_of = [&](int item) -> int {  // slots are < 2^31 (checked on the host)
    const int b = item / p.H;
    return p.idx ? (int)p.idx[b] : b;
  };
  auto tile_of = [&](int item, int slot) { return p.S + ((long long)slot * p.H + (item % p.H)) * D * D; };
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(smem_u32(bars + s), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      const int item = blockIdx.x + s * G;
      if (item < items) tile_load(smem_u32(tiles + s * D * D), tile_of(item, slot_of(item)), smem_u32(bars + s));
    }
  }
  __syncthreads();  // barriers initialised before anyone waits on them
  int slot_next = blockIdx.x < items ? slot_of(blockIdx.x) : 0;
  int j = 0;  // local item count
  for (int item = blockIdx.x; item < items; item += G, ++j) {
    const int b = item / p.H, h = item - b * p.H;
    const long long slot = slot_next;
    if (item + G < items) slot_next = slot_of(item + G);  // in flight during this item
    const int ahead = item + STAGES * G;  // the item whose tile goes into this item's buffer
    int slot_ahead = 0;
    if (tid == 0 && ahead < items) slot_ahead = slot_of(ahead);
    const int s = j % STAGES;
    const float* tile = tiles + s * D * D;
    float4 st[RPW];
    Taps<NT> tp;
    for (int t = 0; t < p.Tn; ++t) {
      const TokenIn<T> in = token_in<T>(p, b, h, t);
      conv_gate_head<T, NT>(p, b, h, t, slot, qs, ks, vs, es, tp);  // while the tile is (still) in flight
      if (t == 0) {
        mbar_wait(smem_u32(bars + s), (j / STAGES) & 1);
#pragma unroll
        for (int r = 0; r < RPW; ++r) st[r] = reinterpret_cast<const float4*>(tile + (w * RPW + r) * D)[lane];
      }
      __syncthreads();  // prologue outputs visible; for t == 0 every thread has its rows of the tile
      if (t == 0 && tid == 0 && ahead < items) {  // the buffer goes straight back to the copy engine
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic reads before async writes
        tile_load(smem_u32(tile), tile_of(ahead, slot_ahead), smem_u32(bars + s));
      }
      if (t == 0 && item + G < items) {
        const int bn = (item + G) / p.H;
        prefetch_head<T, NT>(p, bn, item + G - bn * p.H, slot_next);
      }
      recur_token<T, NW>(p, st, sc, b, h, t, in);
    }
    store_state<NW>(p.S + (slot * p.H + h) * (long long)D * D, st);
    conv_rewrite<T, NT>(p, b, h, slot, tp);
  }
#endif
}

// --------------------------------------------------------------------------------------------------------------
__RAISE_SMEM__

template <typename T, int NW, int STAGES>
cudaError_t launch_persistent(const KdaParams& p, cudaStream_t stream) {
  static bool raised[64] = {};
  constexpr int bytes = persist_smem_bytes(NW, STAGES);
  auto kern = kda_persistent_kernel<T, NW, STAGES>;
  cudaError_t err = raise_smem(kern, bytes, raised);
  if (err != cudaSuccess) return err;
  kern<<<p.grid, 32 * NW, bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_t(const KdaParams& p, int variant, int nw, int stages, cudaStream_t stream) {
  const dim3 bh = p.heads_first ? dim3(p.H, p.B) : dim3(p.B, p.H);
  if (variant == 0) {
    kda_block_kernel<T><<<bh, NT_BLOCK, 0, stream>>>(p);
    return cudaGetLastError();
  }
  if (variant == 1) {
    if (nw == 8) kda_regs_kernel<T, 8><<<bh, 256, 0, stream>>>(p);
    else if (nw == 16) kda_regs_kernel<T, 16><<<bh, 512, 0, stream>>>(p);
    else return cudaErrorInvalidValue;
    return cudaGetLastError();
  }
  if (variant == 2) {
    if (p.grid < 1) return cudaErrorInvalidValue;
    if (nw == 8 && stages == 2) return launch_persistent<T, 8, 2>(p, stream);
    if (nw == 8 && stages == 3) return launch_persistent<T, 8, 3>(p, stream);
    if (nw == 16 && stages == 2) return launch_persistent<T, 16, 2>(p, stream);
    if (nw == 16 && stages == 3) return launch_persistent<T, 16, 3>(p, stream);
  }
  return cudaErrorInvalidValue;
}

// dt: 0 fp32, 1 fp16, 2 bf16 (activations); variant: 0 block, 1 regs, 2 persistent
cudaError_t kda_decode_dispatch(const KdaParams& p, int dt, int variant, int nw, int stages, cudaStream_t stream) {
  if (dt == 0) return launch_t<float>(p, variant, nw, stages, stream);
  if (dt == 1) return launch_t<__half>(p, variant, nw, stages, stream);
  if (dt == 2) return launch_t<__nv_bfloat16>(p, variant, nw, stages, stream);
  return cudaErrorNotSupported;
}
}  // namespace k3kda
"""

_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
namespace k3kda {
__PARAMS__
cudaError_t kda_decode_dispatch(const KdaParams& p, int dt, int variant, int nw, int stages, cudaStream_t stream);
}

torch::Tensor kda_fused_decode_cuda(torch::Tensor qkv, torch::Tensor f, torch::Tensor b, torch::Tensor gate,
                                    torch::Tensor conv_w, torch::Tensor A_log, torch::Tensor dt_bias,
                                    torch::Tensor norm_w, torch::Tensor S, torch::Tensor conv_state,
                                    std::optional<torch::Tensor> idx, bool softplus, double lower_bound,
                                    double eps, double scale, int64_t dt, int64_t variant, int64_t warps,
                                    int64_t stages, int64_t grid, bool heads_first) {
  const c10::cuda::CUDAGuard guard(qkv.device());
  const int64_t B = qkv.size(0), Tn = qkv.size(1), H = A_log.size(0);
  auto y = torch::empty({B, Tn, H, 128}, qkv.options());
  if (B == 0 || Tn == 0) return y;
  TORCH_CHECK(S.scalar_type() == torch::kFloat && S.is_contiguous() && conv_state.is_contiguous(),
              "kda_fused_decode_cuda: contiguous fp32 state and contiguous conv state");
  TORCH_CHECK(S.data_ptr() != nullptr && reinterpret_cast<uintptr_t>(S.data_ptr()) % 16 == 0,
              "kda_fused_decode_cuda: state must be 16-byte aligned");
  qkv = qkv.contiguous(); f = f.contiguous(); b = b.contiguous(); gate = gate.contiguous();
  conv_w = conv_w.contiguous();
  auto A = A_log.to(torch::kFloat).contiguous();
  auto dtb = dt_bias.to(torch::kFloat).contiguous();
  auto nw = norm_w.to(torch::kFloat).contiguous();
  torch::Tensor idx64;
  k3kda::KdaParams p;
  p.idx = nullptr;
  if (idx.has_value()) {
    idx64 = idx->to(torch::kLong).contiguous();
    p.idx = reinterpret_cast<const long long*>(idx64.data_ptr<int64_t>());
  }
  p.qkv = qkv.data_ptr(); p.f = f.data_ptr(); p.bl = b.data_ptr(); p.gate = gate.data_ptr();
  p.conv_w = conv_w.data_ptr(); p.A_log = A.data_ptr<float>(); p.dt_bias = dtb.data_ptr<float>();
  p.norm_w = nw.data_ptr<float>(); p.S = S.data_ptr<float>(); p.conv_state = conv_state.data_ptr();
  p.y = y.data_ptr();
  p.B = (int)B; p.Tn = (int)Tn; p.H = (int)H; p.W = (int)conv_w.size(1);
  p.grid = (int)std::min<int64_t>(grid, B * H);
  p.heads_first = heads_first ? 1 : 0;
  TORCH_CHECK(B <= 65535 || !heads_first, "kda_fused_decode_cuda: heads-first order needs B <= 65535");
  p.scale = (float)scale; p.lower_bound = (float)lower_bound; p.eps = (float)eps; p.softplus = softplus ? 1 : 0;
  const cudaError_t err = k3kda::kda_decode_dispatch(p, (int)dt, (int)variant, (int)warps, (int)stages,
                                                     c10::cuda::getCurrentCUDAStream(qkv.device().index()));
  TORCH_CHECK(err == cudaSuccess, "kda_fused_decode_cuda: ", cudaGetErrorString(err));
  return y;
}
"""

_DECL = ("torch::Tensor kda_fused_decode_cuda(torch::Tensor qkv, torch::Tensor f, torch::Tensor b, "
         "torch::Tensor gate, torch::Tensor conv_w, torch::Tensor A_log, torch::Tensor dt_bias, "
         "torch::Tensor norm_w, torch::Tensor S, torch::Tensor conv_state, std::optional<torch::Tensor> idx, "
         "bool softplus, double lower_bound, double eps, double scale, int64_t dt, int64_t variant, "
         "int64_t warps, int64_t stages, int64_t grid, bool heads_first);")

CUDA_SOURCE = CUDA_SOURCE.replace("__PARAMS__", PARAMS_SOURCE).replace("__RAISE_SMEM__", RAISE_SMEM_SOURCE)
_CPP_SOURCE = _CPP_SOURCE.replace("__PARAMS__", PARAMS_SOURCE)


def kernel_source() -> str:
    """The complete ``.cu`` text (torch-free: compiles with plain nvcc)."""
    return CUDA_SOURCE


def _on(name: str) -> bool:
    return os.environ.get(name, "0").strip() not in ("", "0")


def auto_enabled() -> bool:
    """Whether ``auto`` may take the CUDA kernel (for large B·H) without ``K3NN_KDA_CUDA=1``."""
    v = os.environ.get("K3NN_KDA_CUDA_AUTO", "").strip()
    return AUTO_DEFAULT if v == "" else v != "0"


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    why = toolchain_reason()
    if why:
        return why
    if not _on("K3NN_KDA_CUDA") and not auto_enabled():
        return ("opt-in: set K3NN_KDA_CUDA=1 (every call), or K3NN_KDA_CUDA_AUTO=1 (auto takes it for "
                f"B*H >= {AUTO_MIN_BH}); on the H200 it is slower than the Triton kernel")
    return None


#: seconds the last :func:`build` spent compiling or loading (0 once the module is loaded in this process)
last_build_seconds = 0.0


@functools.lru_cache(maxsize=1)
def build():
    """Compile (once per process; cached on disk by torch under a source hash) and return the module."""
    global last_build_seconds
    mod, last_build_seconds = load_inline_module("k3nn_kda_decode", CUDA_SOURCE, _CPP_SOURCE + "\n" + _DECL,
                                                 ["kda_fused_decode_cuda"])
    return mod


def _env_choice(name: str, choices: tuple, default):
    v = os.environ.get(name, "").strip().lower()
    if not v:
        return default
    if v not in {str(c) for c in choices}:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {v!r}")
    return type(default)(v) if not isinstance(default, str) else v


def plan(B: int, H: int, sm_count: int | None = None) -> dict:
    """Kernel the CUDA path takes for B·H request-heads: ``variant`` (``K3NN_KDA_CUDA_VARIANT``), ``warps``
    (``K3NN_KDA_CUDA_WARPS``), ``stages`` (``K3NN_KDA_CUDA_STAGES``), ``grid`` (persistent CTAs:
    ``K3NN_KDA_CUDA_GRID``, else one per SM, at most B·H). Depends on shapes and environment only (graph-safe)."""
    variant = _env_choice("K3NN_KDA_CUDA_VARIANT", VARIANTS, "persistent")
    warps = _env_choice("K3NN_KDA_CUDA_WARPS", (8, 16), _DEFAULT_WARPS.get(variant, 8))
    stages = _env_choice("K3NN_KDA_CUDA_STAGES", (2, 3), _DEFAULT_STAGES)
    g = os.environ.get("K3NN_KDA_CUDA_GRID", "").strip()
    grid = int(g) if g else (sm_count if sm_count is not None else 132)
    if variant == "block":
        warps = 8
    order = _env_choice("K3NN_KDA_CUDA_ORDER", ("bh", "hb"), "bh")
    return dict(variant=variant, warps=warps, stages=stages, grid=max(1, min(grid, max(1, B * H))),
                heads_first=order == "hb" and B <= 65535)


def supports(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, recurrent_state, conv_state,
             state_indices=None, gate_kind="softplus", lower_bound=-5.0, norm_eps=1e-5, scale=None):
    if qkv.device.type != "cuda":
        return "inputs are not CUDA tensors"
    if norm_weight.shape[0] != D:
        return f"head dim must be {D} for the CUDA kernel, got {norm_weight.shape[0]}"
    if qkv.dtype not in _DT_CODES:
        return f"dtype {qkv.dtype} not supported"
    for name, t in (("f", f), ("b", b), ("gate", gate), ("conv_weight", conv_weight), ("conv_state", conv_state)):
        if t.dtype != qkv.dtype:
            return f"{name} must have qkv's dtype {qkv.dtype}, got {t.dtype}"
    if recurrent_state.dtype != torch.float32 or not recurrent_state.is_contiguous():
        return "recurrent_state must be contiguous float32 (updated in place)"
    if recurrent_state.data_ptr() % 16:
        return "recurrent_state must be 16-byte aligned (vector / bulk copies)"
    if not conv_state.is_contiguous():
        return "conv_state must be contiguous (updated in place)"
    B, H = qkv.shape[0], A_log.shape[0]
    try:
        pl = plan(B, H)
    except ValueError as e:
        return str(e)
    if B > 2 ** 31 - 1 or B * H > 2 ** 31 - 1:
        return f"B*H = {B * H} does not fit in int32"
    if pl["variant"] == "persistent":
        need = smem_bytes(pl["warps"], pl["stages"])
        lim = _smem_limit(qkv.device)
        if need > lim:
            return f"the persistent kernel needs {need} bytes of shared memory per CTA (limit {lim})"
        if torch.cuda.get_device_capability(qkv.device) < (9, 0):
            return "the persistent kernel needs sm_90 (cp.async.bulk, mbarrier tx counts)"
    return auto_reason(B, H)


def auto_reason(B: int, H: int) -> str | None:
    """Without ``K3NN_KDA_CUDA=1`` (here through ``K3NN_KDA_CUDA_AUTO`` / :data:`AUTO_DEFAULT`) the kernel takes
    large batches only: B·H >= ``K3NN_KDA_CUDA_AUTO_MIN`` (default :data:`AUTO_MIN_BH`)."""
    if _on("K3NN_KDA_CUDA"):
        return None
    v = os.environ.get("K3NN_KDA_CUDA_AUTO_MIN", "").strip()
    lo = int(v) if v else AUTO_MIN_BH
    if B * H < lo:
        return f"B*H = {B * H} < {lo}: the Triton kernel is faster there (K3NN_KDA_CUDA=1 forces this one)"
    return None


def kda_fused_decode_cuda(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, recurrent_state, conv_state,
                          state_indices=None, gate_kind="softplus", lower_bound=-5.0, norm_eps=1e-5, scale=None):
    Dh, H = norm_weight.shape[0], A_log.shape[0]
    scale = Dh ** -0.5 if scale is None else float(scale)
    pl = plan(qkv.shape[0], H, _sm_count(qkv.device.index or 0))
    return build().kda_fused_decode_cuda(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight,
                                         recurrent_state, conv_state, state_indices, gate_kind == "softplus",
                                         float(lower_bound), float(norm_eps), scale, _DT_CODES[qkv.dtype],
                                         _VARIANT_CODES[pl["variant"]], pl["warps"], pl["stages"], pl["grid"],
                                         pl["heads_first"])
