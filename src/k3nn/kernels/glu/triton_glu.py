"""Triton forms of :mod:`.reference`: the gated activation over a fused ``gate | up`` projection (one launch for
what is ~10 eager element-wise kernels in SiTU's case) and MLA's sigmoid output gate. fp32 math, output in the
input dtype; forward only."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...utils import records_grad
from ..pdl import gdc_launch_dependents, gdc_wait, pdl_launch
from ..registry import triton_ready
from ..tl_math import tanh as _tanh

__all__ = ["glu_packed_triton", "sigmoid_gate_triton", "supports_glu_packed", "supports_sigmoid_gate"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _glu_kernel(gu_ptr, y_ptr, I, beta, linear_beta, ACT: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                PDL: tl.constexpr = False):
    if PDL:  # launched as a programmatic dependent (kernels/pdl.py): no earlier kernel's data is read before this
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(gu_ptr + row * 2 * I + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + offs, mask=m, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    if PDL:  # our loads are done: a programmatic dependent (a skinny GEMM) may start its weight prefetch
        gdc_launch_dependents()
    if ACT == 0:
        y = g * sig * u
    else:
        a = beta * _tanh(g / beta) * sig
        if CAP:
            u = linear_beta * _tanh(u / linear_beta)
        y = a * u
    tl.store(y_ptr + row * I + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _sigmoid_gate_kernel(o_ptr, g_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched as a programmatic dependent (kernels/pdl.py): no earlier kernel's data is read before this
        gdc_wait()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    o = tl.load(o_ptr + offs, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if PDL:  # our loads are done: a programmatic dependent (a skinny GEMM) may start its weight prefetch
        gdc_launch_dependents()
    tl.store(y_ptr + offs, (o / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty), mask=m)


def _why(*ts: torch.Tensor) -> str | None:
    why = triton_ready(*ts)
    if why:
        return why
    if any(t.dtype not in _DTYPES for t in ts):
        return f"dtypes {[str(t.dtype) for t in ts]} (the Triton kernel takes fp16, bf16, fp32)"
    if records_grad(*ts):
        return "forward only: inputs require grad (the eager path trains)"
    return None


def supports_glu_packed(gate_up, act, beta=4.0, linear_beta=25.0) -> str | None:
    return _why(gate_up)


def supports_sigmoid_gate(o, g) -> str | None:
    return _why(o, g) or (None if o.dtype == g.dtype else f"o {o.dtype} and g {g.dtype} differ")


def glu_packed_triton(gate_up: torch.Tensor, act: str, beta: float = 4.0,
                      linear_beta: float | None = 25.0) -> torch.Tensor:
    I = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * I).contiguous()
    y = torch.empty(gu.shape[0], I, dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0] and I:
        BLOCK = min(1024, triton.next_power_of_2(I))
        _glu_kernel[(gu.shape[0], triton.cdiv(I, BLOCK))](gu, y, I, float(beta), float(linear_beta or 1.0),
                                                          ACT=0 if act == "silu" else 1,
                                                          CAP=linear_beta is not None, BLOCK=BLOCK,
                                                          **pdl_launch(gu))
    return y.view(*gate_up.shape[:-1], I)


def sigmoid_gate_triton(o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    o2, g2 = o.contiguous(), g.contiguous()
    y = torch.empty_like(o2)
    n = o2.numel()
    if n:
        _sigmoid_gate_kernel[(triton.cdiv(n, 1024),)](o2, g2, y, n, BLOCK=1024, **pdl_launch(o2))
    return y
