"""Normalisation kernels: the sigmoid-gated RMSNorm on KDA outputs (eager reference + Triton)."""

from __future__ import annotations

from ..registry import _triton_import_error, register
from .reference import check_gated_rmsnorm, gated_rmsnorm_reference

register("gated_rmsnorm", "eager")(gated_rmsnorm_reference)

if _triton_import_error() is None:
    from .triton_gated import gated_rmsnorm_triton, supports_gated_rmsnorm

    register("gated_rmsnorm", "triton", supports=supports_gated_rmsnorm)(gated_rmsnorm_triton)

__all__ = ["check_gated_rmsnorm", "gated_rmsnorm_reference"]
