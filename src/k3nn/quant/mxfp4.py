"""MXFP4 (OCP Microscaling v1.0): E2M1 elements in 32-element blocks sharing one E8M0 scale.

Storage (compressed-tensors ``mxfp4-pack-quantized``, the K3 layout): for a logical weight [N, K]
``weight_packed`` u8 [N, K/2] (element 2i in the low nibble, 2i+1 in the high nibble) and ``weight_scale``
u8 [N, K/32] with value 2^(s-127) (s = 255 is NaN). 8 + 32·4 = 136 bits per 32 weights = 4.25 bits per weight.

E2M1 (sign = bit 3; magnitude bits index ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``), no Inf/NaN codes.

Quantization (``mxfp4_quantize``) has two scale rules, both with round-to-nearest-even elements and
saturation to ±6:

* ``"ocp"`` (OCP spec / microxcaling): shared exponent ``floor(log2(amax)) - 2``;
* ``"even"`` (compressed-tensors' minmax observer, the producer of the K3 checkpoint): amax is first
  rounded to one mantissa bit (a mantissa ≥ 1.75 bumps the exponent), then the same rule.

Blocks containing NaN or ±Inf get the NaN scale 255; all-zero blocks get scale 0 (2^-127) and zero codes.
Shared exponents are clamped to [-127, 127].
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["E2M1_VALUES", "MXFP4Weight", "mxfp4_dequantize", "mxfp4_quantize", "BLOCK", "SCALE_NAN",
           "e8m0_to_float", "bits_per_weight"]

BLOCK = 32
SCALE_NAN = 255
#: the 16 E2M1 codes (bit 3 = sign)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# byte -> (value of low nibble, value of high nibble)
_PAIR_LUT = torch.stack([E2M1_VALUES.repeat(16), E2M1_VALUES.repeat_interleave(16)], -1)  # [256, 2]
_SCALE_RULES = ("ocp", "even")


class MXFP4Weight(NamedTuple):
    """A packed MXFP4 matrix (or a stack of them): packed [..., N, K/2] u8, scale [..., N, K/32] u8."""

    packed: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (unpacked) shape [..., N, K]."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def device(self) -> torch.device:
        """The device of the packed codes and the scales."""
        return self.packed.device

    def nbytes(self) -> int:
        """Bytes held: codes (K/2 per row) + scales (K/32 per row), about 4.25 bits per weight."""
        return self.packed.numel() + self.scale.numel()

    def __getitem__(self, idx) -> "MXFP4Weight":  # select experts
        return MXFP4Weight(self.packed[idx], self.scale[idx])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense matrix [..., N, K] in ``dtype`` (:func:`mxfp4_dequantize`; E2M1 value × 2^e, exact in fp32)."""
        return mxfp4_dequantize(self.packed, self.scale, dtype)


def bits_per_weight(w: MXFP4Weight) -> float:
    """Storage bits per logical weight (4.25 for the MX layout)."""
    n = 1
    for s in w.shape:
        n *= s
    return 8.0 * w.nbytes() / n


