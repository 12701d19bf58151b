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

A second instantiation of stage 1 takes 64 query rows per CTA (grid ``[ceil(Tq·H / 64), splits, B]``, 256
threads = 8 warps), so at H = 64 each key tile is read once per split instead of four times. Warp ``w`` owns
the 16-row slab ``w % 4`` and output columns ``256·(w / 4)`` … (16 × 256 fp32 accumulators, 128 registers).
The two warps of a slab each compute the 32-key score tile over half of the 576-deep dot, swap the partial
fragments through shared memory (a 64-thread named barrier) and add them, so both hold the whole score tile in
registers; each runs the (identical) online softmax for its two fragment rows and feeds P from the score
registers straight into the A fragments of ``P·V`` (no P tile in shared memory). Key tiles: 32 tokens, two
``cp.async`` buffers, one block barrier per tile; shared memory 166 KB (one CTA per SM, 229 registers, no
spills on sm_90). ``rows=16`` (:func:`rows_choice`) selects the first variant.
On the H200 (``bench/results/logs/h200-s5-run1-2026-11-30.log``) these mma.sync kernels moved 1.66 / 0.88 /
0.58 TB/s (64 rows) and 0.91 / 0.46 / 0.43 (16 rows) at B=64 L=8K H=64 / H=96 and B=1 L=32K H=64.

On sm_90 the default stage 1 is the warp-group kernel (``kernel="wgmma"``, :func:`kernel_choice`; built for
sm_90a): 64 query rows, two specialized warp groups, Q and two 64-key tiles in shared memory in the 128-byte
swizzled layout that ``wgmma`` descriptors and TMA boxes share. Group 0 computes the scores of a whole tile
(``wgmma m64n64k16``), the online softmax (lazy rescale) and P, then ``O[:, :256] += P·V`` with P from its
registers; group 1 loads the key tiles (TMA into an mbarrier per buffer, or ``cp.async`` where pages are not
multiples of 16 rows) and computes ``O[:, 256:] += P·V`` from a shared P tile under group
0's next scores (see ``WGMMA_SOURCE``). On the H200 (``bench/results/logs/h200-s8-run8-2026-11-30.log``) it ran
B=64 L=8K H=64 / H=96 in 177 / 263 µs (3.42 / 2.30 TB/s) against 231 / 418 µs for the Triton kernel's default
plan, 269 against 417 µs with 2-token windows, and B=1 L=32K H=64 / H=96 in 36.2 / 38.7 µs against 34.3 / 42.3
— so ``auto`` leaves a single request of one 64-row block to Triton (:data:`MIN_ROW_CTAS`).

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

The split count and cluster size depend only on ``B``, ``Tq·H``, the block table's width, the variant and the
device (about one wave of CTAs: two per SM with 16 rows, one with 64; the clusters the device keeps resident, asked
once per size), never on lengths read from the device, and the
launches allocate only through ``torch.empty``: calls can be captured in a CUDA graph.

Availability: CUDA, nvcc (``CUDA_HOME`` or on PATH) and sm_80+; the warp-group kernel needs sm_90. ``auto``
takes the warp-group kernel on an sm_90 GPU, except for calls of one 64-row block per request (Tq·H ≤ 64) and
fewer than :data:`MIN_ROW_CTAS` requests, which go to the Triton kernel (:func:`auto_skip`); elsewhere the
mma.sync kernel runs under an explicit ``k3nn.backend("cuda")`` only (it matches the reference but is slower than
the Triton kernel). An explicit ``k3nn.backend("cuda")`` runs every call it supports here.
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
    "BLOCK_N",
    "CLUSTERS",
    "DEFAULT_ROWS",
    "MAX_SPLITS",
    "ROWS",
    "ROWS_VARIANTS",
    "SMEM_BYTES",
    "SMEM_BYTES_BY_ROWS",
    "auto_skip",
    "available",
    "build",
    "cluster_choice",
    "default_num_splits",
    "kernel_num_splits",
    "kernel_choice",
    "kernel_source",
    "max_clusters",
    "mla_decode_cuda",
    "rows_choice",
    "supports",
    "wgmma_plan",
]

