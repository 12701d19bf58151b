"""Functional ops (fla-core argument conventions). Each validates its arguments, then dispatches to the
backend in force (see :mod:`k3nn.kernels.registry`)."""

from .activation import glu, sigmoid_gate
from .attnres import AttnResPhase2Output, attnres_mix, attnres_phase1, attnres_phase2
from .linear import linear
from .kda import kda_chunk, kda_fused_decode, kda_gate, kda_recurrent, short_conv
from .mla import mla_attention, mla_decode, mla_prefill
from .moe import moe_expert_outputs, moe_experts, moe_gate_route, moe_latent_finalize, moe_route
from .mxfp4 import mxfp4_dequantize, mxfp4_quantize
from .norm import gated_rmsnorm, rms_norm

__all__ = ["attnres_mix", "kda_chunk", "kda_recurrent", "moe_experts",
            "moe_expert_outputs", "moe_latent_finalize", "mxfp4_quantize", "mxfp4_dequantize"]
__all__ += ["mla_attention", "mla_decode", "mla_prefill"]
__all__ += ["attnres_phase1", "attnres_phase2", "AttnResPhase2Output"]
__all__ += ["kda_fused_decode"]
__all__ += ["short_conv", "kda_gate", "gated_rmsnorm", "rms_norm"]
__all__ += ["glu", "sigmoid_gate"]
__all__ += ["moe_route", "moe_gate_route"]
__all__ += ["linear"]
