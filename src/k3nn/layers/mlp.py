"""Gated MLPs: SiLU-GLU (SwiGLU) and K3's SiTU-GLU (soft-capped SwiGLU)."""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..kernels.glu import glu_activation, situ_glu  # re-exported: the expert kernels' references use them too
from .linear import Linear, project_onto
from .packed import Packed, pack_linears, unpack

__all__ = ["glu_activation", "situ_glu", "MLP"]


class MLP(nn.Module):
    """``down(act(gate(x), up(x)))`` — the dense layer and the shared experts."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", beta: float = 4.0,
                 linear_beta: float | None = 25.0):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.act, self.beta, self.linear_beta = act, beta, linear_beta
        self._gate_up: Packed | None = None  # prepare_decode(): gate | up as one GEMM

    def prepare_decode(self, on: bool = True) -> None:
        """Pack gate and up into one GEMM weight (one activation kernel over its output; see
        :mod:`k3nn.layers.packed`; kept when already packed); ``on=False`` drops it."""
        if not on:
            unpack(self._gate_up)
            self._gate_up = None
        elif self._gate_up is None:
            self._gate_up = pack_linears([[self.gate_proj], [self.up_proj]])

    def forward(self, x: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., hidden] → mlp(x), or ``add_to + mlp(x)`` (add_to of the output's shape; the add inside the down
        projection's GEMM, :func:`~k3nn.layers.linear.project_onto`). Prepared (and without autograd): one gate|up
        GEMM and one activation kernel."""
        if self._gate_up is None or torch.is_grad_enabled():
            h = glu_activation(self.gate_proj(x), self.up_proj(x), self.act, self.beta, self.linear_beta)
        else:
            h = ops.glu(ops.linear(x, self._gate_up.get()), self.act, self.beta, self.linear_beta)  # [gate | up]
        return project_onto(self.down_proj, h, add_to)
