"""Routed-experts functional ops: the weighted expert sum, per-slot expert outputs, and the deferred
finalization of Stable LatentMoE (weighted top-k reduction fused with the latent RMSNorm)."""

from __future__ import annotations

import torch

from ..kernels import moe as _moe  # noqa: F401  (registers the backends)
from ..kernels.linear.reference import MAX_SKINNY_ROWS, check_linear, rows_of
from ..kernels.moe.routing import (check_finite_on_device, check_route, check_route_args, route_checked,
                                   route_kernel_applies)
from ..kernels.registry import BackendUnavailableError, dispatch, resolve
from ..quant.mxfp4 import MXFP4Weight, check_mxfp4
from ..utils import records_grad
from .linear import linear

__all__ = ["moe_experts", "moe_expert_outputs", "moe_latent_finalize", "moe_route", "moe_gate_route",
           "check_finite_on_device"]


def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scaling: float,
              num_group: int = 1, topk_group: int = 1, score_func: str = "sigmoid"):
    """Router: logits [N, E] fp32 → (topk_ids [N, k] int64, topk_weights [N, k] fp32); selection on the biased
    scores, weights from the raw ones (:mod:`k3nn.kernels.moe.routing`). Non-finite logits raise (asynchronously
    on GPU: no host sync). The top-k order is unspecified. Grouped and softmax routing run the eager form (the
    kernel covers sigmoid scores without expert groups)."""
    check_route(logits, bias, top_k, score_func)
    args = (logits, bias, top_k, renormalize, scaling, num_group, topk_group, score_func)
    if not route_kernel_applies(num_group, topk_group, score_func):
        return route_checked(*args)
    return dispatch("moe_route", *args)


def moe_gate_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                   scaling: float, num_group: int = 1, topk_group: int = 1, score_func: str = "sigmoid"):
    """The router in one call: :func:`moe_route` on the logits ``linear(x, weight)``, computed in fp32 for fp16 /
    bf16 inputs (as if upcast), else in x's dtype (fp32, or fp64 for checks).

    Args:
        x: ``[N, d]``; weight: ``[E, d]`` in x's dtype; the rest as :func:`moe_route`.
    Returns:
        ``(topk_ids [N, k] int64, topk_weights [N, k] fp32)``.

    Where the Triton skinny GEMM and the Triton router both take the call (at most 16 rows, sigmoid scores without
    expert groups), the route kernel adds the GEMM's split-K partial sums itself, in the order the reduce launch
    would: the same logits and routing as the two ops, one launch fewer. Otherwise it is exactly those two ops.
    """
    out = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else None
    check_linear(x, weight, None, None, out)
    if x.dim() != 2:
        raise ValueError(f"moe_gate_route: x must be [N, d], got {tuple(x.shape)}")
    args = (x, weight, bias, top_k, renormalize, scaling, num_group, topk_group, score_func)
    if rows_of(x) <= MAX_SKINNY_ROWS and route_kernel_applies(num_group, topk_group, score_func) \
            and not records_grad(x, weight):
        check_route_args(weight.shape[0], bias, top_k, score_func)
        try:
            impl = resolve("moe_gate_route", args)
        except BackendUnavailableError:
            impl = None  # the two ops below say why, if they cannot run either
        if impl is not None and impl.backend != "eager":
            return impl.fn(*args)
    return moe_route(linear(x, weight, out_dtype=out), bias, top_k, renormalize, scaling, num_group, topk_group,
                     score_func)


def _check_weight(name: str, w, shape: tuple[int, ...]) -> None:
    if isinstance(w, MXFP4Weight):
        check_mxfp4(w.packed, w.scale, f"moe_experts: {name}")
    elif not isinstance(w, torch.Tensor):
        raise TypeError(f"moe_experts: {name} must be a tensor or MXFP4Weight, got {type(w).__name__}")
    if tuple(w.shape) != shape:
        raise ValueError(f"moe_experts: {name} has shape {tuple(w.shape)}, expected {shape} "
                         f"(w1, w3 [E, I, D], w2 [E, D, I])")


