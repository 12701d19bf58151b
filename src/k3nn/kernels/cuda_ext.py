"""What the CUDA-extension kernels (built on first use with ``torch.utils.cpp_extension.load_inline``) need from
the machine, checked in one place."""

from __future__ import annotations

import shutil

import torch

__all__ = ["toolchain_reason"]


def toolchain_reason(min_capability: tuple[int, int] | None = None, why: str = "") -> str | None:
    """None when a CUDA device and an nvcc toolchain are here (and the device is at least ``min_capability``),
    else the reason, for ``k3nn info`` and the registry. ``why``: what the capability is needed for."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None and shutil.which("nvcc") is None:
        return "nvcc / CUDA toolkit not found (CUDA_HOME unset and no nvcc on PATH)"
    if min_capability is not None:
        cc = torch.cuda.get_device_capability()
        if cc < min_capability:
            need = "".join(map(str, min_capability))
            return f"needs sm_{need}+{f' ({why})' if why else ''}, got sm_{''.join(map(str, cc))}"
    return None
