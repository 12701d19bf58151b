"""CUDA fused KDA decode (kernels/kda/cuda_decode.py) on a CPU machine: availability and opt-in reasons (K3NN_KDA_CUDA,
K3NN_KDA_CUDA_AUTO), the variant knobs (plan), the auto rule for small B·H, the registry keeping auto off it here,
and the torch-free source (the slow test compiles it with nvcc for sm_90: no spills, shared memory as mirrored).
The kernels themselves run in tests/gpu/test_kda_decode_cuda_gpu.py."""

import re
import shutil

import pytest
import torch
from conftest import braces_balanced, nvcc_sm90

import k3nn.kernels.kda.cuda_decode as cd
from k3nn.kernels.registry import resolve

KNOBS = ("K3NN_KDA_CUDA", "K3NN_KDA_CUDA_AUTO", "K3NN_KDA_CUDA_AUTO_MIN", "K3NN_KDA_CUDA_VARIANT",
         "K3NN_KDA_CUDA_WARPS", "K3NN_KDA_CUDA_STAGES", "K3NN_KDA_CUDA_GRID", "K3NN_KDA_CUDA_ORDER")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in KNOBS:
        monkeypatch.delenv(k, raising=False)
    cd.available.cache_clear()
    yield
    cd.available.cache_clear()


