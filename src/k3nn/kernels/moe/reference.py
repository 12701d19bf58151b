"""Eager reference for the routed-experts op: loop over experts that received tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...quant.mxfp4 import MXFP4Weight
from ..glu import glu_activation

__all__ = ["moe_experts_reference", "moe_expert_outputs_reference", "moe_latent_finalize_reference"]


def _w(w, e: int, dtype: torch.dtype) -> torch.Tensor:
    return w[e].dequantize(dtype) if isinstance(w, MXFP4Weight) else w[e].to(dtype)


def moe_experts_reference(x, w1, w3, w2, topk_ids, topk_weights, activation="silu", beta=4.0, linear_beta=25.0):
    N, D = x.shape
    out = torch.zeros(N, D, dtype=torch.float32 if x.dtype != torch.float64 else x.dtype, device=x.device)
    flat = topk_ids.reshape(-1)
    tok = torch.arange(N, device=x.device).repeat_interleave(topk_ids.shape[1])
    wts = topk_weights.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel = order[start:start + c]
        start += c
        xe = x[tok[sel]]
        h = glu_activation(F.linear(xe, _w(w1, e, x.dtype)), F.linear(xe, _w(w3, e, x.dtype)), activation, beta, linear_beta)
        ye = F.linear(h, _w(w2, e, x.dtype))
        out.index_add_(0, tok[sel], ye.to(out.dtype) * wts[sel, None].to(out.dtype))
    return out.to(x.dtype)


def moe_expert_outputs_reference(x, w1, w3, w2, topk_ids, activation="silu", beta=4.0, linear_beta=25.0):
    """Unweighted per-slot expert outputs [N, k, D] (x.dtype): ``y[n, j] = E_{ids[n,j]}(x[n])``."""
    N, D = x.shape
    k = topk_ids.shape[1]
    out = torch.zeros(N * k, D, dtype=x.dtype, device=x.device)
    flat = topk_ids.reshape(-1)
    tok = torch.arange(N, device=x.device).repeat_interleave(k)
    for e in torch.unique(flat).tolist():
        sel = (flat == e).nonzero().squeeze(1)
        xe = x[tok[sel]]
        h = glu_activation(F.linear(xe, _w(w1, e, x.dtype)), F.linear(xe, _w(w3, e, x.dtype)), activation, beta, linear_beta)
        out[sel] = F.linear(h, _w(w2, e, x.dtype))
    return out.view(N, k, D)


def moe_latent_finalize_reference(expert_out, topk_weights, norm_weight=None, eps=1e-5, out_dtype=None):
    """``u = Σ_j w_j y_j`` in fp32 (fp64 for fp64 inputs); with ``norm_weight``: ``u · rsqrt(mean(u²) + eps) · norm_weight``."""
    from ...utils import upcast

    u = (upcast(expert_out) * upcast(topk_weights)[..., None]).sum(1)
    if norm_weight is not None:
        u = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps) * upcast(norm_weight)
    return u.to(out_dtype or expert_out.dtype)