R, DR = 512, 64  # the only dims compiled
ROWS, BLOCK_N = 16, 32  # query rows and keys per CTA tile
MAX_SPLITS = 256
_QLD = R + DR + 8  # shared-memory row stride (elements) of the Q and KV tiles
_SLD, _PLD = BLOCK_N + 4, BLOCK_N + 8
#: dynamic shared memory per CTA (mirrors the offsets in the CUDA source)
SMEM_BYTES = ROWS * _QLD * 2 + 2 * BLOCK_N * _QLD * 2 + 4 * ROWS * _SLD * 4 + ROWS * _PLD * 2 + 3 * ROWS * 4
#: the 64-row variant: Q [64, 576], two key tiles, one float4 per lane and n8 score tile for 8 warps, row limits
SMEM_BYTES_64 = 64 * _QLD * 2 + 2 * BLOCK_N * _QLD * 2 + 8 * (BLOCK_N // 8) * 32 * 16 + 64 * 4
SMEM_BYTES_BY_ROWS = {16: SMEM_BYTES, 64: SMEM_BYTES_64}
ROWS_VARIANTS = (16, 64)  # query rows per stage-1 CTA
#: rows per CTA of the mma.sync kernel without ``rows=``: 64 beat 16 at every H200 case
#: (``bench/results/logs/h200-s5-run1-2026-11-30.log``)
DEFAULT_ROWS = 64
#: under ``auto``, calls of one 64-row block per request (Tq·H ≤ 64) and fewer requests than this stay
#: on the Triton kernel. Official bench, H=64, tuned Triton against wgmma (h200-s11-run6): B=1 L=32K 29.6 against
#: 31.9 µs; B=2 L=32K 45.9 / 41.7, B=4 L=32K 74.2 / 59.9, B=8 L=8K 43.4 / 42.2, B=15 L=8K 68.2 / 50.7 (8 splits as one
#: cluster), B=30 L=8K 120.4 / 90.2 (4 as one cluster). With two blocks per request the wgmma kernel is faster at
#: B=1 too (38.7 against 42.3 µs at H=96, h200-s8-run8).
MIN_ROW_CTAS = 2
KERNELS = ("wgmma", "mma")  # stage-1 kernels: warp-group MMA (sm_90) and mma.sync (sm_80+)
CLUSTERS = tuple(range(1, 9))  # CTAs per cluster of the wgmma kernel's cluster merge (1: none; 8: the portable limit)
#: key tiles per split at least, with the cluster merge (its partials cost less: smaller splits pay off)
CLUSTER_MIN_TILES = 4
#: by default, a row tile's splits may shrink to this fraction of the plain rule's to fit one resident cluster
CLUSTER_SHRINK = 0.85
_KERNEL_CODES = {"mma": 0, "wgmma": 1}
WG_BLOCK_N = 64  # keys per tile of the wgmma kernel (one page)
#: shared memory of the wgmma kernels: alignment slack, Q and two key tiles as 128-byte swizzle atoms, P, row
#: stats, two mbarriers
SMEM_BYTES_WGMMA = 1024 + 3 * 9 * 64 * 128 + 64 * 128 + 3 * 64 * 4 + 16
_CTAS_PER_SM = {16: 2, 64: 1}  # resident stage-1 CTAs per SM on sm_90 (shared memory / registers)

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

// Epilogue of the 64-row kernels: this thread's rows r_lo / r_hi (l: whole row sums, m: running max in base 2)
// and its 32 column pairs 256·half + 8 j + 2 tq, read as acc(j, e) with e = 2 hh, 2 hh + 1 (hh = 0: row r_lo);
// lse from the half-0 lane of each row group. One split: o and lse; else fp32 partials (rows that saw a key only)
// and the split's lse.
template <typename TO, typename Acc>
__device__ __forceinline__ void store_rows64(const MlaParams& p, int b, int split, int m0, int r_lo, int r_hi,
                                             float l_lo, float l_hi, float m_lo, float m_hi, int half, int tq,
                                             Acc acc) {
  const bool final_ = p.splits == 1;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = hh ? r_hi : r_lo, m = m0 + r;
    if (m >= p.M) continue;
    const float l = hh ? l_hi : l_lo, mrun = hh ? m_hi : m_lo;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (half == 0 && tq == 0) store_row_lse(p, b, split, m, l, mrun);
    if (final_) {
      const int t = m / p.H, h = m - t * p.H;
      TO* orow = static_cast<TO*>(p.out) + b * p.s_ob + t * p.s_ot + h * p.s_oh;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int col = half * 256 + j * 8 + 2 * tq;
        store_out(orow + col, acc(j, 2 * hh) * inv);
        store_out(orow + col + 1, acc(j, 2 * hh + 1) * inv);
      }
    } else if (inv > 0.f) {  // partials of rows without keys are never read by the merge
      float* prow = p.o_part + (((long long)b * p.M + m) * p.splits + split) * R;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int col = half * 256 + j * 8 + 2 * tq;
        *reinterpret_cast<float2*>(prow + col) = make_float2(acc(j, 2 * hh) * inv, acc(j, 2 * hh + 1) * inv);
      }
    }
  }
}

