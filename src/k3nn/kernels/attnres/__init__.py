"""AttnRes mix kernels: eager reference (and Triton, registered by its module)."""

from ...layers.attnres import attnres_mix_reference
from ..registry import register

register("attnres_mix", "eager")(attnres_mix_reference)
