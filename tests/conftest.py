import os
import re

# Triton kernels run under the interpreter on CPU; this must be set before triton is imported.
if not os.environ.get("K3NN_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=8, deadline=None, derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("gpu", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("K3NN_HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 with K3NN_TEST_GPU=1)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


def poison(*shape, dtype=torch.float32, device="cpu"):
    """NaN-filled buffer for kernels to write into (an unwritten element then fails every comparison)."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def nvcc_sm90(tmp_path, source: str, name: str = "kernel", arch: str = "sm_90") -> tuple[str, list[tuple[str, int]]]:
    """Compile a torch-free .cu for ``arch`` (sm_90 or sm_90a) with nvcc (no GPU needed); returns ptxas' verbose
    log and the (line, bytes of spill stores) of every function that spills. Fails the test on a compile error."""
    import subprocess

    cu = tmp_path / f"{name}.cu"
    cu.write_text(source)
    r = subprocess.run(["nvcc", "-std=c++17", "-O3", f"-arch={arch}", "-c", "-Xptxas", "-v", "-o",
                        str(tmp_path / f"{name}.o"), str(cu)], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    spills = [(ln, int(m.group(1))) for ln in r.stderr.splitlines()
              if (m := re.search(r"(\d+) bytes spill stores", ln)) and int(m.group(1)) > 0]
    return r.stderr, spills


def unique_symbols(obj) -> list[str]:
    """The GNU-unique symbols of a compiled object (``nm`` type ``u``): static locals of functions with external
    linkage in templates. The dynamic loader merges them across every module of the process, RTLD_LOCAL or not,
    so a second build of a kernel source would share the first one's flags (an opt-in done once per module)."""
    import subprocess

    r = subprocess.run(["nm", "-C", str(obj)], check=True, capture_output=True, text=True)
    return [ln for ln in r.stdout.splitlines() if " u " in ln]


def braces_balanced(src: str) -> bool:
    """Every ``{`` of a generated C++/CUDA source closed in order (string literals ignored)."""
    depth = 0
    for ch in re.sub(r'"(\\.|[^"\\])*"', '""', src):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0
