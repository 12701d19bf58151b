"""RMSNorm (the transformers / Moonshot convention) and the gated RMSNorm (fla ``FusedRMSNormGated``) on KDA
outputs before ``o_proj``::

    rms_norm:       y = weight · (x / sqrt(mean(x²) + eps)).to(x.dtype)                 y in promote(weight, x)
    gated_rmsnorm:  y = weight · x / sqrt(mean(x²) + eps) · sigmoid(gate)   fp32 math, y in x's dtype

over the last dim. Shapes: x, gate ``[..., D]``; weight ``[D]``.
"""

from __future__ import annotations

import torch

from ...utils import upcast

__all__ = ["gated_rmsnorm_reference", "check_gated_rmsnorm", "rms_norm_reference", "check_rms_norm"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager math of :class:`k3nn.layers.norm.RMSNorm`: normalised in fp32 (fp64 stays fp64), cast back to
    x's dtype, then scaled (the product rounds once more in the promoted dtype, as transformers does)."""
    xf = upcast(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def check_rms_norm(x, weight, eps) -> int:
    """Validate the ``rms_norm`` op's arguments; returns D."""
    return check_gated_rmsnorm(x, x, weight, eps)


def gated_rmsnorm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager math (fp64 stays fp64): :class:`k3nn.layers.norm.GatedRMSNorm` runs it."""
    xf = upcast(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * upcast(weight)
    return (xf * torch.sigmoid(upcast(gate))).to(x.dtype)


def check_gated_rmsnorm(x, gate, weight, eps) -> int:
    """Validate the ``gated_rmsnorm`` op's arguments; returns D."""
    for name, t in (("x", x), ("gate", gate), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must be [..., D] with D >= 1, got {tuple(x.shape)}")
    D = x.shape[-1]
    if gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if weight.shape != (D,):
        raise ValueError(f"weight must be [D] = [{D}], got {tuple(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    devs = {t.device for t in (x, gate, weight)}
    if len(devs) != 1:
        raise ValueError(f"x, gate, weight must be on one device, got {sorted(map(str, devs))}")
    return D
