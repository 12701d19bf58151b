"""CUDA MLA decode (kernels/mla/cuda_decode.py) on a CPU machine: availability reasons, supports() reasons (the
extension failing to build), auto_skip (auto's default: the wgmma kernel on sm_90 for batched calls only), the
cluster size from the tuning object, the registry keeping auto on
Triton/eager here, the split heuristics, the source (csrc/ files read by cuda_ext.read_source; the slow tests
compile it with nvcc for sm_90a). The kernels themselves run in tests/gpu/test_mla_gpu.py."""

import re
import shutil
from importlib.resources import files
from types import SimpleNamespace

import pytest
import torch
from conftest import braces_balanced, nvcc_sm90, unique_symbols

import k3nn.kernels.mla.cuda_decode as cd
from k3nn.kernels import cuda_ext
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
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "sm_90" in cd.available.__wrapped__()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert "sm_90 (H100 / H200) only" in cd.available.__wrapped__()


def test_auto_skip_leaves_small_calls_to_triton():
    """Under auto: the CUDA kernel for batched calls only. An explicit backend("cuda") runs them all (auto_skip is
    not asked then)."""
    small = _inputs(B=cd.MIN_ROW_CTAS - 1)
    assert "small batch" in cd.auto_skip(*small, 0.07)
    assert cd.auto_skip(*_inputs(B=cd.MIN_ROW_CTAS), 0.07) is None
    assert cd.auto_skip(*_inputs(B=1, H=96), 0.07) is None  # two 64-row blocks per request: the kernel too
    assert cd.auto_skip(*_inputs(B=1, Tq=2, H=64), 0.07) is None
    assert cd.auto_skip(None, None) is None  # not a call for this kernel: supports() gives the reason
    assert get_op("mla_decode").impls["cuda"].auto_skip is not None


def test_registered_and_auto_keeps_the_reference_on_cpu():
    impl = get_op("mla_decode").impls["cuda"]
    args = _inputs(torch.float32) + (0.07,)
    assert impl.why_not(args, {})  # CPU: no CUDA
    assert impl.why_not(args, {}) == cd.available()  # the machine's reason comes first
    assert resolve("mla_decode", args, {}, "auto").backend != "cuda"


def test_supports_reasons_without_gpu():
    assert cd.supports(*_inputs(), 0.07) == "inputs are not CUDA tensors"


def _fake_gpu(monkeypatch, major=9, smem=227 * 1024):
    class Props:
        shared_memory_per_block_optin = smem

    Props.major, Props.minor = major, 0
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: Props())
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(cd, "build", SimpleNamespace(cache_info=lambda: SimpleNamespace(currsize=1)))  # built
    return Props


def test_supports_reasons_on_fake_cuda(monkeypatch):
    """The shape / dtype / device checks behind the device-type check (patched away)."""
    Props = _fake_gpu(monkeypatch)
    assert cd.supports(*_inputs(), 0.07) is None
    assert cd.supports(*_inputs(B=1), 0.07) is None  # what auto passes over, an explicit backend runs
    assert cd.supports(*_inputs(), 0.07, out_dtype=torch.float32) is None
    assert "fp16" in cd.supports(*_inputs(torch.float32), 0.07)
    assert "kv_lora_rank" in cd.supports(*_inputs(R=256), 0.07)
    assert "out dtype" in cd.supports(*_inputs(), 0.07, out_dtype=torch.float16)
    assert "num_splits" in cd.supports(*_inputs(), 0.07, num_splits=257)
    q_lat, q_rope, _, table, sl = _inputs()
    padded = torch.randn(6, 64, 580).bfloat16()[..., :576]  # row stride 580: not 16-byte aligned
    assert "16-byte" in cd.supports(q_lat, q_rope, padded, table, sl, 0.07)
    assert cd.SMEM_BYTES_WGMMA <= 227 * 1024
    Props.shared_memory_per_block_optin = 200 * 1024
    assert "wgmma kernel needs" in cd.supports(*_inputs(), 0.07)
    Props.shared_memory_per_block_optin, Props.major = 227 * 1024, 8
    assert "sm_90" in cd.supports(*_inputs(), 0.07)


