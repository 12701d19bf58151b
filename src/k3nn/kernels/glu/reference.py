"""Gated activations as plain PyTorch: SiLU-GLU (SwiGLU), K3's SiTU-GLU (soft-capped SwiGLU), the same over a
fused ``gate | up`` projection, and the sigmoid output gate of MLA.

Shared by the MLP layers (:mod:`k3nn.layers.mlp`), MLA (:mod:`k3nn.layers.mla`) and the routed-experts
reference (:mod:`..moe.reference`), so it sits below all of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...utils import upcast

__all__ = ["glu_activation", "situ_glu", "glu_packed_reference", "sigmoid_gate_reference", "check_glu_packed",
           "check_sigmoid_gate"]


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """SiTU-GLU in fp32: ``[β₁ tanh(g/β₁) σ(g)] ⊙ [β₂ tanh(u/β₂)]`` (no cap on u when ``linear_beta`` is None)."""
    g, u = upcast(gate), upcast(up)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    b = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (a * b).to(gate.dtype)


def glu_activation(gate: torch.Tensor, up: torch.Tensor, act: str, beta: float = 4.0,
                   linear_beta: float | None = 25.0) -> torch.Tensor:
    """The gated activation of an MLP or expert: ``silu(gate) · up`` (``act="silu"``, SwiGLU) or
    :func:`situ_glu` (``act="situ"``, K3's soft-capped form with ``beta`` / ``linear_beta``). gate, up [..., F] of one
    shape → [..., F] in gate's dtype; another ``act`` is a ValueError."""
    if act == "silu":
        return F.silu(gate) * up
    if act == "situ":
        return situ_glu(gate, up, beta, linear_beta)
    raise ValueError(f"unknown activation {act!r}; expected 'silu' or 'situ'")


ACTIVATIONS = ("silu", "situ")


def check_glu_packed(gate_up: torch.Tensor, act: str, beta: float, linear_beta: float | None) -> None:
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"glu: gate_up must be [..., 2·I] (gate | up), got {tuple(getattr(gate_up, 'shape', ()))}")
    if act not in ACTIVATIONS:
        raise ValueError(f"glu: unknown activation {act!r}; expected one of {ACTIVATIONS}")


def check_sigmoid_gate(o: torch.Tensor, g: torch.Tensor) -> None:
    if o.shape != g.shape:
        raise ValueError(f"sigmoid_gate: o {tuple(o.shape)} and g {tuple(g.shape)} must have one shape")


def glu_packed_reference(gate_up: torch.Tensor, act: str, beta: float = 4.0,
                         linear_beta: float | None = 25.0) -> torch.Tensor:
    """``act(gate, up)`` over a fused projection ``gate_up [..., 2·I]`` (gate first) → ``[..., I]``."""
    g, u = gate_up.chunk(2, -1)
    return glu_activation(g, u, act, beta, linear_beta)


def sigmoid_gate_reference(o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``o ⊙ σ(g)`` in fp32, cast to o's dtype (MLA's output gate)."""
    return (upcast(o) * torch.sigmoid(upcast(g))).to(o.dtype)
