"""Bidirectional attention over images packed along one token axis (varlen: no padding to the longest image).

The patches of all images of a batch lie end to end, ``[L, H, D]`` with ``L = Σ_n t_n·h_n·w_n``; ``cu_seqlens``
[N + 1] (int32, fla / flash-attn convention) bounds each image, or each video clip: a clip's frames attend to each
other. Within segment n = [c_n, c_{n+1})::

    O[i] = Σ_{j ∈ n} softmax_j(q_i · k_j · scale) v_j        (scale = D^-1/2)

Implementations of the same function, chosen by ``backend``:

* ``"eager"``: the reference above, one explicit fp32 softmax per segment;
* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``, one call per distinct segment length over the
  segments of that length stacked (dense per image; flash / memory-efficient kernels on CUDA; still no padding);
* ``"flash"``: one launch of the varlen flash-attention kernel over the whole packed batch
  (``torch.ops.aten._flash_attention_forward`` with ``cu_seqlens``, the kernel behind
  ``torch.nn.attention.varlen.varlen_attn``; its positional signature is the same in torch 2.1 … 2.13). CUDA only,
  fp16 / bf16, head width a multiple of 8 up to 256, equal q / v widths, compute capability ≥ 8.0;
* ``"auto"`` (the tower's default): ``"flash"`` where it runs (:func:`flash_unsupported`), else ``"sdpa"``.

``cu_seqlens`` may be a :class:`Segments` (the tower builds one per forward from ``grid_thw``): the bounds are then
validated once, not read back from the device in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["cu_seqlens_from_grid", "check_cu_seqlens", "varlen_attention", "flash_unsupported", "Segments",
           "BACKENDS"]

BACKENDS = ("auto", "eager", "sdpa", "flash")


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
    _check_bounds(c, total)
    return c


def _check_bounds(c: list[int], total: int) -> None:
    if not c or c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"cu_seqlens must start at 0, not decrease and end at the token count {total}; got {c}")


@dataclass(frozen=True)
class Segments:
    """The packed segments of one batch, known on the host and on the device: ``bounds`` (Python ints, validated),
    ``cu_seqlens`` (int32 [N + 1] on the attention's device) and the longest segment ``max_len``."""

    bounds: tuple[int, ...]
    cu_seqlens: torch.Tensor
    max_len: int
    _by_length: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_bounds(cls, bounds, device: torch.device | str | None = None) -> "Segments":
        """Segments from cumulative bounds ``[0, n_0, n_0 + n_1, ..., total]`` (validated; a ValueError
        otherwise), with ``cu_seqlens`` copied to ``device``."""
        b = [int(x) for x in bounds]
        _check_bounds(b, b[-1] if b else -1)
        cu = torch.tensor(b, dtype=torch.int32).to(device or "cpu", non_blocking=True)
        return cls(tuple(b), cu, max((y - x for x, y in zip(b, b[1:])), default=0))

    @classmethod
    def from_grid(cls, grid_thw: torch.Tensor, device: torch.device | str | None = None) -> "Segments":
        """One segment of t·h·w patches per row of grid_thw [N, 3] (read on the host once)."""
        return cls.from_bounds(cu_seqlens_from_grid(grid_thw.cpu()).tolist(), device)

    @property
    def total(self) -> int:
        """Tokens over all segments."""
        return self.bounds[-1]

    def by_length(self, device: torch.device) -> list[tuple[int, int, torch.Tensor | None]]:
        """The non-empty segments grouped by length, for attention that runs one call per length: (length n, count
        S, the rows of those segments [S·n] on ``device``, or None when every segment has length n: no gather).
        Built once per Segments (one host→device copy), not in every layer."""
        key = str(device)
        if key not in self._by_length:
            starts: dict[int, list[int]] = {}
            for a, e in zip(self.bounds, self.bounds[1:]):
                if e > a:
                    starts.setdefault(e - a, []).append(a)
            if len(starts) == 1:
                (n, s), = starts.items()
                groups = [(n, len(s), None)]
            else:
                rows = [(torch.tensor(s)[:, None] + torch.arange(n)).reshape(-1) for n, s in starts.items()]
                flat = torch.cat(rows).to(device, non_blocking=True) if rows else torch.zeros(0, dtype=torch.long)
                groups = [(n, len(s), r) for (n, s), r in zip(starts.items(), flat.split([r.numel() for r in rows]))]
            self._by_length[key] = groups
        return self._by_length[key]


def flash_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the ``"flash"`` backend runs these inputs, else why not (for the error and for ``"auto"``)."""
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return f"this torch ({torch.__version__}) has no aten._flash_attention_forward"
    if q.device.type != "cuda" or torch.version.cuda is None:
        return f"the inputs are on {q.device.type}, the flash kernel needs an NVIDIA GPU"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"the flash kernel takes fp16 / bf16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    D = q.shape[-1]
    if D % 8 or D > 256 or v.shape[-1] != D:
        return f"the flash kernel needs q/k and v widths equal, a multiple of 8 and ≤ 256, got {D} and {v.shape[-1]}"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "the flash kernel needs compute capability ≥ 8.0"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "the flash kernel needs the last dim of q, k, v contiguous"
    return None


def _eager(q, k, v, seg: Segments, scale):
    out = torch.empty_like(v)
    b = seg.bounds
    for a, e in zip(b, b[1:]):
        if e == a:
            continue
        s = torch.einsum("ihd,jhd->hij", q[a:e].float(), k[a:e].float()) * scale
        p = s.softmax(-1)
        out[a:e] = torch.einsum("hij,jhd->ihd", p, v[a:e].float()).to(v.dtype)
    return out


def _sdpa(q, k, v, seg: Segments, scale):
    groups = seg.by_length(q.device)
    if len(groups) == 1 and groups[0][2] is None:  # every image the same length: the packed tensors are [S, n, H, D]
        (n, S, _), = groups
        qs, ks, vs = (t.unflatten(0, (S, n)).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [S, H, n, Dv]
        return o.transpose(1, 2).reshape(v.shape)
    out = torch.empty_like(v)
    for n, S, idx in groups:
        qs, ks, vs = (t.index_select(0, idx).unflatten(0, (S, n)).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [S, H, n, D]
        out.index_copy_(0, idx, o.transpose(1, 2).reshape(-1, *v.shape[1:]))
    return out


def _flash_op():
    return torch.ops.aten._flash_attention_forward


def _flash(q, k, v, seg: Segments, scale):
    if seg.max_len == 0:
        return torch.zeros_like(v)
    cu = seg.cu_seqlens
    if cu.device != q.device or cu.dtype != torch.int32:
        cu = cu.to(q.device, torch.int32)
    # (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale)
    # → (output, logsumexp, ...): the same keys bound the queries, nothing causal, no dropout
    q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))  # dense rows: the kernel's layout
    out = _flash_op()(q, k, v, cu, cu, seg.max_len, seg.max_len, 0.0, False, False, scale=scale)
    return out[0]


_IMPL = {"eager": _eager, "sdpa": _sdpa, "flash": _flash}


def resolve_backend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The implementation ``backend`` names for these inputs (``"auto"`` → ``"flash"`` or ``"sdpa"``)."""
    if backend not in BACKENDS:
        raise ValueError(f"varlen_attention: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "sdpa" if flash_unsupported(q, k, v) else "flash"
    if backend == "flash":
        why = flash_unsupported(q, k, v)
        if why:
            raise ValueError(f"varlen_attention: backend 'flash' cannot run here: {why} (backend='auto' falls back "
                             f"to 'sdpa')")
    return backend


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | Segments,
                     scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """q, k [L, H, D], v [L, H, Dv], cu_seqlens [N + 1] int (or a :class:`Segments`) → [L, H, Dv], bidirectional
    within each segment."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"varlen_attention: q, k must be [L, H, D] and v [L, H, Dv]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    name = resolve_backend(backend, q, k, v)
    if isinstance(cu_seqlens, Segments):
        seg = cu_seqlens
        if seg.total != q.shape[0]:
            raise ValueError(f"cu_seqlens must end at the token count {q.shape[0]}; got {list(seg.bounds)}")
    else:
        bounds = check_cu_seqlens(cu_seqlens, q.shape[0])
        seg = Segments(tuple(bounds), cu_seqlens, max((b - a for a, b in zip(bounds, bounds[1:])), default=0))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _IMPL[name](q, k, v, seg, scale)
