"""CUDA MLA decode (kernels/mla/cuda_decode.py) on a CPU machine: availability reasons, supports() reasons (the
extension failing to build), auto_skip (auto's default: the wgmma kernel on sm_90 for batched calls only), the
kernel choice (wgmma / mma) and the 16 / 64-row choice, the cluster size from the tuning object, the registry keeping auto on
Triton/eager here, the split heuristics and the generated source (the slow tests compile it with nvcc for sm_90
and sm_90a). The kernels themselves run in tests/gpu/test_mla_gpu.py."""

import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import braces_balanced, nvcc_sm90

import k3nn.kernels.mla.cuda_decode as cd
from k3nn.kernels.registry import get_op, resolve, tuning


def _inputs(dtype=torch.bfloat16, R=512, DR=64, B=2, Tq=1, H=4, page=64):
    q = torch.randn(B, Tq, H, R + DR).to(dtype)
    pool = torch.randn(6, page, R + DR).to(dtype)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)[:B]
    return q[..., :R], q[..., R:], pool, table, torch.tensor([100, 3][:B], dtype=torch.int32)


def test_unavailable_on_cpu_with_a_reason(monkeypatch):
    if not torch.cuda.is_available():
        assert cd.available() == "CUDA is not available"
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "nvcc" in cd.available.__wrapped__()
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvcc")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert "sm_80" in cd.available.__wrapped__()


def test_auto_skip_leaves_small_calls_and_other_gpus_to_triton(monkeypatch):
    """Under auto: on sm_90 the CUDA kernel for batched calls only; off sm_90 never (mma.sync is slower than the
    Triton kernel). An explicit backend("cuda") runs them all (auto_skip is not asked then)."""
    class Props:
        shared_memory_per_block_optin = 227 * 1024
        major, minor = 9, 0

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: Props())
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    small = _inputs(B=cd.MIN_ROW_CTAS - 1)
    assert "small batch" in cd.auto_skip(*small, 0.07)
    assert cd.auto_skip(*_inputs(B=cd.MIN_ROW_CTAS), 0.07) is None
    assert cd.auto_skip(*_inputs(B=1, H=96), 0.07) is None  # two 64-row blocks per request: the kernel too
    assert cd.auto_skip(*_inputs(B=1, Tq=2, H=64), 0.07) is None
    Props.major = 8
    assert "mma.sync" in cd.auto_skip(*_inputs(B=64), 0.07)
    monkeypatch.undo()
    assert cd.auto_skip(*_inputs(), 0.07) is None  # not CUDA tensors: supports() gives the reason
    assert get_op("mla_decode").impls["cuda"].auto_skip is not None


def test_registered_and_auto_keeps_the_reference_on_cpu():
    impl = get_op("mla_decode").impls["cuda"]
    args = _inputs(torch.float32) + (0.07,)
    assert impl.why_not(args, {})  # CPU: no CUDA
    assert impl.why_not(args, {}) == cd.available()  # the machine's reason comes first
    assert resolve("mla_decode", args, {}, "auto").backend != "cuda"


def test_supports_reasons_without_gpu():
    assert cd.supports(*_inputs(), 0.07) == "inputs are not CUDA tensors"


