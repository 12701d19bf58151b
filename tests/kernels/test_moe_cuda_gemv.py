"""CUDA MXFP4 expert GEMV (kernels/moe/cuda_mx_gemv.py) on a CPU machine: availability reasons, the
KernelTuning.moe_gemv / moe_cuda_pdl fields, config checks and the shape of the generated source. The kernels themselves run in
tests/gpu/test_moe_gpu.py."""

import re
import shutil

import pytest
import torch
from conftest import braces_balanced, nvcc_sm90, unique_symbols

import k3nn.kernels.moe.cuda_mx_gemv as cm
import k3nn.kernels.moe.triton_fused as tf
from k3nn.kernels.registry import KernelTuning, tuning
from k3nn.kernels.moe.reference import moe_expert_outputs_reference
from k3nn.quant import mxfp4_quantize


def test_unavailable_on_cpu_with_a_reason(monkeypatch):
    if not torch.cuda.is_available():
        assert cm.available() == "CUDA is not available"
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "nvcc" in cm.available.__wrapped__()


def test_supports_reasons_without_gpu():
    w = mxfp4_quantize(torch.randn(2, 32, 64))
    assert cm.supports(torch.randn(1, 64), w, w, w) == "inputs are not CUDA tensors"


@pytest.mark.parametrize("value", ["cuda-ish", "tri ton", "1", "Triton"])
def test_bad_gemv_value_names_the_field(value):
    with pytest.raises(ValueError, match="moe_gemv"):
        KernelTuning(moe_gemv=value)
    with pytest.raises(ValueError, match="moe_gemv"), tuning(moe_gemv=value):
        pass


@pytest.mark.parametrize("value", ["auto", "triton", "cuda"])
def test_gemv_values(value):
    assert tf.gemv_impl() == "auto"
    with tuning(moe_gemv=value):
        assert tf.gemv_impl() == value
    assert tf.gemv_impl() == "auto"


def test_triton_gemv_never_takes_the_cuda_block_size():
    with tuning(moe_gemv="triton"):
        assert not tf._cuda_gemv_possible()
        assert tf.block_m_for(3, 8, True, "gemv") == 1


def test_gemv_pair_limits_follow_the_tuning():
    """moe_gemv_pairs bounds the Triton GEMV (0: never) where the CUDA GEMV cannot run; bad limits are refused."""
    if tf._cuda_gemv_possible():
        pytest.skip("the CUDA GEMV runs here: moe_cuda_gemv_pairs is the limit")
    for limit in (0, 5, 64):
        with tuning(moe_gemv_pairs=limit):
            assert tf.use_gemv(1, True) is (limit > 0) and not tf.use_gemv(limit + 1, True)
            assert tf.use_gemv(max(limit, 1), True) is (limit > 0)
            assert tf.use_gemv(limit + 1, True, "gemv")  # an explicit mx_mode="gemv" ignores the limit
    with tuning(moe_cuda_gemv_pairs=0):  # the CUDA limit does not apply without the CUDA GEMV
        assert tf.use_gemv(64, True)
    for bad in (-1, 2.5, True, "64"):
        with pytest.raises(ValueError, match="moe_gemv_pairs"):
            KernelTuning(moe_gemv_pairs=bad)
        with pytest.raises(ValueError, match="moe_cuda_gemv_pairs"):
            KernelTuning(moe_cuda_gemv_pairs=bad)


def test_auto_without_gpu_is_silent_triton(monkeypatch, caplog):
    """The default (auto) where the CUDA GEMV cannot run: the Triton GEMV and its 64-pair limit, no warning."""
    monkeypatch.setattr(tf, "_CUDA_GEMV_WARNED", set())
    assert tf.block_m_for(3, 8, True, "gemv") == 1
    limit = KernelTuning().moe_gemv_pairs
    assert limit == 64 and tf.use_gemv(limit, True) and not tf.use_gemv(limit + 1, True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=g)
    w1, w3 = (mxfp4_quantize(torch.randn(4, 32, 64, generator=g) / 8) for _ in range(2))
    w2 = mxfp4_quantize(torch.randn(4, 64, 32, generator=g) / 6)
    with caplog.at_level("WARNING"):
        tf.fused_expert_outputs(x, w1, w3, w2, torch.tensor([[1, 3]]), "situ", 4.0, 25.0, mx_mode="gemv")
    assert not any("moe_gemv" in r.message for r in caplog.records)


def test_cuda_request_without_gpu_warns_and_keeps_triton(monkeypatch, caplog):
    """moe_gemv="cuda" where the kernel cannot run: one warning, the Triton GEMV, same numbers."""
    monkeypatch.setattr(tf, "_CUDA_GEMV_WARNED", set())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=g)
    w1, w3 = (mxfp4_quantize(torch.randn(4, 32, 64, generator=g) / 8) for _ in range(2))
    w2 = mxfp4_quantize(torch.randn(4, 64, 32, generator=g) / 6)
    ids = torch.tensor([[1, 3]])
    with tuning(moe_gemv="cuda"), caplog.at_level("WARNING"):
        assert tf.block_m_for(3, 8, True, "gemv") == 1  # Triton's block size: the CUDA one needs the kernel
        y = tf.fused_expert_outputs(x, w1, w3, w2, ids, "situ", 4.0, 25.0, mx_mode="gemv")
    assert sum("moe_gemv='cuda'" in r.message for r in caplog.records) == 1
    ref = moe_expert_outputs_reference(x, w1, w3, w2, ids, "situ", 4.0, 25.0)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-4


