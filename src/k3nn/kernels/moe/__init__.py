"""Routed-experts kernels: eager references and the fused Triton path (the router, grouped GEMMs with the
GLU activation in the epilogue, in-kernel MXFP4 decode, weighted top-k reduction fused with the latent norm)."""

from __future__ import annotations

import torch

from ...quant.mxfp4 import MXFP4Weight
from ..registry import register, triton_interpreting, triton_ready
from .reference import moe_expert_outputs_reference, moe_experts_reference, moe_latent_finalize_reference
from .routing import route_checked

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _tensors(*ws):
    out = []
    for w in ws:
        out += [w.packed, w.scale] if isinstance(w, MXFP4Weight) else [w]
    return out


def _triton_supports(x, w1, w3, w2, topk_ids, *rest, **kw) -> str | None:
    r = triton_ready(x, *_tensors(w1, w3, w2), topk_ids)
    if r:
        return r
    if x.dtype not in _FLOATS:
        return f"x dtype {x.dtype} is not fp16/bf16/fp32"
    if x.dtype == torch.bfloat16 and triton_interpreting():
        return "bf16 tl.dot is not exact under the Triton interpreter"
    kinds = {isinstance(w, MXFP4Weight) for w in (w1, w3, w2)}
    if len(kinds) != 1:
        return "w1, w3, w2 must all be MXFP4 or all dense"
    if not kinds.pop() and any(w.dtype != x.dtype for w in (w1, w3, w2)):
        return f"dense expert weights must have x's dtype {x.dtype}, got {w1.dtype}/{w3.dtype}/{w2.dtype}"
    for w in _tensors(w1, w3, w2):
        if w.stride(-1) != 1:
            return "expert weights must be contiguous in their last dim"
    return None


def _finalize_supports(expert_out, topk_weights, norm_weight=None, *a, **kw) -> str | None:
    r = triton_ready(expert_out, topk_weights, *([norm_weight] if norm_weight is not None else []))
    if r:
        return r
    if norm_weight is not None and expert_out.shape[-1] > 16384:
        return "latent width above 16384 is not supported by the one-row-per-program norm"
    return None


def _triton_available() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as e:  # pragma: no cover
        return f"triton is not importable ({e})"
    return None


# Lazy wrappers (importing the Triton module compiles nothing but costs time); signatures mirror the references.
def _moe_experts_triton(x, w1, w3, w2, topk_ids, topk_weights, activation="silu", beta=4.0, linear_beta=25.0):
    from .triton_fused import fused_moe_experts

    return fused_moe_experts(x, w1, w3, w2, topk_ids, topk_weights, activation, beta, linear_beta)


def _moe_expert_outputs_triton(x, w1, w3, w2, topk_ids, activation="silu", beta=4.0, linear_beta=25.0, **tuning):
    from .triton_fused import fused_expert_outputs

    return fused_expert_outputs(x, w1, w3, w2, topk_ids, activation, beta, linear_beta, **tuning)


def _moe_latent_finalize_triton(expert_out, topk_weights, norm_weight=None, eps=1e-5, out_dtype=None, out=None):
    from .triton_fused import moe_finalize_triton

    return moe_finalize_triton(expert_out, topk_weights, norm_weight, eps, out_dtype, out)


register("moe_experts", "eager")(moe_experts_reference)
register("moe_experts", "triton", supports=_triton_supports, available=_triton_available)(_moe_experts_triton)
register("moe_expert_outputs", "eager")(moe_expert_outputs_reference)
register("moe_expert_outputs", "triton", supports=_triton_supports,
         available=_triton_available)(_moe_expert_outputs_triton)
register("moe_latent_finalize", "eager")(moe_latent_finalize_reference)
register("moe_latent_finalize", "triton", supports=_finalize_supports,
         available=_triton_available)(_moe_latent_finalize_triton)


def _route_supports(logits, bias, top_k, renormalize, scaling, num_group=1, topk_group=1, score_func="sigmoid"):
    r = triton_ready(logits, bias)
    if r:
        return r
    from .triton_route import supports_route

    return supports_route(logits, bias, top_k, renormalize, scaling, num_group, topk_group, score_func)


def _route_triton(logits, bias, top_k, renormalize, scaling, num_group=1, topk_group=1, score_func="sigmoid"):
    from .triton_route import route_triton

    return route_triton(logits, bias, top_k, renormalize, scaling, num_group, topk_group, score_func)


register("moe_route", "eager")(route_checked)
register("moe_route", "triton", supports=_route_supports, available=_triton_available)(_route_triton)


# The router's GEMM and the routing in one op: on the Triton path the route kernel adds the skinny GEMM's split-K
# partial sums itself (in the reduce launch's order), so a decode-sized router is two launches instead of three.
def _gate_route_reference(x, weight, bias, top_k, renormalize, scaling, num_group=1, topk_group=1,
                          score_func="sigmoid"):
    from ..linear.reference import linear_reference

    out = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else None
    return route_checked(linear_reference(x, weight, None, None, out), bias, top_k, renormalize, scaling,
                           num_group, topk_group, score_func)


def _gate_route_supports(x, weight, bias, top_k, renormalize, scaling, num_group=1, topk_group=1,
                         score_func="sigmoid"):
    from ..linear.triton_skinny import supports_skinny
    from .triton_route import route_kernel_reason

    r = supports_skinny(x, weight, None, None, torch.float32) or triton_ready(bias)
    if r:
        return r
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"x dtype {x.dtype} (the partial sums are fp32)"
    return route_kernel_reason(weight.shape[0], num_group, topk_group, score_func)


def _gate_route_auto_skip(x, weight, *args, **kwargs):
    from ..linear.triton_skinny import auto_skip_skinny

    return auto_skip_skinny(x, weight, None, None, torch.float32)


def _gate_route_triton(x, weight, bias, top_k, renormalize, scaling, num_group=1, topk_group=1,
                       score_func="sigmoid"):
    from ..linear.triton_skinny import linear_skinny
    from .triton_route import route_triton

    parts = linear_skinny(x, weight, out_dtype=torch.float32, partials=True)  # [S, N, E] fp32
    return route_triton(parts, bias, top_k, renormalize, scaling, num_group, topk_group, score_func)


register("moe_gate_route", "eager")(_gate_route_reference)
register("moe_gate_route", "triton", supports=_gate_route_supports, available=_triton_available,
         auto_skip=_gate_route_auto_skip)(_gate_route_triton)
