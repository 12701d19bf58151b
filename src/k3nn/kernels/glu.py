"""Gated activations: SiLU-GLU (SwiGLU) and K3's SiTU-GLU (soft-capped SwiGLU), as plain PyTorch.

Shared by the MLP layers (:mod:`k3nn.layers.mlp`) and the routed-experts reference (:mod:`.moe.reference`),
so it sits below both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils import upcast

__all__ = ["glu_activation", "situ_glu"]


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