def check_mxfp4(packed: torch.Tensor, scale: torch.Tensor, what: str = "mxfp4") -> None:
    """Raise a clear error unless ``packed`` u8 [..., K/2] and ``scale`` u8 [..., K/32] describe one tensor."""
    if not isinstance(packed, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise TypeError(f"{what}: packed and scale must be tensors")
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"{what}: packed and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    if packed.dim() == 0 or packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] * 2 != scale.shape[-1] * BLOCK:
        raise ValueError(f"{what}: packed {tuple(packed.shape)} and scale {tuple(scale.shape)} disagree "
                         f"(need packed [..., K/2] and scale [..., K/{BLOCK}] with the same leading dims)")


_check = check_mxfp4


def e8m0_to_float(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E8M0 bytes → 2^(s-127) in fp32 (exact, 2^-127 is an fp32 subnormal) or fp64; 255 → NaN."""
    s = scale.to(torch.int32)
    pow2 = torch.ldexp(torch.ones_like(s, dtype=dtype), s - 127)
    return torch.where(s == SCALE_NAN, torch.full_like(pow2, float("nan")), pow2)


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed u8 [..., K/2], scale u8 [..., K/32] → [..., K] in ``dtype``.

    Exact in fp64, and in fp32/bf16 except that 6·2^127 (scale 254, code ±6) overflows to ±Inf there;
    fp16 overflows for scales above 2^13.
    """
    check_mxfp4(packed, scale)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    vals = _PAIR_LUT.to(packed.device, cdt)[packed.long()].flatten(-2)  # [..., K]
    vals = vals.unflatten(-1, (-1, BLOCK)) * e8m0_to_float(scale, cdt)[..., None]
    return vals.flatten(-2).to(dtype)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """|x| (already scaled, fp32) → nearest E2M1 magnitude code 0..7, ties to the even code, saturating at 6."""
    mags = E2M1_VALUES[:8].to(x.device)
    a = x.abs().clamp(max=6.0)
    mid = (mags[1:] + mags[:-1]) / 2  # 7 midpoints: 0.25 0.75 1.25 1.75 2.5 3.5 5
    code = torch.bucketize(a, mid)  # a == mid[i] lands on the lower code i
    at_mid = (code < 7) & (a == mid[code.clamp(max=6)])
    return torch.where(at_mid & (code % 2 == 1), code + 1, code)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for finite a > 0 (exact, subnormals included: frexp gives a = m·2^e, m ∈ [0.5, 1))."""
    return torch.frexp(a)[1].to(torch.int32) - 1


def mxfp4_quantize(w: torch.Tensor, scale_rule: str = "ocp") -> MXFP4Weight:
    """Quantize [..., K] (K % 32 == 0) to MXFP4 (see the module docstring for ``scale_rule``).

    Elements are ``x / 2^e`` rounded to the nearest E2M1 value (ties to even), saturating at ±6; the code
    of an element that rounds to zero is +0. Returns packed u8 [..., K/2] and scale u8 [..., K/32].
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError(f"mxfp4_quantize: w must be a floating-point tensor, got {type(w).__name__} "
                        f"{getattr(w, 'dtype', '')}")
    if w.dim() == 0 or w.shape[-1] % BLOCK:
        raise ValueError(f"mxfp4_quantize: last dim must be a multiple of {BLOCK}, got shape {tuple(w.shape)}")
    if scale_rule not in _SCALE_RULES:
        raise ValueError(f"mxfp4_quantize: scale_rule must be one of {_SCALE_RULES}, got {scale_rule!r}")
    x = w.float().unflatten(-1, (-1, BLOCK))
    bad = ~torch.isfinite(x).all(-1)
    amax = x.abs().nan_to_num(0.0, 0.0, 0.0).amax(-1)
    if scale_rule == "even":  # round amax's mantissa to one bit (+2^21 on the fp32 pattern, then truncate)
        bits = amax.view(torch.int32)
        amax = ((bits + (1 << 21)) & ~((1 << 22) - 1)).view(torch.float32)
        fmax = torch.finfo(torch.float32).max
        amax = amax.nan_to_num(fmax, fmax)  # a bump past fp32's max (NaN bit pattern) saturates
    e = torch.where(amax > 0, _floor_log2(amax.clamp_min(torch.finfo(torch.float32).tiny / 4)) - 2,
                    torch.full_like(amax, -127, dtype=torch.int32))
    e = e.clamp(-127, 127)
    xs = torch.ldexp(x, (-e)[..., None].expand_as(x))
    code = _round_e2m1(xs.nan_to_num(0.0, 0.0, 0.0))
    code = torch.where((xs < 0) & (code > 0), code + 8, code).to(torch.uint8).flatten(-2)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    scale = torch.where(bad, torch.full_like(e, SCALE_NAN), e + 127).to(torch.uint8)
    return MXFP4Weight(packed.contiguous(), scale.contiguous())
