"""Eager reference for absorbed MLA decode over a paged latent cache (plain PyTorch, fp32 math).

For request b, query token t, head h, with cached rows ``kv[j] = [c_j (r) ; k_rope_j (dr)]``::

    s_j   = scale · (q_lat[b,t,h] · c_j + q_rope[b,t,h] · k_rope_j)      for j < visible[b, t]
    lse   = log Σ_j exp(s_j)                                               (natural log; −inf if no key)
    o     = Σ_j exp(s_j − lse) · c_j                                       (latent space, [r]; 0 if no key)

``visible[b, t]`` defaults to ``seq_lens[b] − Tq + t + 1`` (a verify window: query t of Tq sits at position
``seq_len − Tq + t``). This is :func:`k3nn.layers.mla.absorbed_attention` read through a block table.
"""

from __future__ import annotations

import torch

from ...cache.pages import gather_latents
from .api import default_visible_lens

__all__ = ["mla_decode_reference"]


def mla_decode_reference(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=None,
                         num_splits=None, out_dtype=None, out=None):
    """Returns (o [B, Tq, H, r] in ``out_dtype`` (default q_lat.dtype), lse [B, Tq, H] fp32); written into
    ``out = (o, lse)`` when given. Rows past a request's length and unused table entries are never read."""
    B, Tq, H, r = q_lat.shape
    acc = torch.float64 if q_lat.dtype == torch.float64 else torch.float32
    if visible_lens is None:
        visible_lens = default_visible_lens(seq_lens, Tq)
    L = int(seq_lens.max().item()) if B else 0
    bs = kv_pool.shape[1]
    nblk = (seq_lens.long()[:, None] + bs - 1) // bs
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < nblk
    table = torch.where(used, block_table.long(), torch.zeros_like(block_table, dtype=torch.long))
    kv = gather_latents(kv_pool, table, L).to(acc)  # [B, L, r + dr]
    inside = torch.arange(L, device=kv.device)[None, :] < seq_lens.long()[:, None]
    kv = torch.where(inside[..., None], kv, torch.zeros((), dtype=acc, device=kv.device))
    c, kr = kv[..., :r], kv[..., r:]
    s = (torch.einsum("bthr,blr->bthl", q_lat.to(acc), c)
         + torch.einsum("bthd,bld->bthl", q_rope.to(acc), kr)) * scale
    keep = torch.arange(L, device=q_lat.device)[None, None, :] < visible_lens.long()[..., None]  # [B, Tq, L]
    s = s.masked_fill(~keep[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)  # −inf where no key
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    o = torch.einsum("bthl,blr->bthr", p, c)
    o, lse = o.to(out_dtype or q_lat.dtype), lse.float()
    if out is not None:
        out[0].copy_(o)
        out[1].copy_(lse)
        return out
    return o, lse
