"""Linear projection op: ``y = x Wᵀ (+ bias) (+ residual)`` (``F.linear`` semantics, weight [N, K])."""

from __future__ import annotations

import torch

from ..kernels import linear as _linear  # noqa: F401  (registers the backends)
from ..kernels.linear.reference import MAX_SKINNY_ROWS, check_linear, linear_reference, rows_of
from ..kernels.registry import dispatch

__all__ = ["linear"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + bias + residual`` → ``[..., N]`` in x's dtype.

    Args:
        x: ``[..., K]``; weight: ``[N, K]`` (x's dtype and device); bias: ``[N]`` or None;
        residual: ``x.shape[:-1] + (N,)`` or None, added inside the GEMM before the output's one rounding
            (``torch.addmm``), e.g. the shared experts' output added to the routed one.
    Returns:
        ``[..., N]``. Reference: :func:`k3nn.kernels.linear.linear_reference` (``F.linear`` / ``torch.addmm``).

    Inputs of at most 16 rows (``x.numel() / K``: decode steps, verify windows) go through the backend registry: the
    Triton skinny GEMM (:mod:`k3nn.kernels.linear.triton_skinny`, one read of the weight, fp32 accumulation) where
    the backend in force takes it (``auto``: where the measured rule says it beats torch's GEMM,
    ``KernelTuning.skinny_linear``), else torch's GEMM. Larger inputs are compute-bound GEMMs and always run torch's
    GEMM, whatever the backend.
    """
    check_linear(x, weight, bias, residual)
    if rows_of(x) > MAX_SKINNY_ROWS:
        return linear_reference(x, weight, bias, residual)
    return dispatch("linear", x, weight, bias, residual)
