"""What the CUDA-extension kernels (built on first use with ``torch.utils.cpp_extension.load_inline``) need from
the machine, checked in one place."""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import shutil
import time

import torch

__all__ = ["RAISE_SMEM_SOURCE", "load_inline_module", "sm_count", "smem_per_block", "toolchain_reason"]


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


#: C++ for the CUDA sources: ``raise_smem(kernel, bytes, raised)`` opts a kernel in to ``bytes`` of dynamic shared
#: memory, once per device (``raised`` is the caller's per-device flag array)
RAISE_SMEM_SOURCE = r"""template <typename K>
cudaError_t raise_smem(K kern, int bytes, bool (&raised)[64]) {  // opt-in shared memory limit, once per device
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64 || !raised[dev]) {
    err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
    if (dev >= 0 && dev < 64) raised[dev] = true;
  }
  return cudaSuccess;
}
"""


#: CUDA for the kernels: programmatic dependent launch. ``pdl_trigger()`` lets the next kernel in the stream (when
#: it is launched with programmatic stream serialization) start launching; ``pdl_wait()`` returns once the previous
#: grid has completed and its writes are visible. Both are no-ops below sm_90 and in launches without the attribute.
#: ``launch_pdl(kernel, grid, block, smem, stream, args...)`` launches with that attribute (sm_90+ only);
#: ``launch_config(grid, block, smem, stream, &attribute)`` is the one-attribute configuration it builds.
PDL_SOURCE = r"""// A launch configuration with one attribute (`at` outlives the launch or query)
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                        cudaLaunchAttribute* at) {
  cudaLaunchConfig_t lc = {};
  lc.gridDim = grid;
  lc.blockDim = block;
  lc.dynamicSmemBytes = smem;
  lc.stream = stream;
  lc.attrs = at;
  lc.numAttrs = 1;
  return lc;
}
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kern)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchAttribute at;
  at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at.val.programmaticStreamSerializationAllowed = 1;
  const cudaLaunchConfig_t lc = launch_config(grid, block, smem, stream, &at);
  return cudaLaunchKernelEx(&lc, kern, static_cast<Args&&>(args)...);
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
"""


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
