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
``e^{iθ}`` computed once per forward (``rope_2d_cis``) and q and k rotated in one call. The patch positions come from
the host (``rope_2d_positions``, per (h, w) cached) and the angles from one product with the frequency ladder
(``rope_2d_angles_at``): no per-image work on the device.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["rope_2d_angles", "rope_2d_angles_at", "rope_2d_positions", "rope_2d_frequencies", "apply_rope_2d",
           "rope_2d_cis", "rotate_pairs"]


def rope_2d_frequencies(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """[head_dim / 4] fp32 on the CPU: f_i = theta^(-4i/head_dim) (cached: callers must not modify it)."""
    if head_dim % 4:
        raise ValueError(f"rope_2d_angles: head_dim must be divisible by 4, got {head_dim}")
    return _frequencies(int(head_dim), float(theta))


@functools.lru_cache(maxsize=16)
def _frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return theta ** (-torch.arange(0, head_dim, 4, dtype=torch.float32)[: head_dim // 4] / head_dim)


@functools.lru_cache(maxsize=64)
def _frame_positions(h: int, w: int) -> torch.Tensor:
    rows = torch.arange(h, dtype=torch.float32).repeat_interleave(w)
    cols = torch.arange(w, dtype=torch.float32).repeat(h)
    return torch.stack([cols, rows], -1)


def rope_2d_positions(grid_thw) -> torch.Tensor:
    """grid_thw [N, 3] (a CPU tensor or rows of ints) → [Σ t·h·w, 2] fp32 on the CPU: (column, row) of each patch in
    raster order (row-major within a frame, frames one after another; the frames of a clip alike)."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    parts = [p for t, h, w in rows for p in [_frame_positions(int(h), int(w))] * int(t)]
    return torch.cat(parts) if parts else torch.zeros(0, 2)


def rope_2d_angles_at(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """positions [L, 2] (column, row), freqs [D/4] → angles [L, D/2] fp32: [col·f_0, row·f_0, col·f_1, ...]."""
    return (positions[:, None, :] * freqs[:, None]).flatten(1)


def rope_2d_angles(grid_thw: torch.Tensor, head_dim: int, theta: float = 10000.0,
                   device: torch.device | None = None) -> torch.Tensor:
    """grid_thw [N, 3] (t, h, w per image or clip) → angles [Σ t·h·w, head_dim / 2] fp32, patches in raster order
    (row-major within a frame, frames one after another)."""
    freqs = rope_2d_frequencies(head_dim, theta)
    device = device or grid_thw.device
    return rope_2d_angles_at(rope_2d_positions(grid_thw.cpu()).to(device), freqs.to(device))


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
