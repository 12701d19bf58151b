"""MLA prefill attention on decompressed K/V: the eager reference of ``mla_attention`` and the paged-context
composite ``mla_prefill``.

``mla_attention`` is causal attention with MLA's key split: per head a nope key ``k_nope`` [dn] and one rope key
``k_rope`` [dr] per token shared by every head, values ``v`` [dv]. For query ``t`` (at key index ``q_start + t``)::

    s_j = scale · (q_nope·k_nope_j + q_rope·k_rope_j),   visible iff j ≤ q_start + t and (key_mask_j or j = q_start + t)
    o   = Σ_j softmax(s)_j v_j,   lse = log Σ_j exp(s_j)        (fp32 softmax; o = 0, lse = −inf if nothing is visible)

The default ``q_start = L − T`` aligns the causal diagonal to the end of the keys (chunked prefill, prefix hits,
verify windows); varlen batches pack sequences along T with ``cu_seqlens`` (and ``cu_seqlens_k`` when the keys
of a sequence are more than its queries), each aligned to the end of its own keys.

The reference scores ``q_block`` queries at a time, so even it never holds a ``[T, L]`` matrix.
"""

from __future__ import annotations

import torch

from ...cache.pages import gather_latents
from ...utils import upcast
from .api import merge_attn_states

__all__ = ["mla_attention_reference", "check_mla_attention_inputs", "mla_prefill", "attention_with_lse"]


def _dense_reference(q_nope, q_rope, k_nope, k_rope, v, scale, q_start, key_mask, q_block):
    B, T, H, _ = q_nope.shape
    L = k_nope.shape[1]
    acc = upcast(q_nope).dtype
    o = torch.empty(B, T, H, v.shape[-1], dtype=v.dtype, device=v.device)
    lse = torch.empty(B, T, H, dtype=acc, device=v.device)
    j = torch.arange(L, device=v.device)
    kn, vv = upcast(k_nope), upcast(v)
    kr = None if k_rope is None else upcast(k_rope)
    for t0 in range(0, T, q_block):
        t1 = min(T, t0 + q_block)
        s = torch.einsum("bthd,blhd->bhtl", upcast(q_nope[:, t0:t1]), kn)
        if q_rope is not None:
            s = s + torch.einsum("bthd,bld->bhtl", upcast(q_rope[:, t0:t1]), kr)
        s = s * scale
        qs = torch.as_tensor(q_start, device=v.device).reshape(-1, 1)  # [1 or B, 1]
        qi = qs + torch.arange(t0, t1, device=v.device)  # [1 or B, tq]
        vis = j[None, None, :] <= qi[..., None]  # [1 or B, tq, L]
        if key_mask is not None:
            vis = vis & (key_mask.bool()[:, None, :] | (j[None, None, :] == qi[..., None]))
        vis = vis[:, None]  # [., 1, tq, L]
        s = s.masked_fill(~vis, float("-inf"))
        m = torch.logsumexp(s, -1)  # [B, H, tq]
        p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m))[..., None])
        o[:, t0:t1] = torch.einsum("bhtl,blhd->bthd", p, vv).to(v.dtype)
        lse[:, t0:t1] = m.transpose(1, 2)
    return o, lse


#: queries scored at a time by the reference (bounds its [B, H, q_block, L] score block)
Q_BLOCK = 1024


def mla_attention_reference(q_nope, q_rope, k_nope, k_rope, v, scale, q_start=None, key_mask=None,
                            cu_seqlens=None, cu_seqlens_k=None, max_seqlen=None, return_lse=False):
    """Eager masked attention (the definition; see the module docstring). fp32 math (fp64 for fp64 inputs),
    ``Q_BLOCK`` queries at a time."""
    q_block = Q_BLOCK
    if cu_seqlens is None:
        T, L = q_nope.shape[1], k_nope.shape[1]
        o, lse = _dense_reference(q_nope, q_rope, k_nope, k_rope, v, scale, L - T if q_start is None else q_start,
                                  key_mask, q_block)
        return (o, lse) if return_lse else o
    cuq = cu_seqlens.tolist()
    cuk = cuq if cu_seqlens_k is None else cu_seqlens_k.tolist()
    o = torch.zeros(*q_nope.shape[:3], v.shape[-1], dtype=v.dtype, device=v.device)
    lse = torch.full(q_nope.shape[:3], float("-inf"), dtype=upcast(q_nope).dtype, device=v.device)
    for i in range(len(cuq) - 1):
        a, b, c, d = cuq[i], cuq[i + 1], cuk[i], cuk[i + 1]
        if b == a:
            continue
        oi, li = _dense_reference(q_nope[:, a:b], None if q_rope is None else q_rope[:, a:b], k_nope[:, c:d],
                                  None if k_rope is None else k_rope[:, c:d], v[:, c:d], scale,
                                  (d - c) - (b - a), None, q_block)
        o[:, a:b], lse[:, a:b] = oi, li
    return (o, lse) if return_lse else o


