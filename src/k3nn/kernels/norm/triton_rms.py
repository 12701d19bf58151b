"""Triton RMSNorm: one pass over rows of D (forward only); see :mod:`.reference` for the math it matches, rounding
included: the normalised row is cast to x's dtype before the weight multiplies it.

A program normalises BR rows of one ``[R, D]`` view, the whole row (D ≤ 16384) in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...utils import records_grad
from ..pdl import gdc_launch_dependents, gdc_wait, pdl_launch
from ..registry import triton_ready
from .triton_gated import MAX_D, _rows, row_config

__all__ = ["rms_norm_triton", "supports_rms_norm"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["R"])  # the row count varies per call
def _rms_norm_fwd(X, Wt, Y, R, eps, s_xr, s_yr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                  PDL: tl.constexpr = False):
    if PDL:  # launched as a programmatic dependent (kernels/pdl.py): no earlier kernel's data is read before this
        gdc_wait()
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    d = tl.arange(0, BD)
    in_d = d < D
    m = (r < R)[:, None] & in_d[None, :]
    x = tl.load(X + r[:, None] * s_xr + d[None, :], mask=m, other=0.0)
    xf = x.to(tl.float32)
    n = (xf * (1.0 / tl.sqrt(tl.sum(xf * xf, 1) / D + eps))[:, None]).to(x.dtype)
    if PDL:  # our loads are done: a programmatic dependent (a skinny GEMM) may start its weight prefetch
        gdc_launch_dependents()
    w = tl.load(Wt + d, mask=in_d, other=0.0)
    tl.store(Y + r[:, None] * s_yr + d[None, :], (w.to(tl.float32)[None, :] * n.to(tl.float32)).to(Y.dtype.element_ty),
             mask=m)


def supports_rms_norm(x, weight, eps) -> str | None:
    why = triton_ready(x, weight)
    if why:
        return why
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        return f"dtypes x {x.dtype}, weight {weight.dtype} (the Triton kernel takes fp16, bf16, fp32)"
    if records_grad(x, weight):
        return "forward only: inputs require grad (the eager path trains)"
    if x.shape[-1] > MAX_D:
        return f"D = {x.shape[-1]} above {MAX_D}"
    return None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, *, config: tuple[int, int] | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`k3nn.ops.rms_norm`. ``config``: (BR, num_warps); ``out``: a buffer of x's shape in the output
    dtype (``torch.promote_types(weight.dtype, x.dtype)``)."""
    D = x.shape[-1]
    x2 = _rows(x, D)
    y = out if out is not None else torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                                                device=x.device)
    y2 = y.view(-1, D)
    R = x2.shape[0]
    br, warps = config or row_config(D)
    if R * D:
        _rms_norm_fwd[(triton.cdiv(R, br),)](x2, weight.contiguous(), y2, R, float(eps), x2.stride(0), y2.stride(0),
                                             D=D, BD=triton.next_power_of_2(D), BR=br, num_warps=warps,
                                             **pdl_launch(x2))
    return y