def test_build_reasons_on_fake_cuda(monkeypatch):
    """A call takes the kernel once the extension builds; a failed build, or a first call inside a CUDA-graph
    capture, makes auto step aside with the reason."""
    _fake_gpu(monkeypatch)
    q_lat, q_rope, pool, table, sl = _inputs()
    big = (q_lat[:1].expand(cd.MIN_ROW_CTAS, -1, -1, -1), q_rope[:1].expand(cd.MIN_ROW_CTAS, -1, -1, -1), pool,
           table[:1].expand(cd.MIN_ROW_CTAS, -1), sl[:1].expand(cd.MIN_ROW_CTAS))
    never_built = SimpleNamespace(cache_info=lambda: SimpleNamespace(currsize=0))
    monkeypatch.setattr(cd, "build", never_built)
    monkeypatch.setattr(cd, "_BUILD_FAILED", [])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert "capture" in cd.supports(*big, 0.07)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def broken_build():
        raise RuntimeError("nvcc fatal: Unsupported gpu architecture 'compute_90a'")
    broken_build.cache_info = never_built.cache_info
    monkeypatch.setattr(cd, "build", broken_build)
    assert "failed to build" in cd.supports(*big, 0.07) and "compute_90a" in cd.supports(*big, 0.07)


def test_default_splits():
    # one 64-row CTA per SM, at least 8 tiles of 64 keys per split: B=64 H=64 is 64 CTAs per split, two fill 132 SMs
    assert cd.default_num_splits(1, 64, 32768, 132) == 64
    assert cd.default_num_splits(64, 64, 8192, 132) == 2
    assert cd.default_num_splits(64, 96, 8192, 132) == 1
    assert cd.default_num_splits(1, 64, 1000, 132) == 8  # short table: about two tiles per split
    assert cd.default_num_splits(1, 96, 8192, 132) == 16  # the 8-tile rule
    assert cd.default_num_splits(1, 96, 512, 132) == 4
    assert cd.default_num_splits(1, 96, 2048, 132) == 16
    assert cd.default_num_splits(1, 64, 10 ** 7, 132, ctas_per_sm=2) == cd.MAX_SPLITS  # 264 CTAs would fit
    assert cd.default_num_splits(1, 96, 10 ** 7, 132, ctas_per_sm=2) == 132
    assert cd.default_num_splits(1, 1, 10 ** 7, 1000) == cd.MAX_SPLITS
    assert cd.default_num_splits(500, 96, 4096, 132) == 1
    # the generic rule: rows / key tile / tiles per split
    assert cd.default_num_splits(1, 64, 32768, 132, rows=16, block_n=32, min_tiles=4) == 33
    assert cd.default_num_splits(1, 64, 256, 132, rows=16, block_n=32, min_tiles=4) == 4  # short: two tiles each


def test_generated_source_has_the_entry_points():
    cu = cd.kernel_source()
    for name in ("mla_combine_kernel", "mla_decode_dispatch(", "struct MlaParams",
                 "launch_t<__nv_bfloat16, __nv_bfloat16>(p, stream)",
                 "mla_wgmma_kernel", "bar.arrive %0, 256", "cp.async.bulk.tensor.3d", "mbarrier.try_wait.parity",
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16", "fence.proxy.async.shared::cta",
                 "cp.async.cg.shared.global", "griddepcontrol.launch_dependents", "griddepcontrol.wait",
                 "cudaLaunchAttributeProgrammaticStreamSerialization", "wg_store_rows(", "#ifdef K3MLA_TRACE",
                 "barrier.cluster.arrive.release.aligned", "mapa.shared::cluster.u32", "ld.shared::cluster.v4.f32",
                 "cudaLaunchAttributeClusterDimension", "cudaOccupancyMaxActiveClusters", "wg_cluster_merge<TO>("):
        assert name in cu, name
    for gone in ("mla_split_kernel", "mla_split64_kernel", "mma.sync.aligned", "ldmatrix"):
        assert gone not in cu, gone
    assert "torch" not in cu and "__PARAMS__" not in cu  # the .cu compiles without torch headers
    assert braces_balanced(cu) and braces_balanced(cd._CPP_SOURCE)
    for decl in filter(None, (d.strip() for d in cd._DECL.split(";"))):
        assert re.sub(r"\s+", " ", decl) in re.sub(r"\s+", " ", cd._CPP_SOURCE), decl
    consts = dict(re.findall(r"constexpr int (\w+) = (\d+)", cu))
    assert "int64_t cluster" in cd._DECL and "p.cluster = (int)cluster" in cd._CPP_SOURCE
    assert "int64_t rows" not in cd._DECL and "int64_t kernel" not in cd._DECL
    assert int(consts["WG_MAX_CLUSTER"]) == max(cd.CLUSTERS)


