"""RMSNorm and the sigmoid-gated RMSNorm used on KDA outputs (fp32 math, result in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..kernels.registry import backend
from ..utils import records_grad


class RMSNorm(nn.Module):
    """``y = w * (x / sqrt(mean(x²) + eps))``; x normalised in fp32, cast back, then scaled (HF convention)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] → [..., dim] (:func:`k3nn.ops.rms_norm`; eager while autograd records)."""
        with backend("eager" if records_grad(x, self.weight) else None):
            return ops.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """Per-head ``y = w * rmsnorm(x) * sigmoid(gate)`` over the last dim, all in fp32 (fla ``FusedRMSNormGated``)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [..., dim] (one shape) → [..., dim] in x's dtype (:func:`k3nn.ops.gated_rmsnorm`; its kernels
        are forward only, so while autograd records the eager math runs, whatever the backend)."""
        with backend("eager" if records_grad(x, gate, self.weight) else None):
            return ops.gated_rmsnorm(x, gate, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