def _validate(x, w1, w3, w2, topk_ids, activation, topk_weights=None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"moe_experts: x must be [N, D], got {tuple(getattr(x, 'shape', ()))}")
    N, D = x.shape
    if len(w1.shape) != 3:
        raise ValueError(f"moe_experts: w1 must be [E, I, D], got {tuple(w1.shape)}")
    E, I = w1.shape[0], w1.shape[1]
    _check_weight("w1", w1, (E, I, D))
    _check_weight("w3", w3, (E, I, D))
    _check_weight("w2", w2, (E, D, I))
    if topk_ids.dim() != 2 or topk_ids.shape[0] != N:
        raise ValueError(f"moe_experts: topk_ids must be [N={N}, k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"moe_experts: topk_ids must be int32/int64, got {topk_ids.dtype}")
    if topk_ids.shape[1] > E:
        raise ValueError(f"moe_experts: top-k {topk_ids.shape[1]} exceeds the number of experts {E}")
    if topk_weights is not None and topk_weights.shape != topk_ids.shape:
        raise ValueError(f"moe_experts: topk_weights {tuple(topk_weights.shape)} must match topk_ids "
                         f"{tuple(topk_ids.shape)}")
    if topk_ids.device.type == "cpu" and topk_ids.numel() and (topk_ids.min() < 0 or topk_ids.max() >= E):
        raise ValueError(f"moe_experts: topk_ids must lie in [0, {E})")
    if activation not in ("silu", "situ"):
        raise ValueError(f"moe_experts: activation must be 'silu' or 'situ', got {activation!r}")


def moe_experts(x: torch.Tensor, w1, w3, w2, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                activation: str = "silu", beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """Weighted sum of GLU experts: ``out[n] = Σ_k topk_weights[n,k] · W2_e act(W1_e x[n], W3_e x[n])``, e = topk_ids[n,k].

    x [N, D]; w1, w3 [E, I, D] and w2 [E, D, I] as tensors or :class:`~k3nn.quant.mxfp4.MXFP4Weight`
    (packed u8 [E, ·, ·/2] + E8M0 scale u8 [E, ·, ·/32]); topk_ids int [N, k] in [0, E); topk_weights
    fp32 [N, k]; activation ``"silu"`` | ``"situ"`` (β = ``beta``, up-branch cap ``linear_beta``). Returns [N, D].
    """
    _validate(x, w1, w3, w2, topk_ids, activation, topk_weights)
    return dispatch("moe_experts", x, w1, w3, w2, topk_ids, topk_weights, activation=activation, beta=beta,
                    linear_beta=linear_beta)


def moe_expert_outputs(x: torch.Tensor, w1, w3, w2, topk_ids: torch.Tensor, activation: str = "silu",
                       beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """Unweighted per-slot expert outputs ``y[n, j] = W2_e act(W1_e x[n], W3_e x[n])``, e = topk_ids[n, j]:
    [N, k, D] in x.dtype (the routing weights are applied later, by :func:`moe_latent_finalize`)."""
    _validate(x, w1, w3, w2, topk_ids, activation)
    return dispatch("moe_expert_outputs", x, w1, w3, w2, topk_ids, activation=activation, beta=beta,
                    linear_beta=linear_beta)


def moe_latent_finalize(expert_out: torch.Tensor, topk_weights: torch.Tensor, norm_weight: torch.Tensor | None = None,
                        eps: float = 1e-5, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Deferred finalization of the latent MoE: ``u = Σ_j w_j y_j`` (fp32), then, with ``norm_weight`` [D],
    ``u · rsqrt(mean(u²) + eps) · norm_weight`` — the input of the latent up-projection.

    expert_out [N, k, D]; topk_weights [N, k]; returns [N, D] in ``out_dtype`` (default expert_out.dtype).
    """
    if expert_out.dim() != 3:
        raise ValueError(f"moe_latent_finalize: expert_out must be [N, k, D], got {tuple(expert_out.shape)}")
    if topk_weights.shape != expert_out.shape[:2]:
        raise ValueError(f"moe_latent_finalize: topk_weights {tuple(topk_weights.shape)} must be "
                         f"{tuple(expert_out.shape[:2])}")
    if norm_weight is not None and tuple(norm_weight.shape) != (expert_out.shape[2],):
        raise ValueError(f"moe_latent_finalize: norm_weight {tuple(norm_weight.shape)} must be "
                         f"[{expert_out.shape[2]}]")
    return dispatch("moe_latent_finalize", expert_out, topk_weights, norm_weight, eps, out_dtype)
