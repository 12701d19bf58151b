"""Normalisation kernels: RMSNorm and the sigmoid-gated RMSNorm on KDA outputs (eager references + Triton)."""

from __future__ import annotations

from ..registry import _triton_import_error, register
from .reference import check_gated_rmsnorm, check_rms_norm, gated_rmsnorm_reference, rms_norm_reference

register("gated_rmsnorm", "eager")(gated_rmsnorm_reference)
register("rms_norm", "eager")(rms_norm_reference)

if _triton_import_error() is None:
    from .triton_gated import gated_rmsnorm_triton, supports_gated_rmsnorm

    from .triton_rms import rms_norm_triton, supports_rms_norm

    register("gated_rmsnorm", "triton", supports=supports_gated_rmsnorm)(gated_rmsnorm_triton)
    register("rms_norm", "triton", supports=supports_rms_norm)(rms_norm_triton)

__all__ = ["check_gated_rmsnorm", "check_rms_norm", "gated_rmsnorm_reference", "rms_norm_reference"]
