"""Linear projections ``y = x Wᵀ (+ bias) (+ residual)``: the eager reference (torch's GEMM) and a Triton
weight-streaming skinny GEMM for at most 16 rows (decode steps, verify windows)."""

from __future__ import annotations

from ..registry import _triton_import_error, register
from .reference import MAX_SKINNY_ROWS, check_linear, linear_reference, rows_of

register("linear", "eager")(linear_reference)

if _triton_import_error() is None:
    from .triton_skinny import auto_skip_skinny, linear_skinny, supports_skinny

    register("linear", "triton", supports=supports_skinny, auto_skip=auto_skip_skinny)(linear_skinny)

__all__ = ["MAX_SKINNY_ROWS", "check_linear", "linear_reference", "rows_of"]
