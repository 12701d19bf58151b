"""MLA prefill on decompressed K/V, with chunked attention to context already in the paged latent cache.

New tokens (``T`` per request) attend causally among themselves with the decompressed keys
``k = [W_UK c ; k_rope]`` (dq = nope + rope) and values ``v = W_UV c`` (dv). A request's cached context
(``context_lens[b]`` tokens, latent rows in the paged pool) is visible to every new token: it is gathered
``chunk_size`` tokens at a time, up-projected with ``W_UK`` / ``W_UV`` for that chunk only, attended, and merged
with the running result by the exact LSE merge. Peak workspace is one chunk's decompressed K/V
(``B · chunk_size · H · (dq + dv)`` values), whatever the context length.

The math is the eager :func:`k3nn.layers.mla.decompressed_attention` over ``[context ; new tokens]``; scores
and softmax in fp32.
"""

from __future__ import annotations

import torch

from ...cache.pages import gather_latents
from .api import merge_attn_states

__all__ = ["mla_prefill", "attention_with_lse"]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, dq], k [B, L, H, dq], v [B, L, H, dv], keep bool [B, T, L] (None: all visible) →
    (o [B, T, H, dv] fp32, lse [B, T, H] fp32); a query with no visible key gets o = 0, lse = −inf."""
    s = torch.einsum("bthd,blhd->bhtl", q.float(), k.float()) * scale
    if keep is not None:
        s = s.masked_fill(~keep[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.einsum("bhtl,blhd->bthd", p, v.float()), lse.transpose(1, 2)


def mla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                kv_pool: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                context_lens: torch.Tensor | None = None, w_uk: torch.Tensor | None = None,
                w_uv: torch.Tensor | None = None, chunk_size: int = 4096, q_chunk: int = 1024,
                return_lse: bool = False):
    """Causal MLA prefill of ``T`` new tokens per request, optionally after cached context.

    Args:
        q: [B, T, H, dn + dr] queries of the new tokens (rope already applied, or NoPE).
        k: [B, T, H, dn + dr] decompressed keys of the new tokens; v: [B, T, H, dv].
        scale: softmax scale, (dn + dr)^-0.5 for Kimi.
        kv_pool, block_table, context_lens: the paged latent cache ``[num_blocks, bs, r + dr]``, int
            ``[B, max_blocks]`` and int ``[B]``: request b's first ``context_lens[b]`` rows precede the new tokens.
        w_uk: [H, dn, r], w_uv: [H, dv, r] (``MultiHeadLatentAttention.w_uk_uv()``) to decompress the context.
        chunk_size: context tokens decompressed at a time; q_chunk: new-token queries per score block.
    Returns:
        o [B, T, H, dv] in v's dtype (and lse [B, T, H] fp32 with ``return_lse``).
    """
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"mla_prefill: q and k must both be [B, T, H, dq]; got {tuple(q.shape)}, {tuple(k.shape)}")
    B, T, H, dq = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"mla_prefill: v must be [B={B}, T={T}, H={H}, dv], got {tuple(v.shape)}")
    dv = v.shape[-1]
    if chunk_size < 1 or q_chunk < 1:
        raise ValueError(f"mla_prefill: chunk_size and q_chunk must be >= 1, got {chunk_size}, {q_chunk}")
    has_ctx = kv_pool is not None
    if has_ctx:
        if block_table is None or context_lens is None or w_uk is None or w_uv is None:
            raise ValueError("mla_prefill: cached context needs kv_pool, block_table, context_lens, w_uk and w_uv")
        if w_uk.dim() != 3 or w_uk.shape[0] != H or w_uv.dim() != 3 or w_uv.shape[:2] != (H, dv):
            raise ValueError(f"mla_prefill: w_uk must be [H={H}, dn, r] and w_uv [H, dv={dv}, r]; got "
                             f"{tuple(w_uk.shape)}, {tuple(w_uv.shape)}")
        dn, r = w_uk.shape[1], w_uk.shape[2]
        if kv_pool.dim() != 3 or kv_pool.shape[2] != r + dq - dn or w_uv.shape[2] != r:
            raise ValueError(f"mla_prefill: kv_pool must be [num_blocks, bs, r + dr = {r + dq - dn}] matching w_uk "
                             f"[H, dn={dn}, r={r}] and q's dq={dq}; got {tuple(kv_pool.shape)}")
        if context_lens.shape != (B,) or block_table.dim() != 2 or block_table.shape[0] != B:
            raise ValueError(f"mla_prefill: context_lens must be [B={B}] and block_table [B, max_blocks]; got "
                             f"{tuple(context_lens.shape)}, {tuple(block_table.shape)}")
        ctx = context_lens.long()
        if (ctx < 0).any() or (ctx > block_table.shape[1] * kv_pool.shape[1]).any():
            raise ValueError(f"mla_prefill: context_lens {ctx.tolist()} must lie in [0, "
                             f"{block_table.shape[1] * kv_pool.shape[1]}] (what block_table covers)")
        max_ctx = int(ctx.max()) if B else 0
    out = torch.empty(B, T, H, dv, dtype=v.dtype, device=v.device)
    lse_out = torch.empty(B, T, H, dtype=torch.float32, device=v.device)
    i_idx = torch.arange(T, device=q.device)
    for q0 in range(0, T, q_chunk):
        qs = q[:, q0:q0 + q_chunk]
        tq = qs.shape[1]
        causal = i_idx[None, :] <= (q0 + torch.arange(tq, device=q.device))[:, None]  # [tq, T]
        o, lse = attention_with_lse(qs, k, v, scale, causal[None].expand(B, -1, -1))
        if has_ctx:
            for c0 in range(0, max_ctx, chunk_size):
                n = min(chunk_size, max_ctx - c0)
                rows = gather_latents(kv_pool, block_table, n, start=c0)  # [B, n, r + dr]
                c, kr = rows[..., :r], rows[..., r:]
                kn = torch.einsum("blr,hdr->blhd", c, w_uk.to(c.dtype))
                kc = torch.cat([kn, kr[:, :, None].expand(-1, -1, H, -1)], -1)
                vc = torch.einsum("blr,hvr->blhv", c, w_uv.to(c.dtype))
                vis = (c0 + torch.arange(n, device=q.device))[None, :] < ctx[:, None]  # [B, n]
                oc, lc = attention_with_lse(qs, kc, vc, scale, vis[:, None, :].expand(-1, tq, -1))
                o, lse = merge_attn_states(torch.stack([o, oc]), torch.stack([lse, lc]))
        out[:, q0:q0 + tq] = o.to(v.dtype)
        lse_out[:, q0:q0 + tq] = lse
    return (out, lse_out) if return_lse else out
