"""bench.gpu.mx_wgmma's decode 4 stays in step with the shipped CUDA MXFP4 GEMV source (no GPU or nvcc needed)."""

from bench.gpu import mx_wgmma
from k3nn.kernels.moe import cuda_mx_gemv as cm


def test_decode4_source_adds_the_wgmma_loop_and_keeps_the_shipped_branches():
    src = mx_wgmma.wgmma_source(cm.CUDA_SOURCE)
    assert src.count("wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3") == 1
    assert src.count("#include <cuda_fp8.h>") == 1
    assert "stream_rows_wg<BMX, NM, RT, KS, U, PF>(" in src
    assert "} else if (fast && nr < 4) {" in src  # decodes 0 and 1, and decode 4's other CTAs, as shipped
    assert src.count("__global__") == cm.CUDA_SOURCE.count("__global__")


def test_decode4_ring_launch_sizes_shared_memory_for_the_b_tiles():
    src = mx_wgmma.wgmma_source(cm.CUDA_SOURCE)
    assert "stream_ring_wg<BMX, NM, RT, KS, U, RING>(W.rf, W.JC, W.G, L, desc0)" in src
    assert mx_wgmma._LAUNCH_SMEM not in src and src.count(mx_wgmma._LAUNCH_SMEM_WG) == 1
    # the kernel and the launcher place the tiles after the slots and barriers that the shipped Smem::total counts
    assert src.index("size_t wg_tiles_off(int G)") < src.index("mx_gemv_kernel(const Args p")


def test_decode4_ring_is_one_per_warpgroup_with_64_row_boxes():
    src = mx_wgmma.wgmma_source(cm.CUDA_SOURCE)
    assert "W.rf.row = n0 + rt * 16;" not in src and src.count(mx_wgmma._RING_PROLOGUE_WG) == 1
    assert src.count("DEC == 4 ? 64u : 16u") == 2  # both matrices' tensor maps
    assert "unsigned rows = 16u" in src and "{(cuuint32_t)box, rows, 1u}" in src
    assert 'bar.sync %0, 128;' in src  # the four warps release a slot together
