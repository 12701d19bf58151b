"""Eager reference for the routed-experts op: loop over experts that received tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...layers.mlp import glu_activation
from ...quant.mxfp4 import MXFP4Weight

__all__ = ["moe_experts_reference"]


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
