import os

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
