"""MXFP4 quantize / dequantize: eager references (the fused MoE kernel decodes MXFP4 in-kernel)."""

from ...quant.mxfp4 import mxfp4_dequantize, mxfp4_quantize
from ..registry import register

register("mxfp4_quantize", "eager")(mxfp4_quantize)
register("mxfp4_dequantize", "eager")(mxfp4_dequantize)
