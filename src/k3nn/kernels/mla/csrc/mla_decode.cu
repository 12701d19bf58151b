
#include <cstdint>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace k3mla {

#include "mla_params.cuh"

#include "../../csrc/pdl.cuh"

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
// in warp order. Empty splits wrote no partial: their loads are discarded by a select, never multiplied. A warp per
// batch of eight partials: fewer warps leave a long row slow, one per split wastes them on short rows
// (docs/perf.md).
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


#include "mla_wgmma.cuh"

#include "../../csrc/raise_smem.cuh"


// `static`: internal linkage keeps raised_wg this module's own (see mx_gemv.cu's launch)
template <typename T, typename TO>
static cudaError_t launch_t(const MlaParams& p, cudaStream_t stream) {
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
  // (onto SMs stage 1 leaves free) and wait in pdl_wait.
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
