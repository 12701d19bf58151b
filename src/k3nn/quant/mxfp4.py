"""MXFP4 (OCP Microscaling v1.0): E2M1 elements in 32-element blocks sharing one E8M0 scale.

Storage (compressed-tensors ``mxfp4-pack-quantized``, the K3 layout): for a logical weight [N, K]
``weight_packed`` u8 [N, K/2] (element 2i in the low nibble, 2i+1 in the high nibble) and ``weight_scale``
u8 [N, K/32] with value 2^(s-127) (s = 255 is NaN). ≈ 4.25 bits per weight.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["E2M1_VALUES", "MXFP4Weight", "mxfp4_dequantize", "mxfp4_quantize", "BLOCK"]

BLOCK = 32
#: the 16 E2M1 codes (bit 3 = sign)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


class MXFP4Weight(NamedTuple):
    """A packed MXFP4 matrix (or a stack of them): packed [..., N, K/2] u8, scale [..., N, K/32] u8."""

    packed: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def __getitem__(self, idx) -> "MXFP4Weight":  # select experts
        return MXFP4Weight(self.packed[idx], self.scale[idx])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return mxfp4_dequantize(self.packed, self.scale, dtype)


def _check(packed: torch.Tensor, scale: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"mxfp4: packed and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] * 2 != scale.shape[-1] * BLOCK:
        raise ValueError(f"mxfp4: packed {tuple(packed.shape)} and scale {tuple(scale.shape)} disagree "
                         f"(need packed[..., K/2], scale[..., K/{BLOCK}])")


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed u8 [..., K/2], scale u8 [..., K/32] → [..., K] in ``dtype`` (exact: every value is representable
    in fp32; in bf16 too unless the scale exceeds bf16's range)."""
    _check(packed, scale)
    lut = E2M1_VALUES.to(packed.device)
    lo, hi = (packed & 0xF).long(), (packed >> 4).long()
    vals = torch.stack([lut[lo], lut[hi]], -1).flatten(-2)  # [..., K]
    s = scale.to(torch.int32)
    pow2 = torch.where(s == 255, torch.full_like(s, 0, dtype=torch.float32).fill_(float("nan")),
                       torch.ldexp(torch.ones_like(s, dtype=torch.float32), s - 127))
    vals = vals.unflatten(-1, (-1, BLOCK)) * pow2[..., None]
    return vals.flatten(-2).to(dtype)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """|x| (already scaled, fp32) → nearest E2M1 magnitude code 0..7, ties to the even code, saturating at 6."""
    mags = E2M1_VALUES[:8].to(x.device)
    a = x.abs().clamp(max=6.0)
    mid = (mags[1:] + mags[:-1]) / 2  # 7 midpoints
    code = torch.bucketize(a, mid)  # a == mid[i] lands on the lower code i
    at_mid = (code < 7) & (a == mid[code.clamp(max=6)])
    return torch.where(at_mid & (code % 2 == 1), code + 1, code)


def mxfp4_quantize(w: torch.Tensor) -> MXFP4Weight:
    """Quantize [..., K] (K % 32 == 0) per the OCP MX spec: shared exponent floor(log2(amax)) - 2 (E2M1 emax),
    elements x / 2^e rounded to nearest-even E2M1 with saturation to ±6."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"mxfp4_quantize: last dim must be a multiple of {BLOCK}, got {w.shape[-1]}")
    x = w.float().unflatten(-1, (-1, BLOCK))
    amax = x.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
    e = e.clamp(-127, 127)
    xs = x / torch.ldexp(torch.ones_like(e), e.int())[..., None]
    code = _round_e2m1(xs)
    code = torch.where((xs < 0) & (code > 0), code + 8, code).to(torch.uint8).flatten(-2)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return MXFP4Weight(packed.contiguous(), (e + 127).to(torch.uint8))