def test_supports_reasons_on_fake_cuda(monkeypatch):
    """The shape / dtype checks behind the device check (the device check is patched away)."""
    class Props:
        shared_memory_per_block_optin = 227 * 1024
        major, minor = 8, 0  # an A100: the mma.sync kernel

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: Props())
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    assert cd.supports(*_inputs(), 0.07) is None
    assert cd.supports(*_inputs(), 0.07, out_dtype=torch.float32) is None
    assert "fp16" in cd.supports(*_inputs(torch.float32), 0.07)
    assert "kv_lora_rank" in cd.supports(*_inputs(R=256), 0.07)
    assert "out dtype" in cd.supports(*_inputs(), 0.07, out_dtype=torch.float16)
    assert "num_splits" in cd.supports(*_inputs(), 0.07, num_splits=257)
    q_lat, q_rope, _, table, sl = _inputs()
    padded = torch.randn(6, 64, 580).bfloat16()[..., :576]  # row stride 580: not 16-byte aligned
    assert "16-byte" in cd.supports(q_lat, q_rope, padded, table, sl, 0.07)
    assert cd.supports(*_inputs(), 0.07, rows=64) is None
    Props.shared_memory_per_block_optin = 150 * 1024  # enough for 16 rows (102 KB), not for 64 (162 KB)
    assert cd.supports(*_inputs(), 0.07) is None  # the default falls back to 16 rows
    assert cd.rows_choice(None, torch.device("cuda", 0)) == 16 and cd.rows_choice() == 64
    assert "64-row" in cd.supports(*_inputs(), 0.07, rows=64)
    assert "rows must be 16 or 64" in cd.supports(*_inputs(), 0.07, rows=32)
    Props.shared_memory_per_block_optin = 48 * 1024
    assert "shared memory" in cd.supports(*_inputs(), 0.07)


def test_kernel_choice_on_fake_cuda(monkeypatch):
    """wgmma is the default on sm_90 and refused elsewhere; kernel= picks; its shared memory is checked; unknown
    names are errors naming the argument."""
    class Props:
        shared_memory_per_block_optin = 227 * 1024
        major, minor = 9, 0

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: Props())
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    dev = torch.device("cuda", 0)
    assert cd.kernel_choice(device=dev) == "wgmma" and cd.kernel_choice() == "mma"
    assert cd.kernel_choice("mma", dev) == "mma"
    q_lat, q_rope, pool, table, sl = _inputs()
    big = (q_lat[:1].expand(cd.MIN_ROW_CTAS, -1, -1, -1), q_rope[:1].expand(cd.MIN_ROW_CTAS, -1, -1, -1), pool,
           table[:1].expand(cd.MIN_ROW_CTAS, -1), sl[:1].expand(cd.MIN_ROW_CTAS))
    # a batched call takes the kernel once the extension builds; a failed build makes auto step aside
    monkeypatch.setattr(cd, "_BUILD_FAILED", [])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert "capture" in cd.supports(*big, 0.07)
    assert "capture" in cd.supports(*_inputs(B=1, H=96), 0.07)  # two 64-row blocks per request: the kernel too
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def broken_build():
        raise RuntimeError("nvcc fatal: Unsupported gpu architecture 'compute_90a'")
    broken_build.cache_info = lambda: SimpleNamespace(currsize=0)  # never built
    monkeypatch.setattr(cd, "build", broken_build)
    assert "failed to build" in cd.supports(*big, 0.07) and "compute_90a" in cd.supports(*big, 0.07)
    monkeypatch.setattr(cd, "build", SimpleNamespace(cache_info=lambda: SimpleNamespace(currsize=1)))  # built
    assert cd.supports(*big, 0.07) is None
    assert cd.supports(*_inputs(B=1), 0.07) is None  # what auto passes over, an explicit backend runs
    assert cd.SMEM_BYTES_WGMMA <= 227 * 1024
    assert "kernel must be one of" in cd.supports(*_inputs(), 0.07, kernel="tcgen05")
    with pytest.raises(ValueError, match="kernel"):
        cd.kernel_choice("wmma", dev)
    Props.shared_memory_per_block_optin = 200 * 1024
    assert "wgmma kernel needs" in cd.supports(*_inputs(), 0.07)
    assert cd.supports(*_inputs(), 0.07, kernel="mma") is None
    Props.major = 8
    with pytest.raises(ValueError, match="sm_90"):
        cd.kernel_choice("wgmma", dev)
    assert "sm_90" in cd.supports(*_inputs(), 0.07, kernel="wgmma")


def test_rows_choice():
    assert cd.rows_choice() == 64 and cd.DEFAULT_ROWS == 64  # faster than 16 rows at every H200 case (h200-s5-run1)
    assert cd.rows_choice(64) == 64 and cd.rows_choice(16) == 16
    for bad in (32, 0, "64"):
        with pytest.raises(ValueError, match="rows must be 16 or 64"):
            cd.rows_choice(bad)
    with pytest.raises(ValueError, match="rows must be 16 or 64"):  # before any device work
        cd.mla_decode_cuda(*_inputs(), 0.07, rows=32)


