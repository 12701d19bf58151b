"""Routed-experts functional op."""

from __future__ import annotations

import torch

from ..kernels import moe as _moe  # noqa: F401  (registers the backends)
from ..kernels.registry import dispatch
from ..quant.mxfp4 import MXFP4Weight

__all__ = ["moe_experts"]


def moe_experts(x: torch.Tensor, w1, w3, w2, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                activation: str = "silu", beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """Weighted sum of GLU experts: ``out[n] = Σ_k topk_weights[n,k] · W2_e act(W1_e x[n], W3_e x[n])``, e = topk_ids[n,k].

    x [N, D]; w1, w3 [E, I, D] and w2 [E, D, I] as tensors or :class:`~k3nn.quant.mxfp4.MXFP4Weight`;
    topk_ids int [N, k] in [0, E); topk_weights fp32 [N, k]; activation ``"silu"`` | ``"situ"``. Returns [N, D].
    """
    if x.dim() != 2:
        raise ValueError(f"moe_experts: x must be [N, D], got {tuple(x.shape)}")
    N, D = x.shape
    E, I, D1 = w1.shape
    if D1 != D or tuple(w3.shape) != (E, I, D) or tuple(w2.shape) != (E, D, I):
        raise ValueError(f"moe_experts: weight shapes w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)} "
                         f"do not match x [N, {D}] (need w1, w3 [E, I, D], w2 [E, D, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != N:
        raise ValueError(f"moe_experts: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [N={N}, k]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"moe_experts: topk_ids must be int32/int64, got {topk_ids.dtype}")
    if activation not in ("silu", "situ"):
        raise ValueError(f"moe_experts: activation must be 'silu' or 'situ', got {activation!r}")
    return dispatch("moe_experts", x, w1, w3, w2, topk_ids, topk_weights, activation=activation, beta=beta,
                    linear_beta=linear_beta)
