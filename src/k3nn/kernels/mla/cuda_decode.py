"""CUDA absorbed MLA decode over the paged latent cache, split-KV (``torch.utils.cpp_extension.load_inline``,
built on first use, never at import).

Same contract as :func:`k3nn.ops.mla_decode` (see :mod:`.reference`), for the K3 dims: latent r = 512, rope
dr = 64 (one 576-wide cache row per token), bf16 or fp16 inputs, fp32 accumulation.

Stage 1 is the warp-group kernel (built for sm_90a): 64 query rows of one request (rows are ``(t, h)`` pairs; all
share every key row — MQA) and one contiguous slice of its keys per CTA, grid ``[ceil(Tq·H / 64), splits, B]``, two
specialized warp groups, Q and two 64-key tiles in shared memory in the 128-byte swizzled layout that ``wgmma``
descriptors and TMA boxes share. Group 0 computes the scores of a whole tile (``wgmma m64n64k16``), the online
softmax (fp32, base 2, lazy rescale) and P, then ``O[:, :256] += P·V`` with P from its registers; group 1 loads the
key tiles (TMA into an mbarrier per buffer, or ``cp.async`` where pages are not multiples of 16 rows) and computes
``O[:, 256:] += P·V`` from a shared P tile under group 0's next scores (see ``WGMMA_SOURCE``). On the H200
(``bench/results/logs/h200-s8-run8-2026-11-30.log``) it ran B=64 L=8K H=64 / H=96 in 177 / 263 µs (3.42 / 2.30
TB/s) against 231 / 418 µs for the Triton kernel's default plan, 269 against 417 µs with 2-token windows, and B=1
L=32K H=64 / H=96 in 36.2 / 38.7 µs against 34.3 / 42.3 — so ``auto`` leaves a single request of one 64-row block
to Triton (:data:`MIN_ROW_CTAS`). (Two ``mma.sync`` stage-1 kernels for sm_80+, 16 and 64 query rows per CTA, moved
1.66 / 0.88 / 0.58 TB/s at best at B=64 L=8K H=64 / H=96 and B=1 L=32K H=64, h200-s5-run1, slower than the Triton
kernel; they are gone.)

With one split stage 1 writes o and lse; otherwise it writes fp32 partials (o only for rows that saw a key) and
stage 2, grid ``[Tq·H, B, 4]`` (one warp per 128 columns of a row), merges them exactly
(``lse = log Σ exp lse_s``, ``o = Σ exp(lse_s − lse) o_s``). A row that sees no key ends with o = 0 and
lse = −inf.

Cluster merge (warp-group kernel, :func:`wgmma_plan`): ``C`` consecutive splits of a row tile run as one thread-block
cluster (2 to 8 CTAs; ``cluster=`` or :attr:`KernelTuning.mla_cluster <k3nn.kernels.registry.KernelTuning>`). Each CTA stages its normalized rows and their lse in
its shared memory; after a cluster barrier, each CTA of the cluster merges its ``ceil(64 / C)`` rows of all ``C``
tiles through distributed shared memory (the same weights as stage 2) and writes one partial per cluster, or o and
lse when the cluster holds every split. By default a call whose splits are 2 to 8 runs them as one cluster when every
row tile's cluster is resident at once, so no combine kernel runs: on the H200 (``h200-s11-run2``) B=64 L=8K H=64 (two
splits) took 165 / 164 µs against 196 / 191, B=30 (four) 87 against 96, B=15 (eight) 51 against 58. With more splits
than one cluster, merging in clusters changed nothing at B=1 L=32K (32.3–33.6 µs against 32.1–32.5 for 64–132 splits,
run 1), so the default leaves those to the combine kernel.

The split count and cluster size depend only on ``B``, ``Tq·H``, the block table's width and the device (about one
wave of CTAs, one per SM; the clusters the device keeps resident, asked once per size), never on lengths read from
the device, and the
launches allocate only through ``torch.empty``: calls can be captured in a CUDA graph.

Availability: an sm_90 GPU (H100 / H200) and nvcc (``CUDA_HOME`` or on PATH). ``auto`` takes the kernel except for
calls of one 64-row block per request (Tq·H ≤ 64) and fewer than :data:`MIN_ROW_CTAS` requests, which go to the
Triton kernel (:func:`auto_skip`); an explicit ``k3nn.backend("cuda")`` runs every call it supports.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ..cuda_ext import PDL_SOURCE, RAISE_SMEM_SOURCE, load_inline_module, toolchain_reason
from ..registry import current_tuning
from ..cuda_ext import sm_count as _sm_count
from ..cuda_ext import smem_per_block as _smem_limit

__all__ = [
    "CLUSTERS",
    "MAX_SPLITS",
    "SMEM_BYTES_WGMMA",
    "WG_BLOCK_N",
    "auto_skip",
    "available",
    "build",
    "cluster_choice",
    "default_num_splits",
    "kernel_source",
    "max_clusters",
    "mla_decode_cuda",
    "supports",
    "wgmma_plan",
]

R, DR = 512, 64  # the only dims compiled
MAX_SPLITS = 256
#: under ``auto``, calls of one 64-row block per request (Tq·H ≤ 64) and fewer requests than this stay
#: on the Triton kernel. Official bench, H=64, tuned Triton against wgmma (h200-s11-run6): B=1 L=32K 29.6 against
#: 31.9 µs; B=2 L=32K 45.9 / 41.7, B=4 L=32K 74.2 / 59.9, B=8 L=8K 43.4 / 42.2, B=15 L=8K 68.2 / 50.7 (8 splits as one
#: cluster), B=30 L=8K 120.4 / 90.2 (4 as one cluster). With two blocks per request the wgmma kernel is faster at
#: B=1 too (38.7 against 42.3 µs at H=96, h200-s8-run8).
MIN_ROW_CTAS = 2
CLUSTERS = tuple(range(1, 9))  # CTAs per cluster of the wgmma kernel's cluster merge (1: none; 8: the portable limit)
#: key tiles per split at least, with the cluster merge (its partials cost less: smaller splits pay off)
CLUSTER_MIN_TILES = 4
#: by default, a row tile's splits may shrink to this fraction of the plain rule's to fit one resident cluster
CLUSTER_SHRINK = 0.85
WG_BLOCK_N = 64  # keys per tile of the wgmma kernel (one page)
#: shared memory of the wgmma kernels: alignment slack, Q and two key tiles as 128-byte swizzle atoms, P, row
#: stats, two mbarriers
SMEM_BYTES_WGMMA = 1024 + 3 * 9 * 64 * 128 + 64 * 128 + 3 * 64 * 4 + 16

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
  float* o_part;    // [B, M, parts, 512] fp32 (parts > 1)
  float* lse_part;  // [B, M, parts] fp32 (parts > 1)
  long long s_qlb, s_qlt, s_qlh, s_qrb, s_qrt, s_qrh;
  long long s_kvb, s_kvr, s_btb, s_visb;
  long long s_ob, s_ot, s_oh, s_lb, s_lt, s_lh;
  float scale_log2;
  int B, Tq, H, M, page, splits;
  int tma_rows;  // wgmma kernel: rows per TMA box of the key tiles (16 or 64; 0: cp.async loads)
  int cluster;   // wgmma kernel: CTAs per cluster along the splits, merging their partials (1: none)
  int parts;     // partials per row that the combine merges: splits / cluster (1: stage 1 writes o and lse)
  struct alignas(64) { unsigned long long w[16]; } tmap;  // CUtensorMap of the pool [blocks, page, 576]
};
"""

