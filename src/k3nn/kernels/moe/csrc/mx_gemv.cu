
#include <cstdint>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace k3mx {
#include "mx_gemv_args.cuh"
template <typename T> struct Io;
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
#include "../../csrc/pdl.cuh"

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
  // the weight ring (RING > 0) after the rest, 128-byte aligned: per warp RING slots of SLOT bytes, then barriers
  static __host__ __device__ size_t ring_off(int G) { return (bytes(G) + 127) & ~(size_t)127; }
  static __host__ __device__ size_t total(int G, int RING, int SLOT) {
    return RING ? ring_off(G) + (size_t)RT * KS * RING * (SLOT + 8) : bytes(G);
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

// Where a warp works: its rows, K slice and lane roles, the staged activations and scales, the reduction buffer.
struct Lane {
  int ks, rt, g, q, ASTR, SSTR;
  bool diag;  // q == g % 4: this lane carries activations in B
  const uint4* act;
  const uint8_t* scl;
  float* red;
};

// One 128-k group gr for NR n8 tiles: w[m][0 / 1] = this lane's MX block (block 4gr + q) of rows g and g + 8 of
// matrix m; 8 mmas per matrix and tile, then each accumulator column's E8M0 scale (one FFMA) into acc.
// FAST: no E8M0 byte of the CTA's rows is 0 (2^-127, subnormal) or 255 (NaN), so 2^(s-127) is the byte placed in
// an fp32 exponent (one shift and mask per scale, against two compares and selects for the general case).
template <int NR, int NM, int RT, int DEC, bool FAST>
__device__ __forceinline__ void group_step(const uint4 (&w)[NM][2], int gr, const Lane& L, float (&acc)[NM][NR][4]) {
  constexpr int ROWS = 16 * RT;
  const int tokb = L.g >> 2;
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
      if (L.diag) bq[nt] = L.act[(2 * nt + tokb) * (L.ASTR >> 3) + (4 * gr + L.q) * 4 + i];
    }
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      uint32_t x0[4], x1[4];
      decode<DEC>(word(w[m][0], i), x0);
      decode<DEC>(word(w[m][1], i), x1);
#pragma unroll
      for (int nt = 0; nt < NR; ++nt) {
        mma16816(c[m][nt], x0[0], x1[0], x0[1], x1[1], bq[nt].x, bq[nt].y);
        mma16816(c[m][nt], x0[2], x1[2], x0[3], x1[3], bq[nt].z, bq[nt].w);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < NM; ++m) {  // E8M0 bytes of blocks 4gr + 2(q&1), +1 for rows g and g+8
    const uint8_t* sb = L.scl + (m * ROWS + L.rt * 16 + L.g) * L.SSTR + 4 * gr + 2 * (L.q & 1);
    const unsigned u0 = *reinterpret_cast<const unsigned short*>(sb);
    const unsigned u1 = *reinterpret_cast<const unsigned short*>(sb + 8 * L.SSTR);
    float s00, s01, s10, s11;
    if constexpr (FAST) {
      s00 = __uint_as_float((u0 << 23) & 0x7F800000u);
      s01 = __uint_as_float((u0 << 15) & 0x7F800000u);
      s10 = __uint_as_float((u1 << 23) & 0x7F800000u);
      s11 = __uint_as_float((u1 << 15) & 0x7F800000u);
    } else {
      s00 = e8m0(u0 & 0xFFu), s01 = e8m0(u0 >> 8), s10 = e8m0(u1 & 0xFFu), s11 = e8m0(u1 >> 8);
    }
#pragma unroll
    for (int nt = 0; nt < NR; ++nt) {
      acc[m][nt][0] = fmaf(c[m][nt][0], s00, acc[m][nt][0]);
      acc[m][nt][1] = fmaf(c[m][nt][1], s01, acc[m][nt][1]);
      acc[m][nt][2] = fmaf(c[m][nt][2], s10, acc[m][nt][2]);
      acc[m][nt][3] = fmaf(c[m][nt][3], s11, acc[m][nt][3]);
    }
  }
}

