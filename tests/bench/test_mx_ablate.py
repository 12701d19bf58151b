"""bench.gpu.mx_ablate's source variants stay in step with the shipped CUDA MXFP4 GEMV (no GPU or nvcc needed):
each ablation and occupancy variant finds its markers exactly once and changes what it names."""

import pytest

from bench.gpu import mx_ablate
from k3nn.kernels.moe import cuda_mx_gemv as cm


@pytest.mark.parametrize("compute,staging", [(False, True), (True, False), (False, False)])
def test_ablations_cut_the_shipped_source(compute, staging):
    src = mx_ablate.ablated(cm.CUDA_SOURCE, compute, staging)
    assert src != cm.CUDA_SOURCE
    assert ("acc[m][0][0] +=" in src) == (not compute)  # the XOR fold replaces decode, mma and scale
    assert ("  // 2. E8M0 bytes" in src) == staging and ("  // 3. activations" in src) == staging
    assert src.count("__global__") == cm.CUDA_SOURCE.count("__global__")


def test_occupancy_variant():
    assert mx_ablate.occupancy(cm.CUDA_SOURCE, 0, -1) == cm.CUDA_SOURCE
    src = mx_ablate.occupancy(cm.CUDA_SOURCE, 120, 100)
    assert "need > 122880u ? need : (size_t)122880;" in src
    assert src.count("cudaFuncAttributePreferredSharedMemoryCarveout, 100)") == 1
    assert mx_ablate.occupancy(cm.CUDA_SOURCE, 0, 50).count(mx_ablate._SMEM_LINE) == 1


def test_markers_must_match_once():
    with pytest.raises(ValueError, match="exactly one"):
        mx_ablate._cut("a b a", "a", "b", "")


@pytest.mark.parametrize("name", mx_ablate.LAYOUTS)
def test_layout_timings_rewrite_what_they_name(name):
    src = mx_ablate.layout(cm.CUDA_SOURCE, name)
    assert ("cvt.rn.f16x2.e4m3x2" in src) == (name == "tiled")  # the byte permute replaces the convert
    assert ("0x71717171u" in src) == ("e5m2" in name)
    assert ("((b - q) << 4) + q" in src) == name.startswith("tiled")
    with pytest.raises(ValueError, match="layout must be"):
        mx_ablate.layout(cm.CUDA_SOURCE, "rows")


def test_layout_with_an_ablation():
    src = mx_ablate.layout_variant(cm.CUDA_SOURCE, "tiled+e5m2+no-compute")
    assert "0x71717171u" in src and "((b - q) << 4) + q" in src and "acc[m][0][0] +=" in src
    assert mx_ablate.layout_variant(cm.CUDA_SOURCE, "tiled+e5m2") == mx_ablate.layout(cm.CUDA_SOURCE, "tiled+e5m2")


@pytest.mark.parametrize("hint", mx_ablate.LOAD_HINTS)
def test_load_hint_marks_the_weight_loads(hint):
    src = mx_ablate.load_hint(cm.CUDA_SOURCE, hint)
    assert src.count(f"ld.global.nc.L1::no_allocate.{hint}.v4.u32") == 1
    with pytest.raises(ValueError, match="load hint must be"):
        mx_ablate.load_hint(cm.CUDA_SOURCE, "L2::512B")


def test_no_loads_replaces_the_weight_loads_only():
    src = mx_ablate.ablated(cm.CUDA_SOURCE, True, True, False)
    assert src.count("fake_load(wr[m][") == 2 and "ld_stream(wr[m][" not in src
    assert "ld.global.nc.L1::no_allocate.v4.u32" in src  # ld_stream itself stays (unused by the loop)


def test_min_blocks_sets_the_launch_bounds():
    src = mx_ablate.min_blocks(cm.CUDA_SOURCE, 3)
    assert "__launch_bounds__(32 * RT * KS, 3)" in src
    assert "MinBlocks<32 * RT * KS>::value" not in src
    with pytest.raises(ValueError, match="positive"):
        mx_ablate.min_blocks(cm.CUDA_SOURCE, 0)
