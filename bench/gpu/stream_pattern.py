#!/usr/bin/env python3
"""How fast the MXFP4 GEMV's weight reads can go with no arithmetic: read-only streams over the up kernel's bytes
(16 experts × w1 | w3 [3072, 1792 B], 176 MB) with the CUDA GEMV's CTA shape (256 threads, 64 rows, two CTAs per
SM) and three address patterns, each XOR-folding what it loads so nothing is optimised away:

    gemv        the kernel's pattern: lane 4g + q reads 16 bytes of rows g and g + 8 of its warp's 16-row tile at
                block q of its group, the two K-slice warps taking alternate 64-byte groups (8 rows × 64 B per
                warp load)
    warp        each warp reads its own contiguous eighth of the CTA's 64 × 1792 bytes, 512 B per warp load
    cta         the CTA's warps read its bytes in turn, 512 B each, so the CTA walks them in address order

``depth`` loads per lane and matrix are in flight at once (the GEMV holds 2 groups × 2 rows, plus as many
prefetched: 4 to 8). If ``gemv`` streams far below ``warp`` / ``cta``, the row-interleaved addresses cost DRAM
efficiency and a contiguous layout or staging is the lever; if all three stay near copy, the GEMV loses its time
elsewhere (prologue, decode, waits). One GPU check:

    python3 -m bench.gpu.stream_pattern [--depths 2,4,8]
"""

from __future__ import annotations

import argparse
import functools

import torch

from bench.common import device_meta, graph_bench_ms
from k3nn.kernels import cuda_ext

print = functools.partial(print, flush=True)

ROW_BYTES = 1792  # K = 3584 E2M1 per row
ROWS = 16 * 3072  # 16 experts × 3072 rows per matrix
PATTERNS = ("gemv", "warp", "cta")

CUDA_SOURCE = r"""
#include <cstdint>
#include <cuda_runtime.h>

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// Byte offset inside one matrix of load i (0 <= i < 28) of this lane; 64 rows of RB bytes per CTA.
template <int PAT>
__device__ __forceinline__ long long offset(int tile, int warp, int lane, int i, int RB) {
  const long long base = (long long)tile * 64 * RB;
  if (PAT == 0) {  // gemv: rows g, g + 8 of tile rt; groups ks, ks + 2, ... (64 B: four 16-byte blocks)
    const int rt = warp & 3, ks = warp >> 2, g = lane >> 2, q = lane & 3;
    const int row = 16 * rt + g + 8 * (i & 1), gr = ks + 2 * (i >> 1);
    return base + (long long)row * RB + gr * 64 + q * 16;
  } else if (PAT == 1) {  // warp: a contiguous eighth of the CTA's bytes
    return base + (long long)warp * (8 * RB) + i * 512 + lane * 16;
  } else {  // cta: warp loads interleaved in address order
    return base + ((long long)i * 8 + warp) * 512 + lane * 16;
  }
}

template <int PAT, int NM, int DEPTH>
__global__ void __launch_bounds__(256, 2) stream_kernel(const uint8_t* w1, const uint8_t* w3, int RB,
                                                        unsigned* out) {
  const int tile = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int LOADS = 8 * RB / 512;  // per lane and matrix: 28 for 1792-byte rows
  unsigned acc = 0u;
#pragma unroll 1
  for (int i0 = 0; i0 < LOADS; i0 += DEPTH) {
    uint4 v[DEPTH][NM];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const bool ok = i0 + d < LOADS;
      const long long o = offset<PAT>(tile, warp, lane, ok ? i0 + d : 0, RB);
      v[d][0] = ok ? ld_stream(reinterpret_cast<const uint4*>(w1 + o)) : make_uint4(0u, 0u, 0u, 0u);
      if (NM == 2) v[d][NM - 1] = ok ? ld_stream(reinterpret_cast<const uint4*>(w3 + o)) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
#pragma unroll
      for (int m = 0; m < NM; ++m) acc ^= v[d][m].x ^ v[d][m].y ^ v[d][m].z ^ v[d][m].w;
  }
  if (acc == 0x9E3779B9u) out[blockIdx.x * 256 + threadIdx.x] = acc;  // practically never: keeps the loads alive
}

template <int PAT, int NM, int DEPTH>
cudaError_t launch_one(const void* w1, const void* w3, int rows, int rb, unsigned* out, cudaStream_t s) {
  stream_kernel<PAT, NM, DEPTH><<<rows / 64, 256, 0, s>>>(static_cast<const uint8_t*>(w1),
                                                          static_cast<const uint8_t*>(w3), rb, out);
  return cudaGetLastError();
}

#define K3SP_CASES(P, M)                                                            \
  if (pat == P && nm == M && depth == 2) return launch_one<P, M, 2>(w1, w3, rows, rb, out, s); \
  if (pat == P && nm == M && depth == 4) return launch_one<P, M, 4>(w1, w3, rows, rb, out, s); \
  if (pat == P && nm == M && depth == 8) return launch_one<P, M, 8>(w1, w3, rows, rb, out, s);

cudaError_t k3sp_launch(int pat, int nm, int depth, const void* w1, const void* w3, int rows, int rb,
                        unsigned* out, cudaStream_t s) {
  K3SP_CASES(0, 1) K3SP_CASES(0, 2) K3SP_CASES(1, 1) K3SP_CASES(1, 2) K3SP_CASES(2, 1) K3SP_CASES(2, 2)
  return cudaErrorNotSupported;
}
"""