// Async copy of this thread's share of cache row `pos` (LANES threads per row, thread `sub` taking 16-byte chunks
// sub, sub + LANES, ...) into shared memory at `dst`; a row at or past `end` is zero-filled, its address never read.
template <int LANES, int CH>
__device__ __forceinline__ void issue_row(const MlaParams& p, const uint16_t* kv, const int* bt_row, int pos, int end,
                                          int sub, uint32_t dst) {
  const uint16_t* src = kv;  // valid address even when nothing is read
  int bytes = 0;
  if (pos < end) {
    const int blk = bt_row[pos / p.page];
    src = kv + (long long)blk * p.s_kvb + (long long)(pos % p.page) * p.s_kvr;
    bytes = 16;
  }
  dst += sub * 16;
  src += sub * 8;
#pragma unroll
  for (int i = 0; i < CH / LANES; ++i) cp_async16(dst + i * 16 * LANES, src + i * 8 * LANES, bytes);
}

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

  if (tid < ROWS) lim_s[tid] = row_limit(p, m0 + tid, b, seq);
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
  const KeyRange kr = key_range(p, split, seq, maxlim, BN);
  const int start = kr.start, end = kr.end, ntiles = kr.ntiles;

  // Tile loader: thread -> (cache row ld_row, chunks ld_sub, ld_sub + 4, ...); rows past `end` zero-filled.
  const int ld_row = tid >> 2, ld_sub = tid & 3;
  const uint16_t* kv = static_cast<const uint16_t*>(p.kv);
  const int* bt_row = p.bt + (long long)b * p.s_btb;
  auto issue = [&](int tile, int buf) {
    issue_row<4, CHUNKS>(p, kv, bt_row, start + tile * BN + ld_row, end, ld_sub,
                          smem_u32(kvs + (buf * BN + ld_row) * QLD));
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
      *reinterpret_cast<uint2*>(ps + sm_row * PLD + sm_col) =
          make_uint2(Ty<T>::pack(pe[0], pe[1]), Ty<T>::pack(pe[2], pe[3]));
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
    inv_s[sm_row] = l > 0.f ? 1.f / l : 0.f;
    const int m = m0 + sm_row;
    if (m < p.M) store_row_lse(p, b, split, m, l, m_run);
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

// ---- 64-row variant: 8 warps; warp w owns the 16-row slab w % 4 and output columns 256·(w / 4) … ----
// The two warps of a slab each take half of the 576-deep score dot over all 32 keys of the tile, swap their
// partial fragments through shared memory (pair barrier) and then both hold the whole score tile in
// registers: the softmax runs twice (bitwise the same: fp32 addition commutes) and P goes from the score
// accumulators straight into the A fragments of P·V, never through shared memory.
constexpr int ROWS64 = 64, NWARP64 = 8, NT64 = 32 * NWARP64;
constexpr int KW64 = D / 2;  // score depth per warp (288)
constexpr int CW64 = R / 2;  // output columns per warp (256)
constexpr int Q_BYTES64 = ROWS64 * QLD * 2;
constexpr int KV_BYTES64 = 2 * BN * QLD * 2;
constexpr int SX_BYTES64 = NWARP64 * (BN / 8) * 32 * 16;  // one float4 per lane and n8 score tile
constexpr int SMEM_BYTES64 = Q_BYTES64 + KV_BYTES64 + SX_BYTES64 + ROWS64 * 4;
static_assert(BN * 8 == NT64 && CHUNKS % 8 == 0, "one thread per eighth cache row in the tile loader");
static_assert(KW64 % 16 == 0 && CW64 % 16 == 0 && BN % 16 == 0, "tile shape");

__device__ __forceinline__ void cp_async_wait0() { asm volatile("cp.async.wait_group 0;\n" ::); }
__device__ __forceinline__ void pair_sync(int id) { asm volatile("bar.sync %0, 64;\n" ::"r"(id) : "memory"); }

// Stage 1, 64-row variant: one CTA = 64 query rows of request blockIdx.z × key split blockIdx.y.
template <typename T, typename TO>
__global__ void __launch_bounds__(NT64, 1) mla_split64_kernel(const MlaParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem);
  uint16_t* kvs = reinterpret_cast<uint16_t*>(smem + Q_BYTES64);
  float4* sx = reinterpret_cast<float4*>(smem + Q_BYTES64 + KV_BYTES64);
  int* lim_s = reinterpret_cast<int*>(smem + Q_BYTES64 + KV_BYTES64 + SX_BYTES64);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slab = warp & 3, half = warp >> 2;  // rows 16·slab …, output columns 256·half …
  const int g = lane >> 2, tq = lane & 3;       // mma fragment row group / column pair
  const int m0 = blockIdx.x * ROWS64, split = blockIdx.y, b = blockIdx.z;
  const int seq = p.seq[b];

  const KeyRange kr = rows64_key_range(p, b, m0, split, seq, lim_s, tid, BN);
  const int start = kr.start, end = kr.end, ntiles = kr.ntiles;

  // Tile loader: thread -> (cache row ld_row, chunks ld_sub, ld_sub + 8, ...); rows past `end` zero-filled.
  const int ld_row = tid >> 3, ld_sub = tid & 7;
  const uint16_t* kv = static_cast<const uint16_t*>(p.kv);
  const int* bt_row = p.bt + (long long)b * p.s_btb;
  auto issue = [&](int tile, int buf) {
    issue_row<8, CHUNKS>(p, kv, bt_row, start + tile * BN + ld_row, end, ld_sub,
                          smem_u32(kvs + (buf * BN + ld_row) * QLD));
  };
  if (ntiles > 0) issue(0, 0);  // the first key tile loads while the Q tile is read
  cp_async_commit();

  {  // Q tile [64, 576] = [q_lat | q_rope], zero rows past M; 16-byte loads when every row is 16-byte aligned
    const uint16_t* ql = static_cast<const uint16_t*>(p.q_lat);
    const uint16_t* qr = static_cast<const uint16_t*>(p.q_rope);
    const bool vec = ((reinterpret_cast<uintptr_t>(ql) | reinterpret_cast<uintptr_t>(qr)) & 15) == 0 &&
                     ((p.s_qlb | p.s_qlt | p.s_qlh | p.s_qrb | p.s_qrt | p.s_qrh) & 7) == 0;
    if (vec) {
      for (int i = tid; i < ROWS64 * CHUNKS; i += NT64) {
        const int r = i / CHUNKS, c = (i - r * CHUNKS) * 8, m = m0 + r;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (m < p.M) {
          const int t = m / p.H, h = m - t * p.H;
          const uint16_t* src = c < R ? ql + b * p.s_qlb + t * p.s_qlt + h * p.s_qlh + c
                                      : qr + b * p.s_qrb + t * p.s_qrt + h * p.s_qrh + (c - R);
          v = *reinterpret_cast<const uint4*>(src);
        }
        *reinterpret_cast<uint4*>(qs + r * QLD + c) = v;
      }
    } else {
      for (int i = tid; i < ROWS64 * D; i += NT64) {
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
  }

  const int r_lo = slab * 16 + g, r_hi = r_lo + 8;  // this thread's two rows (fragment rows g, g + 8)
  const int lim_lo = min(lim_s[r_lo], end), lim_hi = min(lim_s[r_hi], end);
  float acc[CW64 / 8][4];
#pragma unroll
  for (int j = 0; j < CW64 / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m_lo = -1.0e30f, m_hi = -1.0e30f, l_lo = 0.f, l_hi = 0.f;  // running max (base 2), partial row sums
  const uint32_t q_addr = smem_u32(qs + (slab * 16 + (lane & 15)) * QLD + half * KW64 + (lane >> 4) * 8);
  float4* sx_mine = sx + warp * (BN / 8) * 32 + lane;
  const float4* sx_pair = sx + (warp ^ 4) * (BN / 8) * 32 + lane;

  for (int it = 0; it < ntiles; ++it) {
    const int buf = it & 1;
    cp_async_wait0();
    __syncthreads();  // tile `it` (and the Q tile) visible; every warp is done with tile it - 1 and its buffer
    if (it + 1 < ntiles) issue(it + 1, buf ^ 1);
    cp_async_commit();
    const uint16_t* kt = kvs + buf * BN * QLD;

    // partial scores S[16, 32] over this warp's 288 columns of the dot
    float s[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    const uint32_t k_addr =
        smem_u32(kt + ((lane & 7) + ((lane >> 4) << 3)) * QLD + half * KW64 + ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int ks = 0; ks < KW64 / 16; ++ks) {
      uint32_t a[4];
      ldsm_x4(a, q_addr + ks * 32);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t bb[4];
        ldsm_x4(bb, k_addr + (np * 16 * QLD + ks * 16) * 2);
        Ty<T>::mma(s[2 * np], a, bb[0], bb[1]);
        Ty<T>::mma(s[2 * np + 1], a, bb[2], bb[3]);
      }
    }
    // swap partials with the other warp of the slab (same lane, same fragment layout) and add
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) sx_mine[j * 32] = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
    pair_sync(1 + slab);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const float4 o = sx_pair[j * 32];
      s[j][0] += o.x; s[j][1] += o.y; s[j][2] += o.z; s[j][3] += o.w;
    }

    // online softmax (base 2) of rows r_lo / r_hi; keys n0 + 8 j + e; the 4 lanes of a row group share a row
    const int n0 = start + it * BN + 2 * tq;
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int n = n0 + j * 8 + e;
        s[j][e] = n < lim_lo ? s[j][e] * p.scale_log2 : -INFINITY;
        s[j][2 + e] = n < lim_hi ? s[j][2 + e] * p.scale_log2 : -INFINITY;
        mx_lo = fmaxf(mx_lo, s[j][e]);
        mx_hi = fmaxf(mx_hi, s[j][2 + e]);
      }
    }
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
    const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);  // finite: m starts at -1e30
    const float al_lo = exp2f(m_lo - mn_lo), al_hi = exp2f(m_hi - mn_hi);
    m_lo = mn_lo;
    m_hi = mn_hi;
    float ps_lo = 0.f, ps_hi = 0.f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[j][e] = exp2f(s[j][e] - mn_lo);  // 0 for masked keys
        s[j][2 + e] = exp2f(s[j][2 + e] - mn_hi);
        ps_lo += s[j][e];
        ps_hi += s[j][2 + e];
      }
    }
    l_lo = l_lo * al_lo + ps_lo;
    l_hi = l_hi * al_hi + ps_hi;

    // O[16 rows, this warp's 256 columns] = alpha · O + P · V; the m16n8 score fragments of keys 16 ks … are
    // the m16k16 A fragment of P (rounded to the input dtype)
