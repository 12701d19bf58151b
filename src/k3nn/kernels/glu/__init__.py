"""Gated activations (SiLU-GLU, SiTU-GLU, MLA's sigmoid gate): eager references + Triton."""

from __future__ import annotations

from ..registry import _triton_import_error, register
from .reference import (check_glu_packed, check_sigmoid_gate, glu_activation, glu_packed_reference,
                        sigmoid_gate_reference, situ_glu)

register("glu", "eager")(glu_packed_reference)
register("sigmoid_gate", "eager")(sigmoid_gate_reference)

if _triton_import_error() is None:
    from .triton_glu import glu_packed_triton, sigmoid_gate_triton, supports_glu_packed, supports_sigmoid_gate

    register("glu", "triton", supports=supports_glu_packed)(glu_packed_triton)
    register("sigmoid_gate", "triton", supports=supports_sigmoid_gate)(sigmoid_gate_triton)

__all__ = ["check_glu_packed", "check_sigmoid_gate", "glu_activation", "glu_packed_reference",
           "sigmoid_gate_reference", "situ_glu"]
