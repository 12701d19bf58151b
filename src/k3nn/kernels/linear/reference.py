"""Linear projection ``y = x Wᵀ (+ bias) (+ residual)`` as plain PyTorch (torch's GEMM: cuBLAS on CUDA), with the
argument checks of :func:`k3nn.ops.linear`.

``residual`` is added inside the GEMM (``torch.addmm``, one rounding of ``x Wᵀ + residual``), the form of the
shared experts' add in :class:`k3nn.layers.mlp.MLP`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["MAX_SKINNY_ROWS", "check_linear", "linear_reference", "rows_of"]

#: the most rows (tokens) a skinny-GEMM kernel takes: decode steps and verify windows of up to 16 tokens
MAX_SKINNY_ROWS = 16


def rows_of(x: torch.Tensor) -> int:
    """Rows of ``x [..., K]`` seen as a ``[M, K]`` matrix."""
    k = x.shape[-1]
    return x.numel() // k if k else 0


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_linear(x, weight, bias=None, residual=None, out_dtype=None) -> None:
    """Argument checks of :func:`k3nn.ops.linear` (types, shapes, dtypes, devices); raises with the argument's name."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise TypeError(f"linear: x must be a tensor [..., K], got {type(x).__name__ if not isinstance(x, torch.Tensor) else tuple(x.shape)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"linear: weight must be a 2-D tensor [N, K], got {got}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"linear: x has {x.shape[-1]} features in its last dim, weight [N={N}, K={K}] expects {K}")
    if not x.dtype.is_floating_point or x.dtype != weight.dtype:
        raise TypeError(f"linear: x ({x.dtype}) and weight ({weight.dtype}) must have one floating dtype")
    if x.device != weight.device:
        raise ValueError(f"linear: x is on {x.device}, weight on {weight.device}")
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise TypeError(f"linear: out_dtype must be None or a floating torch.dtype, got {out_dtype!r}")
    out = out_dtype or x.dtype
    for name, t, shape, dt in (("bias", bias, (N,), x.dtype), ("residual", residual, (*x.shape[:-1], N), out)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear: {name} must be a tensor or None, got {type(t).__name__}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"linear: {name} must have shape {list(shape)}, got {list(t.shape)}")
        if t.dtype != dt or t.device != x.device:
            raise TypeError(f"linear: {name} is {t.dtype} on {t.device}; expected {dt} on {x.device}")


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, or with ``residual`` ``addmm(residual (+ bias), x, weightᵀ)``: [..., N] in x's
    dtype; with ``out_dtype`` the operands are cast to it first (exact for a wider dtype: bf16 → fp32)."""
    if out_dtype is not None and out_dtype != x.dtype:
        x, weight = x.to(out_dtype), weight.to(out_dtype)
        bias = None if bias is None else bias.to(out_dtype)
    if residual is None:
        return F.linear(x, weight, bias)
    N, K = weight.shape
    r = residual.reshape(-1, N)
    if bias is not None:
        r = r + bias
    return torch.addmm(r, x.reshape(-1, K), weight.t()).view(*x.shape[:-1], N)