// Step 6: quad reduction of the warp's accumulators into red[ks][rt][m][row][16] (rows 2nt, 2nt+1 of each n8 tile).
template <int NR, int BMX, int NM, int RT>
__device__ __forceinline__ void reduce_quads(const float (&acc)[NM][NR][4], const Lane& L) {
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int nt = 0; nt < NR; ++nt) {
      float v0 = acc[m][nt][0] + acc[m][nt][1];
      float v1 = acc[m][nt][2] + acc[m][nt][3];
      v0 += __shfl_xor_sync(0xFFFFFFFFu, v0, 1);
      v1 += __shfl_xor_sync(0xFFFFFFFFu, v1, 1);
      if ((L.q & 1) == 0) {
        float* d = L.red + (((L.ks * RT + L.rt) * NM + m) * BMX + 2 * nt + (L.q >> 1)) * 16;
        d[L.g] = v0;
        d[L.g + 8] = v1;
      }
    }
}

template <int NM, int NR>
__device__ __forceinline__ void zero(float (&acc)[NM][NR][4]) {
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int nt = 0; nt < NR; ++nt)
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[m][nt][k] = 0.f;
}

// Steps 5-6 from registers (RING 0) for NR n8 tiles (the block's first 2*NR staged rows): the warp's groups ks,
// ks + KS, ... in batches of U, each batch's loads issued before the previous one is used (PF), then the reduction.
template <int NR, int BMX, int NM, int RT, int KS, int U, int PF, int DEC, bool FAST>
__device__ __forceinline__ void stream_rows(uint4 (&cur)[U][NM][2], const uint4* (&wr)[NM][2], bool ok0,
                                            bool ok1, int J, int IT, int NBLK, const Lane& L) {
  uint4 nxt[U][NM][2];
  float acc[NM][NR][4];
  zero(acc);
#pragma unroll 1
  for (int it = 0; it < IT; ++it) {
    if (PF) {
      if (it + 1 < IT) load_batch<U, NM, KS>(nxt, wr, it + 1, L.ks, J, NBLK, L.q, ok0, ok1);
    } else if (it > 0) {
      load_batch<U, NM, KS>(cur, wr, it, L.ks, J, NBLK, L.q, ok0, ok1);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = it * U + u;
      if (j < J) group_step<NR, NM, RT, DEC, FAST>(cur[u], L.ks + KS * j, L, acc);
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
  reduce_quads<NR, BMX, NM, RT>(acc, L);
}

// ---- the weight ring (RING > 0, sm_90+): each warp streams its 16 rows through RING shared-memory slots that the
// copy engine fills (one 2D tile copy per matrix and slot from the weights' tensor map, issued by lane 0: no
// registers in flight, no per-row address arithmetic), each slot completing on its own mbarrier. A slot holds chunk
// c = U consecutive whole groups of the warp's rows for each matrix ([NM][16][U*64] bytes); the warp takes chunks
// ks, ks + KS, ... and refills a slot as soon as its lanes have read it.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t a = smem_u32(bar);
  uint32_t done = 0;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(a), "r"(parity) : "memory");
  } while (!done);
#endif
}

template <int NM, int U, int RING>
struct Ring {
  static constexpr int CB = U * 64;           // bytes of one row per slot (U groups)
  static constexpr int SLOT = NM * 16 * CB;   // bytes per slot
  static constexpr int WARP = RING * SLOT;    // bytes per warp (the barriers follow all warps' slots)
};