def test_config_checks_and_block_m():
    with pytest.raises(ValueError, match="bad config"):
        cm.build([cm.CudaGemvConfig(row_tiles=3)])
    with pytest.raises(ValueError, match="dtypes"):
        cm.build(dtypes=("fp32",))
    with pytest.raises(ValueError, match="ring 0-8 and then no prefetch"):
        cm.build([cm.CudaGemvConfig(2, 2, 2, True, 1, 4)])
    for bad in (cm.CudaGemvConfig(2, 2, 2, False, 1, 9), cm.CudaGemvConfig(2, 2, 5, False, 1, 2)):
        with pytest.raises(ValueError, match="bad config"):
            cm.build([bad])
    # the default: one block of 8 rows per expert whatever the sizes
    assert {cm.cuda_block_m(p, e) for p in (1, 16, 64, 256) for e in (4, 128, 896)} == {8}
    # poisson: K3 (128 experts, top-16) at 1 / 4 / 16 tokens, then a few small and large expert counts
    assert [cm.cuda_block_m(16 * t, 128, "poisson") for t in (1, 4, 16, 64)] == [2, 4, 8, 8]
    assert [cm.cuda_block_m(p, 896, "poisson") for p in (16, 64, 256, 1024)] == [2, 2, 4, 8]
    assert [cm.cuda_block_m(p, e, "poisson") for p, e in ((1, 4), (12, 4), (32, 8))] == [2, 8, 8]
    # mean: the earlier rule (≈ pairs per touched expert), kept for the benchmark's A/B
    assert [cm.cuda_block_m(p, 896, "mean") for p in (16, 64, 256)] == [2, 2, 2]
    assert [cm.cuda_block_m(p, e, "mean") for p, e in ((12, 4), (32, 8), (64, 4))] == [4, 4, 8]
    assert cm.cuda_block_m(256, 128, "mean") == 2
    with pytest.raises(ValueError, match="rule"):
        cm.cuda_block_m(16, 128, "bogus")
    # K3 shapes: every block size fits the H200's 227 KB
    for bm in (1, 2, 4, 8):
        assert cm.smem_bytes(cm.DEFAULT_CONFIG, bm, 3584, True) < 227 * 1024
    # two 64-row CTAs per SM (228 KB) even at block_m 8: E8M0 scales stay bytes in shared memory
    assert 2 * (cm.smem_bytes(cm.CudaGemvConfig(4, 2, 2, True, 1), 8, 3584, True) + 1024) <= 228 * 1024
    # the ring adds warps · slots · (16 rows · matrices · unroll · 64 bytes + an 8-byte barrier), 128-byte aligned
    base = cm.smem_bytes(cm.CudaGemvConfig(2, 2, 2, False, 1), 2, 3584, True)
    ring = cm.smem_bytes(cm.CudaGemvConfig(2, 2, 2, False, 1, 4), 2, 3584, True)
    assert ring == -(-base // 128) * 128 + 4 * 4 * (2 * 16 * 2 * 64 + 8)


def test_launch_config_takes_the_ring_for_few_tokens_on_sm90(monkeypatch):
    x, w = torch.randn(1, 64), mxfp4_quantize(torch.randn(2, 32, 64))
    monkeypatch.setattr(cm, "_smem_limit", lambda dev: 227 * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    assert cm.default_configs("cpu") == (cm.DEFAULT_CONFIG, cm.RING_CONFIG)
    picks = [cm.launch_config(x, w, w, t, 8) for t in range(1, 2 * cm.RING_MAX_TOKENS + 1)]
    assert picks == [cm.RING_CONFIG] * cm.RING_MAX_TOKENS + [cm.DEFAULT_CONFIG] * cm.RING_MAX_TOKENS
    assert cm.RING_CONFIG.ring and not cm.RING_CONFIG.prefetch and cm.RING_CONFIG[:3] == cm.DEFAULT_CONFIG[:3]
    # where the ring does not fit (its shared memory) the register loop runs
    ring_need = cm.smem_bytes(cm.RING_CONFIG, 8, 64, True)
    assert ring_need > cm.smem_bytes(cm.DEFAULT_CONFIG, 8, 64, True)
    monkeypatch.setattr(cm, "_smem_limit", lambda dev: ring_need - 1)
    assert cm.launch_config(x, w, w, 1, 8) == cm.DEFAULT_CONFIG
    monkeypatch.setattr(cm, "_smem_limit", lambda dev: 227 * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 9))  # no bulk copies: no ring
    assert cm.default_configs("cpu") == (cm.DEFAULT_CONFIG,)
    assert cm.launch_config(x, w, w, 1, 8) == cm.DEFAULT_CONFIG
    # a ring launch stages one row per token (each token routes to an expert once), the register loop block_m
    assert cm.instance_rows(cm.RING_CONFIG, 8, 16, 16) == 1 and cm.instance_rows(cm.RING_CONFIG, 8, 64, 16) == 4
    assert cm.instance_rows(cm.RING_CONFIG, 2, 64, 16) == 2 and cm.instance_rows(cm.DEFAULT_CONFIG, 8, 16, 16) == 8


def test_pdl_field(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    assert cm.pdl_enabled("cpu") is True
    with tuning(moe_cuda_pdl=False):
        assert cm.pdl_enabled("cpu") is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 9))
    assert cm.pdl_enabled("cpu") is False  # sm_90+ only
    with pytest.raises(TypeError, match="moe_cuda_pdl"):
        KernelTuning(moe_cuda_pdl=1)


