"""Triton pieces shared by the grouped MoE GEMMs (triton_fused.py) and the decode GEMV (triton_mx_gemv.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl_math import tanh as _tanh

__all__ = ["_act", "_e2m1_to_f32"]


@triton.jit
def _act(g, u, ACT: tl.constexpr, beta, linear_beta, CAP_UP: tl.constexpr):
    sig = 1.0 / (1.0 + tl.exp(-g))
    if ACT == 0:  # SiLU-GLU
        return g * sig * u
    a = beta * _tanh(g / beta) * sig  # SiTU-GLU
    if CAP_UP:
        u = linear_beta * _tanh(u / linear_beta)
    return a * u


@triton.jit
def _e2m1_to_f32(code):
    mag = code & 7
    bits = tl.where(mag >= 2, (((mag >> 1) + 126) << 23) | ((mag & 1) << 22), tl.where(mag == 1, 126 << 23, 0))
    return (bits | ((code >> 3) << 31)).to(tl.float32, bitcast=True)