// The producer side (lane 0 of the warp): one 2D tile copy per matrix and slot, a box of the warp's 16 rows by
// U groups from the weights' tensor map ([E][N][K/2] bytes; rows past N and bytes past K/2 arrive as zeros).
template <int NM, int U, int RING>
struct RingFill {
  uint8_t* ring;
  uint64_t* bar;
  const CUtensorMap* tm[NM];
  int row, e;
  // The lanes' reads of the slot's previous chunk are ordered before the copy by the caller's __syncwarp and the
  // proxy fence.
  __device__ __forceinline__ void issue(int slot, int c) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using R = Ring<NM, U, RING>;
    const uint32_t b = smem_u32(bar + slot);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(R::SLOT) : "memory");
#pragma unroll
    for (int m = 0; m < NM; ++m)
      asm volatile(
          "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
          "[%5];" ::"r"(smem_u32(ring + slot * R::SLOT + m * 16 * R::CB)), "l"(tm[m]), "r"(c * R::CB), "r"(row),
          "r"(e), "r"(b) : "memory");
#endif
  }
};

// Steps 5-6 from the ring for NR n8 tiles: JC chunks (the first min(RING, JC) issued in the prologue).
template <int NR, int BMX, int NM, int RT, int KS, int U, int RING, int DEC, bool FAST>
__device__ __forceinline__ void stream_ring(const RingFill<NM, U, RING>& rf, int JC, int G, const Lane& L) {
  using R = Ring<NM, U, RING>;
  float acc[NM][NR][4];
  zero(acc);
#pragma unroll 1
  for (int j = 0; j < JC; ++j) {
    const int slot = j % RING, c = L.ks + KS * j;
    mbar_wait(rf.bar + slot, (unsigned)(j / RING) & 1u);
    const uint8_t* st = rf.ring + slot * R::SLOT;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c * U + u < G) {
        uint4 w[NM][2];
#pragma unroll
        for (int m = 0; m < NM; ++m) {
          w[m][0] = *reinterpret_cast<const uint4*>(st + (m * 16 + L.g) * R::CB + (4 * u + L.q) * 16);
          w[m][1] = *reinterpret_cast<const uint4*>(st + (m * 16 + L.g + 8) * R::CB + (4 * u + L.q) * 16);
        }
        group_step<NR, NM, RT, DEC, FAST>(w, c * U + u, L, acc);
      }
    }
    __syncwarp();  // every lane has read the slot
    if (j + RING < JC && (threadIdx.x & 31) == 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // those reads before the copy engine's writes
#endif
      rf.issue(slot, L.ks + KS * (j + RING));
    }
  }
  reduce_quads<NR, BMX, NM, RT>(acc, L);
}

// The weights' source for steps 5-6: the first register batch (RING 0) or the ring's producer side.
template <int NM, int U, int RING>
struct Stream {
  uint4 cur[U][NM][2];
  const uint4* wr[NM][2];
  bool ok0, ok1;
  int J, IT, NBLK;  // registers: groups of the warp, batches, MX blocks per row
  RingFill<NM, U, (RING > 0 ? RING : 1)> rf;
  int JC, G;        // ring: chunks of the warp, groups per row
};

