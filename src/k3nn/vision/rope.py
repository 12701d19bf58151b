"""2D rotary position embedding of MoonViT (Kimi K2.5 / K3 vision towers).

A head of width D is D/2 interleaved pairs ``(x_{2j}, x_{2j+1})``; pair j is rotated by the angle

    θ_j = col · f_{j/2}        (j even: the patch's column)
    θ_j = row · f_{(j-1)/2}    (j odd:  the patch's row)          f_i = theta^(-4i/D),  i < D/4

so the columns and rows of the patch grid share one frequency ladder. Frames of a clip share the 2D angles (time is
an additive embedding instead). This is Moonshot's complex form (``view_as_complex`` on the pairs); transformers'
``Kimi_K25VisionRotaryEmbedding`` is the same rotation after its checkpoint converter has permuted each head's
q/k rows from pairs to halves (:mod:`k3nn.checkpoint.formats.multimodal` applies that permutation).

``apply_rope_2d`` is the reference (the rotation written out on the two halves of each pair); the tower rotates with
``rotate_pairs``: the same rotation as one complex product per pair, ``(x_{2j} + i·x_{2j+1})·e^{iθ_j}``, with
``e^{iθ}`` computed once per forward (``rope_2d_cis``) and q and k rotated in one call.
"""

from __future__ import annotations

import torch

__all__ = ["rope_2d_angles", "apply_rope_2d", "rope_2d_cis", "rotate_pairs"]


def rope_2d_angles(grid_thw: torch.Tensor, head_dim: int, theta: float = 10000.0,
                   device: torch.device | None = None) -> torch.Tensor:
    """grid_thw [N, 3] (t, h, w per image or clip) → angles [Σ t·h·w, head_dim / 2] fp32, patches in raster order
    (row-major within a frame, frames one after another)."""
    if head_dim % 4:
        raise ValueError(f"rope_2d_angles: head_dim must be divisible by 4, got {head_dim}")
    device = device or grid_thw.device
    f = theta ** (-torch.arange(0, head_dim, 4, device=device, dtype=torch.float32)[: head_dim // 4] / head_dim)
    out, per_grid = [], {}
    for t, h, w in grid_thw.tolist():
        a = per_grid.get((h, w))
        if a is None:
            rows = torch.arange(h, device=device, dtype=torch.float32)[:, None, None].expand(h, w, 1)
            cols = torch.arange(w, device=device, dtype=torch.float32)[None, :, None].expand(h, w, 1)
            a = torch.stack([cols * f, rows * f], -1).reshape(h * w, head_dim // 2)  # [col, row] per frequency
            per_grid[(h, w)] = a
        out.append(a.repeat(t, 1))
    return torch.cat(out) if out else torch.zeros(0, head_dim // 2, device=device)


def apply_rope_2d(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x [L, H, D] rotated pairwise by angles [L, D/2] (fp32 math, result in x's dtype)."""
    xf = x.float().unflatten(-1, (-1, 2))  # [L, H, D/2, 2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    a, b = xf[..., 0], xf[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).to(x.dtype)


def rope_2d_cis(angles: torch.Tensor) -> torch.Tensor:
    """angles [L, D/2] → e^{i·angle} [L, 1, D/2] complex64 (broadcasts over heads)."""
    a = angles.float()
    return torch.polar(torch.ones_like(a), a)[:, None]


def rotate_pairs(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """x [..., L, H, D] (any strides) rotated pairwise by cis [L, 1, D/2] (:func:`rope_2d_cis`): fp32 math, the
    result contiguous in x's dtype (so x = qkv[:, :2].transpose(0, 1), [2, L, H, D], gives dense q and k). Equals
    ``apply_rope_2d`` on each [L, H, D]."""
    xf = x.float().contiguous()  # one pass: the cast (bf16) or the gather of a strided view (fp32)
    y = torch.view_as_real(torch.view_as_complex(xf.unflatten(-1, (-1, 2))) * cis)
    return y.flatten(-2).to(x.dtype)
