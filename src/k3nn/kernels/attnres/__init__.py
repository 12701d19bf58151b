"""AttnRes kernels: the depth mix and the two phases of paper Algorithm 1 (eager references + Triton)."""

from ..registry import _triton_import_error, register
from .reference import (AttnResPhase2Output, attnres_mix_reference, attnres_phase1_reference,
                        attnres_phase2_reference)

register("attnres_mix", "eager")(attnres_mix_reference)
register("attnres_phase1", "eager")(attnres_phase1_reference)
register("attnres_phase2", "eager")(attnres_phase2_reference)

if _triton_import_error() is None:
    from . import triton_mix as _tm

    register("attnres_mix", "triton", supports=_tm.mix_supports)(_tm.attnres_mix_triton)
    register("attnres_phase1", "triton", supports=_tm.phase1_supports)(_tm.attnres_phase1_triton)
    register("attnres_phase2", "triton", supports=_tm.phase2_supports)(_tm.attnres_phase2_triton)

__all__ = ["AttnResPhase2Output", "attnres_mix_reference", "attnres_phase1_reference", "attnres_phase2_reference"]