CPP_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
cudaError_t k3sp_launch(int pat, int nm, int depth, const void* w1, const void* w3, int rows, int rb,
                        unsigned* out, cudaStream_t s);
void stream_launch(int64_t pat, int64_t nm, int64_t depth, torch::Tensor w1, torch::Tensor w3, torch::Tensor out) {
  TORCH_CHECK(w1.is_cuda() && w1.is_contiguous() && w3.sizes() == w1.sizes() && w1.size(0) % 64 == 0, "bad weights");
  TORCH_CHECK(w1.size(1) % 64 == 0, "row bytes must be a multiple of 64");
  const cudaError_t e = k3sp_launch((int)pat, (int)nm, (int)depth, w1.data_ptr(), w3.data_ptr(), (int)w1.size(0),
                                    (int)w1.size(1), reinterpret_cast<unsigned*>(out.data_ptr()),
                                    c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(e == cudaSuccess, "stream_launch: ", cudaGetErrorString(e));
}
"""


def build():
    mod, secs = cuda_ext.load_inline_module("k3nn_stream_pattern", CUDA_SOURCE, CPP_SOURCE, ["stream_launch"],
                                            ("-gencode=arch=compute_90,code=sm_90",))
    print(f"built in {secs:.1f} s")
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="2,4,8")
    args = ap.parse_args()
    meta = device_meta()
    copy = meta["copy_tbps"]
    print(f"{meta['gpu']} torch {meta['torch']}: copy {copy} TB/s")
    mod = build()
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randint(0, 256, (ROWS, ROW_BYTES), generator=g, device="cuda", dtype=torch.uint8)
    w3 = torch.randint(0, 256, (ROWS, ROW_BYTES), generator=g, device="cuda", dtype=torch.uint8)
    out = torch.zeros(ROWS // 64 * 256, dtype=torch.int32, device="cuda")
    for nm in (1, 2):
        nbytes = nm * ROWS * ROW_BYTES
        print(f"-- {nm} matri{'x' if nm == 1 else 'ces'}: {nbytes / 1e6:.1f} MB, {ROWS // 64} CTAs")
        for depth in (int(d) for d in args.depths.split(",")):
            cells = []
            for p, name in enumerate(PATTERNS):
                us = graph_bench_ms(lambda: mod.stream_launch(p, nm, depth, w1, w3, out), inner=20, rep=10) * 1e3
                cells.append(f"{name} {us:6.1f} us {nbytes / us / 1e6 / copy:6.1%}")
            print(f"   depth {depth}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
