"""Everything position-dependent in MoonViT, derived from ``grid_thw`` on the host once per forward.

The tower's per-image work — resampling the learned position grid to each image's h×w, the 2D rotary positions, the
segment bounds of the varlen attention, the patch-merge order — depends on the grid [N, 3] alone, never on the
features. :class:`GridLayout` builds it for the whole packed batch as index tensors on the CPU, from per-frame pieces
cached by (h, w) (bounded LRU caches), and sends them to the device in one copy; the tower then runs each of these
steps as one op over all images, whatever their sizes:

    pos_index, pos_weight [L, K] int32 / fp32   x += Σ_k pos_weight[:, k] · [P; T][pos_index[:, k]]   (embedding_bag)
                                                P = the learned grid [H0·W0, D], T = the frame table [pos_emb_time, D];
                                                K = 16 (bicubic) or 4 (bilinear) taps into P, + 1 into T if a clip
    rope_pos [L, 2] fp32                        (column, row) of each patch (:func:`k3nn.vision.rope.rope_2d_positions`)
    rope_freqs [head_dim / 4] fp32              the rotary frequency ladder
    merge_index [F, M] int32                    merged row m's source patch in frame slot f (F: the longest clip;
                                                slots past a clip's frames point at row L, a zero row)
    merge_frames [M] fp32 or None               frames averaged into row m (None: no clip; the merge is one gather)
    segments                                    :class:`~k3nn.vision.attention.Segments`: cu_seqlens [N + 1] int32
                                                on the device, the bounds on the host

The taps reproduce ``F.interpolate(mode, align_corners=False)`` (PyTorch's ``aten/native/UpSample.h``: source index
``(dst + ½)·in/out − ½``, Keys' cubic with A = −0.75 and clamped edges, or linear with the source clamped at 0); the
resampled grid is ``LearnedPosEmb.grid`` up to fp32 rounding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .attention import Segments
from .config import VisionConfig
from .rope import rope_2d_frequencies, rope_2d_positions

__all__ = ["GridLayout", "interpolation_taps", "position_taps", "merge_index", "grid_rows"]

_CUBIC_A = -0.75


def grid_rows(grid_thw) -> list[tuple[int, int, int]]:
    """grid_thw [N, 3] (a CPU tensor, or rows of ints) → [(t, h, w), ...] as Python ints."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


