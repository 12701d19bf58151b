"""Activation ops: the gated activation over a fused ``gate | up`` projection and MLA's sigmoid output gate."""

from __future__ import annotations

import torch

from ..kernels import glu as _glu  # noqa: F401  (registers the backends)
from ..kernels.glu import check_glu_packed, check_sigmoid_gate
from ..kernels.registry import dispatch

__all__ = ["glu", "sigmoid_gate"]


def glu(gate_up: torch.Tensor, act: str, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """``act(gate, up)`` for ``gate_up = [gate | up]`` ``[..., 2·I]`` → ``[..., I]`` in gate_up's dtype.

    ``act``: ``"silu"`` (SwiGLU) or ``"situ"`` (K3's SiTU-GLU, ``beta`` / ``linear_beta`` its caps). Reference:
    :func:`k3nn.kernels.glu.glu_packed_reference`; the Triton kernel computes in fp32 (forward only)."""
    check_glu_packed(gate_up, act, beta, linear_beta)
    return dispatch("glu", gate_up, act, beta, linear_beta)


def sigmoid_gate(o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``o ⊙ σ(g)`` in fp32, in o's dtype; o and g of one shape."""
    check_sigmoid_gate(o, g)
    return dispatch("sigmoid_gate", o, g)