CUDA_SOURCE = r"""
#include <cstdint>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace k3mla {
__PARAMS__
__PDL__
// Phase stamps (bench/gpu/mla_trace.py builds with K3MLA_TRACE defined; compiled out otherwise): the global timer
// at fixed points of a CTA's life, written by the first thread of each warp group into the CTA's row of k3mla_trace.
#ifdef K3MLA_TRACE
constexpr int K3MLA_STAMPS = 24, K3MLA_TRACE_CTAS = 1024;
__device__ unsigned long long k3mla_trace[K3MLA_TRACE_CTAS][K3MLA_STAMPS];
#define K3MLA_STAMP(slot)                                                                                     \
  do {                                                                                                        \
    const unsigned cta_ = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);                     \
    if ((threadIdx.x & 127) == 0 && cta_ < K3MLA_TRACE_CTAS) {                                                \
      unsigned long long t_;                                                                                  \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)::"memory");                                        \
      k3mla_trace[cta_][slot] = t_;                                                                           \
    }                                                                                                         \
  } while (0)
#else
#define K3MLA_STAMP(slot) \
  do {                    \
  } while (0)
#endif

constexpr int R = 512, DR = 64, D = R + DR;
constexpr float LN2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void cp_async_wait0() { asm volatile("cp.async.wait_group 0;\n" ::); }
template <typename T> struct Ty;
template <> struct Ty<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <> struct Ty<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_out(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_out(__half* p, float v) { *p = __float2half_rn(v); }

// Keys query row m of request b may see (0 for rows past M): its visible length, or the causal limit.
__device__ __forceinline__ int row_limit(const MlaParams& p, int m, int b, int seq) {
  int lim = 0;
  if (m < p.M) {
    const int t = m / p.H;
    lim = p.vis ? p.vis[(long long)b * p.s_visb + t] : seq - p.Tq + 1 + t;
    lim = max(0, min(lim, seq));
  }
  return lim;
}

// Key range [start, end) of split `split` (BN-aligned chunks, cut at the longest visible row) and its tiles.
struct KeyRange { int start, end, ntiles; };
__device__ __forceinline__ KeyRange key_range(const MlaParams& p, int split, int seq, int maxlim, int bn) {
  const int per = (seq + p.splits - 1) / p.splits;
  const int chunk = (per + bn - 1) / bn * bn;
  const long long start_ll = (long long)split * chunk;
  const int start = (int)min(start_ll, (long long)seq);
  const int end = min(start + chunk, min(seq, maxlim));
  return {start, end, end > start ? (end - start + bn - 1) / bn : 0};
}

// The 64 query rows' key limits into shared memory (lim_s), then the split's key range cut at the longest of them
// (a block barrier: every thread of the CTA calls it).
__device__ __forceinline__ KeyRange rows64_key_range(const MlaParams& p, int b, int m0, int split, int seq, int* lim_s,
                                                     int tid, int bn) {
  if (tid < 64) lim_s[tid] = row_limit(p, m0 + tid, b, seq);
  __syncthreads();
  int maxlim = 0;
#pragma unroll 8
  for (int r = 0; r < 64; ++r) maxlim = max(maxlim, lim_s[r]);
  return key_range(p, split, seq, maxlim, bn);
}

// The lse of row m as the output's with one partial (p.parts == 1), else as partial `part`'s; the lse of a row from its
// whole sum l and running max mrun (base 2); store_row_lse: both (partials are the splits where no cluster merges).
__device__ __forceinline__ void store_lse(const MlaParams& p, int b, int part, int m, float lse) {
  if (p.parts == 1) {
    const int t = m / p.H, h = m - t * p.H;
    p.lse[b * p.s_lb + t * p.s_lt + h * p.s_lh] = lse;
  } else {
    p.lse_part[((long long)b * p.M + m) * p.parts + part] = lse;
  }
}
__device__ __forceinline__ float row_lse(float l, float mrun) { return l > 0.f ? (mrun + log2f(l)) * LN2 : -INFINITY; }
__device__ __forceinline__ void store_row_lse(const MlaParams& p, int b, int split, int m, float l, float mrun) {
  store_lse(p, b, split, m, row_lse(l, mrun));
}

// Stage 2: exact LSE merge of the p.parts partials ("splits" below: one per split, or per cluster of splits after a
// cluster merge) of row blockIdx.x of request blockIdx.y, columns 128·blockIdx.z …:
// blockDim.y warps (up to MERGE_WARPS, one per 8 splits), 4 columns per lane. The splits' weights go to shared
// memory first; then warp w sums the w-th contiguous share of the splits, eight partial loads at a time per lane
// (a single request still keeps M · 4 · blockDim.y warps loading) and the warps' sums meet in shared memory, added
// in warp order. Empty splits wrote no partial: their loads are discarded by a select, never multiplied. One warp
// per row chunk took 5.3 µs at B=1 L=32K H=64 with 64 splits, eight take 4.3 (h200-s10-run13); a warp per split
// for two splits (B=64) took 22 µs against 12 (run 12), hence a warp per batch of eight.
constexpr int MERGE_COLS = 128, MERGE_MAX_SPLITS = 256, MERGE_WARPS = 8;  // MAX_SPLITS on the Python side
// (The minimum of 4 resident CTAs lets ptxas take 64 registers: aiming at full occupancy, it keeps 32 and issues
// the eight loads two at a time.)
template <typename TO>
__global__ void __launch_bounds__(32 * MERGE_WARPS, 4) mla_combine_kernel(const MlaParams p) {
  __shared__ float ws[MERGE_MAX_SPLITS];  // the splits' weights
  __shared__ float red[2][MERGE_WARPS];
  __shared__ float4 sums[MERGE_WARPS - 1][32];
  const int lane = threadIdx.x, wid = threadIdx.y, nw = blockDim.y, tid = wid * 32 + lane, nt = nw * 32;
  const int m = blockIdx.x, b = blockIdx.y, c0 = blockIdx.z * MERGE_COLS + lane * 4;
  const long long row = (long long)b * p.M + m;
  const float* lp = p.lse_part + row * p.parts;
  pdl_wait();  // after the warp-group stage 1, launched as its programmatic dependent: its partials are visible
  float mx = -INFINITY;
  for (int s = tid; s < p.parts; s += nt) mx = fmaxf(mx, lp[s]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) red[0][wid] = mx;
  __syncthreads();
  mx = red[0][0];
  for (int w = 1; w < nw; ++w) mx = fmaxf(mx, red[0][w]);
  float tot = 0.f;
  for (int s = tid; s < p.parts; s += nt) {
    const float ls = lp[s];
    const float w = ls == -INFINITY ? 0.f : expf(ls - mx);  // an empty split: its partial output was not written
    ws[s] = w;
    tot += w;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
  if (lane == 0) red[1][wid] = tot;
  __syncthreads();
  tot = 0.f;
  for (int w = 0; w < nw; ++w) tot += red[1][w];
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  const auto add = [&](float w, float4 v) {
    o.x += w != 0.f ? w * v.x : 0.f;
    o.y += w != 0.f ? w * v.y : 0.f;
    o.z += w != 0.f ? w * v.z : 0.f;
    o.w += w != 0.f ? w * v.w : 0.f;
  };
  if (tot > 0.f) {
    const int per = (p.parts + nw - 1) / nw, s1 = min(p.parts, (wid + 1) * per);
    const float* op = p.o_part + row * p.parts * R + c0;
    int s = wid * per;
    for (; s + 8 <= s1; s += 8) {  // all eight loads issued before the first is used
      float4 v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = *reinterpret_cast<const float4*>(op + (long long)(s + k) * R);
#pragma unroll
      for (int k = 0; k < 8; ++k) add(ws[s + k], v[k]);
    }
    for (; s < s1; ++s) add(ws[s], *reinterpret_cast<const float4*>(op + (long long)s * R));
  }
  if (wid > 0) sums[wid - 1][lane] = o;
  __syncthreads();
  if (wid > 0) return;
  for (int w = 1; w < nw; ++w) {
    const float4 v = sums[w - 1][lane];
    o.x += v.x;
    o.y += v.y;
    o.z += v.z;
    o.w += v.w;
  }
  const float inv = tot > 0.f ? 1.f / tot : 0.f;
  const int t = m / p.H, h = m - t * p.H;
  TO* orow = static_cast<TO*>(p.out) + b * p.s_ob + t * p.s_ot + h * p.s_oh + c0;
  store_out(orow, o.x * inv);
  store_out(orow + 1, o.y * inv);
  store_out(orow + 2, o.z * inv);
  store_out(orow + 3, o.w * inv);
  if (blockIdx.z == 0 && lane == 0)
    p.lse[b * p.s_lb + t * p.s_lt + h * p.s_lh] = tot > 0.f ? mx + logf(tot) : -INFINITY;
}

__WGMMA_KERNEL__
__RAISE_SMEM__

template <typename T, typename TO>
cudaError_t launch_t(const MlaParams& p, cudaStream_t stream) {
  static bool raised_wg[64] = {};
  cudaError_t err;
  auto kern = mla_wgmma_kernel<T, TO>;
  err = raise_smem(kern, WG_SMEM, raised_wg);
  if (err != cudaSuccess) return err;
  const dim3 grid1((p.M + WG_ROWS - 1) / WG_ROWS, p.splits, p.B);
  if (p.cluster > 1) {
    err = launch_cluster(kern, grid1, dim3(WG_NT), WG_SMEM, p.cluster, stream, p);
    if (err != cudaSuccess) return err;
  } else {
    kern<<<grid1, WG_NT, WG_SMEM, stream>>>(p);
  }
  err = cudaGetLastError();
  if (err != cudaSuccess || p.parts == 1) return err;
  const int merge_warps = max(1, min(MERGE_WARPS, p.parts / 8));  // a warp takes at least one batch of 8 partials
  const dim3 grid(p.M, p.B, R / MERGE_COLS), block(32, merge_warps);
  // After the warp-group kernel (sm_90) the combine is a programmatic dependent: its CTAs launch while stage 1 runs
  // (onto SMs stage 1 leaves free) and wait in pdl_wait. Graph totals, same run (h200-s10-run16): B=1 L=32K H=96
  // 33.9 / 33.8 → 33.8 / 33.6 µs, H=64 34.2 / 34.3 → 32.8 / 34.0, B=64 L=8K H=64 196.6 / 193.2 → 196.0 / 189.6.
  return launch_pdl(mla_combine_kernel<TO>, grid, block, 0, stream, p);
}

// in_dt: 0 bf16, 1 fp16; out_dt: 0 bf16, 1 fp16, 2 fp32 (the input dtype or fp32); the 64-row warp-group kernel
// (sm_90a builds only)
cudaError_t mla_decode_dispatch(const MlaParams& p, int in_dt, int out_dt, cudaStream_t stream) {
  if (p.splits < 1 || p.splits > MERGE_MAX_SPLITS) return cudaErrorInvalidValue;
  if (p.cluster < 1 || p.splits % p.cluster || p.parts * p.cluster != p.splits) return cudaErrorInvalidValue;
  if (p.cluster > WG_MAX_CLUSTER) return cudaErrorInvalidValue;
  if (in_dt == 0 && out_dt == 0) return launch_t<__nv_bfloat16, __nv_bfloat16>(p, stream);
  if (in_dt == 0 && out_dt == 2) return launch_t<__nv_bfloat16, float>(p, stream);
  if (in_dt == 1 && out_dt == 1) return launch_t<__half, __half>(p, stream);
  if (in_dt == 1 && out_dt == 2) return launch_t<__half, float>(p, stream);
  return cudaErrorNotSupported;
}

// How many clusters of `cluster` warp-group CTAs (one per SM) the device runs at once (0 where none fit).
int wgmma_max_clusters(int cluster, int in_dt) {
  static bool raised[64] = {};
  auto kern = in_dt == 0 ? mla_wgmma_kernel<__nv_bfloat16, __nv_bfloat16> : mla_wgmma_kernel<__half, __half>;
  if (raise_smem(kern, WG_SMEM, raised) != cudaSuccess) return 0;
  cudaLaunchAttribute at = clusters_along_y(cluster);
  const cudaLaunchConfig_t lc = launch_config(dim3(1, cluster, 1), dim3(WG_NT), WG_SMEM, nullptr, &at);
  int n = 0;
  return cudaOccupancyMaxActiveClusters(&n, kern, &lc) == cudaSuccess ? n : 0;
}
}  // namespace k3mla
#ifdef K3MLA_TRACE
cudaError_t k3mla_trace_copy(void* dst, size_t bytes) {
  return cudaMemcpyFromSymbol(dst, k3mla::k3mla_trace, bytes);
}
#endif
"""

