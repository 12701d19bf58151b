"""RMSNorm and the sigmoid-gated RMSNorm used on KDA outputs (fp32 math, result in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn

from ..utils import upcast


class RMSNorm(nn.Module):
    """``y = w * (x / sqrt(mean(x²) + eps))``; x normalised in fp32, cast back, then scaled (HF convention)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """Per-head ``y = w * rmsnorm(x) * sigmoid(gate)`` over the last dim, all in fp32 (fla ``FusedRMSNormGated``)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * upcast(self.weight)
        return (xf * torch.sigmoid(upcast(gate))).to(x.dtype)
