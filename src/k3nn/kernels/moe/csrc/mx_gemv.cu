
#include <cstdint>
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
// FAST: no E8M0 byte of the CTA's rows is 0 (2^-127, subnormal) or 255 (NaN), so 2^(s-127) is the byte placed in
// an fp32 exponent (one shift and mask per scale, against two compares and selects for the general case).
template <int NR, int BMX, int NM, int RT, int KS, int U, int PF, int DEC, bool FAST>
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

// Steps 5-6 with the CTA's n8 tile count nr (1, 2 or 4, at most NT; 1 or 2 when FAST).
template <int NT, int BMX, int NM, int RT, int KS, int U, int PF, int DEC, bool FAST>
__device__ __forceinline__ void stream_tiles(int nr, uint4 (&cur)[U][NM][2], const uint4* (&wr)[NM][2], bool ok0,
                                             bool ok1, int ks, int rt, int g, int q, int J, int IT, int NBLK,
                                             int ASTR, int SSTR, const __half* act, const uint8_t* scl, float* red) {
  if (nr == 1) {
    stream_rows<1, BMX, NM, RT, KS, U, PF, DEC, FAST>(cur, wr, ok0, ok1, ks, rt, g, q, J, IT, NBLK, ASTR, SSTR, act,
                                                      scl, red);
  } else if (nr == 2) {
    if constexpr (NT >= 2)
      stream_rows<2, BMX, NM, RT, KS, U, PF, DEC, FAST>(cur, wr, ok0, ok1, ks, rt, g, q, J, IT, NBLK, ASTR, SSTR,
                                                        act, scl, red);
  } else {
    // no prefetch registers: four tiles of accumulators fit 128 registers; the general scales only (the caller
    // never sends four tiles to FAST: a second copy of this branch spills twice as much)
    if constexpr (NT >= 4 && !FAST)
      stream_rows<4, BMX, NM, RT, KS, U, 0, DEC, false>(cur, wr, ok0, ok1, ks, rt, g, q, J, IT, NBLK, ASTR, SSTR,
                                                        act, scl, red);
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
  if (fast && nr < 4) {
    stream_tiles<NT, BMX, NM, RT, KS, U, PF, DEC, true>(nr, cur, wr, ok0, ok1, ks, rt, g, q, J, IT, NBLK, ASTR, SSTR,
                                                         act, scl, red);
  } else {
    stream_tiles<NT, BMX, NM, RT, KS, U, PF, DEC, false>(nr, cur, wr, ok0, ok1, ks, rt, g, q, J, IT, NBLK, ASTR,
                                                          SSTR, act, scl, red);
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

// `static`: internal linkage, so the opt-in flags below belong to this module. In a function template with
// external linkage they would be one unique symbol across every module of the process, and a second build (other
// configs or source) would find them set and launch without its own opt-in ("invalid argument").
template <typename T, int NT, int RT, int KS, int U, int PF, int DEC, bool GLU>
static cudaError_t launch(const Args& p, cudaStream_t stream) {
  using S = Smem<NT, RT, KS, GLU>;
  const int G = (p.K + 127) >> 7;
  const size_t smem = S::bytes(G);
  auto kern = mx_gemv_kernel<T, NT, RT, KS, U, PF, DEC, GLU>;
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
  const long long tiles = (p.N + S::ROWS - 1) / S::ROWS;
  const dim3 grid((unsigned)(tiles * p.nb)), block(32 * RT * KS);
  if (p.pdl) return launch_pdl(kern, grid, block, smem, stream, p);  // may start while the up GEMV finishes
  kern<<<grid, block, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace k3mx
