"""CUDA fused KDA decode (``torch.utils.cpp_extension.load_inline``, built on first use, never at import).

Same contract as :mod:`.decode`. One block of 256 threads per (request, head), head dim 128: thread ``tid``
holds state column ``j = tid % 128`` for rows ``64·(tid // 128) …`` in registers (coalesced loads along V),
the two row halves meet in shared memory for the two K reductions. The state load is issued first (before the
conv prologue) with streaming cache hints, as in the Triton ``head`` path; no cross-block traffic, no atomics. Conv + SiLU, L2 norm, gate, β and the
gated RMSNorm run in the same block; roundings follow the eager reference (activation dtype where it rounds).

Availability: needs CUDA and nvcc. It is opt-in (``K3NN_KDA_CUDA=1``) until it has been checked against the
eager reference on a GPU (``tests/gpu/test_kda_gpu.py::test_fused_decode_cuda``), so ``auto`` keeps using
the Triton kernel meanwhile.
"""

from __future__ import annotations

import functools
import os

import torch

from ..cuda_ext import toolchain_reason

__all__ = ["available", "supports", "kda_fused_decode_cuda", "CUDA_SOURCE"]

CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

namespace {
constexpr int D = 128;       // head dim (K = V)
constexpr int NT = 256;      // threads per block
constexpr int KH = D / 2;    // state rows held per thread

template <typename T> __device__ __forceinline__ float to_f(T x) { return static_cast<float>(x); }
template <typename T> __device__ __forceinline__ float round_t(float x) { return static_cast<float>(static_cast<T>(x)); }
__device__ __forceinline__ float sigm(float x) {
  const float e = expf(-fabsf(x));
  return x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
}
// every thread gets the sum over the block
__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < NT / 32; ++i) s += red[i];
  return s;
}

template <typename T>
__global__ void __launch_bounds__(NT) kda_decode_kernel(
    const T* __restrict__ qkv, const T* __restrict__ f, const T* __restrict__ bl, const T* __restrict__ gate,
    const T* __restrict__ conv_w, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
    const float* __restrict__ norm_w, float* __restrict__ S, T* __restrict__ conv_state,
    const int64_t* __restrict__ idx, T* __restrict__ y, int Tn, int H, int W, float scale, float lower_bound,
    float eps, bool softplus) {
  const int b = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int j = tid & (D - 1), half = tid >> 7;
  const int64_t C = (int64_t)H * D, C3 = 3 * C;
  const int64_t slot = idx ? idx[b] : (int64_t)b;
  __shared__ float qs[D], ks[D], vs[D], es[D], part[2][D], red[NT / 32];
  float* Sp = S + (slot * H + h) * (int64_t)D * D;  // [K, V] row-major
  float st[KH];
#pragma unroll
  for (int r = 0; r < KH; ++r) st[r] = __ldcs(Sp + (int64_t)(half * KH + r) * D + j);  // streamed: evict first
  const T* xb = qkv + (int64_t)b * Tn * C3;
  T* cs = conv_state + slot * (int64_t)(W - 1) * C3;
  const float a = expf(A_log[h]);
  for (int t = 0; t < Tn; ++t) {
    const int64_t row = (int64_t)b * Tn + t;
    for (int c = tid; c < 3 * D; c += NT) {  // conv + SiLU over the head's q | k | v channels
      const int grp = c / D, d = c % D;
      const int64_t ch = grp * C + (int64_t)h * D + d;
      float acc = 0.f;
      for (int w = 0; w < W; ++w) {
        const int r = t + w;  // row of [conv_state (W-1 rows) ; new tokens]
        const float xv = r < W - 1 ? to_f(cs[(int64_t)r * C3 + ch]) : to_f(xb[(int64_t)(r - (W - 1)) * C3 + ch]);
        acc += to_f(conv_w[ch * W + w]) * xv;
      }
      const float xv = round_t<T>(acc);
      const float sv = round_t<T>(xv * sigm(xv));
      (grp == 0 ? qs : (grp == 1 ? ks : vs))[d] = sv;
    }
    if (tid < D) {
      const float xg = to_f(f[row * C + (int64_t)h * D + tid]) + dt_bias[h * D + tid];
      const float g = softplus ? -a * (xg > 20.f ? xg : log1pf(expf(xg))) : lower_bound * sigm(a * xg);
      es[tid] = expf(g);
    }
    __syncthreads();
    const float qv = tid < D ? qs[tid] : 0.f, kv = tid < D ? ks[tid] : 0.f;
    const float qn = block_sum(qv * qv, red);
    const float kn = block_sum(kv * kv, red);
    const float beta = sigm(to_f(bl[row * H + h]));
    if (tid < D) {
      qs[tid] = round_t<T>(qv / sqrtf(qn + 1e-6f)) * scale;
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
      const float gt = to_f(gate[row * C + (int64_t)h * D + j]);
      y[(row * H + h) * D + j] = static_cast<T>(o * rsqrtf(ss / D + eps) * norm_w[j] * sigm(gt));
    }
    __syncthreads();  // before the shared vectors are overwritten by the next token
  }
#pragma unroll
  for (int r = 0; r < KH; ++r) __stcs(Sp + (int64_t)(half * KH + r) * D + j, st[r]);
  // conv state: new row i = window row Tn + i. Each channel is read and written by one thread, and row Tn + i
  // is never a row already rewritten (Tn >= 1); all reads of the token loop finished at its last barrier.
  for (int c = tid; c < 3 * D; c += NT) {
    const int grp = c / D, d = c % D;
    const int64_t ch = grp * C + (int64_t)h * D + d;
    for (int i = 0; i < W - 1; ++i) {
      const int r = Tn + i;
      const T v = r < W - 1 ? cs[(int64_t)r * C3 + ch] : xb[(int64_t)(r - (W - 1)) * C3 + ch];
      cs[(int64_t)i * C3 + ch] = v;
    }
  }
}