WGMMA_SOURCE = r"""
// ---- Hopper variant: warp-group MMA (wgmma) from 128-byte-swizzled shared memory, specialized warp groups -------
// One CTA = 64 query rows of request blockIdx.z × key split blockIdx.y, 256 threads = two warp groups. Q [64, 576]
// and two 64-key tiles sit in shared memory as nine "atoms" of 64 columns (64 rows × 128 B, the 16-byte chunks of
// row r XOR-ed with r % 8: the canonical 128-byte swizzle that wgmma descriptors and TMA boxes share). The groups
// do different work:
//   group 0  scores S[64, 64] = Q · Kᵀ over the whole tile (36 × wgmma m64n64k16, both operands K-major in smem:
//            Q is read once per tile), the online softmax (it sees every key of a row: no max exchange; lazy
//            rescale: a row's reference max moves only when it grows by more than 8 in base 2), P (rounded to the
//            input dtype) and the rows' rescale factors into shared memory, then O[:, 0:256] += P · V with A from
//            its registers (4 × wgmma m64n256k16; V is the same key tile read MN-major: 8-key groups 1024 B apart,
//            64-column atoms 8 KB apart)
//   group 1  the loader and O[:, 256:512] += P · V with P from the shared tile, which runs under group 0's scores
//            of the next tile. Key tiles come by TMA (a 3-D tensor map of the pool, boxes of 64 columns × 64 or 16
//            rows inside one page, completion on one mbarrier per buffer; rows past the split's end are zeroed
//            after landing) when pages are multiples of 16 rows and the pool's tensor map encodes, else by
//            per-thread cp.async (zero-filled past the end). A buffer is refilled as soon as both groups are done with it;
//            the block ids of a refill are read a tile ahead.
// Hand-offs are named barriers of 256 threads, each used once per tile (one side arrives, the other waits):
//   FULL    group 1 → 0: tile `it` landed and fenced for the async proxy
//   PREADY  group 0 → 1: P(it) and its rescale factors written
//   PFREE   group 1 → 0: group 1's P·V(it) done, the P tile may be overwritten
//   VFREE   group 0 → 1: group 0's P·V(it) done, buffer it % 2 may be refilled (two ids, alternating: group 0 can
//           run a tile ahead of group 1's wait)
// With Tq·H = 96 the second CTA of a request has 32 live rows of 64 (wgmma's M is 64).
// Measured on the H200 (bench/results/logs/h200-s8-*): this layout took B=64 L=8K H=64 from 204 to 177 µs and H=96
// from 355 to 263 µs against the former symmetric one (both groups scoring 32 keys each with m64n32k16 — Q read
// twice per tile — and exchanging row maxima and P through shared memory, run8); TMA against cp.async 183 / 188 µs
// (run5). No faster: an L2 prefetch of whole tiles ahead of the loads (run2: 1-4% with cp.async, L2 thrash at 4
// tiles ahead); refilling a buffer's rope atom and right half early (run7: slower, the issuing lane holds its
// group's P·V); group 1's P·V deferred until group 0's next scores are done, to run under the softmax (run10:
// 19-32% slower: the two groups' products overlap better than they serialize); earlier, for the symmetric kernel
// (s7 runs 4, 9, 10): two tiles in flight, several score accumulators, duplicated scores with P kept in registers.
// Also no faster (s9 runs 5-9, same-run A/B at B=64 L=8K): the two row tiles of H=96 / Tq=2 as one cluster sharing
// each key tile by TMA multicast (394 against 299 µs at H=96: the loader waits for the peer CTA's free buffer on
// its group's P·V path); one mbarrier per atom so the scores start as atoms land (244 against 181 µs at H=64: the
// wait between the products makes ptxas serialize the wgmma chain, C7520); a TMA L2 prefetch of each tile a tile
// before its load (216 against 182); a third, loader warp group with setmaxnreg 56 / 224 (199 against 176); with
// two splits, the splits of a row tile as one cluster, split 0 merging split 1's partial instead of the combine
// kernel (run 12: 180-183 against 177). The softmax as one FMA and one ex2 per probability (run 6) changed no
// time: the tiles' arrival paces the kernel.
// With p.cluster > 1 the CTAs of consecutive splits form a cluster and merge their staged rows through distributed
// shared memory (wg_cluster_merge) before anything reaches global memory.
// A CTA's life at B=1 L=32K H=64 with 132 splits (phase stamps, K3MLA_TRACE, bench/gpu/mla_trace.py, h200-s10 runs
// 6-10): ~2 µs until its first key tile is asked for (the lengths, then the block id: two dependent loads), ~3 µs
// until it lands (every SM asks at once), ~3 µs per further tile (bandwidth), then the epilogue: 6-9 µs with the
// fragments' own stores, 4-5 µs staged (below). A lone CTA with one tile takes 12-15 µs in all. For scale, a
// plain read of the same 38 MB (a sum in PyTorch) takes 18.7 µs (run 3). Loading pages in pool order changed nothing
// (run 2).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define K3MLA_WGMMA 1
#endif
constexpr int WG_ROWS = 64, WG_BN = 64, WG_NT = 256;
constexpr int WG_ATOMS = D / 64;             // 9 atoms of 64 columns per row
constexpr int WG_ATOM = 64 * 128;            // 64 rows × 128 B
constexpr int WG_TILE = WG_ATOMS * WG_ATOM;  // 73728 B: Q, or one key tile
constexpr int WG_P = WG_ROWS * 128;          // probabilities [64 rows, 64 keys]
// Q, two key tiles, P, + alignment slack, row factors / stats (2 × 64 floats), row limits, two mbarriers
constexpr int WG_SMEM = 1024 + 3 * WG_TILE + WG_P + 2 * WG_ROWS * 4 + WG_ROWS * 4 + 16;
constexpr int WS_FULL = 1, WS_PREADY = 2, WS_PFREE = 3, WS_VFREE = 4;  // named barriers of the hand-offs (above)
constexpr int WG_MAX_CLUSTER = 8;  // CTAs per cluster of the cluster merge (the portable limit)
// Clusters of `cluster` CTAs along grid y (the splits of one row tile): the launch attribute, and a launch with it
inline cudaLaunchAttribute clusters_along_y(int cluster) {
  cudaLaunchAttribute at;
  at.id = cudaLaunchAttributeClusterDimension;
  at.val.clusterDim.x = 1;
  at.val.clusterDim.y = cluster;
  at.val.clusterDim.z = 1;
  return at;
}
template <typename... Params, typename... Args>
cudaError_t launch_cluster(void (*kern)(Params...), dim3 grid, dim3 block, size_t smem, int cluster,
                           cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute at = clusters_along_y(cluster);
  const cudaLaunchConfig_t lc = launch_config(grid, block, smem, stream, &at);
  return cudaLaunchKernelEx(&lc, kern, static_cast<Args&&>(args)...);
}
static_assert(WG_BN == 64 && WG_ROWS == 64, "one 128-byte swizzle span per P row; one page per key tile");

#ifdef K3MLA_WGMMA
__device__ __forceinline__ uint32_t sw128(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }
// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading / stride byte offsets (16-byte units).
__device__ __forceinline__ uint64_t gmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
         (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across the asynchronous products.
template <int N>
__device__ __forceinline__ void reg_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__WGMMA_OPS__
template <typename T> struct Wg;
template <> struct Wg<__nv_bfloat16> {
  static __device__ __forceinline__ void qk(float (&d)[32], uint64_t a, uint64_t b) { wg_qk_bf16(d, a, b); }
  static __device__ __forceinline__ void pv(float (&d)[128], uint64_t a, uint64_t b) { wg_pv_bf16(d, a, b); }
  static __device__ __forceinline__ void pvr(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {
    wg_pvr_bf16(d, a, b);
  }
};
template <> struct Wg<__half> {
  static __device__ __forceinline__ void qk(float (&d)[32], uint64_t a, uint64_t b) { wg_qk_f16(d, a, b); }
  static __device__ __forceinline__ void pv(float (&d)[128], uint64_t a, uint64_t b) { wg_pv_f16(d, a, b); }
  static __device__ __forceinline__ void pvr(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {
    wg_pvr_f16(d, a, b);
  }
};
__device__ __forceinline__ float ex2_ftz(float x) {  // 2^x, results below 2^-126 flushed to zero
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ void nb_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void nb_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n"
               ::"r"(bar), "r"(parity) : "memory");
}
// TMA: box (64 columns, rows, 1) of the pool's tensor map at (column c0, row-in-page c1, block c2) into shared
// memory at dst (128-byte swizzled, like the atoms), completing `bar`'s transaction bytes
__device__ __forceinline__ void tma_load3(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
               "[%2];\n" ::"r"(dst), "l"(tmap), "r"(bar), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
// Clusters: every thread of every CTA of the cluster meets (release / acquire: shared-memory writes before it are
// visible to the peers' reads after it); the CTA's rank; a shared address of this CTA mapped to CTA `rank`'s copy;
// loads through distributed shared memory.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, uint32_t rank) {
  uint32_t d;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(d) : "r"(addr), "r"(rank));
  return d;
}
__device__ __forceinline__ float ld_cluster(uint32_t addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ float4 ld_cluster4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr));
  return v;
}
#endif

// Four outputs of one row (16-byte aligned fp32 or 8-byte aligned 16-bit rows in one store; else one at a time)
__device__ __forceinline__ void store_out4(float* o, float4 v) {
  if ((reinterpret_cast<uintptr_t>(o) & 15) == 0) {
    *reinterpret_cast<float4*>(o) = v;
  } else {
    o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
  }
}
template <typename TO>
__device__ __forceinline__ void store_out4(TO* o, float4 v) {
  if ((reinterpret_cast<uintptr_t>(o) & 7) == 0) {
    *reinterpret_cast<uint2*>(o) = make_uint2(Ty<TO>::pack(v.x, v.y), Ty<TO>::pack(v.z, v.w));
  } else {
    store_out(o, v.x); store_out(o + 1, v.y); store_out(o + 2, v.z); store_out(o + 3, v.w);
  }
}
// Columns col … col + 3 of row m: into o with one partial (p.parts == 1), else into partial `part` (fp32)
template <typename TO>
__device__ __forceinline__ void store_part4(const MlaParams& p, int b, int part, int m, int col, float4 v) {
  if (p.parts == 1) {
    const int t = m / p.H, h = m - t * p.H;
    store_out4(static_cast<TO*>(p.out) + b * p.s_ob + t * p.s_ot + h * p.s_oh + col, v);
  } else {
    *reinterpret_cast<float4*>(p.o_part + (((long long)b * p.M + m) * p.parts + part) * R + col) = v;
  }
}

// Epilogue of the warp-group kernel (every warp past the loop: Q, the key buffers and P are free). Each thread puts
// its rows r_lo / r_hi, columns 256·grp + 8 j + 2 tq (+1), scaled by 1 / l, into a padded fp32 tile [64, 516] over
// the Q and key buffers (the 8 rows of a fragment store fall on distinct banks); then the CTA writes the tile in
// row-contiguous 16-byte pieces, a warp store covering four cache lines of one row. One split: o and lse; else the
// fp32 partials and the split's lse. Phase stamps (bench/gpu/mla_trace.py, h200-s10 runs 6-9): the fragments' own
// stores (eight rows' 32-byte pieces per warp store) took a CTA 6-9 µs, this 4-5 (B=1 L=32K, 132 splits: stage 1
// 28.4 → 24.4 µs). One bulk copy per row (cp.async.bulk shared → global) instead was faster for a lone CTA (2.3
// against 5.4 µs) but slower with every SM writing partials (4.1 against 2.8 µs; stage 1 26.8 µs).
constexpr int WG_OLD = R + 4;  // fp32 row stride of the staged output tile
// the staged tile, its rows' lse and the cluster merge's weights (WG_MAX_CLUSTER per row and 1 / their sum)
static_assert(WG_ROWS * (WG_OLD + 1 + WG_MAX_CLUSTER + 1) * 4 <= 3 * WG_TILE, "the staged output fits over Q, keys");

#ifdef K3MLA_WGMMA
// Cluster merge (p.cluster > 1: that many CTAs of a row tile, consecutive splits, form one cluster). After the cluster
// barrier each CTA takes ceil(64 / cluster) rows (the last fewer): the rows' weights from the cluster's lse
// (exp(lse_c - max), as the combine kernel weighs partials), then its rows of every staged tile through distributed
// shared memory, summed in rank order and scaled by 1 / Σ weights: one partial (and lse) per cluster at index
// split / cluster, or o and lse where the cluster holds every split. A second barrier keeps each tile alive until its
// peers have read it.
template <typename TO>
__device__ __forceinline__ void wg_cluster_merge(const MlaParams& p, int b, int split, int m0, const float* ot) {
  constexpr int MC = WG_MAX_CLUSTER, WS = MC + 1;
  const float* lse_s = ot + WG_ROWS * WG_OLD;
  float* wts = const_cast<float*>(lse_s) + WG_ROWS;  // [rows][MC weights, 1 / their sum]
  const int C = p.cluster, rc = (WG_ROWS + C - 1) / C, tid = threadIdx.x;
  const int r0 = (int)cluster_rank() * rc, rows = min(rc, min(WG_ROWS, p.M - m0) - r0), part = split / C;
  uint32_t peer[MC];
#pragma unroll
  for (int c = 0; c < MC; ++c) peer[c] = c < C ? map_rank(smem_u32(ot), c) : 0u;
  cluster_sync();  // every tile and lse of the cluster is written
  if (tid < rows) {
    const int m = m0 + r0 + tid;
    float ls[MC], mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < MC; ++c) {
      ls[c] = c < C ? ld_cluster(peer[c] + (WG_ROWS * WG_OLD + r0 + tid) * 4) : -INFINITY;
      mx = fmaxf(mx, ls[c]);
    }
    float tot = 0.f;
#pragma unroll
    for (int c = 0; c < MC; ++c) {
      const float w = ls[c] == -INFINITY ? 0.f : expf(ls[c] - mx);
      wts[tid * WS + c] = w;
      tot += w;
    }
    wts[tid * WS + MC] = tot > 0.f ? 1.f / tot : 0.f;
    store_lse(p, b, part, m, tot > 0.f ? mx + logf(tot) : -INFINITY);
  }
  __syncthreads();
  for (int i = tid; i < rows * (R / 4); i += WG_NT) {
    const int r = i / (R / 4), col = (i % (R / 4)) * 4;
    const uint32_t off = ((r0 + r) * WG_OLD + col) * 4;
    float4 v[MC];
#pragma unroll
    for (int c = 0; c < MC; ++c) if (c < C) v[c] = ld_cluster4(peer[c] + off);  // all loads before the sums
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int c = 0; c < MC; ++c) {
      const float w = c < C ? wts[r * WS + c] : 0.f;
      if (w != 0.f) {
        o.x += w * v[c].x;
        o.y += w * v[c].y;
        o.z += w * v[c].z;
        o.w += w * v[c].w;
      }
    }
    const float inv = wts[r * WS + MC];
    store_part4<TO>(p, b, part, m0 + r0 + r, col, make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv));
  }
  cluster_sync();  // the peers are done with this CTA's tile
}
#endif
template <typename TO>
__device__ __forceinline__ void wg_store_rows(const MlaParams& p, int b, int split, int m0, float* ot, int r_lo,
                                              int r_hi, float l_lo, float l_hi, float m_lo, float m_hi, int grp, int tq,
                                              const float (&acc)[128]) {
  const float inv_lo = l_lo > 0.f ? 1.f / l_lo : 0.f, inv_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int col = grp * 256 + j * 8 + 2 * tq;
    *reinterpret_cast<float2*>(ot + r_lo * WG_OLD + col) = make_float2(acc[4 * j] * inv_lo, acc[4 * j + 1] * inv_lo);
    *reinterpret_cast<float2*>(ot + r_hi * WG_OLD + col) =
        make_float2(acc[4 * j + 2] * inv_hi, acc[4 * j + 3] * inv_hi);
  }
  if (grp == 0 && tq == 0) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = hh ? r_hi : r_lo, m = m0 + r;
      if (p.cluster > 1) ot[WG_ROWS * WG_OLD + r] = row_lse(hh ? l_hi : l_lo, hh ? m_hi : m_lo);
      else if (m < p.M) store_row_lse(p, b, split, m, hh ? l_hi : l_lo, hh ? m_hi : m_lo);
    }
  }
  K3MLA_STAMP(grp ? 23 : 9);
#ifdef K3MLA_WGMMA
  if (p.cluster > 1) {
    wg_cluster_merge<TO>(p, b, split, m0, ot);
    return;
  }
#endif
  __syncthreads();
  K3MLA_STAMP(grp ? 11 : 10);
  const int rows = min(WG_ROWS, p.M - m0);
#pragma unroll 4
  for (int i = threadIdx.x; i < rows * (R / 4); i += WG_NT) {
    const int r = i / (R / 4), c = (i % (R / 4)) * 4;
    store_part4<TO>(p, b, split, m0 + r, c, *reinterpret_cast<const float4*>(ot + r * WG_OLD + c));
  }
}

template <typename T, typename TO>
__global__ void __launch_bounds__(WG_NT, 1) mla_wgmma_kernel(const __grid_constant__ MlaParams p) {
#ifdef K3MLA_WGMMA
  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t raw = smem_u32(smem), base = (raw + 1023u) & ~1023u;  // swizzle atoms need 1024-byte alignment
  const uint32_t q_s = base, kv_s = base + WG_TILE, p_s = base + 3 * WG_TILE;
  float* red = reinterpret_cast<float*>(smem + (base - raw) + 3 * WG_TILE + WG_P);  // rescale factors; l, m at the end
  int* lim_s = reinterpret_cast<int*>(red + 2 * WG_ROWS);
  const uint32_t full_bar = smem_u32(lim_s + WG_ROWS);  // two mbarriers (8-byte aligned): TMA tiles landed

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  pdl_trigger();  // the combine kernel may launch now (its CTAs wait for this grid's completion)
  if (tid == 0 && p.tma_rows) {
    mbar_init(full_bar, 1);
    mbar_init(full_bar + 8, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  const int grp = warp >> 2, wq = warp & 3;  // warp group (its role, its 256 output columns), warp in the group
  const int g = lane >> 2, tq = lane & 3;    // fragment row group / column pair
  const int m0 = blockIdx.x * WG_ROWS, split = blockIdx.y, b = blockIdx.z;
  K3MLA_STAMP(grp ? 12 : 0);
  const int seq = p.seq[b];  // in flight while group 1 issues Q's copies
  if (grp == 1) {
    // Q [64, 576] = [q_lat | q_rope] by cp.async before anything waits on the lengths: thread -> rows
    // ld_row + 16 hh (hh < 4), chunk ld_sub of each atom (8 threads cover a 128-byte span); rows past M zero-filled
    // (16-byte aligned rows: checked by the caller). The copies join the first commit group of the loader.
    const int ld_row = (tid - 128) >> 3, ld_sub = tid & 7;
    const uint16_t* ql = static_cast<const uint16_t*>(p.q_lat);
    const uint16_t* qr = static_cast<const uint16_t*>(p.q_rope);
#pragma unroll
    for (int hh = 0; hh < 4; ++hh) {
      const int r = ld_row + 16 * hh, m = m0 + r;
      const uint16_t* lat = ql;
      const uint16_t* rope = qr;
      int bytes = 0;
      if (m < p.M) {
        const int t = m / p.H, h = m - t * p.H;
        lat = ql + b * p.s_qlb + t * p.s_qlt + h * p.s_qlh + ld_sub * 8;
        rope = qr + b * p.s_qrb + t * p.s_qrt + h * p.s_qrh + ld_sub * 8;
        bytes = 16;
      }
      const uint32_t dst = q_s + sw128(r, ld_sub);
#pragma unroll
      for (int a = 0; a < WG_ATOMS - 1; ++a) cp_async16(dst + a * WG_ATOM, lat + (bytes ? a * 64 : 0), bytes);
      cp_async16(dst + (WG_ATOMS - 1) * WG_ATOM, rope, bytes);
    }
  }

  const KeyRange kr = rows64_key_range(p, b, m0, split, seq, lim_s, tid, WG_BN);
  const int start = kr.start, end = kr.end, ntiles = kr.ntiles;
  K3MLA_STAMP(grp ? 13 : 1);
  const int r_lo = wq * 16 + g, r_hi = r_lo + 8;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  float m_lo = -1.0e30f, m_hi = -1.0e30f, l_lo = 0.f, l_hi = 0.f;  // group 0: running max (base 2), row sums

  if (grp == 0) {
    const int lim_lo = min(lim_s[r_lo], end), lim_hi = min(lim_s[r_hi], end);
    const uint64_t d_q = gmma_desc(q_s, 16, 1024), d_k0 = gmma_desc(kv_s, 16, 1024);
    const uint64_t d_v0 = gmma_desc(kv_s, WG_ATOM, 1024);
    for (int it = 0; it < ntiles; ++it) {
      const int buf = it & 1;
      const uint64_t d_k = d_k0 + buf * (WG_TILE >> 4), d_v = d_v0 + buf * (WG_TILE >> 4);
      nb_sync(WS_FULL);
      if (it == 0) K3MLA_STAMP(2);
      float s[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) s[i] = 0.f;
      reg_fence(s);
      wg_fence();
#pragma unroll
      for (int a = 0; a < WG_ATOMS; ++a) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint32_t off = (a * WG_ATOM + kk * 32) >> 4;
          Wg<T>::qk(s, d_q + off, d_k + off);
        }
      }
      wg_commit();
      wg_wait0();
      reg_fence(s);
      if (it == 0) K3MLA_STAMP(3);

      // online softmax (base 2): s[4 j + e] is row r_lo (e < 2) or r_hi, key n0 + 8 j + (e & 1). Keys at or past a
      // row's limit are masked on the tiles that hold any; the row max is taken before scaling (scale > 0: fl(c·s)
      // is monotone in s) and each probability is one FMA and one ex2 (flush-to-zero below 2^-126).
      if (start + (it + 1) * WG_BN > min(lim_lo, lim_hi)) {
        const int n0 = start + it * WG_BN + 2 * tq;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int n = n0 + j * 8 + e;
            if (n >= lim_lo) s[4 * j + e] = -INFINITY;
            if (n >= lim_hi) s[4 * j + 2 + e] = -INFINITY;
          }
        }
      }
      float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        mx_lo = fmaxf(mx_lo, fmaxf(s[4 * j], s[4 * j + 1]));
        mx_hi = fmaxf(mx_hi, fmaxf(s[4 * j + 2], s[4 * j + 3]));
      }
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
      mx_lo *= p.scale_log2;
      mx_hi *= p.scale_log2;
      // lazy rescale: m starts at -1e30, so the first visible key always moves it
      const float mn_lo = mx_lo > m_lo + 8.f ? mx_lo : m_lo, mn_hi = mx_hi > m_hi + 8.f ? mx_hi : m_hi;
      const float al_lo = ex2_ftz(m_lo - mn_lo), al_hi = ex2_ftz(m_hi - mn_hi);
      m_lo = mn_lo;
      m_hi = mn_hi;
      float ps_lo = 0.f, ps_hi = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[4 * j + e] = ex2_ftz(fmaf(s[4 * j + e], p.scale_log2, -mn_lo));  // 0 for masked keys
          s[4 * j + 2 + e] = ex2_ftz(fmaf(s[4 * j + 2 + e], p.scale_log2, -mn_hi));
          ps_lo += s[4 * j + e];
          ps_hi += s[4 * j + 2 + e];
        }
      }
      l_lo = l_lo * al_lo + ps_lo;
      l_hi = l_hi * al_hi + ps_hi;
      uint32_t pa[4][4];  // P as the A fragments of four 16-key steps
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        pa[h][0] = Ty<T>::pack(s[8 * h], s[8 * h + 1]);
        pa[h][1] = Ty<T>::pack(s[8 * h + 2], s[8 * h + 3]);
        pa[h][2] = Ty<T>::pack(s[8 * h + 4], s[8 * h + 5]);
        pa[h][3] = Ty<T>::pack(s[8 * h + 6], s[8 * h + 7]);
      }
      if (it > 0) nb_sync(WS_PFREE);  // group 1 has read P(it - 1) and its factors
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // keys 8 j + 2 tq (+1): chunk j, word tq
        sts32(p_s + sw128(r_lo, j) + 4 * tq, pa[j >> 1][(j & 1) * 2]);
        sts32(p_s + sw128(r_hi, j) + 4 * tq, pa[j >> 1][(j & 1) * 2 + 1]);
      }
      if (tq == 0) {
        red[r_lo] = al_lo;
        red[r_hi] = al_hi;
      }
      fence_async_smem();
      nb_arrive(WS_PREADY);
      if (it == 0) K3MLA_STAMP(4);
      if (__any_sync(0xffffffffu, al_lo != 1.f || al_hi != 1.f)) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          acc[4 * j] *= al_lo; acc[4 * j + 1] *= al_lo; acc[4 * j + 2] *= al_hi; acc[4 * j + 3] *= al_hi;
        }
      }
      reg_fence(acc);
      wg_fence();
#pragma unroll
      for (int h = 0; h < 4; ++h) Wg<T>::pvr(acc, pa[h], d_v + h * ((16 * 128) >> 4));
      wg_commit();
      wg_wait0();
      reg_fence(acc);
      if (it == 0) K3MLA_STAMP(5);
      if (it + 2 < ntiles) nb_arrive(WS_VFREE + buf);
    }
  } else {
    const int t1 = tid - 128, ld_row = t1 >> 3, ld_sub = t1 & 7;  // cp.async rows and chunks as for Q above
    const uint16_t* kv = static_cast<const uint16_t*>(p.kv);
    const int* bt_row = p.bt + (long long)b * p.s_btb;
    // cp.async key tiles: rows past `end` zero-filled (their addresses never read); with 64-row pages (a split starts
    // on a multiple of 64) a tile is one page: one block-table read per tile.
    const bool one_page = p.page == WG_BN;
    // TMA (one thread): tile `tile` into buffer `buf` as boxes of tma_rows rows (inside one page: blocks blk[k]) up
    // to the split's end, the tile's bytes announced to the buffer's mbarrier. The block ids are read a tile ahead
    // (fetch_blocks), off the path from a freed buffer to its refill.
    int blk[WG_BN / 16];
    auto fetch_blocks = [&](int tile) {
      const int pos0 = start + tile * WG_BN;
#pragma unroll
      for (int k = 0; k < WG_BN / 16; ++k) {
        const int pos = pos0 + k * p.tma_rows;
        const bool used = p.tma_rows && t1 == 0 && tile < ntiles && k * p.tma_rows < WG_BN && pos < end;
        blk[k] = used ? bt_row[pos / p.page] : 0;
      }
    };
    auto issue = [&](int tile, int buf) {
      const int pos0 = start + tile * WG_BN;
      if (p.tma_rows) {
        if (t1 == 0) {
          const int nbox = (min(WG_BN, end - pos0) + p.tma_rows - 1) / p.tma_rows;
          const uint32_t bar = full_bar + 8 * buf;
          mbar_expect_tx(bar, nbox * p.tma_rows * 128 * WG_ATOMS);
#pragma unroll
          for (int k = 0; k < WG_BN / 16; ++k) {
            if (k >= nbox) break;
            const int row = (pos0 + k * p.tma_rows) % p.page;
#pragma unroll
            for (int a = 0; a < WG_ATOMS; ++a)
              tma_load3(kv_s + buf * WG_TILE + a * WG_ATOM + k * p.tma_rows * 128, &p.tmap, bar, a * 64, row, blk[k]);
          }
        }
        return;
      }
      const int blk0 = one_page && pos0 < end ? bt_row[pos0 / WG_BN] : 0;
#pragma unroll
      for (int hh = 0; hh < 4; ++hh) {
        const int r = ld_row + 16 * hh, pos = pos0 + r;
        const uint16_t* src = kv;
        int bytes = 0;
        if (pos < end) {
          const int blk = one_page ? blk0 : bt_row[pos / p.page];
          src = kv + (long long)blk * p.s_kvb + (long long)(one_page ? r : pos % p.page) * p.s_kvr + ld_sub * 8;
          bytes = 16;
        }
        const uint32_t dst = kv_s + buf * WG_TILE + sw128(r, ld_sub);
#pragma unroll
        for (int a = 0; a < WG_ATOMS; ++a) cp_async16(dst + a * WG_ATOM, src + (bytes ? a * 64 : 0), bytes);
      }
    };
    // Tile `tile` in buffer `buf` is complete (this thread's copies, or the TMA transactions), rows past the
    // split's end are zero (TMA boxes bring whole pages), and the copies are visible to the async proxy
    auto landed = [&](int tile, int buf) {
      if (p.tma_rows) {
        mbar_wait(full_bar + 8 * buf, (tile >> 1) & 1);
        const int valid = end - (start + tile * WG_BN);
        if (valid < WG_BN) {
          for (int c = t1; c < (WG_BN - valid) * 8 * WG_ATOMS; c += 128) {
            const int r = valid + c / (8 * WG_ATOMS), a = (c / 8) % WG_ATOMS;
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(kv_s + buf * WG_TILE + a * WG_ATOM +
                         r * 128 + (c % 8) * 16), "r"(0) : "memory");
          }
        }
      } else {
        cp_async_wait0();
      }
      fence_async_smem();
    };
    K3MLA_STAMP(14);
    fetch_blocks(0);
    if (ntiles > 0) issue(0, 0);
    cp_async_commit();  // group: Q (+ tile 0)
    K3MLA_STAMP(15);
    fetch_blocks(1);
    if (ntiles > 1) issue(1, 1);
    cp_async_commit();
    fetch_blocks(2);
    if (ntiles > 0) {
      if (p.tma_rows) cp_async_wait0();  // Q
      else cp_async_wait1();             // Q + tile 0
      K3MLA_STAMP(16);
      if (p.tma_rows) landed(0, 0);
      K3MLA_STAMP(17);
      fence_async_smem();
      nb_arrive(WS_FULL);
    }
    const uint64_t d_p = gmma_desc(p_s, 16, 1024), d_v0 = gmma_desc(kv_s + 4 * WG_ATOM, WG_ATOM, 1024);
    for (int it = 0; it < ntiles; ++it) {
      const int buf = it & 1;
      const uint64_t d_v = d_v0 + buf * (WG_TILE >> 4);
      nb_sync(WS_PREADY);
      if (it == 0) K3MLA_STAMP(18);
      const float al_lo = red[r_lo], al_hi = red[r_hi];
      if (__any_sync(0xffffffffu, al_lo != 1.f || al_hi != 1.f)) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          acc[4 * j] *= al_lo; acc[4 * j + 1] *= al_lo; acc[4 * j + 2] *= al_hi; acc[4 * j + 3] *= al_hi;
        }
      }
      reg_fence(acc);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) Wg<T>::pv(acc, d_p + kk * 2, d_v + kk * ((16 * 128) >> 4));
      wg_commit();
      if (it + 1 < ntiles) {  // tile it + 1 (issued a tile ago) for group 0's next scores
        landed(it + 1, buf ^ 1);
        nb_arrive(WS_FULL);
      }
      wg_wait0();
      reg_fence(acc);
      if (it == 0) K3MLA_STAMP(19);
      if (it + 1 < ntiles) nb_arrive(WS_PFREE);
      if (it + 2 < ntiles) {  // refill this buffer once group 0's P·V(it) is done with it
        nb_sync(WS_VFREE + buf);
        issue(it + 2, buf);
        fetch_blocks(it + 3);
        cp_async_commit();
      }
    }
    cp_async_wait0();
  }

  K3MLA_STAMP(grp ? 20 : 6);
  __syncthreads();  // both groups are past the loop: the factor slots are free
  if (grp == 0) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    if (tq == 0) {
      red[r_lo] = l_lo;
      red[r_hi] = l_hi;
      red[WG_ROWS + r_lo] = m_lo;
      red[WG_ROWS + r_hi] = m_hi;
    }
  }
  __syncthreads();
  l_lo = red[r_lo];
  l_hi = red[r_hi];
  m_lo = red[WG_ROWS + r_lo];
  m_hi = red[WG_ROWS + r_hi];
  K3MLA_STAMP(grp ? 21 : 7);
  wg_store_rows<TO>(p, b, split, m0, reinterpret_cast<float*>(smem + (base - raw)), r_lo, r_hi, l_lo, l_hi, m_lo,
                    m_hi, grp, tq, acc);
  K3MLA_STAMP(grp ? 22 : 8);
#else
  __trap();
#endif
}
"""


