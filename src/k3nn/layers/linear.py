"""``Linear``: ``nn.Linear`` whose forward is :func:`k3nn.ops.linear` (the skinny GEMM at decode sizes).

A drop-in subclass: same parameters, state-dict keys, ``isinstance(m, nn.Linear)`` (checkpoint loading, tensor-
parallel sharding and its hooks, weight init, LoRA wrappers that take an ``nn.Linear`` as their base layer), same
autograd (while autograd records, ``F.linear`` runs: the kernel is forward only) and autocast (``F.linear``
casts the operands itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..utils import records_grad

__all__ = ["Linear"]


class Linear(nn.Linear):
    """``y = x Wᵀ (+ b)`` through :func:`k3nn.ops.linear` (``F.linear`` while autograd records)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if records_grad(x, self.weight, self.bias) or torch.is_autocast_enabled(x.device.type):
            return F.linear(x, self.weight, self.bias)
        return ops.linear(x, self.weight, self.bias)