// Steps 5-6 with the CTA's n8 tile count nr (1, 2 or 4, at most NT; 1 or 2 when FAST).
template <int NT, int BMX, int NM, int RT, int KS, int U, int PF, int RING, int DEC, bool FAST>
__device__ __forceinline__ void stream_tiles(int nr, Stream<NM, U, RING>& S, const Lane& L) {
  if constexpr (RING > 0) {
    if (nr == 1) {
      stream_ring<1, BMX, NM, RT, KS, U, RING, DEC, FAST>(S.rf, S.JC, S.G, L);
    } else if (nr == 2) {
      if constexpr (NT >= 2) stream_ring<2, BMX, NM, RT, KS, U, RING, DEC, FAST>(S.rf, S.JC, S.G, L);
    } else {
      if constexpr (NT >= 4 && !FAST) stream_ring<4, BMX, NM, RT, KS, U, RING, DEC, false>(S.rf, S.JC, S.G, L);
    }
  } else {
    if (nr == 1) {
      stream_rows<1, BMX, NM, RT, KS, U, PF, DEC, FAST>(S.cur, S.wr, S.ok0, S.ok1, S.J, S.IT, S.NBLK, L);
    } else if (nr == 2) {
      if constexpr (NT >= 2)
        stream_rows<2, BMX, NM, RT, KS, U, PF, DEC, FAST>(S.cur, S.wr, S.ok0, S.ok1, S.J, S.IT, S.NBLK, L);
    } else {
      // no prefetch registers: four tiles of accumulators fit 128 registers; the general scales only (the caller
      // never sends four tiles to FAST: a second copy of this branch spills twice as much)
      if constexpr (NT >= 4 && !FAST)
        stream_rows<4, BMX, NM, RT, KS, U, 0, DEC, false>(S.cur, S.wr, S.ok0, S.ok1, S.J, S.IT, S.NBLK, L);
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
template <typename T, int NT, int RT, int KS, int U, int PF, int DEC, int RING, bool GLU>
__global__ void __launch_bounds__(32 * RT * KS, MinBlocks<32 * RT * KS>::value)
mx_gemv_kernel(const Args p, const __grid_constant__ CUtensorMap tm1, const __grid_constant__ CUtensorMap tm3) {
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
  const int ASTR = S::astr(G), SSTR = S::sstr(G);

  extern __shared__ __align__(16) unsigned char smem[];
  __half* act = reinterpret_cast<__half*>(smem);                              // [BMX][ASTR], permuted, scaled
  uint8_t* scl = smem + S::act_bytes(G);                                       // [NM][ROWS][SSTR] E8M0 bytes
  float* red = reinterpret_cast<float*>(scl + S::scl_bytes(G));               // [KS][RT][NM][BMX][16]
  unsigned* amx = reinterpret_cast<unsigned*>(red + KS * RT * NM * BMX * 16);  // [BMX] max |a| bits

  // 1. (registers) first weight loads in flight before anything else
  Stream<NM, U, RING> W;
  if constexpr (RING == 0) {
    const int r0 = n0 + rt * 16 + g, r1 = r0 + 8;
    const uint8_t* b0 = p.w1 + (long long)e * p.wse;
    W.wr[0][0] = reinterpret_cast<const uint4*>(b0 + (long long)r0 * p.wsn);
    W.wr[0][1] = reinterpret_cast<const uint4*>(b0 + (long long)r1 * p.wsn);
    if constexpr (GLU) {
      const uint8_t* b3 = p.w3 + (long long)e * p.wse;
      W.wr[NM - 1][0] = reinterpret_cast<const uint4*>(b3 + (long long)r0 * p.wsn);
      W.wr[NM - 1][1] = reinterpret_cast<const uint4*>(b3 + (long long)r1 * p.wsn);
    }
    W.ok0 = r0 < N, W.ok1 = r1 < N;
    W.J = (G - ks + KS - 1) / KS;  // groups of this warp
    W.IT = (W.J + U - 1) / U;
    W.NBLK = NBLK;
    load_batch<U, NM, KS>(W.cur, W.wr, 0, ks, W.J, NBLK, q, W.ok0, W.ok1);
  }

  // valid rows of the block (a prefix in align.py; here: the last valid row + 1), the same in every warp
  const unsigned vb = __ballot_sync(0xFFFFFFFFu, lane < bm && __ldg(p.sorted + blk * bm + lane) < p.num_pairs);
  const int nv = 32 - __clz(vb);
  if (nv == 0) return;
  // More valid rows than the instance stages (2*NT: the launcher sized it for one row per token of each block, i.e.
  // distinct experts per token) would be lost: the CTA writes NaN for all of them instead of a partial result.
  const bool over = nv > 2 * NT;
  const int nr = nv <= 2 || NT == 1 ? 1 : (nv <= 4 || NT == 2 ? 2 : 4);  // n8 tiles this CTA runs
  const int rows2 = 2 * nr;                                              // activation rows staged

  // 1. (ring) the warp's barriers, then its first RING chunks in flight; copies are issued only by CTAs that
  //    consume them, since a CTA must not exit with copies into its shared memory outstanding
  if constexpr (RING > 0) {
    using R = Ring<NM, U, RING>;
    W.G = G;
    const int NC = (G + U - 1) / U;  // chunks of U groups per row
    W.JC = over || ks >= NC ? 0 : (NC - ks + KS - 1) / KS;
    W.rf.ring = smem + S::ring_off(G) + warp * R::WARP;
    W.rf.bar = reinterpret_cast<uint64_t*>(smem + S::ring_off(G) + (NTHR / 32) * R::WARP) + warp * RING;
    W.rf.tm[0] = &tm1;
    if constexpr (GLU) W.rf.tm[NM - 1] = &tm3;
    W.rf.row = n0 + rt * 16;
    W.rf.e = e;
    if (lane < RING) mbar_init(W.rf.bar + lane, 1);
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < RING; ++j)
        if (j < W.JC) W.rf.issue(j, ks + KS * j);
    }
  }

  // 2. E8M0 bytes of the CTA's rows -> shared memory (rows past N and blocks past K read as 1 = 127)
  if (tid < BMX) amx[tid] = 0u;
  bool special = false;  // an E8M0 byte 0 or 255 among the CTA's rows: the loop takes the general decode
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
        special |= (__vcmpeq4(v.x, 0u) | __vcmpeq4(v.y, 0u) | __vcmpeq4(v.z, 0u) | __vcmpeq4(v.w, 0u) |
                    __vcmpeq4(v.x, ~0u) | __vcmpeq4(v.y, ~0u) | __vcmpeq4(v.z, ~0u) | __vcmpeq4(v.w, ~0u)) != 0u;
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
        const uint8_t sv = n < N ? __ldg(sb + (long long)n * p.ssn + b) : (uint8_t)127;
        special |= sv == 0 || sv == 255;
        scl[(m * ROWS + rr) * SSTR + b] = sv;
      }
    }
    for (int i = tid; i < ROWS * (4 * G - NBLK); i += NTHR) {  // padded blocks of the last group
      const int rr = i / (4 * G - NBLK);
      scl[(m * ROWS + rr) * SSTR + NBLK + (i - rr * (4 * G - NBLK))] = (uint8_t)127;
    }
  }
  if constexpr (!GLU) pdl_wait();  // h (the up kernel's output) is read from here on
  const bool fast = !__syncthreads_or(special);

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

  // 5-6. stream the weights with the CTA's n8 tile count (uniform per CTA) and scale decode (uniform per CTA)
  const Lane L{ks, rt, g, q, ASTR, SSTR, (g & 3) == q, reinterpret_cast<const uint4*>(act), scl, red};
  if (fast && nr < 4) {
    stream_tiles<NT, BMX, NM, RT, KS, U, PF, RING, DEC, true>(nr, W, L);
  } else {
    stream_tiles<NT, BMX, NM, RT, KS, U, PF, RING, DEC, false>(nr, W, L);
  }
  __syncthreads();

  // 7. K-slice reduction and epilogue over the valid rows
  for (int i = tid; i < RT * nv * 16; i += NTHR) {
    const int rr = i & 15, t = (i >> 4) % nv, rti = i / (16 * nv);
    const int orow = blk * bm + t;
    const int flat = __ldg(p.sorted + orow);
    const int n = n0 + rti * 16 + rr;
    if (flat >= p.num_pairs || n >= N) continue;
    float s[NM];
    if (over) {
#pragma unroll
      for (int m = 0; m < NM; ++m) s[m] = __uint_as_float(0x7FC00000u);
    } else {
      const unsigned mb = amx[t];
      const float am = Io<T>::f(mb);
      int et = am > 0.f && mb < Io<T>::kBad ? (int)((__float_as_uint(am) >> 23) & 0xFF) - 127 : 0;
      et = max(et, -100);
      const float qt = mb >= Io<T>::kBad ? __uint_as_float(0x7FC00000u)
                                          : __uint_as_float((unsigned)(et + 127) << 23);
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        float v = 0.f;
#pragma unroll
        for (int k = 0; k < KS; ++k) v += red[(((k * RT + rti) * NM + m) * BMX + t) * 16 + rr];
        s[m] = v * qt;
      }
    }
    if constexpr (GLU) {
      Io<T>::st(p.out, (long long)orow * p.stride_o + n, glu(s[0], s[NM - 1], p.act, p.cap, p.beta, p.linear_beta));
    } else {
      Io<T>::st(p.out, (long long)flat * p.stride_o + n, s[0]);
    }
  }
}

