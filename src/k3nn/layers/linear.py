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
from ..kernels.linear.reference import MAX_SKINNY_ROWS
from ..utils import records_grad

__all__ = ["Linear", "hooked", "project_onto"]


class Linear(nn.Linear):
    """``y = x Wᵀ (+ b)`` through :func:`k3nn.ops.linear` (``F.linear`` while autograd records)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] → [..., out_features] in x's dtype: ``F.linear`` for prefill-sized inputs, under
        autograd or autocast; :func:`k3nn.ops.linear` (the skinny GEMM on the GPU) for decode-sized ones."""
        # more rows than a skinny GEMM takes (prefill): torch's GEMM at once, no per-call op overhead
        if (x.numel() > MAX_SKINNY_ROWS * x.shape[-1] or records_grad(x, self.weight, self.bias)
                or torch.is_autocast_enabled(x.device.type)):
            return F.linear(x, self.weight, self.bias)
        return ops.linear(x, self.weight, self.bias)


def hooked(mod: nn.Module) -> bool:
    """``mod`` has forward (pre-)hooks, e.g. tensor parallelism's all-reduce: a GEMM on its weight that skips the
    module (a packed projection, a residual added inside the GEMM) would skip them."""
    return bool(mod._forward_hooks or mod._forward_pre_hooks)


def project_onto(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``residual + proj(x)`` (``proj(x)`` without a residual). For a k3nn :class:`Linear` without bias, hooks or
    autocast the add runs inside the GEMM (:func:`k3nn.ops.linear`'s ``residual``: one launch, one rounding);
    otherwise the module runs first (a tensor-parallel all-reduce hook must see the projection alone, a LoRA
    wrapper its own forward), then the add."""
    if residual is None:
        return proj(x)
    if (not isinstance(proj, Linear) or proj.bias is not None or hooked(proj)
            or torch.is_autocast_enabled(x.device.type) or not x.dtype == proj.weight.dtype == residual.dtype):
        return residual + proj(x)
    w = proj.weight
    return ops.linear(x, w, residual=residual.reshape(*x.shape[:-1], w.shape[0])).view(residual.shape)
