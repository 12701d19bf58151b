"""Gated MLPs: SiLU-GLU (SwiGLU) and K3's SiTU-GLU (soft-capped SwiGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..utils import upcast

__all__ = ["glu_activation", "situ_glu", "MLP"]


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """SiTU-GLU in fp32: ``[β₁ tanh(g/β₁) σ(g)] ⊙ [β₂ tanh(u/β₂)]`` (no cap on u when ``linear_beta`` is None)."""
    g, u = upcast(gate), upcast(up)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    b = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (a * b).to(gate.dtype)


def glu_activation(gate: torch.Tensor, up: torch.Tensor, act: str, beta: float = 4.0,
                   linear_beta: float | None = 25.0) -> torch.Tensor:
    if act == "silu":
        return F.silu(gate) * up
    if act == "situ":
        return situ_glu(gate, up, beta, linear_beta)
    raise ValueError(f"unknown activation {act!r}; expected 'silu' or 'situ'")


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