def _wgmma_ops() -> str:
    """The wgmma wrappers (scores m64n64k16, K-major B; output m64n256k16, MN-major B, with A from shared memory or
    from registers; bf16 and fp16 inputs): generated, as each names every accumulator register."""
    out = []
    for ty, ptx in (("bf16", "bf16"), ("f16", "f16")):
        k = 128
        regs = ", ".join(f"%{i}" for i in range(k))
        outs = ", ".join(f'"+f"(d[{i}])' for i in range(k))
        out.append(  # A (P) from registers: the m64k16 fragment layout of the score accumulators
            f"__device__ __forceinline__ void wg_pvr_{ty}(float (&d)[{k}], const uint32_t (&a)[4], uint64_t db) {{\n"
            f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k + 5}, 0;\\n"\n'
            f'               "wgmma.mma_async.sync.aligned.m64n256k16.f32.{ptx}.{ptx} {{{regs}}}, '
            f'{{%{k}, %{k + 1}, %{k + 2}, %{k + 3}}}, %{k + 4}, p, 1, 1, 1;\\n}}\\n"\n'
            f'               : {outs}\n'
            f'               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));\n'
            f"}}")
        for name, n, trans_b in (("qk", 64, 0), ("pv", 256, 1)):
            k = n // 2
            regs = ", ".join(f"%{i}" for i in range(k))
            outs = ", ".join(f'"+f"(d[{i}])' for i in range(k))
            out.append(
                f"__device__ __forceinline__ void wg_{name}_{ty}(float (&d)[{k}], uint64_t da, uint64_t db) {{\n"
                f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k + 2}, 0;\\n"\n'
                f'               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx} {{{regs}}}, %{k}, %{k + 1}, '
                f'p, 1, 1, 0, {trans_b};\\n}}\\n"\n'
                f'               : {outs}\n'
                f'               : "l"(da), "l"(db), "r"(1));\n'
                f"}}")
    return "\n".join(out)