def test_generated_source_has_the_entry_points():
    cfgs = (cm.DEFAULT_CONFIG, cm.CudaGemvConfig(2, 4, 1, False, 1))
    cu = cm.kernel_source(cfgs, ("bf16",))
    for name in ("mx_gemv_kernel", "cudaError_t dispatch(", "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                 "cvt.rn.f16x2.e4m3x2", "ld.global.nc.L1::no_allocate.v4.u32", "struct Args",
                 "griddepcontrol.wait", "griddepcontrol.launch_dependents", "cudaLaunchKernelEx",
                 "cudaLaunchAttributeProgrammaticStreamSerialization", "stream_rows<4, BMX"):
        assert name in cu, name
    assert "torch" not in cu  # the .cu compiles without torch headers
    assert '#include "' not in cu and '#include "' not in cm._CPP_SOURCE  # csrc/ includes spliced in
    assert cu.count("struct Args {") == 1 and "struct Args {" in cm._CPP_SOURCE
    assert f"kTable[{len(cfgs)}][2][3][2]" in cu
    assert "&launch<__nv_bfloat16, 4, 2, 4, 1, 0, 1, 0, true>" in cu and "&launch<__half" not in cu
    ring = cm.kernel_source((cm.CudaGemvConfig(2, 2, 2, False, 1, 4),), ("bf16",))
    for name in ("&launch<__nv_bfloat16, 4, 2, 2, 2, 0, 1, 4, true>", "mbarrier.try_wait.parity",
                 "cp.async.bulk.tensor.3d.shared::cluster.global.tile", "cuTensorMapEncodeTiled",
                 "fence.proxy.async.shared::cta"):
        assert name in ring, name
    assert braces_balanced(cu) and braces_balanced(cm._CPP_SOURCE)
    decl = cm._DECL.rstrip(";")
    assert re.sub(r"\s+", " ", decl) in re.sub(r"\s+", " ", cm._CPP_SOURCE)  # binding matches its declaration


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_source_compiles_for_sm90(tmp_path):
    """The torch-free .cu through nvcc (no GPU needed) for the default (64-row) and the 32-row shape: no errors,
    at most 128 registers everywhere (two 256-thread CTAs per SM), and at most a few dozen bytes of register spills
    (the GLU instances carry the loop twice, with the fast and the general scale decode: 48 bytes at block_m 4) —
    except the four-n8-tile GLU instance (block_m 8), whose four-tile branch spills ~180 bytes (a real spill
    problem is many hundreds: the same instance with prefetch in that branch spills 600)."""
    cfgs = (cm.DEFAULT_CONFIG, cm.CudaGemvConfig(2, 2, 2, True, 1), cm.CudaGemvConfig(2, 2, 2, False, 1, 4))
    log, _ = nvcc_sm90(tmp_path, cm.kernel_source(cfgs), "mx")
    funcs, cur = {}, None
    for ln in log.splitlines():
        if m := re.search(r"entry function '(\w+)'", ln):
            cur = m.group(1)
        elif cur and (m := re.search(r"(\d+) bytes spill stores", ln)):
            funcs.setdefault(cur, {})["spill"] = int(m.group(1))
        elif cur and (m := re.search(r"Used (\d+) registers", ln)):
            funcs.setdefault(cur, {})["regs"] = int(m.group(1))
    assert len(funcs) == len(cfgs) * 2 * 3 * 2, sorted(funcs)  # configs x dtypes x NT x GLU
    for name, f in funcs.items():
        nt4_glu = re.search(r"mx_gemv_kernelI(13__nv_bfloat16|6__half)Li4E\w*Lb1E", name) is not None
        assert f["regs"] <= 128, (name, f)
        assert f.get("spill", 0) <= (192 if nt4_glu else 64), (name, f)
    assert sum(re.search(r"mx_gemv_kernelI(13__nv_bfloat16|6__half)Li4E\w*Lb1E", n) is not None for n in funcs) == 6
    assert not unique_symbols(tmp_path / "mx.o")  # the smem opt-in flags are this module's own
