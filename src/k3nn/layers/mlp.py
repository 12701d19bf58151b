"""Gated MLPs: SiLU-GLU (SwiGLU) and K3's SiTU-GLU (soft-capped SwiGLU)."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.glu import glu_activation, situ_glu  # re-exported: the expert kernels' references use them too

__all__ = ["glu_activation", "situ_glu", "MLP"]


class MLP(nn.Module):
    """``down(act(gate(x), up(x)))`` — the dense layer and the shared experts."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", beta: float = 4.0,
                 linear_beta: float | None = 25.0):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act, self.beta, self.linear_beta = act, beta, linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu_activation(self.gate_proj(x), self.up_proj(x), self.act, self.beta, self.linear_beta))
