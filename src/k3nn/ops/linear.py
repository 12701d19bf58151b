"""Linear projection op: ``y = x Wᵀ (+ bias) (+ residual)`` (``F.linear`` semantics, weight [N, K])."""

from __future__ import annotations

import torch

from ..kernels import linear as _linear  # noqa: F401  (registers the backends)
from ..kernels.linear.reference import MAX_SKINNY_ROWS, check_linear, linear_reference, rows_of
from ..kernels.registry import dispatch
from ..utils import records_grad

__all__ = ["linear"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x Wᵀ + bias + residual`` → ``[..., N]`` in x's dtype (or ``out_dtype``).

    Args:
        x: ``[..., K]``; weight: ``[N, K]`` (x's dtype and device); bias: ``[N]`` or None;
        residual: ``x.shape[:-1] + (N,)`` in the output dtype, or None, added inside the GEMM before the output's
            one rounding (``torch.addmm``), e.g. the shared experts' output added to the routed one.
        out_dtype: the output dtype (default x's); a wider one computes as if the operands were cast to it first
            (bf16 inputs, fp32 logits: the router), without materialising the casts on the Triton path.
    Returns:
        ``[..., N]``. Reference: :func:`k3nn.kernels.linear.linear_reference` (``F.linear`` / ``torch.addmm``).

    Inputs of at most 16 rows (``x.numel() / K``: decode steps, verify windows) go through the backend registry: the
    Triton skinny GEMM (:mod:`k3nn.kernels.linear.triton_skinny`, one read of the weight, fp32 accumulation) where
    the backend in force takes it (``auto``: where the measured rule says it beats torch's GEMM,
    ``KernelTuning.skinny_linear``), else torch's GEMM. Larger inputs are compute-bound GEMMs, and calls while
    autograd records (the kernel is forward only), always run torch's GEMM, whatever the backend.
    """
    check_linear(x, weight, bias, residual, out_dtype)
    if out_dtype == x.dtype:
        out_dtype = None
    if rows_of(x) > MAX_SKINNY_ROWS or records_grad(x, weight, bias, residual):
        return linear_reference(x, weight, bias, residual, out_dtype)
    return dispatch("linear", x, weight, bias, residual, out_dtype)
