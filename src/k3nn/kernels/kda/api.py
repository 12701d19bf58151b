"""Argument checking shared by every KDA backend (one place, so all backends reject the same inputs)."""

from __future__ import annotations

from typing import Sequence

import torch

Checkpoints = list[tuple[int, int]]  # (sequence index, position) pairs, position = tokens consumed

__all__ = ["check_kda_inputs", "normalise_checkpoints", "seq_lengths"]


def seq_lengths(T: int, B: int, cu_seqlens: torch.Tensor | None) -> list[int]:
    if cu_seqlens is None:
        return [T] * B
    cs = cu_seqlens.tolist()
    return [cs[i + 1] - cs[i] for i in range(len(cs) - 1)]


def normalise_checkpoints(checkpoint_positions, lengths: Sequence[int]) -> Checkpoints:
    """``checkpoint_positions``: per sequence, a list of positions p (0 <= p <= len) at which to export the
    state after the first p tokens. Accepts a list of lists (one per sequence), or a flat list / 1-D tensor
    when there is one sequence. Returns flat (sequence, position) pairs in the order given."""
    if checkpoint_positions is None:
        return []
    cp = checkpoint_positions
    if isinstance(cp, torch.Tensor):
        cp = cp.tolist()
    cp = list(cp)
    if cp and not isinstance(cp[0], (list, tuple)) and not isinstance(cp[0], torch.Tensor):
        if len(lengths) != 1:
            raise ValueError("checkpoint_positions: give one list of positions per sequence "
                             f"({len(lengths)} sequences), not a flat list")
        cp = [cp]
    if len(cp) != len(lengths):
        raise ValueError(f"checkpoint_positions: expected {len(lengths)} lists (one per sequence), got {len(cp)}")
    out: Checkpoints = []
    for n, (ps, L) in enumerate(zip(cp, lengths)):
        ps = ps.tolist() if isinstance(ps, torch.Tensor) else list(ps)
        for p in ps:
            p = int(p)
            if not 0 <= p <= L:
                raise ValueError(f"checkpoint_positions: position {p} is outside sequence {n} of length {L}")
            out.append((n, p))
    return out


def check_kda_inputs(q, k, v, g, beta, initial_state=None, cu_seqlens=None, state_name="initial_state"):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must match q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must be [B, T, H, K] = {tuple(q.shape)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    if K > 256:
        raise ValueError(f"KDA head dim K must be <= 256, got {K}")
    devs = {t.device for t in (q, k, v, g, beta)}
    if len(devs) != 1:
        raise ValueError(f"q, k, v, g, beta must be on one device, got {sorted(map(str, devs))}")
    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError("cu_seqlens must be an int32/int64 tensor")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (packed sequences), got B={B}")
        cs = cu_seqlens.tolist()
        if cs[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {cs[0]}")
        if any(b < a for a, b in zip(cs, cs[1:])):
            raise ValueError("cu_seqlens must be non-decreasing")
        if cs[-1] != T:
            raise ValueError(f"cu_seqlens must end at T={T}, got {cs[-1]}")
        N = len(cs) - 1
    V = v.shape[-1]
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"{state_name} must be a tensor")
        if initial_state.shape != (N, H, K, V):
            raise ValueError(f"{state_name} must be [N, H, K, V] = {(N, H, K, V)}, got {tuple(initial_state.shape)}")
        if initial_state.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{state_name} must be float32 (or float64 for checks), got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"{state_name} is on {initial_state.device}, inputs on {q.device}")
    return B, T, H, K, V, N
