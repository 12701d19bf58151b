"""The KDA prologue, everything between the input projections and the recurrence: causal short convolution
(+ SiLU, + L2 norm of q and k) and the log-space decay gate. Plain PyTorch: the math the layer, the decode
reference and the Triton kernels (:mod:`.triton_prologue`) share, with the argument checks of their ops.

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

__all__ = ["GATES", "l2norm", "kda_gate", "short_conv", "short_conv_reference", "check_short_conv",
           "check_kda_gate"]

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


def _l2norm_leading(y: torch.Tensor, channels: int, head_dim: int, eps: float) -> torch.Tensor:
    if channels == 0:
        return y
    yn = l2norm(y[..., :channels].unflatten(-1, (-1, head_dim)), eps).flatten(-2)
    return torch.cat([yn, y[..., channels:]], dim=-1)


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None = None,
                         cu_seqlens: torch.Tensor | None = None, l2norm_channels: int = 0,
                         head_dim: int | None = None, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager ``short_conv`` op (see :func:`k3nn.ops.short_conv`): :func:`short_conv` per sequence, then
    :func:`l2norm` of the leading channels in groups of ``head_dim``."""
    if cu_seqlens is None:
        y, final = short_conv(x, weight, initial_state)
    else:
        cs = cu_seqlens.tolist()
        ys, finals = [], []
        for n in range(len(cs) - 1):
            h = None if initial_state is None else initial_state[n:n + 1]
            y, f = short_conv(x[:, cs[n]:cs[n + 1]], weight, h)
            ys.append(y)
            finals.append(f)
        y, final = torch.cat(ys, dim=1), torch.cat(finals, dim=0)
    return _l2norm_leading(y, l2norm_channels, head_dim or 1, eps), final


def _tensor(name: str, t, *, floating: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


def _eps(v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
        raise ValueError(f"eps must be a float >= 0, got {v!r}")
    return float(v)


def check_short_conv(x, weight, initial_state=None, cu_seqlens=None, l2norm_channels=0, head_dim=None, eps=1e-6):
    """Validate the ``short_conv`` op's arguments; returns (B, T, C, W, N) with N the number of sequences.

    The values of ``cu_seqlens`` are checked when it lives on the CPU (reading a GPU tensor would sync)."""
    _tensor("x", x)
    _tensor("weight", weight)
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C], got shape {tuple(x.shape)}")
    B, T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C, W] = [{C}, W] with W >= 1, got {tuple(weight.shape)}")
    W = weight.shape[1]
    N = B
    if cu_seqlens is not None:
        _tensor("cu_seqlens", cu_seqlens, floating=False)
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be an int32/int64 tensor, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"with cu_seqlens x must be [1, total, C] (packed sequences), got B={B}")
        if cu_seqlens.device != x.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, x on {x.device}")
        if cu_seqlens.device.type == "cpu":
            cs = cu_seqlens.tolist()
            if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:])):
                raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}, got {cs}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        _tensor("initial_state", initial_state)
        if initial_state.shape != (N, W - 1, C):
            raise ValueError(f"initial_state must be [N, W-1, C] = {(N, W - 1, C)}, got {tuple(initial_state.shape)}")
        if initial_state.device != x.device:
            raise ValueError(f"initial_state is on {initial_state.device}, x on {x.device}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    _int("l2norm_channels", l2norm_channels, 0)
    if l2norm_channels:
        _int("head_dim", head_dim, 1)
        if l2norm_channels > C or l2norm_channels % head_dim:
            raise ValueError(f"l2norm_channels must be a multiple of head_dim={head_dim} and at most C={C}, "
                             f"got {l2norm_channels}")
    elif head_dim is not None:
        _int("head_dim", head_dim, 1)
    _eps(eps)
    return B, T, C, W, N


def check_kda_gate(f, A_log, dt_bias, kind, lower_bound, head_dim):
    """Validate the ``kda_gate`` op's arguments; returns (H, D)."""
    for name, t in (("f", f), ("A_log", A_log), ("dt_bias", dt_bias)):
        _tensor(name, t)
    if kind not in GATES:
        raise ValueError(f"kind must be one of {GATES}, got {kind!r}")
    if kind == "lower_bound" and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))):
        raise TypeError(f"lower_bound must be a float for the lower_bound gate, got {type(lower_bound).__name__}")
    D = _int("head_dim", head_dim, 1)
    if A_log.dim() != 1:
        raise ValueError(f"A_log must be [H], got {tuple(A_log.shape)}")
    H = A_log.shape[0]
    if f.dim() < 1 or f.shape[-1] != H * D:
        raise ValueError(f"f must be [..., H*D] = [..., {H * D}], got {tuple(f.shape)}")
    if dt_bias.shape != (H * D,):
        raise ValueError(f"dt_bias must be [H*D] = [{H * D}], got {tuple(dt_bias.shape)}")
    devs = {t.device for t in (f, A_log, dt_bias)}
    if len(devs) != 1:
        raise ValueError(f"f, A_log, dt_bias must be on one device, got {sorted(map(str, devs))}")
    return H, D
