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
// Group 0 owns whole tiles so Q is read once per tile and no row maximum crosses groups; the measurements behind
// this layout, and the variants that were no faster, are in docs/perf.md (MLA, CUDA decode).
// With p.cluster > 1 the CTAs of consecutive splits form a cluster and merge their staged rows through distributed
// shared memory (wg_cluster_merge) before anything reaches global memory.
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
// @generated wgmma_ops: the wgmma wrappers (cuda_decode._wgmma_ops, one named register per accumulator)
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
// fp32 partials and the split's lse. Staged, because the fragments' own stores (eight rows' 32-byte pieces per warp
// store) are slower, and one bulk copy per row only wins for a lone CTA (docs/perf.md).
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