def test_sources_are_package_files():
    """The .cu / .cpp texts are the package's csrc/ files with their quoted includes and the generated wgmma
    wrappers spliced in: no include or @generated line is left for the compilers, one MlaParams serves the kernel
    and the binding, and the PDL / shared-memory helpers are kernels/csrc's."""
    csrc = files("k3nn.kernels.mla").joinpath("csrc")
    cu, cpp = cd.kernel_source(), cd._CPP_SOURCE
    for text in (cu, cpp):
        assert not re.search(r'^#include "', text, re.MULTILINE) and "@generated" not in text
    raw = csrc.joinpath("mla_decode.cu").read_text()
    for inc in ("mla_params.cuh", "mla_wgmma.cuh", "../../csrc/pdl.cuh", "../../csrc/raise_smem.cuh"):
        assert f'#include "{inc}"' in raw, inc
    params = csrc.joinpath("mla_params.cuh").read_text()
    assert params in cu and params in cpp and cu.count("struct MlaParams {") == 1
    assert cuda_ext.PDL_SOURCE in cu and cuda_ext.RAISE_SMEM_SOURCE in cu and cd._wgmma_ops() in cu
    assert cd.CUDA_SOURCE == cuda_ext.read_source("mla/csrc/mla_decode.cu", wgmma_ops=cd._wgmma_ops())


def test_read_source_expands_includes_and_generated_lines(tmp_path, monkeypatch):
    """read_source: quoted includes relative to the including file, recursively (<...> includes stay), each
    ``// @generated NAME`` line replaced by its text; a line without text, text without a line, an include cycle
    and an include outside the kernels package are errors."""
    (tmp_path / "op" / "csrc").mkdir(parents=True)
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "shared.cuh").write_text("int shared;\n")
    (tmp_path / "op" / "csrc" / "part.cuh").write_text('#include "../../csrc/shared.cuh"\nint part;\n')
    (tmp_path / "op" / "csrc" / "k.cu").write_text(
        '#include <cstdint>\n#include "part.cuh"\n\n// @generated table: made in Python\nint k;\n')
    (tmp_path / "op" / "csrc" / "loop.cuh").write_text('#include "loop.cuh"\n')
    (tmp_path / "op" / "csrc" / "out.cuh").write_text('#include "../../../x.cuh"\n')
    monkeypatch.setattr(cuda_ext.importlib.resources, "files", lambda package: tmp_path)
    assert cuda_ext.read_source("op/csrc/k.cu", table="int t[2] = {1, 2};") == (
        "#include <cstdint>\nint shared;\nint part;\n\nint t[2] = {1, 2};\nint k;\n")
    assert cuda_ext.read_source("op/csrc/part.cuh") == "int shared;\nint part;\n"
    with pytest.raises(ValueError, match="table"):
        cuda_ext.read_source("op/csrc/k.cu")
    with pytest.raises(ValueError, match="other"):
        cuda_ext.read_source("op/csrc/k.cu", table="", other="")
    with pytest.raises(ValueError, match="cycle"):
        cuda_ext.read_source("op/csrc/loop.cuh")
    with pytest.raises(ValueError, match="outside"):
        cuda_ext.read_source("op/csrc/out.cuh")


def test_wgmma_plan_and_cluster_choice(monkeypatch):
    plain = lambda kernel, *a: cd.default_num_splits(*a)  # noqa: E731
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
    assert not unique_symbols(tmp_path / "mla_wg.o")  # the smem opt-in flags are this module's own


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
