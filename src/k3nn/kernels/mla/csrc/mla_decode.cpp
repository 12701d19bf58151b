
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cstdlib>
#include <cstring>
namespace k3mla {

#include "mla_params.cuh"

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
