"""KDA kernels: eager reference, and (registered by their modules) Triton / CUDA backends."""

from __future__ import annotations

from ..registry import register
from .api import check_kda_inputs, normalise_checkpoints
from .reference import kda_recurrent_reference

register("kda_chunk", "eager")(kda_recurrent_reference)
register("kda_recurrent", "eager")(kda_recurrent_reference)