template <typename T>
void launch(const torch::Tensor& qkv, const torch::Tensor& f, const torch::Tensor& b, const torch::Tensor& gate,
            const torch::Tensor& conv_w, const torch::Tensor& A, const torch::Tensor& dtb, const torch::Tensor& nw,
            torch::Tensor& S, torch::Tensor& cs, const int64_t* ip, torch::Tensor& y, int H, bool softplus,
            double lower_bound, double eps, double scale) {
  const int B = qkv.size(0), Tn = qkv.size(1), W = conv_w.size(1);
  dim3 grid(B, H);
  kda_decode_kernel<T><<<grid, NT, 0, c10::cuda::getCurrentCUDAStream()>>>(
      qkv.data_ptr<T>(), f.data_ptr<T>(), b.data_ptr<T>(), gate.data_ptr<T>(), conv_w.data_ptr<T>(),
      A.data_ptr<float>(), dtb.data_ptr<float>(), nw.data_ptr<float>(), S.data_ptr<float>(), cs.data_ptr<T>(),
      ip, y.data_ptr<T>(), Tn, H, W, (float)scale, (float)lower_bound, (float)eps, softplus);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
}  // namespace

torch::Tensor kda_fused_decode_cuda(torch::Tensor qkv, torch::Tensor f, torch::Tensor b, torch::Tensor gate,
                                    torch::Tensor conv_w, torch::Tensor A_log, torch::Tensor dt_bias,
                                    torch::Tensor norm_w, torch::Tensor S, torch::Tensor conv_state,
                                    std::optional<torch::Tensor> idx, bool softplus, double lower_bound,
                                    double eps, double scale) {
  const int B = qkv.size(0), Tn = qkv.size(1), H = A_log.size(0);
  auto y = torch::empty({B, Tn, H, D}, qkv.options());
  if (B == 0 || Tn == 0) return y;
  qkv = qkv.contiguous(); f = f.contiguous(); b = b.contiguous(); gate = gate.contiguous();
  conv_w = conv_w.contiguous();
  auto A = A_log.to(torch::kFloat).contiguous();
  auto dtb = dt_bias.to(torch::kFloat).contiguous();
  auto nw = norm_w.to(torch::kFloat).contiguous();
  torch::Tensor idx64;
  const int64_t* ip = nullptr;
  if (idx.has_value()) {
    idx64 = idx->to(torch::kLong).contiguous();
    ip = idx64.data_ptr<int64_t>();
  }
  switch (qkv.scalar_type()) {
    case torch::kFloat: launch<float>(qkv, f, b, gate, conv_w, A, dtb, nw, S, conv_state, ip, y, H, softplus, lower_bound, eps, scale); break;
    case torch::kHalf: launch<at::Half>(qkv, f, b, gate, conv_w, A, dtb, nw, S, conv_state, ip, y, H, softplus, lower_bound, eps, scale); break;
    case torch::kBFloat16: launch<at::BFloat16>(qkv, f, b, gate, conv_w, A, dtb, nw, S, conv_state, ip, y, H, softplus, lower_bound, eps, scale); break;
    default: TORCH_CHECK(false, "kda_fused_decode_cuda: unsupported dtype ", qkv.scalar_type());
  }
  return y;
}
"""

_DECL = ("torch::Tensor kda_fused_decode_cuda(torch::Tensor qkv, torch::Tensor f, torch::Tensor b, "
         "torch::Tensor gate, torch::Tensor conv_w, torch::Tensor A_log, torch::Tensor dt_bias, "
         "torch::Tensor norm_w, torch::Tensor S, torch::Tensor conv_state, std::optional<torch::Tensor> idx, "
         "bool softplus, double lower_bound, double eps, double scale);")


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    why = toolchain_reason()
    if why:
        return why
    if os.environ.get("K3NN_KDA_CUDA", "0") in ("", "0"):
        return "opt-in: set K3NN_KDA_CUDA=1 (matches the reference on the H200 but is slower than the Triton kernel there)"
    return None


@functools.lru_cache(maxsize=1)
def _module():
    from torch.utils.cpp_extension import load_inline

    return load_inline(name="k3nn_kda_fused_decode", cpp_sources=_DECL, cuda_sources=CUDA_SOURCE,
                       functions=["kda_fused_decode_cuda"], extra_cuda_cflags=["-O3"], verbose=False)


def supports(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, recurrent_state, conv_state,
             state_indices=None, gate_kind="softplus", lower_bound=-5.0, norm_eps=1e-5, scale=None):
    if qkv.device.type != "cuda":
        return "inputs are not CUDA tensors"
    if norm_weight.shape[0] != 128:
        return f"head dim must be 128 for the CUDA kernel, got {norm_weight.shape[0]}"
    if qkv.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {qkv.dtype} not supported"
    for name, t in (("f", f), ("b", b), ("gate", gate), ("conv_weight", conv_weight), ("conv_state", conv_state)):
        if t.dtype != qkv.dtype:
            return f"{name} must have qkv's dtype {qkv.dtype}, got {t.dtype}"
    if recurrent_state.dtype != torch.float32 or not recurrent_state.is_contiguous():
        return "recurrent_state must be contiguous float32 (updated in place)"
    if not conv_state.is_contiguous():
        return "conv_state must be contiguous (updated in place)"
    return None


def kda_fused_decode_cuda(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, recurrent_state, conv_state,
                          state_indices=None, gate_kind="softplus", lower_bound=-5.0, norm_eps=1e-5, scale=None):
    D = norm_weight.shape[0]
    scale = D ** -0.5 if scale is None else float(scale)
    return _module().kda_fused_decode_cuda(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight,
                                           recurrent_state, conv_state, state_indices, gate_kind == "softplus",
                                           float(lower_bound), float(norm_eps), scale)
