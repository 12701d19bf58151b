"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (sm_90+).

A decode step is a chain of short kernels, most of them weight streams whose weights do not depend on the kernel
before them. Launched as a programmatic dependent, a kernel's programs may start while the kernel before it is
still running: they issue what needs no earlier result (L2 prefetches of their first weight tiles), then
``griddepcontrol.wait`` returns once the previous grid has completed and its writes are visible; every read of
an earlier kernel's output and every global write comes after that wait. A kernel lets its dependents start by
``griddepcontrol.launch_dependents`` (:func:`gdc_launch_dependents`); one that never calls it releases them when it
exits, as in plain stream order.

* :func:`pdl_on` — whether launches on a device go this way: sm_90+, a Triton with grid dependency control, not
  under the interpreter, and :attr:`KernelTuning.pdl <k3nn.kernels.registry.KernelTuning>` (default True).
  Kernels take it as a constexpr: the trigger and the wait compile away when it is False.
* Launched as dependents (a ``PDL`` constexpr and Triton's ``launch_pdl``, :func:`pdl_launch`): the Triton kernels
  of a decode step. Two do real work before the wait: the skinny GEMM requests its first weight tiles into L2,
  the fused KDA decode loads its recurrent state (this layer's, written by the same kernel a step ago) and the
  step's slot metadata. Both were written before the step's first torch op (the cache bookkeeping, the embedding
  lookup), which is not a dependent, and a dependent starts only once the kernel before it has triggered, so a
  chain of early starts never reaches back past it. The others
  (AttnRes, routing, the expert alignment, the latent finalize, GLU, RMSNorm, the split-K reduce) wait first
  thing, after at most loading weights: their programs are resident when the kernel before them ends, so their
  launch latency is hidden.
* Where a kernel triggers: the latency-bound short kernels and the KDA decode once their own loads are done
  (a dependent's prefetches, megabytes across every SM, would otherwise queue ahead of them: AttnRes took 4.8
  against 3.1 µs with the trigger at its start), the skinny GEMM at its start (it streams at full bandwidth
  anyway).

The wait is transitive: a dependent's own completion comes after its wait, so a kernel that waits has every
kernel before it in the stream completed, not only the previous one. CUDA graph capture keeps the programmatic
edges (the launches are captured as such).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .registry import current_tuning, triton_interpreting

__all__ = ["gdc_wait", "gdc_launch_dependents", "l2_prefetch", "pdl_on", "pdl_launch", "HAVE_GDC"]

try:  # grid dependency control in Triton (absent in old releases: then no PDL)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def l2_prefetch(ptrs, mask):
    """Ask L2 for the 128-byte lines at ``ptrs`` (a pointer tensor, one pointer per line) where ``mask``: a hint,
    no registers held, no result (GPU only: inline PTX)."""
    go = mask.to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [ptrs.to(tl.int64), go], dtype=tl.int32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or above (ROCm reports its own architecture numbers here)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_on(t: torch.Tensor) -> bool:
    """Whether Triton kernels on ``t``'s device trigger their dependents early and the skinny GEMM launches as a
    programmatic dependent (see the module docstring)."""
    if not HAVE_GDC or t.device.type != "cuda" or triton_interpreting() or not current_tuning().pdl:
        return False
    return _sm90(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch keywords of a kernel with a ``PDL`` constexpr on ``t``'s device: ``PDL=True`` and Triton's
    ``launch_pdl`` where :func:`pdl_on`, else none (the kernel's default, plain stream order)."""
    return {"PDL": True, "launch_pdl": True} if pdl_on(t) else {}