#pragma unroll
    for (int j = 0; j < CW64 / 8; ++j) {
      acc[j][0] *= al_lo; acc[j][1] *= al_lo; acc[j][2] *= al_hi; acc[j][3] *= al_hi;
    }
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
      const uint32_t a[4] = {Ty<T>::pack(s[2 * ks][0], s[2 * ks][1]), Ty<T>::pack(s[2 * ks][2], s[2 * ks][3]),
                             Ty<T>::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                             Ty<T>::pack(s[2 * ks + 1][2], s[2 * ks + 1][3])};
      const uint32_t v_addr = smem_u32(kt + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * QLD + half * CW64
                                       + (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < CW64 / 16; ++np) {
        uint32_t bb[4];
        ldsm_x4_t(bb, v_addr + np * 32);
        Ty<T>::mma(acc[2 * np], a, bb[0], bb[1]);
        Ty<T>::mma(acc[2 * np + 1], a, bb[2], bb[3]);
      }
    }
  }

  // row totals over the 4 lanes of a row group, lse, 1 / l
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
  store_rows64<TO>(p, b, split, m0, r_lo, r_hi, l_lo, l_hi, m_lo, m_hi, half, tq,
                   [&](int j, int e) { return acc[j][e]; });
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
cudaError_t launch_t(const MlaParams& p, int rows, int kernel, cudaStream_t stream) {
  static bool raised16[64] = {}, raised64[64] = {}, raised_wg[64] = {};
  cudaError_t err;
  if (kernel != 0) {
    auto kern = mla_wgmma_kernel<T, TO>;
    err = raise_smem(kern, WG_SMEM, raised_wg);
    if (err != cudaSuccess) return err;
    const dim3 grid((p.M + WG_ROWS - 1) / WG_ROWS, p.splits, p.B);
    if (p.cluster > 1) {
      err = launch_cluster(kern, grid, dim3(WG_NT), WG_SMEM, p.cluster, stream, p);
      if (err != cudaSuccess) return err;
    } else {
      kern<<<grid, WG_NT, WG_SMEM, stream>>>(p);
    }
  } else if (rows == ROWS64) {
    auto kern = mla_split64_kernel<T, TO>;
    err = raise_smem(kern, SMEM_BYTES64, raised64);
    if (err != cudaSuccess) return err;
    kern<<<dim3((p.M + ROWS64 - 1) / ROWS64, p.splits, p.B), NT64, SMEM_BYTES64, stream>>>(p);
  } else {
    auto kern = mla_split_kernel<T, TO>;
    err = raise_smem(kern, SMEM_BYTES, raised16);
    if (err != cudaSuccess) return err;
    kern<<<dim3((p.M + ROWS - 1) / ROWS, p.splits, p.B), NT, SMEM_BYTES, stream>>>(p);
  }
  err = cudaGetLastError();
  if (err != cudaSuccess || p.parts == 1) return err;
  const int merge_warps = max(1, min(MERGE_WARPS, p.parts / 8));  // a warp takes at least one batch of 8 partials
  const dim3 grid(p.M, p.B, R / MERGE_COLS), block(32, merge_warps);
  // After the warp-group kernel (sm_90) the combine is a programmatic dependent: its CTAs launch while stage 1 runs
  // (onto SMs stage 1 leaves free) and wait in pdl_wait. Graph totals, same run (h200-s10-run16): B=1 L=32K H=96
  // 33.9 / 33.8 → 33.8 / 33.6 µs, H=64 34.2 / 34.3 → 32.8 / 34.0, B=64 L=8K H=64 196.6 / 193.2 → 196.0 / 189.6.
  if (kernel != 0) return launch_pdl(mla_combine_kernel<TO>, grid, block, 0, stream, p);
  mla_combine_kernel<TO><<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}

