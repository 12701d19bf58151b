"""Token sort / align by expert for the fused MoE kernels (device-only: no host synchronisation).

Flattened (token, slot) pairs (flat id = token·k + slot) are stably sorted by expert; each expert's segment
is padded up to a multiple of ``block_m`` with the sentinel ``N·k``; one expert id per ``block_m`` rows
(−1 for blocks past the used length). Buffer sizes depend only on (N·k, E, block_m), so the result can be
produced inside a captured CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["MoEAlignment", "moe_align", "max_blocks"]


class MoEAlignment(NamedTuple):
    sorted_ids: torch.Tensor  # int32 [B·block_m]: flat ids grouped by expert; sentinel N·k in padding
    expert_ids: torch.Tensor  # int32 [B]: expert of each block_m-row block, −1 when unused
    num_rows: torch.Tensor  # int32 [1]: rows in use (sum of padded segment lengths)
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on used blocks: each used block holds ≥ 1 pair, and ≤ one partial block per expert."""
    return max(1, min(num_pairs, -(-num_pairs // block_m) + min(num_experts, num_pairs)))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """topk_ids int [N, k] in [0, E) → :class:`MoEAlignment` (see module docstring)."""
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pend = padded.cumsum(0)
    pstart = pend - padded
    ustart = counts.cumsum(0) - counts
    order = torch.sort(flat, stable=True)[1]
    e_sorted = flat[order]
    dest = pstart[e_sorted] + torch.arange(P, device=dev) - ustart[e_sorted]
    nb = max_blocks(P, num_experts, block_m)
    sorted_ids = torch.full((nb * block_m,), P, dtype=torch.int32, device=dev)
    sorted_ids.index_copy_(0, dest, order.to(torch.int32))
    bstart = torch.arange(nb, device=dev) * block_m
    expert_ids = torch.searchsorted(pend, bstart, right=True)
    used = pend[-1:]
    expert_ids = torch.where(bstart < used, expert_ids, -1).to(torch.int32)
    return MoEAlignment(sorted_ids, expert_ids, used.to(torch.int32), block_m)
