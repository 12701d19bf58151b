
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <cstdint>
namespace k3mx {
#include "mx_gemv_args.cuh"
}  // namespace k3mx

namespace k3mx {
cudaError_t dispatch(int cfg, int dtype, int nt, int glu, const Args& p, int E, cudaStream_t stream);
}

void mx_gemv_launch(int64_t cfg, bool glu, torch::Tensor a, torch::Tensor w1, torch::Tensor s1, torch::Tensor w3,
                    torch::Tensor s3, torch::Tensor out, torch::Tensor sorted, torch::Tensor eid,
                    torch::Tensor num_rows, int64_t bm, int64_t rows, int64_t top_k, int64_t num_pairs, bool a_by_token,
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
  TORCH_CHECK(rows >= 1 && rows <= bm, "mx_gemv_launch: rows must be in [1, block_m]");
  const int nt = rows <= 2 ? 0 : (rows <= 4 ? 1 : 2);  // the instance: n8 tiles for `rows` rows per block
  int dt;
  if (a.scalar_type() == torch::kBFloat16) dt = 0;
  else if (a.scalar_type() == torch::kHalf) dt = 1;
  else TORCH_CHECK(false, "mx_gemv_launch: activations must be bf16 or fp16, got ", a.scalar_type());
  TORCH_CHECK(out.scalar_type() == a.scalar_type(), "mx_gemv_launch: out dtype must match the activations");
  if (p.nb == 0 || p.N == 0) return;
  c10::cuda::CUDAGuard guard(a.device());
  const cudaError_t err = k3mx::dispatch((int)cfg, dt, nt, glu ? 1 : 0, p, (int)w1.size(0),
                                         c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "mx_gemv_launch: ", err == cudaErrorNotSupported ?
              "this (config, dtype, block_m) was not built" : cudaGetErrorString(err));
}
