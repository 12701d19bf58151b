"""Bidirectional attention over images packed along one token axis (varlen: no padding to the longest image).

The patches of all images of a batch lie end to end, ``[L, H, D]`` with ``L = Σ_n t_n·h_n·w_n``; ``cu_seqlens``
[N + 1] (int32, fla / flash-attn convention) bounds each image, or each video clip: a clip's frames attend to each
other. Within segment n = [c_n, c_{n+1})::

    O[i] = Σ_{j ∈ n} softmax_j(q_i · k_j · scale) v_j        (scale = D^-1/2)

Two implementations of the same function, chosen by ``backend``:

* ``"eager"``: the reference above, one explicit fp32 softmax per segment;
* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``, one call per distinct segment length over the
  segments of that length stacked (flash / memory-efficient kernels on CUDA; still no padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cu_seqlens_from_grid", "check_cu_seqlens", "varlen_attention", "BACKENDS"]

BACKENDS = ("eager", "sdpa")


def cu_seqlens_from_grid(grid_thw: torch.Tensor) -> torch.Tensor:
    """grid_thw [N, 3] → cu_seqlens [N + 1] int32: one segment of t·h·w patches per image or clip."""
    n = grid_thw.long().prod(-1)
    return F.pad(n.cumsum(0), (1, 0)).to(torch.int32)


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> list[int]:
    """Validate and return the segment bounds as Python ints (one host sync)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [num_segments + 1]")
    if cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens must hold integers, got {cu_seqlens.dtype}")
    c = cu_seqlens.tolist()
    if c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"cu_seqlens must start at 0, not decrease and end at the token count {total}; got {c}")
    return c


def _eager(q, k, v, bounds, scale):
    out = torch.empty_like(v)
    for a, b in zip(bounds, bounds[1:]):
        if b == a:
            continue
        s = torch.einsum("ihd,jhd->hij", q[a:b].float(), k[a:b].float()) * scale
        p = s.softmax(-1)
        out[a:b] = torch.einsum("hij,jhd->ihd", p, v[a:b].float()).to(v.dtype)
    return out


def _sdpa(q, k, v, bounds, scale):
    out = torch.empty_like(v)
    by_len: dict[int, list[int]] = {}
    for a, b in zip(bounds, bounds[1:]):
        if b > a:
            by_len.setdefault(b - a, []).append(a)
    for n, starts in by_len.items():
        idx = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(n, device=q.device)).reshape(-1)
        qs, ks, vs = (t.index_select(0, idx).unflatten(0, (len(starts), n)).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [S, H, n, D]
        out.index_copy_(0, idx, o.transpose(1, 2).reshape(-1, *v.shape[1:]))
    return out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float | None = None, backend: str = "sdpa") -> torch.Tensor:
    """q, k [L, H, D], v [L, H, Dv], cu_seqlens [N + 1] int → [L, H, Dv] (bidirectional within each segment)."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"varlen_attention: q, k must be [L, H, D] and v [L, H, Dv]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if backend not in BACKENDS:
        raise ValueError(f"varlen_attention: backend must be one of {BACKENDS}, got {backend!r}")
    bounds = check_cu_seqlens(cu_seqlens, q.shape[0])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return (_eager if backend == "eager" else _sdpa)(q, k, v, bounds, scale)