def _fake_toolchain(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")


def test_unavailable_on_cpu_with_a_reason():
    if not torch.cuda.is_available():
        assert cd.available() == "CUDA is not available"


@pytest.mark.parametrize("env,on", [({}, False), ({"K3NN_KDA_CUDA": "0"}, False), ({"K3NN_KDA_CUDA": "1"}, True),
                                    ({"K3NN_KDA_CUDA_AUTO": "1"}, True), ({"K3NN_KDA_CUDA_AUTO": "0"}, False)])
def test_opt_in(monkeypatch, env, on):
    _fake_toolchain(monkeypatch)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    r = cd.available.__wrapped__()
    assert (r is None) == on, r
    if not on:
        assert "K3NN_KDA_CUDA=1" in r and "K3NN_KDA_CUDA_AUTO=1" in r


def test_auto_default_switch(monkeypatch):
    _fake_toolchain(monkeypatch)
    monkeypatch.setattr(cd, "AUTO_DEFAULT", True)
    assert cd.auto_enabled() and cd.available.__wrapped__() is None
    monkeypatch.setenv("K3NN_KDA_CUDA_AUTO", "0")
    assert not cd.auto_enabled()


def test_plan_defaults_and_knobs(monkeypatch):
    assert cd.plan(64, 96, 132) == dict(variant="persistent", warps=16, stages=2, grid=132, heads_first=False)
    assert cd.plan(1, 96, 132)["grid"] == 96  # never more CTAs than request-heads
    monkeypatch.setenv("K3NN_KDA_CUDA_VARIANT", "regs")
    assert cd.plan(64, 96, 132)["variant"] == "regs" and cd.plan(64, 96, 132)["warps"] == 8
    monkeypatch.setenv("K3NN_KDA_CUDA_WARPS", "16")
    assert cd.plan(64, 96, 132)["warps"] == 16
    monkeypatch.setenv("K3NN_KDA_CUDA_VARIANT", "Persistent")
    monkeypatch.setenv("K3NN_KDA_CUDA_STAGES", "3")
    monkeypatch.setenv("K3NN_KDA_CUDA_GRID", "264")
    assert cd.plan(64, 96, 132) == dict(variant="persistent", warps=16, stages=3, grid=264, heads_first=False)
    monkeypatch.setenv("K3NN_KDA_CUDA_ORDER", "hb")
    assert cd.plan(64, 96, 132)["heads_first"] and not cd.plan(70000, 2, 132)["heads_first"]  # grid y <= 65535
    for k, bad in (("K3NN_KDA_CUDA_VARIANT", "tma"), ("K3NN_KDA_CUDA_WARPS", "4"), ("K3NN_KDA_CUDA_STAGES", "4"),
                   ("K3NN_KDA_CUDA_ORDER", "hbb")):
        monkeypatch.setenv(k, bad)
        with pytest.raises(ValueError, match=k):
            cd.plan(64, 96, 132)
        monkeypatch.delenv(k)


def test_auto_rule_small_batches(monkeypatch):
    assert cd.auto_reason(1, 96) and "Triton" in cd.auto_reason(8, 96)
    assert cd.auto_reason(64, 96) is None
    monkeypatch.setenv("K3NN_KDA_CUDA_AUTO_MIN", "1")
    assert cd.auto_reason(1, 96) is None
    monkeypatch.setenv("K3NN_KDA_CUDA", "1")  # forced: every call
    monkeypatch.setenv("K3NN_KDA_CUDA_AUTO_MIN", "100000")
    assert cd.auto_reason(1, 96) is None


def test_supports_needs_cuda_tensors():
    x = torch.zeros(1, 1, 3 * 128)
    assert cd.supports(x, None, None, None, None, torch.zeros(1), None, torch.zeros(128), None, None) \
        == "inputs are not CUDA tensors"


def test_auto_stays_off_cuda_here(monkeypatch):
    monkeypatch.setenv("K3NN_KDA_CUDA_AUTO", "1")
    H, D, W, B = 2, 128, 4, 2
    args = [torch.randn(B, 1, 3 * H * D), torch.randn(B, 1, H * D), torch.randn(B, 1, H), torch.randn(B, 1, H * D),
            torch.randn(3 * H * D, W), torch.rand(H), torch.randn(H * D), torch.ones(D),
            torch.zeros(B, H, D, D), torch.zeros(B, W - 1, 3 * H * D)]
    assert resolve("kda_fused_decode", tuple(args)).backend != "cuda"


def _braces_balanced(src):
    return braces_balanced(src) and src.count("(") == src.count(")")


def test_source_is_torch_free_and_mirrors_python():
    cu = cd.kernel_source()
    assert "torch" not in cu and "#include <cuda_bf16.h>" in cu
    assert _braces_balanced(cu) and _braces_balanced(cd._CPP_SOURCE)
    assert re.sub(r"\s+", " ", cd._DECL.rstrip(";")) in re.sub(r"\s+", " ", cd._CPP_SOURCE)
    assert cd.smem_bytes(16, 3) <= 227 * 1024 and cd.smem_bytes(8, 3) <= 227 * 1024
    for w, s in ((8, 2), (8, 3), (16, 2), (16, 3)):
        assert f"launch_persistent<T, {w}, {s}>" in cu
    assert set(cd._VARIANT_CODES) == set(cd.VARIANTS)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_source_compiles_for_sm90(tmp_path):
    """The torch-free .cu through nvcc for sm_90: every kernel and dtype, no spills (the 2-CTA-per-SM regs kernel
    with 8 warps may spill a few bytes under its 128-register cap), 512-thread kernels within 128 registers, and
    the shared-memory size equal to the Python mirror."""
    asserts = "".join(f"static_assert(k3kda::persist_smem_bytes({w}, {s}) == {cd.smem_bytes(w, s)}, \"smem\");\n"
                      for w in (8, 16) for s in (2, 3))
    log, _ = nvcc_sm90(tmp_path, cd.kernel_source() + asserts, "kda")
    entries = re.findall(r"Compiling entry function '(\w+)'", log)
    assert sum("kda_persistent_kernel" in e for e in entries) == 12, entries  # 3 dtypes x {8, 16} warps x {2, 3}
    assert sum("kda_regs_kernel" in e for e in entries) == 6, entries
    assert sum("kda_block_kernel" in e for e in entries) == 3, entries
    # ptxas prints the spill line after the entry line: map each spill back to its function
    per_fn, fn = {}, None
    for ln in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", ln)
        if m:
            fn = m.group(1)
        m = re.search(r"(\d+) bytes spill stores", ln)
        if m and int(m.group(1)) > 0:
            per_fn[fn] = int(m.group(1))
        m = re.search(r"Used (\d+) registers", ln)
        if m and fn:
            regs = int(m.group(1))
            assert regs <= 255, (fn, regs)
            if "Li16E" in fn:
                assert regs <= 128, (fn, regs)  # 512 threads in one CTA
    bad = {f: n for f, n in per_fn.items() if not ("kda_regs_kernel" in f and "Li8E" in f and n <= 128)}
    assert not bad, bad