@functools.lru_cache(maxsize=256)
def interpolation_taps(src: int, dst: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One axis of ``F.interpolate(size=dst, mode=mode, align_corners=False)`` from ``src`` samples: (index [dst, n]
    int64, weight [dst, n] fp32), n = 4 (``"bicubic"``) or 2 (``"bilinear"``); output i = Σ_j weight[i, j] ·
    input[index[i, j]]. fp32 math as PyTorch's kernels do it (cached: callers must not modify the results)."""
    scale = torch.tensor(src, dtype=torch.float32) / dst
    real = scale * (torch.arange(dst, dtype=torch.float32) + 0.5) - 0.5
    if mode == "bicubic":
        base = real.floor()
        t = (real - base)[:, None]
        x = torch.cat([t + 1, t, 1 - t, (1 - t) + 1], 1)  # distances to taps base-1 .. base+2, rounded as PyTorch's
        near = ((_CUBIC_A + 2) * x - (_CUBIC_A + 3)) * x * x + 1
        far = ((_CUBIC_A * x - 5 * _CUBIC_A) * x + 8 * _CUBIC_A) * x - 4 * _CUBIC_A
        weight = torch.cat([far[:, :1], near[:, 1:3], far[:, 3:]], 1)
        index = (base.long()[:, None] + torch.arange(-1, 3)).clamp(0, src - 1)
    elif mode == "bilinear":
        real = real.clamp_min(0)  # src == dst: real = i exactly, weights (1, 0) as PyTorch's identity case
        i0 = real.long()  # real ≥ 0: truncation is floor
        lam = (real - i0).clamp(0, 1)
        index = torch.stack([i0, i0 + (i0 < src - 1).long()], 1)
        weight = torch.stack([1 - lam, lam], 1)
    else:
        raise ValueError(f"interpolation_taps: mode must be 'bicubic' or 'bilinear', got {mode!r}")
    return index, weight


@functools.lru_cache(maxsize=32)
def _frame_taps(h: int, w: int, H0: int, W0: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """([h·w, n²] int32 indices into the flattened [H0·W0] grid, [h·w, n²] fp32 weights), raster order."""
    iy, wy = interpolation_taps(H0, h, mode)
    ix, wx = interpolation_taps(W0, w, mode)
    n = iy.shape[1]
    index = (iy[:, None, :, None] * W0 + ix[None, :, None, :]).reshape(h * w, n * n)
    weight = (wy[:, None, :, None] * wx[None, :, None, :]).reshape(h * w, n * n)
    return index.to(torch.int32), weight


def _per_entry(rows, values, dtype=torch.int32) -> torch.Tensor:
    """One value per grid entry, repeated over the entry's t·h·w patches."""
    return torch.tensor(values, dtype=dtype).repeat_interleave(torch.tensor([t * h * w for t, h, w in rows]))


def position_taps(grid_thw, pos_grid: tuple[int, int], mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The learned-position taps of every patch: (index [L, K] int32, weight [L, K] fp32) into the table
    [H0·W0 + pos_emb_time, D] (the learned grid flattened, then the frame table). K = n², plus one column for the
    frame table when a clip (t > 1) is present: frame f of a clip → row H0·W0 + f, weight 1; an image → weight 0."""
    rows = grid_rows(grid_thw)
    H0, W0 = pos_grid
    index, weight = [], []
    for t, h, w in rows:
        i, wt = _frame_taps(h, w, H0, W0, mode)
        index += [i] * t  # a clip's frames share the spatial taps
        weight += [wt] * t
    index, weight = torch.cat(index), torch.cat(weight)
    if any(t > 1 for t, _, _ in rows):
        frame = torch.cat([_frame_numbers(t, h * w) for t, h, w in rows]) + H0 * W0
        index = torch.cat([index, frame[:, None]], 1)
        weight = torch.cat([weight, _per_entry(rows, [float(t > 1) for t, _, _ in rows], torch.float32)[:, None]], 1)
    return index, weight


@functools.lru_cache(maxsize=64)
def _frame_numbers(t: int, hw: int) -> torch.Tensor:
    return torch.arange(t, dtype=torch.int32).repeat_interleave(hw)


@functools.lru_cache(maxsize=64)
def _merge_order(h: int, w: int, kh: int, kw: int) -> torch.Tensor:
    """[h·w] int32: the raster index of each patch of one frame in merged order (kh×kw blocks, raster inside)."""
    return torch.arange(h * w, dtype=torch.int32).view(h // kh, kh, w // kw, kw).permute(0, 2, 1, 3).reshape(-1)


def merge_index(grid_thw, merge_kernel_size) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(index [F, M] int32, frames [M] fp32 or None) for :func:`merge_patches`: M = Σ h·w rows (kh·kw per merged
    token), F = the most frames of any entry; index[f, m] = the packed patch that lands in row m from frame f, or L
    (a zero row) past the entry's frames. frames is None when every entry is an image (F = 1)."""
    rows = grid_rows(grid_thw)
    kh, kw = merge_kernel_size
    if not rows:
        return torch.zeros(1, 0, dtype=torch.int32), None
    order = torch.cat([_merge_order(h, w, kh, kw) for _, h, w in rows])  # within a frame, merged order
    starts, a = [], 0
    for t, h, w in rows:
        starts.append(a)
        a += t * h * w
    per_row = lambda v: torch.tensor(v, dtype=torch.int32).repeat_interleave(hw)  # noqa: E731
    hw = torch.tensor([h * w for _, h, w in rows])
    first = order + per_row(starts)  # the row's patch in the entry's first frame
    F = max(t for t, _, _ in rows)
    if F == 1:
        return first[None], None
    t_row = per_row([t for t, _, _ in rows])
    f = torch.arange(F, dtype=torch.int32)[:, None]
    index = torch.where(f < t_row, first + f * per_row([h * w for _, h, w in rows]), a)
    return index, t_row.float()


def merge_patches(x: torch.Tensor, index: torch.Tensor, frames: torch.Tensor | None, merge_size: int) -> torch.Tensor:
    """x [L, D] → [M / merge_size, merge_size, D] by :func:`merge_index`'s (index, frames): one gather for images;
    with clips, the frames gathered into [F, M, D] (fp32, zero past a clip's end), summed and divided by the frame
    count (a clip's mean in fp32), in x's dtype."""
    D = x.shape[-1]
    if frames is None:
        return x.index_select(0, index[0]).view(-1, merge_size, D)
    xf = torch.cat([x.float(), x.new_zeros(1, D, dtype=torch.float32)])
    g = xf.index_select(0, index.flatten()).view(*index.shape, D)
    return (g.sum(0) / frames[:, None]).to(x.dtype).view(-1, merge_size, D)


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The CPU tensors on ``device`` in one host→device copy: packed as bytes (8-byte aligned), copied from pinned
    memory without blocking the host, and viewed back as each tensor's dtype and shape."""
    if device.type == "cpu":
        return tensors
    parts, spans, offset = [], [], 0
    for t in tensors:
        b = t.contiguous().view(-1).view(torch.uint8)
        spans.append((offset, b.numel()))
        pad = -b.numel() % 8
        parts += [b, torch.zeros(pad, dtype=torch.uint8)] if pad else [b]
        offset += b.numel() + pad
    buf = torch.cat(parts)
    if device.type == "cuda":
        buf = buf.pin_memory()
    buf = buf.to(device, non_blocking=True)
    return [buf[o:o + n].view(t.dtype).view(t.shape) for (o, n), t in zip(spans, tensors)]


@dataclass(frozen=True)
class GridLayout:
    """The index tensors of one packed batch (see the module docstring), on the tower's device."""

    grid: tuple[tuple[int, int, int], ...]
    segments: Segments
    pos_index: torch.Tensor
    pos_weight: torch.Tensor
    rope_pos: torch.Tensor
    rope_freqs: torch.Tensor
    merge_index: torch.Tensor
    merge_frames: torch.Tensor | None
    merge_size: int

    @property
    def has_clips(self) -> bool:
        """The batch has a video clip (t > 1): frames are averaged when merging, and get a temporal embedding."""
        return self.merge_frames is not None

    @classmethod
    def build(cls, grid_thw, cfg: VisionConfig, device: torch.device | str = "cpu") -> "GridLayout":
        """grid_thw [N, 3] (a CPU tensor: its one host read is the caller's) → the layout on ``device``."""
        rows = grid_rows(grid_thw)
        if not rows:
            raise ValueError("GridLayout: grid_thw is empty (no images)")
        device = torch.device(device)
        pos_index, pos_weight = position_taps(rows, (cfg.pos_emb_height, cfg.pos_emb_width),
                                              cfg.pos_emb_interpolation)
        index, frames = merge_index(rows, cfg.merge_kernel_size)
        bounds = [0]
        for t, h, w in rows:
            bounds.append(bounds[-1] + t * h * w)
        host = [pos_index, pos_weight, rope_2d_positions(rows), rope_2d_frequencies(cfg.head_dim, cfg.rope_theta),
                index, torch.tensor(bounds, dtype=torch.int32)] + ([frames] if frames is not None else [])
        pos_index, pos_weight, rope_pos, rope_freqs, index, cu, *rest = _to_device(host, device)
        segments = Segments(tuple(bounds), cu, max(b - a for a, b in zip(bounds, bounds[1:])))
        return cls(tuple(rows), segments, pos_index, pos_weight, rope_pos, rope_freqs, index, rest[0] if rest else None,
                   cfg.merge_size)