def test_default_splits():
    # B=64, H=64: 256 CTAs per split = one wave of 2 × 132 already
    assert cd.default_num_splits(64, 64, 8192, 132) == 1
    assert cd.default_num_splits(1, 64, 32768, 132) == 66
    assert cd.default_num_splits(1, 64, 256, 132) == 2  # short table: at least 4 tiles per split
    assert cd.default_num_splits(1, 1, 10 ** 6, 132) == cd.MAX_SPLITS
    assert cd.default_num_splits(500, 96, 4096, 132) == 1
    # 64 rows, one CTA per SM: B=64 H=64 is 64 CTAs per split, so two splits fill the 132 SMs
    assert cd.default_num_splits(64, 64, 8192, 132, rows=64) == 2
    assert cd.default_num_splits(64, 96, 8192, 132, rows=64) == 1
    assert cd.default_num_splits(1, 64, 32768, 132, rows=64) == 132
    assert cd.default_num_splits(1, 64, 256, 132, rows=64) == 2
    assert cd.default_num_splits(1, 64, 32768, 132, 2, rows=64) == 256  # ctas_per_sm still overrides
    # per kernel: the warp-group kernel keeps at least 8 tiles of 64 keys per split, mma.sync the plain rule
    assert cd.kernel_num_splits("wgmma", 1, 64, 32768, 132) == 64
    assert cd.kernel_num_splits("wgmma", 64, 64, 8192, 132) == 2
    assert cd.kernel_num_splits("wgmma", 1, 64, 1000, 132) == 2
    assert cd.kernel_num_splits("mma", 1, 64, 32768, 132, 16) == cd.default_num_splits(1, 64, 32768, 132)
    assert cd.kernel_num_splits("mma", 1, 64, 32768, 132, 64) == cd.default_num_splits(1, 64, 32768, 132, rows=64)


def test_generated_source_has_the_entry_points():
    cu = cd.kernel_source()
    for name in ("mla_split_kernel", "mla_split64_kernel", "mla_combine_kernel", "mla_decode_dispatch(",
                 "struct MlaParams", "launch_t<__nv_bfloat16, __nv_bfloat16>(p, rows, kernel, stream)",
                 "mla_wgmma_kernel", "bar.arrive %0, 256", "cp.async.bulk.tensor.3d", "mbarrier.try_wait.parity",
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16", "fence.proxy.async.shared::cta",
                 "if (rows == ROWS64)", "bar.sync %0, 64", "SMEM_BYTES64 = Q_BYTES64",
                 "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "mma.sync.aligned.m16n8k16.row.col.f32.f16",
                 "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "cp.async.cg.shared.global",
                 "SMEM_BYTES = Q_BYTES", "griddepcontrol.launch_dependents", "griddepcontrol.wait",
                 "cudaLaunchAttributeProgrammaticStreamSerialization", "wg_store_rows(", "#ifdef K3MLA_TRACE",
                 "barrier.cluster.arrive.release.aligned", "mapa.shared::cluster.u32", "ld.shared::cluster.v4.f32",
                 "cudaLaunchAttributeClusterDimension", "cudaOccupancyMaxActiveClusters", "wg_cluster_merge<TO>("):
        assert name in cu, name
    assert "torch" not in cu and "__PARAMS__" not in cu  # the .cu compiles without torch headers
    assert braces_balanced(cu) and braces_balanced(cd._CPP_SOURCE)
    for decl in filter(None, (d.strip() for d in cd._DECL.split(";"))):
        assert re.sub(r"\s+", " ", decl) in re.sub(r"\s+", " ", cd._CPP_SOURCE), decl
    # the Python mirror of the shared-memory size matches the CUDA constants
    consts = dict(re.findall(r"constexpr int (\w+) = (\d+)", cu))
    assert int(consts["ROWS"]) == cd.ROWS and "BN = 32" in cu and cd.BLOCK_N == 32
    assert int(consts["ROWS64"]) == 64 and "NWARP64 = 8" in cu and cd.ROWS_VARIANTS == (16, 64)
    assert cd.SMEM_BYTES < 114 * 1024  # two CTAs per SM on sm_90 (227 KB)
    assert cd.SMEM_BYTES_BY_ROWS[64] <= 227 * 1024  # one 64-row CTA per SM
    assert "int64_t rows" in cd._DECL and "(int)rows" in cd._CPP_SOURCE
    assert "int64_t kernel" in cd._DECL and "(int)kernel" in cd._CPP_SOURCE
    assert "int64_t cluster" in cd._DECL and "p.cluster = (int)cluster" in cd._CPP_SOURCE
    assert int(consts["WG_MAX_CLUSTER"]) == max(cd.CLUSTERS)


