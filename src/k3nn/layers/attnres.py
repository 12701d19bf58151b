"""Block Attention Residuals, as Kimi K3 wires them.

A pseudo-query (RMSNorm gain g folded into a 1×d projection w) attends over depth::

    K_j = V_j / sqrt(mean_d(V_j²) + eps)      (sources V_j: stored blocks + current partial sum)
    s_j = Σ_d K_j,d · g_d · w_d
    h   = Σ_j softmax_j(s)_j · V_j            (fp32 math, cast back)

Per decoder layer two queries (before attention, before the MLP), plus one before the final norm.
The model threads the running partial sum; a block is pushed every ``attn_res_block_size`` layers
(mix before push; layer 0 has nothing to mix).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.attnres.reference import attnres_mix_reference  # re-exported: the math lives with the kernels
from .norm import RMSNorm

__all__ = ["attnres_mix_reference", "AttnResQuery", "stack_queries"]


class AttnResQuery(nn.Module):
    """One pseudo-query: ``*_res_norm`` (RMSNorm gain) + ``*_res_proj`` (Linear d→1, no bias). Zero-init:
    uniform weights over depth at the start of training."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.proj = nn.Linear(dim, 1, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """The depth mix over ``sources`` (S tensors [..., d] of one shape: the stored blocks and the current
        partial sum) → h [..., d] in the sources' dtype, computed in fp32 (:func:`k3nn.ops.attnres_mix`)."""
        from .. import ops

        return ops.attnres_mix(sources, self.proj.weight[0], self.norm.weight, self.norm.eps)


def stack_queries(queries: list[AttnResQuery]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The pseudo-queries of one block, in call order, as phase-1 inputs: (query_weight [Q, d],
    norm_weight [Q, d], eps) for :func:`k3nn.ops.attnres_phase1`. Cache the result for inference."""
    eps = {q.norm.eps for q in queries}
    if len(eps) != 1:
        raise ValueError(f"stack_queries: the queries use different eps {sorted(eps)}")
    return (torch.stack([q.proj.weight[0] for q in queries]), torch.stack([q.norm.weight for q in queries]),
            eps.pop())
