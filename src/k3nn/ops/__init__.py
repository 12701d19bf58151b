"""Functional ops (fla-core argument conventions). Each validates its arguments, then dispatches to the
backend in force (see :mod:`k3nn.kernels.registry`)."""

from .attnres import attnres_mix
from .kda import kda_chunk, kda_recurrent
from .moe import moe_experts

__all__ = ["attnres_mix", "kda_chunk", "kda_recurrent", "moe_experts"]