WGMMA_SOURCE = WGMMA_SOURCE.replace("__WGMMA_OPS__", _wgmma_ops())

_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cstdlib>
#include <cstring>
namespace k3mla {
__PARAMS__
cudaError_t mla_decode_dispatch(const MlaParams& p, int in_dt, int out_dt, cudaStream_t stream);
int wgmma_max_clusters(int cluster, int in_dt);
}

int64_t mla_max_clusters(int64_t device, int64_t cluster, int64_t in_dt) {
  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  return k3mla::wgmma_max_clusters((int)cluster, (int)in_dt);
}

// The pool [blocks, page, 576] as a 3-D tensor map with (64 columns, box_rows rows, 1 block) boxes in the 128-byte
// swizzle of the kernel's atoms (the driver's encoder reached through the runtime: no link to libcuda)
static bool k3mla_encode_pool_map(void* out, const torch::Tensor& kv, int box_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                           &found);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) return false;
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  CUtensorMap map;
  const cuuint64_t dims[3] = {(cuuint64_t)kv.size(2), (cuuint64_t)kv.size(1), (cuuint64_t)kv.size(0)};
  const cuuint64_t strides[2] = {(cuuint64_t)kv.stride(1) * 2, (cuuint64_t)kv.stride(0) * 2};
  const cuuint32_t box[3] = {64, (cuuint32_t)box_rows, 1}, unit[3] = {1, 1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, kv.data_ptr(), dims, strides, box, unit,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return false;
  static_assert(sizeof(CUtensorMap) == 128, "CUtensorMap is 128 bytes");
  std::memcpy(out, &map, sizeof(map));
  return true;
}