// in_dt: 0 bf16, 1 fp16; out_dt: 0 bf16, 1 fp16, 2 fp32 (the input dtype or fp32); rows: 16 or 64 per CTA of the
// mma.sync kernels; kernel: 0 mma.sync, 1 the 64-row warp-group kernel (sm_90a builds only)
cudaError_t mla_decode_dispatch(const MlaParams& p, int in_dt, int out_dt, int rows, int kernel,
                                cudaStream_t stream) {
  if (rows != ROWS && rows != ROWS64) return cudaErrorInvalidValue;
  if (p.splits < 1 || p.splits > MERGE_MAX_SPLITS) return cudaErrorInvalidValue;
  if (kernel < 0 || kernel > 1) return cudaErrorInvalidValue;
  if (p.cluster < 1 || p.splits % p.cluster || p.parts * p.cluster != p.splits) return cudaErrorInvalidValue;
  if (p.cluster > 1 && (kernel != 1 || p.cluster > WG_MAX_CLUSTER)) return cudaErrorInvalidValue;
  if (in_dt == 0 && out_dt == 0) return launch_t<__nv_bfloat16, __nv_bfloat16>(p, rows, kernel, stream);
  if (in_dt == 0 && out_dt == 2) return launch_t<__nv_bfloat16, float>(p, rows, kernel, stream);
  if (in_dt == 1 && out_dt == 1) return launch_t<__half, __half>(p, rows, kernel, stream);
  if (in_dt == 1 && out_dt == 2) return launch_t<__half, float>(p, rows, kernel, stream);
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
cudaError_t mla_decode_dispatch(const MlaParams& p, int in_dt, int out_dt, int rows, int kernel,
                                cudaStream_t stream);
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
                       double scale_log2, int64_t splits, int64_t in_dt, int64_t out_dt, int64_t rows,
                       int64_t kernel, int64_t cluster) {
  TORCH_CHECK(q_lat.is_cuda() && q_lat.stride(3) == 1 && q_rope.stride(3) == 1 && kv.stride(2) == 1,
              "mla_decode_launch: inputs must be CUDA tensors with a contiguous last dim");
  TORCH_CHECK(bt.scalar_type() == torch::kInt && seq.scalar_type() == torch::kInt, "mla_decode_launch: int32 indices");
  TORCH_CHECK(lse.scalar_type() == torch::kFloat, "mla_decode_launch: lse must be fp32");
  TORCH_CHECK(rows == 16 || rows == 64, "mla_decode_launch: rows must be 16 or 64, got ", rows);
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
  if (kernel == 1 && p.page % 16 == 0) {
    p.tma_rows = p.page % 64 == 0 ? 64 : 16;
    if (!k3mla_encode_pool_map(&p.tmap, kv, p.tma_rows)) p.tma_rows = 0;  // no tensor map: the cp.async loader
  }
  const cudaError_t err = k3mla::mla_decode_dispatch(p, (int)in_dt, (int)out_dt, (int)rows, (int)kernel,
                                                     c10::cuda::getCurrentCUDAStream(q_lat.device().index()));
  TORCH_CHECK(err == cudaSuccess, "mla_decode_launch: ", cudaGetErrorString(err));
}
"""

_DECL = ("void mla_decode_launch(torch::Tensor q_lat, torch::Tensor q_rope, torch::Tensor kv, torch::Tensor bt, "
         "torch::Tensor seq, std::optional<torch::Tensor> vis, torch::Tensor out, torch::Tensor lse, "
         "std::optional<torch::Tensor> o_part, std::optional<torch::Tensor> lse_part, double scale_log2, "
         "int64_t splits, int64_t in_dt, int64_t out_dt, int64_t rows, int64_t kernel, int64_t cluster);\n"
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
    return toolchain_reason((8, 0), "cp.async, ldmatrix, mma.sync m16n8k16")


def _hopper(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def auto_skip(q_lat, q_rope=None, *args, **kwargs) -> str | None:
    """The registry's ``auto_skip``: why ``auto`` takes the Triton kernel for a call this one could run. Off sm_90
    (only the mma.sync kernel runs there, slower than the Triton one) and, on sm_90, for a single request of one
    64-row block (Tq·H ≤ 64, fewer than :data:`MIN_ROW_CTAS` requests). ``k3nn.backend("cuda")`` runs them here."""
    if not isinstance(q_lat, torch.Tensor) or q_lat.dim() != 4 or q_lat.device.type != "cuda":
        return None  # not a call for this kernel at all: supports() says why
    if not _hopper(q_lat.device):
        return ("off sm_90 only the mma.sync kernel runs, which matches the reference but is slower than the Triton "
                "kernel (k3nn.backend('cuda') runs it)")
    B, M = q_lat.shape[0], q_lat.shape[1] * q_lat.shape[2]
    if M <= 64 and B < MIN_ROW_CTAS:
        return (f"small batch (B = {B} < {MIN_ROW_CTAS} with Tq·H = {M} ≤ 64): the Triton split-KV kernel is faster "
                "(k3nn.backend('cuda') runs the CUDA kernel anyway)")
    return None


#: seconds the last :func:`build` spent compiling or loading (0 once the module is loaded in this process)
last_build_seconds = 0.0
#: (kernel, query rows per CTA, splits) of the latest :func:`mla_decode_cuda` call
LAST_CALL: tuple[str, int, int, int] | None = None  # kernel, rows, splits, cluster of the last call


def _arch_flags() -> tuple[str, ...]:
    """Targets of the build: sm_90a on a Hopper GPU (the warp-group kernel needs the arch-specific features);
    elsewhere torch's choice (the wgmma kernel then compiles to a trap and is never picked)."""
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


