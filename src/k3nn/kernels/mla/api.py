"""Argument checking and LSE merging shared by every MLA decode backend and by DCP."""

from __future__ import annotations

import torch

__all__ = ["check_mla_decode_inputs", "default_visible_lens", "merge_attn_states"]


def default_visible_lens(seq_lens: torch.Tensor, Tq: int) -> torch.Tensor:
    """Keys visible to each query of a verify window: query ``t`` of ``Tq`` sees ``seq_len - Tq + t + 1``
    keys (its own and every earlier one). int32 [B, Tq]."""
    t = torch.arange(Tq, device=seq_lens.device, dtype=torch.int32)
    return (seq_lens.to(torch.int32)[:, None] - Tq + 1 + t).clamp_min(0)


def _int_tensor(name: str, t, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")


def check_mla_decode_inputs(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=None,
                            check_values: bool = True) -> tuple[int, int, int, int, int]:
    """Validate ``mla_decode`` arguments; returns ``(B, Tq, H, r, dr)``. ``check_values`` also reads the
    index tensors (a host sync): lengths within the table, table entries inside the pool."""
    for name, t in (("q_lat", q_lat), ("q_rope", q_rope), ("kv_pool", kv_pool)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if q_lat.dim() != 4:
        raise ValueError(f"q_lat must be [B, Tq, H, kv_lora_rank], got shape {tuple(q_lat.shape)}")
    B, Tq, H, r = q_lat.shape
    if q_rope.dim() != 4 or q_rope.shape[:3] != (B, Tq, H):
        raise ValueError(f"q_rope must be [B={B}, Tq={Tq}, H={H}, rope_dim], got shape {tuple(q_rope.shape)}")
    dr = q_rope.shape[3]
    if kv_pool.dim() != 3 or kv_pool.shape[2] != r + dr:
        raise ValueError(f"kv_pool must be [num_blocks, block_size, kv_lora_rank + rope_dim = {r + dr}], got "
                         f"shape {tuple(kv_pool.shape)}")
    if q_rope.dtype != q_lat.dtype or kv_pool.dtype != q_lat.dtype:
        raise TypeError(f"q_lat, q_rope and kv_pool must share a dtype; got {q_lat.dtype}, {q_rope.dtype}, "
                        f"{kv_pool.dtype}")
    if B == 0 or Tq == 0 or H == 0 or r == 0:
        raise ValueError(f"q_lat must have non-empty B, Tq, H, kv_lora_rank; got shape {tuple(q_lat.shape)}")
    _int_tensor("block_table", block_table, 2)
    _int_tensor("seq_lens", seq_lens, 1)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table must have one row per request (B={B}), got shape {tuple(block_table.shape)}")
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens must be [B={B}], got shape {tuple(seq_lens.shape)}")
    if visible_lens is not None:
        _int_tensor("visible_lens", visible_lens, 2)
        if tuple(visible_lens.shape) != (B, Tq):
            raise ValueError(f"visible_lens must be [B={B}, Tq={Tq}], got shape {tuple(visible_lens.shape)}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive float (the model's (qk_nope + qk_rope)^-0.5), got {scale!r}")
    devs = {t.device for t in (q_lat, q_rope, kv_pool, block_table, seq_lens)}
    if visible_lens is not None:
        devs.add(visible_lens.device)
    if len(devs) != 1:
        raise ValueError(f"all mla_decode tensors must be on one device, got {sorted(map(str, devs))}")
    if check_values:
        nb, bs = kv_pool.shape[0], kv_pool.shape[1]
        cap = block_table.shape[1] * bs
        lens = seq_lens.long().cpu()
        if (lens < 0).any():
            raise ValueError(f"seq_lens must be >= 0, got {lens.tolist()}")
        if (lens > cap).any():
            raise ValueError(f"seq_lens {lens.max().item()} exceeds what block_table covers "
                             f"({block_table.shape[1]} blocks × {bs} = {cap} tokens)")
        used = torch.arange(block_table.shape[1])[None, :] < ((lens + bs - 1) // bs)[:, None]
        tab = block_table.long().cpu()[used]
        if tab.numel() and (int(tab.min()) < 0 or int(tab.max()) >= nb):
            bad = tab[(tab < 0) | (tab >= nb)][0].item()
            raise ValueError(f"block_table points at block {bad}, outside the pool of {nb} blocks")
        if visible_lens is None:
            if (lens < Tq).any():
                raise ValueError(f"seq_lens must be >= Tq={Tq} (the query tokens are in the cache), got "
                                 f"{lens.tolist()}")
        else:
            vis = visible_lens.long().cpu()
            if (vis < 0).any() or (vis > lens[:, None]).any():
                raise ValueError("visible_lens must lie in [0, seq_lens] for every query")
    return B, Tq, H, r, dr


def merge_attn_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial attention results over disjoint key sets (natural-log LSE).

    outs [S, ..., D], lses [S, ...] → (o [..., D] fp32, lse [...] fp32) with ``lse = log Σ_s exp(lse_s)`` and
    ``o = Σ_s exp(lse_s − lse) o_s``. Non-finite partial LSEs (empty shards: −inf; NaN, +inf) contribute
    nothing, and their outputs are never multiplied (so NaN garbage there cannot leak); if every part is
    empty the result is lse = −inf, o = 0.
    """
    lse = lses.float()
    ok = torch.isfinite(lse)
    lse = torch.where(ok, lse, torch.full_like(lse, float("-inf")))
    m = lse.amax(0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)  # 0 for empty parts
    tot = w.sum(0)
    out_lse = torch.where(tot > 0, m_safe + torch.log(tot), torch.full_like(m, float("-inf")))
    wn = torch.where(tot > 0, w / tot.clamp_min(1e-38), torch.zeros_like(w))
    o = torch.where(ok[..., None], outs.float(), torch.zeros((), dtype=torch.float32, device=outs.device))
    return (wn[..., None] * o).sum(0), out_lse