void mla_decode_launch(torch::Tensor q_lat, torch::Tensor q_rope, torch::Tensor kv, torch::Tensor bt,
                       torch::Tensor seq, std::optional<torch::Tensor> vis, torch::Tensor out, torch::Tensor lse,
                       std::optional<torch::Tensor> o_part, std::optional<torch::Tensor> lse_part,
                       double scale_log2, int64_t splits, int64_t in_dt, int64_t out_dt, int64_t cluster) {
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
  if (splits / cluster > 1) {
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
  TORCH_CHECK(cluster >= 1 && splits % cluster == 0, "mla_decode_launch: cluster ", cluster, " must divide splits ",
              splits);
  p.cluster = (int)cluster;
  p.parts = (int)(splits / cluster);
  p.tma_rows = 0;
  if (p.page % 16 == 0) {
    p.tma_rows = p.page % 64 == 0 ? 64 : 16;
    if (!k3mla_encode_pool_map(&p.tmap, kv, p.tma_rows)) p.tma_rows = 0;  // no tensor map: the cp.async loader
  }
  const cudaError_t err = k3mla::mla_decode_dispatch(p, (int)in_dt, (int)out_dt,
                                                     c10::cuda::getCurrentCUDAStream(q_lat.device().index()));
  TORCH_CHECK(err == cudaSuccess, "mla_decode_launch: ", cudaGetErrorString(err));
}
"""

_DECL = ("void mla_decode_launch(torch::Tensor q_lat, torch::Tensor q_rope, torch::Tensor kv, torch::Tensor bt, "
         "torch::Tensor seq, std::optional<torch::Tensor> vis, torch::Tensor out, torch::Tensor lse, "
         "std::optional<torch::Tensor> o_part, std::optional<torch::Tensor> lse_part, double scale_log2, "
         "int64_t splits, int64_t in_dt, int64_t out_dt, int64_t cluster);\n"
         "int64_t mla_max_clusters(int64_t device, int64_t cluster, int64_t in_dt);")

CUDA_SOURCE = (CUDA_SOURCE.replace("__PARAMS__", PARAMS_SOURCE).replace("__RAISE_SMEM__", RAISE_SMEM_SOURCE)
               .replace("__PDL__", PDL_SOURCE)
               .replace("__WGMMA_KERNEL__", WGMMA_SOURCE))
_CPP_SOURCE = _CPP_SOURCE.replace("__PARAMS__", PARAMS_SOURCE)


def kernel_source() -> str:
    """The complete ``.cu`` text (torch-free: compiles with plain nvcc)."""
    return CUDA_SOURCE


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None when the kernel can be built and run on this machine, else the reason."""
    why = toolchain_reason((9, 0), "wgmma, TMA, thread-block clusters")
    if why:
        return why
    if torch.cuda.get_device_capability() != (9, 0):
        return "the warp-group (wgmma) kernel is built for sm_90 (H100 / H200) only"
    return None


def auto_skip(q_lat, q_rope=None, *args, **kwargs) -> str | None:
    """The registry's ``auto_skip``: why ``auto`` takes the Triton kernel for a call this one could run: a single
    request of one 64-row block (Tq·H ≤ 64, fewer than :data:`MIN_ROW_CTAS` requests). ``k3nn.backend("cuda")``
    runs it here anyway."""
    if not isinstance(q_lat, torch.Tensor) or q_lat.dim() != 4:
        return None  # not a call for this kernel at all: supports() says why
    B, M = q_lat.shape[0], q_lat.shape[1] * q_lat.shape[2]
    if M <= 64 and B < MIN_ROW_CTAS:
        return (f"small batch (B = {B} < {MIN_ROW_CTAS} with Tq·H = {M} ≤ 64): the Triton split-KV kernel is faster "
                "(k3nn.backend('cuda') runs the CUDA kernel anyway)")
    return None


#: seconds the last :func:`build` spent compiling or loading (0 once the module is loaded in this process)
last_build_seconds = 0.0
#: (kernel, query rows per CTA, splits) of the latest :func:`mla_decode_cuda` call
LAST_CALL: tuple[int, int] | None = None  # splits, cluster of the last call


def _arch_flags() -> tuple[str, ...]:
    """Targets of the build: sm_90a on a Hopper GPU (the warp-group kernel needs the arch-specific features);
    elsewhere torch's choice (the kernel then compiles to a trap; :func:`available` refuses such a GPU)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        return ("-gencode=arch=compute_90a,code=sm_90a",)
    return ()


@functools.lru_cache(maxsize=1)
def build():
    """Compile (once per process; cached on disk by torch under a source hash) and return the module."""
    global last_build_seconds
    mod, last_build_seconds = load_inline_module("k3nn_mla_decode", CUDA_SOURCE, _CPP_SOURCE + "\n" + _DECL,
                                                 ["mla_decode_launch", "mla_max_clusters"], _arch_flags())
    return mod


def _build_reason() -> str | None:
    """None once the extension is built and loaded, else why not: building is not started inside a CUDA-graph
    capture, and a failed build (an nvcc without sm_90a, say) is reported once and not retried in this process."""
    if build.cache_info().currsize:
        return None
    if _BUILD_FAILED:
        return _BUILD_FAILED[0]
    if torch.cuda.is_current_stream_capturing():
        return "the CUDA extension is not built yet (first call inside a CUDA-graph capture)"
    try:
        build()
    except Exception as e:  # noqa: BLE001 - any compiler or loader failure: auto takes another backend
        _BUILD_FAILED.append(f"the CUDA extension failed to build: {type(e).__name__}: {str(e)[-300:]}")
        return _BUILD_FAILED[0]
    return None


_BUILD_FAILED: list[str] = []


def default_num_splits(B: int, M: int, max_tokens: int, sm_count: int, ctas_per_sm: int = 1, rows: int = 64,
                       block_n: int = WG_BLOCK_N, min_tiles: int = 8) -> int:
    """Splits per request: about one wave of stage-1 CTAs (``ctas_per_sm`` resident per SM; one CTA of ``rows``
    query rows per row tile), at least ``min_tiles`` ``block_n``-key tiles per split of the longest possible request
    (``max_tokens``: the block table's width in tokens), at most :data:`MAX_SPLITS`. Depends on shapes only
    (graph-safe). At least 8 tiles per split: more split partials cost more than the wave they fill (B=1 L=32K H=64
    ran in 36.6 µs with 64 splits against 41.5 with 128, h200-s8-run2)."""
    per = B * math.ceil(M / rows)
    by_wave = (ctas_per_sm * sm_count) // per
    by_len = math.ceil(max(1, max_tokens) / (min_tiles * block_n))
    return max(1, min(MAX_SPLITS, by_wave, by_len))


def cluster_choice(cluster: int | None = None) -> int | None:
    """CTAs per cluster of the wgmma kernel's cluster merge: ``cluster`` when given, else ``mla_cluster`` of the
    current :class:`~k3nn.kernels.registry.KernelTuning` (read per call); None (neither set): :func:`wgmma_plan`
    decides. Raises ``ValueError`` for anything not in :data:`CLUSTERS`."""
    if cluster is None:
        return current_tuning().mla_cluster  # checked by KernelTuning
    if isinstance(cluster, bool) or cluster not in CLUSTERS:
        raise ValueError(f"mla_decode_cuda: cluster must be one of {CLUSTERS}, got {cluster!r}")
    return int(cluster)


@functools.cache
def max_clusters(device_index: int, cluster: int, in_code: int = 0) -> int:
    """Clusters of ``cluster`` wgmma stage-1 CTAs the device runs at once (``cudaOccupancyMaxActiveClusters``)."""
    return int(build().mla_max_clusters(device_index, cluster, in_code))


def wgmma_plan(B: int, M: int, max_tokens: int, sm_count: int, cluster: int | None = None,
               num_splits: int | None = None, resident: Callable[[int], int] | None = None) -> tuple[int, int]:
    """``(splits, cluster)`` of a wgmma call; ``resident(c)``: how many clusters of ``c`` CTAs run at once (default
    ``sm_count // c``).

    * ``cluster`` None (the default): ``num_splits`` or :func:`default_num_splits`, and the splits of a row tile as
      one cluster where they are 2 to 8 and every row tile's cluster is resident at once; the cluster merge then
      writes o and lse and no combine kernel runs (B=64 L=8K H=64, two splits: 161.5 against 189.5 µs,
      h200-s11-run1). Without ``num_splits``, where the clusters of the rule's splits do not all fit, one split
      fewer (down to :data:`CLUSTER_SHRINK` of them) may: B=14 L=8K H=64 takes 8 splits as clusters of 8 rather
      than 9 and a combine (51.3 against 56.3 µs, h200-s11-run5).
    * ``cluster`` c: with ``num_splits``, those splits and the largest cluster size up to c that divides them; else
      about one wave of resident clusters, at least :data:`CLUSTER_MIN_TILES` 64-key tiles per split, a multiple
      of c (none where that leaves fewer than c splits: the plain rule, no cluster)."""
    resident = resident or (lambda c: sm_count // c)
    tiles = B * math.ceil(M / 64)
    if cluster is None:
        if num_splits:
            S = max(1, min(MAX_SPLITS, int(num_splits)))
            return S, S if 2 <= S <= max(CLUSTERS) and tiles <= resident(S) else 1
        S = default_num_splits(B, M, max_tokens, sm_count)
        for s in range(min(S, max(CLUSTERS)), max(2, math.ceil(CLUSTER_SHRINK * S)) - 1, -1):
            if tiles <= resident(s):
                return s, s
        return S, 1
    if num_splits:
        S = max(1, min(MAX_SPLITS, int(num_splits)))
        return S, max(c for c in CLUSTERS if c <= cluster and S % c == 0)
    if cluster > 1:
        by_wave = resident(cluster) * cluster // tiles
        by_len = math.ceil(max(1, max_tokens) / (CLUSTER_MIN_TILES * WG_BLOCK_N))
        S = min(MAX_SPLITS, by_wave, by_len) // cluster * cluster
        if S >= cluster:
            return S, cluster
    return default_num_splits(B, M, max_tokens, sm_count), 1


def supports(q_lat, q_rope, kv_pool, block_table, seq_lens, scale=None, visible_lens=None, num_splits=None,
             out_dtype=None, out=None) -> str | None:
    """None when :func:`mla_decode_cuda` takes this call, else the reason (inputs already checked by
    ``check_mla_decode_inputs``). Which calls ``auto`` leaves to the Triton kernel: :func:`auto_skip`."""
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
    if torch.cuda.get_device_capability(q_lat.device) != (9, 0):
        return "the warp-group (wgmma) kernel needs an sm_90 GPU (H100 / H200)"
    lim = _smem_limit(q_lat.device)
    if SMEM_BYTES_WGMMA > lim:
        return f"the wgmma kernel needs {SMEM_BYTES_WGMMA} bytes of shared memory per CTA (limit {lim})"
    return _build_reason()


def _rows16(t: torch.Tensor) -> torch.Tensor:
    """``t`` when every row is 16-byte aligned (the wgmma kernel copies Q in 16-byte chunks), else a contiguous
    copy."""
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:-1])
    return t if ok else t.contiguous()


def mla_decode_cuda(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=None, num_splits=None,
                    out_dtype=None, out=None, cluster=None):
    """``k3nn.ops.mla_decode`` on the CUDA kernel (inputs as checked by ``check_mla_decode_inputs`` and
    :func:`supports`). ``cluster``: as in :func:`cluster_choice`. Returns ``(o [B, Tq, H, 512], lse [B, Tq, H]
    fp32)``."""
    B, Tq, H, r = q_lat.shape
    M = Tq * H
    dev = q_lat.device
    C = cluster_choice(cluster)
    q_lat, q_rope = _rows16(q_lat), _rows16(q_rope)
    bt = block_table if block_table.dtype == torch.int32 and block_table.stride(-1) == 1 else \
        block_table.to(torch.int32).contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    vis = None if visible_lens is None else visible_lens.to(torch.int32).contiguous()
    if out is None:
        o = torch.empty(B, Tq, H, r, dtype=out_dtype or q_lat.dtype, device=dev)
        lse = torch.empty(B, Tq, H, dtype=torch.float32, device=dev)
    else:
        o, lse = out
    max_tokens, sms, dix = bt.shape[1] * kv_pool.shape[1], _sm_count(dev.index or 0), dev.index or 0
    S, C = wgmma_plan(B, M, max_tokens, sms, C, num_splits, lambda c: max_clusters(dix, c, _IN_CODES[q_lat.dtype]))
    o_part = lse_part = None
    if S // C > 1:
        o_part = torch.empty(B, M, S // C, r, dtype=torch.float32, device=dev)
        lse_part = torch.empty(B, M, S // C, dtype=torch.float32, device=dev)
    global LAST_CALL
    LAST_CALL = (S, C)
    build().mla_decode_launch(q_lat, q_rope, kv_pool, bt, sl, vis, o, lse, o_part, lse_part,
                              float(scale) * _LOG2E, S, _IN_CODES[q_lat.dtype], _OUT_CODES[o.dtype], C)
    return o, lse