def kernel_choice(kernel: str | None = None, device: torch.device | None = None) -> str:
    """Stage-1 kernel: ``"wgmma"`` (64 query rows, warp-group MMA from swizzled shared memory; sm_90 only) or
    ``"mma"`` (``mma.sync``, 16 or 64 rows, see :func:`rows_choice`). ``kernel`` when given, else ``"wgmma"`` on
    an sm_90 ``device`` and ``"mma"`` elsewhere. Raises ``ValueError`` for other names, and for ``"wgmma"`` on a
    device that is not sm_90."""
    name = kernel
    hopper = _hopper(device)
    if not name:
        return "wgmma" if hopper else "mma"
    if name not in KERNELS:
        raise ValueError(f"mla_decode_cuda: kernel must be one of {KERNELS}, got {name!r}")
    if name != "mma" and device is not None and not hopper:
        raise ValueError(f"the {name} MLA decode kernel needs an sm_90 GPU (H100 / H200)")
    return name


def rows_choice(rows: int | None = None, device: torch.device | None = None) -> int:
    """Query rows per stage-1 CTA of the mma.sync kernel: ``rows`` when given, else :data:`DEFAULT_ROWS`, or 16
    where ``device`` cannot give a CTA the 64-row kernel's shared memory. Raises ``ValueError`` for anything but
    16 or 64."""
    if rows is not None:
        if rows not in ROWS_VARIANTS:
            raise ValueError(f"mla_decode_cuda: rows must be 16 or 64, got {rows!r}")
        return int(rows)
    if device is not None and SMEM_BYTES_BY_ROWS[DEFAULT_ROWS] > _smem_limit(device):
        return 16
    return DEFAULT_ROWS


