"""Routed-experts kernels: eager reference (fused Triton registered by its module)."""

from ..registry import register
from .reference import moe_experts_reference

register("moe_experts", "eager")(moe_experts_reference)