// The tensor map of one packed weight tensor [E][N][K/2] (bytes) for the ring's tile copies: boxes of 16 rows by
// `box` bytes (at most 256), zeros past its ends. E comes with the launch, not in Args (the register loop's
// parameter layout stays as it was). The driver's encoder comes through the runtime (no libcuda link).
static cudaError_t weight_map(CUtensorMap* m, const uint8_t* base, const Args& p, int E, int box) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult q;
    void* fn = nullptr;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
    if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || fn == nullptr) return cudaErrorNotSupported;
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  const cuuint64_t dims[3] = {(cuuint64_t)(p.K / 2), (cuuint64_t)p.N, (cuuint64_t)E};
  const cuuint64_t strides[2] = {(cuuint64_t)p.wsn, (cuuint64_t)p.wse};
  const cuuint32_t boxd[3] = {(cuuint32_t)box, 16u, 1u}, step[3] = {1u, 1u, 1u};
  const CUresult r = encode(m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<uint8_t*>(base), dims, strides, boxd, step,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// `static`: internal linkage, so the opt-in flags below belong to this module. In a function template with
// external linkage they would be one unique symbol across every module of the process, and a second build (other
// configs or source) would find them set and launch without its own opt-in ("invalid argument").
template <typename T, int NT, int RT, int KS, int U, int PF, int DEC, int RING, bool GLU>
static cudaError_t launch(const Args& p, int E, cudaStream_t stream) {
  using S = Smem<NT, RT, KS, GLU>;
  const int G = (p.K + 127) >> 7;
  const size_t smem = S::total(G, RING, Ring<S::NM, U, RING>::SLOT);
  auto kern = mx_gemv_kernel<T, NT, RT, KS, U, PF, DEC, RING, GLU>;
  if (smem > 48 * 1024) {
    // the opt-in limit per device, raised again for a larger K
    static size_t set[64] = {};
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    if (dev < 0 || dev >= 64 || smem > set[dev]) {
      err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
      if (err != cudaSuccess) return err;
      if (dev >= 0 && dev < 64) set[dev] = smem;
    }
  }
  CUtensorMap tm1 = {}, tm3 = {};
  if constexpr (RING > 0) {
    cudaError_t err = weight_map(&tm1, p.w1, p, E, Ring<S::NM, U, RING>::CB);
    if (err == cudaSuccess && GLU) err = weight_map(&tm3, p.w3, p, E, Ring<S::NM, U, RING>::CB);
    if (err != cudaSuccess) return err;
  }
  const long long tiles = (p.N + S::ROWS - 1) / S::ROWS;
  const dim3 grid((unsigned)(tiles * p.nb)), block(32 * RT * KS);
  if (p.pdl) return launch_pdl(kern, grid, block, smem, stream, p, tm1, tm3);  // may start while up finishes
  kern<<<grid, block, smem, stream>>>(p, tm1, tm3);
  return cudaGetLastError();
}

}  // namespace k3mx