def test_wgmma_plan_and_cluster_choice(monkeypatch):
    plain = cd.kernel_num_splits
    # default: the plain split rule, and the splits of a row tile as one resident cluster where they are 2 to 8
    assert cd.wgmma_plan(1, 64, 32768, 132) == (plain("wgmma", 1, 64, 32768, 132), 1)
    assert cd.wgmma_plan(64, 64, 8192, 132) == (2, 2)  # 64 clusters of 2: no combine kernel
    assert cd.wgmma_plan(64, 96, 8192, 132) == (1, 1)
    assert cd.wgmma_plan(30, 64, 8192, 132) == (4, 4)
    assert cd.wgmma_plan(20, 64, 8192, 132) == (6, 6)
    h200 = {2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15}.__getitem__  # resident clusters (h200-s11-run4)
    assert cd.wgmma_plan(30, 64, 8192, 132, resident=h200) == (4, 4)
    assert cd.wgmma_plan(32, 64, 8192, 132, resident=h200) == (4, 1)  # 32 clusters of 4 > 30; 3 is too few
    assert cd.wgmma_plan(20, 64, 8192, 132, resident=h200) == (6, 1)  # 20 clusters of 6 > 17
    assert cd.wgmma_plan(15, 64, 8192, 132, resident=h200) == (8, 8)
    assert cd.wgmma_plan(16, 64, 8192, 132, resident=h200) == (8, 1)  # 16 > 15 clusters of 8, and of 7
    assert cd.wgmma_plan(14, 64, 8192, 132, resident=h200) == (8, 8)  # 9 splits: one fewer fits
    assert cd.wgmma_plan(1, 64, 32768, 132, num_splits=2) == (2, 2)
    assert cd.wgmma_plan(1, 64, 32768, 132, num_splits=5) == (5, 5)
    assert cd.wgmma_plan(16, 64, 32768, 132, num_splits=8, resident=h200) == (8, 1)  # explicit splits never shrink
    assert cd.wgmma_plan(1, 64, 32768, 132, num_splits=16) == (16, 1)
    # a cluster size asked for: B=1 L=64K H=64, one wave of clusters (33 of 4 on 132 SMs, or as many as are
    # resident), a multiple of the cluster size
    assert cd.wgmma_plan(1, 64, 65536, 132, 1) == (plain("wgmma", 1, 64, 65536, 132), 1)
    assert cd.wgmma_plan(1, 64, 65536, 132, 4) == (132, 4)
    assert cd.wgmma_plan(1, 64, 65536, 132, 4, resident=lambda c: 30) == (120, 4)
    assert cd.wgmma_plan(1, 64, 65536, 132, 8, resident=lambda c: 15) == (120, 8)
    assert cd.wgmma_plan(1, 64, 32768, 132, 4) == (128, 4)  # L=32K: 4 tiles per split at least
    assert cd.wgmma_plan(1, 96, 32768, 132, 2) == (66, 2)  # two row tiles
    assert cd.wgmma_plan(1, 64, 1000, 132, 2) == (4, 2)
    # too few splits for a cluster: the plain rule
    assert cd.wgmma_plan(64, 96, 8192, 132, 2) == (1, 1)
    assert cd.wgmma_plan(1, 64, 32768, 132, 4, resident=lambda c: 0) == (plain("wgmma", 1, 64, 32768, 132), 1)
    # explicit splits stay; the largest cluster size up to the one asked for that divides them
    assert cd.wgmma_plan(1, 64, 32768, 132, 8, num_splits=12) == (12, 6)
    assert cd.wgmma_plan(1, 64, 32768, 132, 4, num_splits=7) == (7, 1)
    assert cd.wgmma_plan(1, 64, 32768, 132, 5, num_splits=15) == (15, 5)
    assert cd.wgmma_plan(1, 64, 32768, 132, 2, num_splits=999) == (cd.MAX_SPLITS, 2)
    assert cd.cluster_choice() is None
    assert cd.cluster_choice(4) == 4
    with tuning(mla_cluster=2):
        assert cd.cluster_choice() == 2 and cd.cluster_choice(4) == 4  # an explicit cluster= wins
    assert cd.cluster_choice() is None
    for bad in (0, 9, 16, "2", True):
        with pytest.raises(ValueError, match="cluster"):
            cd.cluster_choice(bad)
    with pytest.raises(ValueError, match="mla_cluster"):
        tuning(mla_cluster=9).__enter__()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_wgmma_kernel_compiles_for_sm90a(tmp_path):
    """The warp-group kernel for sm_90a (no GPU needed): four instantiations, no spills, no wgmma chain that ptxas
    serializes (C7510-C7520: a divergent wait between the products, or too few registers), its shared memory equal
    to the Python mirror and within one CTA per SM; the combine kernel's split bound equal to MAX_SPLITS."""
    log, spills = nvcc_sm90(tmp_path, cd.kernel_source()
                            + f"static_assert(k3mla::WG_SMEM == {cd.SMEM_BYTES_WGMMA}, \"wgmma smem\");\n"
                            f"static_assert(k3mla::MERGE_MAX_SPLITS == {cd.MAX_SPLITS}, \"combine splits\");\n",
                            "mla_wg", arch="sm_90a")
    assert not spills, spills
    assert "are serialized" not in log, [ln for ln in log.splitlines() if "serialized" in ln]
    entries = re.findall(r"Compiling entry function '(\w+)'", log)
    assert sum("mla_wgmma_kernel" in e for e in entries) == 4, entries
    assert cd.SMEM_BYTES_WGMMA <= 227 * 1024


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_traced_wgmma_kernel_compiles_for_sm90a(tmp_path):
    """The phase-stamp build (``K3MLA_TRACE``, bench/gpu/mla_trace.py) still compiles for sm_90a without spills or a
    serialized wgmma chain, and adds the trace buffer and its host copy; the default build has neither."""
    src = cd.kernel_source()
    assert "k3mla_trace_copy" in src and src.index("k3mla_trace_copy") > src.index("#ifdef K3MLA_TRACE")
    log, spills = nvcc_sm90(tmp_path, "#define K3MLA_TRACE 1\n" + src, "mla_trace", arch="sm_90a")
    assert not spills, spills
    assert "are serialized" not in log, [ln for ln in log.splitlines() if "serialized" in ln]
    entries = re.findall(r"Compiling entry function '(\w+)'", log)
    assert sum("mla_wgmma_kernel" in e for e in entries) == 4, entries


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_source_compiles_for_sm90(tmp_path):
    """The torch-free .cu through nvcc (no GPU needed): both stage-1 variants, no errors, no register spills,
    shared-memory sizes equal to the Python mirrors."""
    log, spills = nvcc_sm90(tmp_path, cd.kernel_source()
                            + f"static_assert(k3mla::SMEM_BYTES == {cd.SMEM_BYTES}, \"16-row smem\");\n"
                            f"static_assert(k3mla::SMEM_BYTES64 == {cd.SMEM_BYTES_BY_ROWS[64]}, \"64-row smem\");\n",
                            "mla")
    assert not spills, spills
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    assert regs and max(regs) <= 255
    entries = re.findall(r"Compiling entry function '(\w+)'", log)
    assert sum("mla_split_kernel" in e for e in entries) == 4, entries  # {bf16, fp16} x {input dtype, fp32} out
    assert sum("mla_split64_kernel" in e for e in entries) == 4, entries