def _tensor(name, t, dims, floating=True):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"mla_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if floating and not t.is_floating_point():
        raise TypeError(f"mla_attention: {name} must be floating point, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"mla_attention: {name} must have {dims} dims, got shape {tuple(t.shape)}")


def _cu(name, cu, total):
    _tensor(name, cu, 1, floating=False)
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"mla_attention: {name} must be int32 or int64, got {cu.dtype}")
    vals = cu.long().cpu()
    if vals.numel() < 2 or int(vals[0]) != 0 or int(vals[-1]) != total or bool((vals.diff() < 0).any()):
        raise ValueError(f"mla_attention: {name} must rise from 0 to {total} (the packed length), got "
                         f"{vals.tolist()}")
    return vals


def check_mla_attention_inputs(q_nope, q_rope, k_nope, k_rope, v, scale, q_start=None, key_mask=None,
                               cu_seqlens=None, cu_seqlens_k=None, max_seqlen=None):
    """Validate ``mla_attention`` arguments (shapes, dtypes, devices, offsets); raises naming the argument."""
    _tensor("q_nope", q_nope, 4)
    _tensor("k_nope", k_nope, 4)
    _tensor("v", v, 4)
    B, T, H, dn = q_nope.shape
    L = k_nope.shape[1]
    if k_nope.shape[0] != B or k_nope.shape[2:] != (H, dn):
        raise ValueError(f"mla_attention: k_nope must be [B={B}, L, H={H}, dn={dn}], got {tuple(k_nope.shape)}")
    if v.shape[:3] != (B, L, H):
        raise ValueError(f"mla_attention: v must be [B={B}, L={L}, H={H}, dv], got {tuple(v.shape)}")
    if (q_rope is None) != (k_rope is None):
        raise ValueError("mla_attention: q_rope and k_rope come together (both None for no rope part)")
    tensors = [q_nope, k_nope, v]
    if q_rope is not None:
        _tensor("q_rope", q_rope, 4)
        _tensor("k_rope", k_rope, 3)
        if q_rope.shape[:3] != (B, T, H):
            raise ValueError(f"mla_attention: q_rope must be [B={B}, T={T}, H={H}, dr], got {tuple(q_rope.shape)}")
        if k_rope.shape != (B, L, q_rope.shape[3]):
            raise ValueError(f"mla_attention: k_rope must be [B={B}, L={L}, dr={q_rope.shape[3]}] (one rope key "
                             f"per token, shared by the heads), got {tuple(k_rope.shape)}")
        tensors += [q_rope, k_rope]
    if len({t.dtype for t in tensors}) != 1:
        raise TypeError(f"mla_attention: q, k and v must share a dtype, got {sorted({str(t.dtype) for t in tensors})}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"mla_attention: scale must be a positive float, got {scale!r}")
    if key_mask is not None:
        _tensor("key_mask", key_mask, 2, floating=False)
        if key_mask.shape != (B, L):
            raise ValueError(f"mla_attention: key_mask must be [B={B}, L={L}], got {tuple(key_mask.shape)}")
        tensors.append(key_mask)
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"mla_attention: with cu_seqlens the sequences are packed along T of one row (B=1), "
                             f"got B={B}")
        if q_start is not None or key_mask is not None:
            raise ValueError("mla_attention: cu_seqlens aligns each sequence to the end of its keys; q_start and "
                             "key_mask are for dense batches")
        cq = _cu("cu_seqlens", cu_seqlens, T)
        ck = cq if cu_seqlens_k is None else _cu("cu_seqlens_k", cu_seqlens_k, L)
        if cu_seqlens_k is None and L != T:
            raise ValueError(f"mla_attention: without cu_seqlens_k the keys are the queries' own (L == T), got "
                             f"L={L}, T={T}")
        if ck.numel() != cq.numel():
            raise ValueError(f"mla_attention: cu_seqlens_k must have {cq.numel()} entries like cu_seqlens, got "
                             f"{ck.numel()}")
        tensors.append(cu_seqlens)
    elif cu_seqlens_k is not None:
        raise ValueError("mla_attention: cu_seqlens_k needs cu_seqlens")
    elif isinstance(q_start, torch.Tensor):
        if q_start.dtype not in (torch.int32, torch.int64) or q_start.shape != (B,):
            raise ValueError(f"mla_attention: a q_start tensor must be int [B={B}] (per row), got "
                             f"{q_start.dtype} {tuple(q_start.shape)}")
        tensors.append(q_start)
    elif q_start is not None and (not isinstance(q_start, int) or isinstance(q_start, bool)):
        raise TypeError(f"mla_attention: q_start must be an int or an int [B] tensor (key index of the first "
                        f"query), got {q_start!r}")
    devs = {t.device for t in tensors}
    if len(devs) != 1:
        raise ValueError(f"mla_attention: all tensors must be on one device, got {sorted(map(str, devs))}")


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention with an explicit mask: q [B, T, H, dq], k [B, L, H, dq], v [B, L, H, dv], keep bool
    [B, T, L] (None: all visible) → (o [B, T, H, dv] fp32, lse [B, T, H] fp32); a query with no visible key gets
    o = 0, lse = −inf. (Test helper for the LSE merge.)"""
    s = torch.einsum("bthd,blhd->bhtl", q.float(), k.float()) * scale
    if keep is not None:
        s = s.masked_fill(~keep[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.einsum("bhtl,blhd->bthd", p, v.float()), lse.transpose(1, 2)


def mla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                kv_pool: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                context_lens: torch.Tensor | None = None, w_uk: torch.Tensor | None = None,
                w_uv: torch.Tensor | None = None, chunk_size: int = 4096, return_lse: bool = False):
    """Causal MLA prefill of ``T`` new tokens per request, optionally after context in the paged latent cache.

    The new tokens attend causally among themselves (``ops.mla_attention``); a request's cached context
    (``context_lens[b]`` latent rows in the pool) is visible to every new token: it is gathered ``chunk_size``
    tokens at a time, up-projected with ``W_UK`` / ``W_UV`` for that chunk only, attended and merged by the exact
    LSE merge, so the workspace is one chunk's decompressed K/V whatever the context length.

    Args:
        q: [B, T, H, dn + dr] queries of the new tokens (rope already applied, or NoPE).
        k: [B, T, H, dn + dr] decompressed keys of the new tokens; v: [B, T, H, dv].
        scale: softmax scale, (dn + dr)^-0.5 for Kimi.
        kv_pool, block_table, context_lens: the paged latent cache ``[num_blocks, bs, r + dr]``, int
            ``[B, max_blocks]`` and int ``[B]``: request b's first ``context_lens[b]`` rows precede the new tokens.
        w_uk: [H, dn, r], w_uv: [H, dv, r] (``MultiHeadLatentAttention.w_uk_uv()``) to decompress the context.
        chunk_size: context tokens decompressed at a time.
    Returns:
        o [B, T, H, dv] in v's dtype (and lse [B, T, H] fp32 with ``return_lse``).
    """
    from ..registry import dispatch

    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"mla_prefill: q and k must both be [B, T, H, dq]; got {tuple(q.shape)}, {tuple(k.shape)}")
    B, T, H, dq = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"mla_prefill: v must be [B={B}, T={T}, H={H}, dv], got {tuple(v.shape)}")
    dv = v.shape[-1]
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"mla_prefill: chunk_size must be an int >= 1, got {chunk_size!r}")

    def attend(qn, qr, kn, kr, vv, q_start, keep=None):
        return dispatch("mla_attention", qn, qr, kn, kr, vv, scale, q_start=q_start, key_mask=keep, return_lse=True)

    o, lse = attend(q, None, k, None, v, 0)
    if kv_pool is not None:
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
        q_nope, q_rope = q[..., :dn], q[..., dn:]
        for c0 in range(0, max_ctx, chunk_size):
            n = min(chunk_size, max_ctx - c0)
            rows = gather_latents(kv_pool, block_table, n, start=c0)  # [B, n, r + dr]
            c, kr = rows[..., :r], rows[..., r:]
            kn = torch.einsum("blr,hdr->blhd", c, w_uk.to(c.dtype))
            vc = torch.einsum("blr,hvr->blhv", c, w_uv.to(c.dtype))
            vis = (c0 + torch.arange(n, device=q.device))[None, :] < ctx[:, None]  # [B, n]
            # every context key precedes every new token: a q_start past the chunk leaves only the key mask
            oc, lc = attend(q_nope.to(c.dtype), q_rope.to(c.dtype) if dq > dn else None, kn.contiguous(),
                            kr.contiguous() if dq > dn else None, vc.contiguous(), n + T, vis)
            o, lse = merge_attn_states(torch.stack([o.float(), oc.float()]), torch.stack([lse, lc]))
    o = o.to(v.dtype)
    return (o, lse.float()) if return_lse else o
