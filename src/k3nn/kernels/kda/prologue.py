"""The KDA prologue, everything between the input projections and the recurrence: causal short convolution
(+ SiLU, + L2 norm of q and k) and the log-space decay gate. Plain PyTorch: the math the layer and the decode
reference share.

Per token, channels ordered q | k | v (each H·D), depthwise kernel width W::

    y  = SiLU(Σ_j w[c, j] · xx[t + j, c])        xx = [history (W−1 rows) ; x], y rounded to x's dtype
    y  = y / sqrt(Σ_group y² + eps)                on the first ``l2norm_channels`` channels, groups of head_dim
    g  = −exp(A_log) · softplus(f + dt_bias)       "softplus" (Kimi Linear; torch's threshold 20)
       | lower_bound · sigmoid(exp(A_log) · (f + dt_bias))   "lower_bound" (K3)

The final conv state of a sequence is its last W−1 inputs, history included (for a sequence shorter than
W−1 it mixes history rows and inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...utils import upcast

__all__ = ["GATES", "l2norm", "kda_gate", "short_conv"]

GATES = ("softplus", "lower_bound")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim, fp32 math (fp64 stays fp64), result in x's dtype."""
    xf = upcast(x)
    return (xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, kind: str, lower_bound: float,
             head_dim: int) -> torch.Tensor:
    """Log-space decay ``g`` [..., H, D] fp32 (fp64 for fp64 inputs) from the gate projection ``f`` [..., H·D].

    A_log: [H]; dt_bias: [H·D]; kind: ``"softplus"`` or ``"lower_bound"`` (see the module docstring)."""
    x = (upcast(f) + upcast(dt_bias)).unflatten(-1, (-1, head_dim))
    a = upcast(A_log).exp()[:, None]  # [H, 1]
    if kind == "softplus":
        return -a * F.softplus(x, beta=1.0, threshold=20.0)
    if kind == "lower_bound":
        return lower_bound * torch.sigmoid(a * x)
    raise ValueError(f"unknown KDA gate {kind!r}")


def short_conv(x: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU. x [B, T, C], weight [C, W], prev [B, W-1, C] (None = zeros).

    Returns (y [B, T, C], new_prev [B, W-1, C]: the last W-1 inputs including history), both in x's dtype."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if prev is None:
        prev = x.new_zeros(B, W - 1, C)
    xx = torch.cat([prev.to(x.dtype), x], dim=1)  # [B, W-1+T, C]
    if T == 0:  # conv1d refuses an input shorter than its kernel
        return x.new_empty(B, 0, C), xx[:, xx.shape[1] - (W - 1):]
    y = F.conv1d(xx.transpose(1, 2), weight.to(x.dtype)[:, None, :], groups=C).transpose(1, 2)
    return F.silu(y), xx[:, xx.shape[1] - (W - 1):]
