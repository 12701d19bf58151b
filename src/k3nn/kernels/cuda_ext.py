"""What the CUDA-extension kernels (built on first use with ``torch.utils.cpp_extension.load_inline``) share: their
sources read from the package (``csrc/`` folders next to the kernels, shared pieces in ``kernels/csrc/``), the
build, and what they need from the machine, checked in one place."""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import inspect
import os
import posixpath
import re
import shutil
import time

import torch

__all__ = ["PDL_SOURCE", "RAISE_SMEM_SOURCE", "clear_stale_build_lock", "load_inline_module", "read_source",
           "sm_count", "smem_per_block", "toolchain_reason"]


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


_INCLUDE = re.compile(r'^#include "([^"]+)"(?:\n|\Z)', re.MULTILINE)
_GENERATED = re.compile(r"^// @generated (\w+)\b.*$", re.MULTILINE)


def read_source(path: str, **generated: str) -> str:
    """The text of the C++ / CUDA source file ``path`` (relative to the ``k3nn.kernels`` package, read with
    ``importlib.resources``) as one self-contained translation unit: each ``#include "file"`` line (``file``
    relative to the including file) is replaced by that file's text, recursively, and each ``// @generated NAME``
    line by ``generated[NAME]`` (text made in Python). ``#include <...>`` lines stay. The result is what nvcc and
    the host compiler see, so the build's source hash covers every line of it. Raises ``ValueError`` for an
    ``@generated`` line without text (or twice), text without its line, an include cycle or an include outside
    ``k3nn/kernels``."""
    root = importlib.resources.files("k3nn.kernels")

    def expand(rel: str, stack: tuple[str, ...]) -> str:
        if rel in stack:
            raise ValueError(f"read_source: include cycle {' -> '.join((*stack, rel))}")
        node = root
        for part in rel.split("/"):
            node = node.joinpath(part)
        text = node.read_text(encoding="utf-8")

        def include(m: re.Match) -> str:
            inc = posixpath.normpath(posixpath.join(posixpath.dirname(rel), m.group(1)))
            if inc.startswith("../"):
                raise ValueError(f"read_source: {rel} includes {m.group(1)!r}, outside k3nn/kernels")
            return expand(inc, (*stack, rel))

        return _INCLUDE.sub(include, text)

    text = expand(posixpath.normpath(path), ())
    names = _GENERATED.findall(text)
    missing = sorted(set(names) - set(generated))
    unused = sorted(set(generated) - set(names))
    if missing or unused or len(names) != len(set(names)):
        raise ValueError(f"read_source({path!r}): @generated lines {names}, generated text for {sorted(generated)}")
    return _GENERATED.sub(lambda m: generated[m.group(1)], text)


#: C++ for the CUDA sources (``csrc/raise_smem.cuh``): ``raise_smem(kernel, bytes, raised)`` opts a kernel in to
#: ``bytes`` of dynamic shared memory, once per device (``raised`` is the caller's per-device flag array)
RAISE_SMEM_SOURCE = read_source("csrc/raise_smem.cuh")

#: CUDA for the kernels (``csrc/pdl.cuh``): programmatic dependent launch. ``pdl_trigger()`` lets the next kernel in
#: the stream (when it is launched with programmatic stream serialization) start launching; ``pdl_wait()`` returns
#: once the previous grid has completed and its writes are visible. Both are no-ops below sm_90 and in launches
#: without the attribute. ``launch_pdl(kernel, grid, block, smem, stream, args...)`` launches with that attribute
#: (sm_90+ only); ``launch_config(grid, block, smem, stream, &attribute)`` is the one-attribute configuration it
#: builds.
PDL_SOURCE = read_source("csrc/pdl.cuh")


#: a build lock older than this is left by a process killed mid-build (these builds take a few minutes at most):
#: torch would wait on it forever, so it is removed
STALE_LOCK_S = 20 * 60


def clear_stale_build_lock(name: str) -> bool:
    """Remove the build lock of torch extension ``name`` when it is older than :data:`STALE_LOCK_S` (a build
    killed before it released the lock); returns whether one was removed."""
    from torch.utils.cpp_extension import get_default_build_root

    lock = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(), name, "lock")
    try:
        if time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
            os.remove(lock)
            return True
    except OSError:
        pass
    return False


def load_inline_module(prefix: str, cuda_source: str, cpp_source: str, functions: list[str],
                       arch_flags: tuple[str, ...] = ()):
    """Compile (cached on disk by torch under a hash of the sources and flags) and load a torch extension whose
    ``.cu`` includes no torch headers; returns ``(module, seconds spent)``. ``arch_flags`` (``-gencode=...``)
    replace torch's choice of targets. ``K3NN_BUILD_VERBOSE=1`` shows the build."""
    from torch.utils.cpp_extension import load_inline

    tag = hashlib.sha1((cuda_source + cpp_source + " ".join(arch_flags)).encode()).hexdigest()[:12]
    kw = {}
    if "no_implicit_headers" in inspect.signature(load_inline).parameters:  # keep torch headers out of the .cu
        kw["no_implicit_headers"] = True
    t0 = time.perf_counter()
    clear_stale_build_lock(f"{prefix}_{tag}")
    mod = load_inline(name=f"{prefix}_{tag}", cpp_sources=[cpp_source], cuda_sources=[cuda_source],
                      functions=functions, extra_cflags=["-O2"], extra_cuda_cflags=["-O3", "-std=c++17", *arch_flags],
                      verbose=os.environ.get("K3NN_BUILD_VERBOSE") == "1", **kw)
    return mod, time.perf_counter() - t0


@functools.cache
def sm_count(index: int) -> int:
    """Multiprocessors of CUDA device ``index`` (cached)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def smem_per_block(device) -> int:
    """Shared memory one block may opt in to on ``device`` (48 KB, the guaranteed amount, if torch does not say)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)
