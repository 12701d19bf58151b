"""Quantized weight formats (MXFP4) and their loaders."""

from .experts import compressed_expert_keys, load_compressed_experts
from .mxfp4 import BLOCK, E2M1_VALUES, MXFP4Weight, bits_per_weight, mxfp4_dequantize, mxfp4_quantize

__all__ = ["BLOCK", "E2M1_VALUES", "MXFP4Weight", "bits_per_weight", "mxfp4_dequantize", "mxfp4_quantize",
           "load_compressed_experts", "compressed_expert_keys"]