def default_num_splits(B: int, M: int, max_tokens: int, sm_count: int, ctas_per_sm: int | None = None,
                       rows: int = ROWS, block_n: int = BLOCK_N, min_tiles: int = 4) -> int:
    """Splits per request for the ``rows``-row variant: about one wave of stage-1 CTAs (``ctas_per_sm``
    resident per SM; default 2 for 16 rows, 1 for 64), at least four ``block_n``-key tiles per split of the
    longest possible request (``max_tokens``: the block table's width in tokens), at most :data:`MAX_SPLITS`.
    Depends on shapes only (graph-safe)."""
    if ctas_per_sm is None:
        ctas_per_sm = _CTAS_PER_SM[rows]
    per = B * math.ceil(M / rows)
    by_wave = (ctas_per_sm * sm_count) // per
    by_len = math.ceil(max(1, max_tokens) / (min_tiles * block_n))
    return max(1, min(MAX_SPLITS, by_wave, by_len))


def kernel_num_splits(kernel: str, B: int, M: int, max_tokens: int, sm_count: int, rows: int = 64) -> int:
    """:func:`default_num_splits` for a stage-1 kernel: the warp-group kernel takes 64-key tiles, at least 8 per split
    (more split partials cost more than the wave they fill: B=1 L=32K H=64 ran in 36.6 µs with 64 splits against
    41.5 with 128, h200-s8-run2)."""
    if kernel == "mma":
        return default_num_splits(B, M, max_tokens, sm_count, rows=rows)
    return default_num_splits(B, M, max_tokens, sm_count, rows=64, block_n=WG_BLOCK_N, min_tiles=8)


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

    * ``cluster`` None (the default): ``num_splits`` or :func:`kernel_num_splits`, and the splits of a row tile as
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
        S = kernel_num_splits("wgmma", B, M, max_tokens, sm_count)
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
    return kernel_num_splits("wgmma", B, M, max_tokens, sm_count), 1


