"""MXFP4 functional ops (OCP MX: E2M1 elements, 32-element blocks, E8M0 scales, low nibble = even index)."""

from __future__ import annotations

import torch

from ..kernels import mxfp4 as _mxfp4  # noqa: F401  (registers the backends)
from ..kernels.registry import dispatch
from ..quant.mxfp4 import BLOCK, MXFP4Weight, check_mxfp4

__all__ = ["mxfp4_quantize", "mxfp4_dequantize"]


def mxfp4_quantize(w: torch.Tensor, scale_rule: str = "ocp") -> MXFP4Weight:
    """w [..., K] float (K % 32 == 0) → :class:`MXFP4Weight` (packed u8 [..., K/2], scale u8 [..., K/32]).

    ``scale_rule``: ``"ocp"`` (spec: 2^(floor(log2 amax) − 2)) or ``"even"`` (compressed-tensors, K3's producer).
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError(f"mxfp4_quantize: w must be a floating-point tensor, got {getattr(w, 'dtype', type(w))}")
    if w.dim() == 0 or w.shape[-1] % BLOCK:
        raise ValueError(f"mxfp4_quantize: w's last dim must be a multiple of {BLOCK}, got {tuple(w.shape)}")
    if scale_rule not in ("ocp", "even"):
        raise ValueError(f"mxfp4_quantize: scale_rule must be 'ocp' or 'even', got {scale_rule!r}")
    return dispatch("mxfp4_quantize", w, scale_rule=scale_rule)


def mxfp4_dequantize(packed, scale: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed u8 [..., K/2] + scale u8 [..., K/32] (or one :class:`MXFP4Weight`) → [..., K] in ``dtype``.
    Scale byte 255 decodes its whole block to NaN."""
    if isinstance(packed, MXFP4Weight):
        if scale is not None:
            raise ValueError("mxfp4_dequantize: pass an MXFP4Weight or (packed, scale), not both")
        packed, scale = packed.packed, packed.scale
    if scale is None:
        raise ValueError("mxfp4_dequantize: scale is required with a packed tensor")
    check_mxfp4(packed, scale, "mxfp4_dequantize")
    if not dtype.is_floating_point:
        raise TypeError(f"mxfp4_dequantize: dtype must be floating point, got {dtype}")
    return dispatch("mxfp4_dequantize", packed, scale, dtype)
