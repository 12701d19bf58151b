"""Token sort / align by expert for the fused MoE kernels (device-only: no host synchronisation).

Flattened (token, slot) pairs (flat id = token·k + slot) are stably sorted by expert; each expert's segment
is padded up to a multiple of ``block_m`` with the sentinel ``N·k``; one expert id per ``block_m`` rows
(−1 for blocks past the used length). Buffer sizes depend only on (N·k, E, block_m), so the result can be
produced inside a captured CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["MoEAlignment", "moe_align", "moe_align_triton", "max_blocks", "align_for", "one_launch_ok"]


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


def _align_kernel_src():
    import triton
    import triton.language as tl

    @triton.jit
    def _moe_align_small(ids_ptr, sorted_ptr, eid_ptr, num_rows_ptr, P, E, S, NB,
                         BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr,
                         MAX_BPE: tl.constexpr):
        """One program, no atomics, every output written by exactly one store (no ordering between threads):
        each pair's rank among the earlier pairs of its expert by comparisons (moe_align's stable order), the
        experts' counts, padded lengths and padded starts chunk by chunk over the experts (a running prefix),
        each used block's expert, -1 past the used rows, and the sorted ids gathered slot by slot."""
        offs_p = tl.arange(0, BLOCK_P)
        pm = offs_p < P
        ids = tl.load(ids_ptr + offs_p, mask=pm, other=-1).to(tl.int32)
        rank = tl.zeros([BLOCK_P], dtype=tl.int32)
        for q0 in range(0, P, CHUNK):
            offs_q = q0 + tl.arange(0, CHUNK)
            idq = tl.load(ids_ptr + offs_q, mask=offs_q < P, other=-2).to(tl.int32)
            hit = (ids[:, None] == idq[None, :]) & (offs_q[None, :] < offs_p[:, None])
            rank += tl.sum(hit.to(tl.int32), 1)
        start = tl.zeros([BLOCK_P], dtype=tl.int32)
        base = tl.sum(tl.zeros([CHUNK], dtype=tl.int32), 0)
        for e0 in range(0, E, CHUNK):
            offs_e = e0 + tl.arange(0, CHUNK)
            em = offs_e < E
            cnt = tl.sum((offs_e[:, None] == ids[None, :]).to(tl.int32), 1)
            pad = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
            pstart = base + tl.cumsum(pad, 0) - pad
            start += tl.sum(tl.where(ids[:, None] == offs_e[None, :], pstart[None, :], 0), 1)
            for j in range(0, MAX_BPE):
                tl.store(eid_ptr + pstart // BLOCK_M + j, offs_e, mask=em & (j * BLOCK_M < pad))
            base += tl.sum(pad, 0)
        tl.store(num_rows_ptr, base)
        for b0 in range(0, NB, CHUNK):
            offs_b = b0 + tl.arange(0, CHUNK)
            tl.store(eid_ptr + offs_b, tl.full([CHUNK], -1, tl.int32), mask=(offs_b < NB) & (offs_b * BLOCK_M >= base))
        dest = start + rank
        for f0 in range(0, S, CHUNK):
            offs_f = f0 + tl.arange(0, CHUNK)
            match = (dest[None, :] == offs_f[:, None]) & pm[None, :]
            val = tl.sum(tl.where(match, offs_p[None, :], 0), 1)
            has = tl.max(match.to(tl.int32), 1)
            tl.store(sorted_ptr + offs_f, tl.where(has > 0, val, P), mask=offs_f < S)

    return _moe_align_small


_KERNEL = None
#: the one-program alignment handles up to this many (token, slot) pairs (decode-sized batches)
SMALL_PAIRS = 1024
#: ``align_for`` takes the one-program kernel up to this many pairs (its slot-by-slot gather grows as pairs²;
#: the torch path's ~35 small launches cost about the same there)
ONE_LAUNCH_PAIRS = 512


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """One-launch alignment for small batches (≤ ``SMALL_PAIRS`` pairs): the same result as :func:`moe_align`,
    the pairs of an expert in their flat order."""
    import triton

    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _align_kernel_src()
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    P = flat.numel()
    if P > SMALL_PAIRS:
        raise ValueError(f"moe_align_triton: {P} pairs exceed {SMALL_PAIRS}; use moe_align")
    dev = flat.device
    nb = max_blocks(P, num_experts, block_m)
    sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(nb, dtype=torch.int32, device=dev)
    num_rows = torch.empty(1, dtype=torch.int32, device=dev)
    block_p = triton.next_power_of_2(max(P, 16))
    _KERNEL[(1,)](flat, sorted_ids, expert_ids, num_rows, P, num_experts, nb * block_m, nb,
                  BLOCK_M=block_m, BLOCK_P=block_p, CHUNK=max(8, min(128, 8192 // block_p)),
                  MAX_BPE=-(-P // block_m), num_warps=4)
    return MoEAlignment(sorted_ids, expert_ids, num_rows, block_m)


_SELF_CHECK: dict[tuple[str, int | None], bool] = {}


def _same_alignment(a: MoEAlignment, b: MoEAlignment) -> bool:
    return (torch.equal(a.expert_ids, b.expert_ids) and torch.equal(a.num_rows, b.num_rows)
            and torch.equal(a.sorted_ids, b.sorted_ids))


def _one_launch_ok(dev: torch.device) -> bool:
    """The one-launch kernel is used on a device once it reproduced ``moe_align`` there (checked on the first
    call outside graph capture, like autotuning); otherwise the multi-kernel torch path is kept."""
    key = (dev.type, dev.index)
    if key not in _SELF_CHECK:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        ids = (torch.arange(60, device=dev).view(15, 4) * 5 + 3) % 7
        big = (torch.arange(256, device=dev).view(16, 16) * 37 + 11) % 131
        ok = (all(_same_alignment(moe_align(ids, 7, bm), moe_align_triton(ids, 7, bm)) for bm in (4, 16))
              and _same_alignment(moe_align(big, 131, 8), moe_align_triton(big, 131, 8)))
        if not ok:
            import logging

            logging.getLogger(__name__).warning("one-launch MoE alignment disagrees with moe_align on %s; "
                                                "keeping the torch alignment", dev)
        _SELF_CHECK[key] = ok
    return _SELF_CHECK[key]


def one_launch_ok(dev: torch.device) -> bool:
    """Whether :func:`align_for` takes the one-launch kernel on ``dev`` (its self-check passed there)."""
    return _one_launch_ok(torch.device(dev))


def align_for(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """The alignment the fused kernels use: one launch for decode-sized batches, else :func:`moe_align`."""
    if topk_ids.numel() <= ONE_LAUNCH_PAIRS and num_experts <= 8192 and _one_launch_ok(topk_ids.device):
        return moe_align_triton(topk_ids, num_experts, block_m)
    return moe_align(topk_ids, num_experts, block_m)
