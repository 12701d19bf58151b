"""Triton gated RMSNorm: one pass over rows of D (forward only); see :mod:`.reference` for the math it matches.

A program normalises BR rows of one ``[R, D]`` view, the whole row (D ≤ 16384) in registers: read x and gate
once, fp32 math, write y in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...utils import records_grad
from ..registry import triton_interpreting, triton_ready
from ..tl_math import sigmoid

__all__ = ["gated_rmsnorm_triton", "supports_gated_rmsnorm", "row_config", "MAX_D"]

MAX_D = 16384
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["R"])  # the row count varies per call
def _gated_rmsnorm_fwd(X, Gt, Wt, Y, R, eps, s_xr, s_gr, s_yr,
                       D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    d = tl.arange(0, BD)
    in_d = d < D
    m = (r < R)[:, None] & in_d[None, :]
    x = tl.load(X + r[:, None] * s_xr + d[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(Wt + d, mask=in_d, other=0.0).to(tl.float32)
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps))[:, None] * w[None, :]
    gt = tl.load(Gt + r[:, None] * s_gr + d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(Y + r[:, None] * s_yr + d[None, :], (y * sigmoid(gt)).to(Y.dtype.element_ty), mask=m)


def row_config(D: int) -> tuple[int, int]:
    """(BR, num_warps): about 4K elements per program, at least one row."""
    bd = triton.next_power_of_2(max(D, 1))
    if triton_interpreting():
        return max(1, min(16, 1024 // bd)), 1
    return max(1, 4096 // bd), 4 if bd <= 1024 else 8


def supports_gated_rmsnorm(x, gate, weight, eps) -> str | None:
    why = triton_ready(x, gate, weight)
    if why:
        return why
    if x.dtype not in _DTYPES or gate.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        return (f"dtypes x {x.dtype}, gate {gate.dtype}, weight {weight.dtype} (the Triton kernel takes fp16, bf16, "
                "fp32)")
    if records_grad(x, gate, weight):
        return "forward only: inputs require grad (the eager path trains)"
    if x.shape[-1] > MAX_D:
        return f"D = {x.shape[-1]} above {MAX_D}"
    return None


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    t2 = t.reshape(-1, D)
    return t2 if t2.stride(-1) == 1 or D == 1 else t2.contiguous()


def gated_rmsnorm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                         config: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`k3nn.ops.gated_rmsnorm`. ``config``: (BR, num_warps); ``out``: a buffer of x's shape and dtype."""
    D = x.shape[-1]
    x2, g2 = _rows(x, D), _rows(gate, D)
    y = out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, D)
    R = x2.shape[0]
    br, warps = config or row_config(D)
    if R * D:
        _gated_rmsnorm_fwd[(triton.cdiv(R, br),)](x2, g2, weight.contiguous(), y2, R, float(eps), x2.stride(0),
                                                  g2.stride(0), y2.stride(0), D=D, BD=triton.next_power_of_2(D),
                                                  BR=br, num_warps=warps)
    return y
