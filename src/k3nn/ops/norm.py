"""Normalisation ops: ``rms_norm`` and ``gated_rmsnorm`` (the sigmoid-gated RMSNorm on KDA outputs)."""

from __future__ import annotations

import torch

from ..kernels import norm as _norm  # noqa: F401  (registers the backends)
from ..kernels.norm.reference import check_gated_rmsnorm, check_rms_norm
from ..kernels.registry import dispatch

__all__ = ["gated_rmsnorm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``y = weight · (x / sqrt(mean(x²) + eps)).to(x.dtype)`` over the last dim (fp32 normalisation).

    Args:
        x: ``[..., D]`` (fp16 / bf16 / fp32 on the Triton path; fp64 eager); weight: ``[D]``.
    Returns:
        y ``[..., D]`` in ``torch.promote_types(weight.dtype, x.dtype)``. Reference:
        :func:`k3nn.kernels.norm.reference.rms_norm_reference` (:class:`k3nn.layers.norm.RMSNorm`); the Triton
        kernel is forward only (eager when an input requires grad).
    """
    check_rms_norm(x, weight, eps)
    return dispatch("rms_norm", x, weight, eps)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``y = weight · x / sqrt(mean(x²) + eps) · sigmoid(gate)`` over the last dim, fp32 math.

    Args:
        x, gate: ``[..., D]`` of one shape (fp16 / bf16 / fp32 on the Triton path; fp64 eager); weight: ``[D]``.
    Returns:
        y ``[..., D]`` in x's dtype. Reference: :func:`k3nn.kernels.norm.reference.gated_rmsnorm_reference`
        (:class:`k3nn.layers.norm.GatedRMSNorm`); the Triton kernel is forward only (eager when an input
        requires grad).
    """
    check_gated_rmsnorm(x, gate, weight, eps)
    return dispatch("gated_rmsnorm", x, gate, weight, eps)
