"""Eager references for Block AttnRes: the one-shot depth mix and its two-phase form (paper Algorithm 1).

The mix (``attnres_mix``): a pseudo-query (RMSNorm gain g folded into a 1×d projection w) attends over depth::

    K_j = V_j / sqrt(mean_d(V_j²) + eps)      (sources V_j: stored blocks + current partial sum)
    s_j = Σ_d K_j,d · g_d · w_d
    h   = Σ_j softmax_j(s)_j · V_j            (fp32 math, cast back)

Notation (shapes with a legend: Q queries, S stored sources, ``...`` token dims, d model width):

* phase 1 scores every pseudo-query of a block against the stored block representations once::

      s_qj = (V_j · (g_q ⊙ w_q)) / sqrt(mean_d(V_j²) + eps)
      m_q  = max_j s_qj,   l_q = Σ_j exp(s_qj − m_q),   o_q = Σ_j exp(s_qj − m_q) V_j    (unnormalised)

* phase 2, per sublayer, merges one more source (the running intra-block partial sum ``b``) into that
  state with the online-softmax rule and normalises::

      s_b = score(b);  M = max(m, s_b);  h = (e^{m−M} o + e^{s_b−M} b) / (e^{m−M} l + e^{s_b−M})

  which equals one softmax over [V_0 … V_{S−1}, b] (``attnres_mix``). Optionally the residual update
  ``b ← b + update`` is applied first (rounded to b's dtype, as an eager add would) and the next RMSNorm
  ``normed = w ⊙ rmsnorm(h)`` is applied after.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...utils import upcast

__all__ = ["AttnResPhase2Output", "attnres_mix_reference", "attnres_phase1_reference", "attnres_phase2_reference",
           "rmsnorm_reference"]


def attnres_mix_reference(sources: list[torch.Tensor], query_weight: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float) -> torch.Tensor:
    """sources: S tensors [..., d] (blocks then the partial); query_weight, norm_weight: [d] → [..., d]."""
    V = torch.stack([upcast(s) for s in sources], 0)  # [S, ..., d]
    K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    s = (K * (upcast(norm_weight) * upcast(query_weight))).sum(-1)  # [S, ...]
    p = s.softmax(0)
    return (p[..., None] * V).sum(0).to(sources[-1].dtype)


class AttnResPhase2Output(NamedTuple):
    """``mix``: h [..., d]; ``normed``: ``post_norm_weight ⊙ rmsnorm(h)`` or None when not requested;
    ``partial``: the source merged in phase 2 (``partial + update`` when an update was given), or None."""

    mix: torch.Tensor
    normed: torch.Tensor | None
    partial: torch.Tensor | None


def _scores(V: torch.Tensor, q: torch.Tensor, eps: float) -> torch.Tensor:
    """V: [S, ..., d] fp32; q: [Q, d] fp32 (gain folded) → [Q, S, ...]."""
    K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    return torch.einsum("s...d,qd->qs...", K, q)


def attnres_phase1_reference(sources: list[torch.Tensor], query_weight: torch.Tensor, norm_weight: torch.Tensor,
                             eps: float, out_dtype: torch.dtype = torch.float32
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sources: S tensors [..., d]; query_weight, norm_weight: [Q, d] →
    (o [Q, ..., d] ``out_dtype`` unnormalised, m [Q, ...] fp32, l [Q, ...] fp32)."""
    V = torch.stack([s.float() for s in sources], 0)
    s = _scores(V, norm_weight.float() * query_weight.float(), eps)  # [Q, S, ...]
    m = s.amax(1)
    e = torch.exp(s - m.unsqueeze(1))
    o = torch.einsum("qs...,s...d->q...d", e, V)
    return o.to(out_dtype), m, e.sum(1)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`k3nn.layers.norm.RMSNorm` as a function: normalise in fp32, cast back, then scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def attnres_phase2_reference(o: torch.Tensor, m: torch.Tensor, l: torch.Tensor, partial: torch.Tensor | None,
                             query_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             update: torch.Tensor | None = None, post_norm_weight: torch.Tensor | None = None,
                             post_norm_eps: float = 1e-5, dtype: torch.dtype | None = None) -> AttnResPhase2Output:
    """o: [..., d]; m, l: [...] fp32 (one query's phase-1 state); partial, update: [..., d] or None."""
    if update is not None:
        partial = update if partial is None else partial + update
    out_dtype = dtype or (partial.dtype if partial is not None else o.dtype)
    of, lf = o.float(), l.float()
    if partial is None:
        h = of / lf.unsqueeze(-1)
    else:
        b = partial.float()
        q = (norm_weight.float() * query_weight.float())[None]
        s = _scores(b[None], q, eps)[0, 0]
        M = torch.maximum(m, s)
        a, c = torch.exp(m - M), torch.exp(s - M)
        h = (a.unsqueeze(-1) * of + c.unsqueeze(-1) * b) / (a * lf + c).unsqueeze(-1)
    h = h.to(out_dtype)
    normed = None if post_norm_weight is None else rmsnorm_reference(h, post_norm_weight, post_norm_eps)
    return AttnResPhase2Output(h, normed, partial)