def supports(q_lat, q_rope, kv_pool, block_table, seq_lens, scale=None, visible_lens=None, num_splits=None,
             out_dtype=None, out=None, rows=None, kernel=None) -> str | None:
    """None when :func:`mla_decode_cuda` takes this call, else the reason (inputs already checked by
    ``check_mla_decode_inputs``; ``rows`` as in :func:`rows_choice` and ``kernel`` as in :func:`kernel_choice`,
    whose errors are the reason when they are asked for something they do not offer). Which calls ``auto`` leaves
    to the Triton kernel: :func:`auto_skip`."""
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
    try:
        kern = kernel_choice(kernel, q_lat.device)
        nrows = rows_choice(rows, q_lat.device)
    except ValueError as e:
        return str(e)
    lim = _smem_limit(q_lat.device)
    if kern != "mma":
        if SMEM_BYTES_WGMMA > lim:
            return f"the {kern} kernel needs {SMEM_BYTES_WGMMA} bytes of shared memory per CTA (limit {lim})"
        return _build_reason()
    need = SMEM_BYTES_BY_ROWS[nrows]
    if need > lim:
        return f"the {nrows}-row kernel needs {need} bytes of shared memory per CTA (limit {lim})"
    return None


def _rows16(t: torch.Tensor) -> torch.Tensor:
    """``t`` when every row is 16-byte aligned (the wgmma kernel copies Q in 16-byte chunks), else a contiguous
    copy."""
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:-1])
    return t if ok else t.contiguous()


def mla_decode_cuda(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=None, num_splits=None,
                    out_dtype=None, out=None, rows=None, kernel=None, cluster=None):
    """``k3nn.ops.mla_decode`` on the CUDA kernel (inputs as checked by ``check_mla_decode_inputs`` and
    :func:`supports`). ``kernel``: ``"wgmma"`` or ``"mma"`` (None: :func:`kernel_choice`); ``rows``: 16 or 64
    query rows per stage-1 CTA of the ``mma`` kernel (None: :data:`DEFAULT_ROWS` where it fits; the wgmma kernel
    always takes 64); ``cluster``: as in :func:`cluster_choice`. Returns ``(o [B, Tq, H, 512], lse [B, Tq, H] fp32)``."""
    kern = kernel_choice(kernel, q_lat.device)
    wgmma = kern != "mma"
    nrows = 64 if wgmma else rows_choice(rows, q_lat.device)
    B, Tq, H, r = q_lat.shape
    M = Tq * H
    dev = q_lat.device
    if wgmma:
        q_lat, q_rope = _rows16(q_lat), _rows16(q_rope)
    else:
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
    max_tokens, sms, dix = bt.shape[1] * kv_pool.shape[1], _sm_count(dev.index or 0), dev.index or 0
    C = 1
    if wgmma:
        S, C = wgmma_plan(B, M, max_tokens, sms, cluster_choice(cluster), num_splits,
                          lambda c: max_clusters(dix, c, _IN_CODES[q_lat.dtype]))
    else:
        S = int(num_splits) if num_splits else kernel_num_splits(kern, B, M, max_tokens, sms, nrows)
        S = max(1, min(MAX_SPLITS, S))
    o_part = lse_part = None
    if S // C > 1:
        o_part = torch.empty(B, M, S // C, r, dtype=torch.float32, device=dev)
        lse_part = torch.empty(B, M, S // C, dtype=torch.float32, device=dev)
    global LAST_CALL
    LAST_CALL = (kern, nrows, S, C)
    build().mla_decode_launch(q_lat, q_rope, kv_pool, bt, sl, vis, o, lse, o_part, lse_part,
                              float(scale) * _LOG2E, S, _IN_CODES[q_lat.dtype], _OUT_CODES[o.dtype], nrows,
                              _KERNEL_CODES[kern], C)
    return o, lse
