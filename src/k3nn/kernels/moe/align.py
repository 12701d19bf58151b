"""Token sort / align by expert for the fused MoE kernels (device-only: no host synchronisation).

Flattened (token, slot) pairs (flat id = token·k + slot) are stably sorted by expert; each expert's segment
is padded up to a multiple of ``block_m`` with the sentinel ``N·k``; one expert id per ``block_m`` rows
(−1 for blocks past the used length). Buffer sizes depend only on (N·k, E, block_m), so the result can be
produced inside a captured CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["MoEAlignment", "moe_align", "moe_align_triton", "moe_align_chunked", "max_blocks", "align_for",
           "one_launch_ok", "chunked_ok"]


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

    from ..pdl import gdc_wait

    @triton.jit(do_not_specialize=["P", "S", "NB"])  # per-request counts: one compile for all
    def _moe_align_small(ids_ptr, sorted_ptr, eid_ptr, num_rows_ptr, P, E, S, NB,
                         BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr,
                         MAX_BPE: tl.constexpr, PDL: tl.constexpr = False):
        """One program, no atomics, every output written by exactly one store (no ordering between threads):
        each pair's rank among the earlier pairs of its expert by comparisons (moe_align's stable order), the
        experts' counts, padded lengths and padded starts chunk by chunk over the experts (a running prefix),
        each used block's expert, -1 past the used rows, and the sorted ids gathered slot by slot."""
        if PDL:  # launched as a programmatic dependent (kernels/pdl.py): the ids are read after this
            gdc_wait()
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

    from ..pdl import pdl_launch

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
    # constants from the power-of-two bucket of P only (MAX_BPE bounds a loop whose stores are masked): a handful
    # of compiles cover every decode and mixed step
    block_p = triton.next_power_of_2(max(P, 16))
    _KERNEL[(1,)](flat, sorted_ids, expert_ids, num_rows, P, num_experts, nb * block_m, nb,
                  BLOCK_M=block_m, BLOCK_P=block_p, CHUNK=max(8, min(128, 8192 // block_p)),
                  MAX_BPE=-(-block_p // block_m), num_warps=4, **pdl_launch(flat))
    return MoEAlignment(sorted_ids, expert_ids, num_rows, block_m)


def _chunked_kernels_src():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["P"])
    def _align_count(ids_ptr, cnt_ptr, P, E, C: tl.constexpr, SUB: tl.constexpr, CH: tl.constexpr):
        """Program c: how many of pairs [c·C, (c+1)·C) each expert got → cnt[c, :] (comparisons, no atomics)."""
        c = tl.program_id(0)
        for e0 in range(0, E, CH):
            offs_e = e0 + tl.arange(0, CH)
            n = tl.zeros([CH], dtype=tl.int32)
            for p0 in tl.static_range(0, C, SUB):
                offs_p = c * C + p0 + tl.arange(0, SUB)
                ids = tl.load(ids_ptr + offs_p, mask=offs_p < P, other=-1).to(tl.int32)
                n += tl.sum((offs_e[:, None] == ids[None, :]).to(tl.int32), 1)
            tl.store(cnt_ptr + c * E + offs_e, n, mask=offs_e < E)

    @triton.jit(do_not_specialize=["P", "S", "NC"])
    def _align_offsets(cnt_ptr, off_ptr, pend_ptr, sorted_ptr, num_rows_ptr, P, E, S, NC,
                       BLOCK_M: tl.constexpr, BLOCK_NC: tl.constexpr, CH: tl.constexpr, FILL: tl.constexpr):
        """One program: per expert (CH at a time) the total over the chunks, padded length and padded end (a
        running prefix over the experts), and per (chunk, expert) the first destination row (an exclusive cumsum
        over the chunks, BLOCK_NC chunks a tile, carried across tiles); the used rows, and the sentinel in every
        slot (the scatter launch writes the pairs and the blocks' experts afterwards). Tiles of fixed size: one
        compile for every number of chunks."""
        base = tl.sum(tl.zeros([CH], dtype=tl.int32), 0)
        for e0 in range(0, E, CH):
            offs_e = e0 + tl.arange(0, CH)
            em = offs_e < E
            tot = tl.zeros([CH], dtype=tl.int32)
            for c0 in range(0, NC, BLOCK_NC):
                offs_c = c0 + tl.arange(0, BLOCK_NC)
                m2 = (offs_c < NC)[:, None] & em[None, :]
                tot += tl.sum(tl.load(cnt_ptr + offs_c[:, None] * E + offs_e[None, :], mask=m2, other=0), 0)
            pad = (tot + BLOCK_M - 1) // BLOCK_M * BLOCK_M
            pend = base + tl.cumsum(pad, 0)
            tl.store(pend_ptr + offs_e, pend, mask=em)
            run = pend - pad
            for c0 in range(0, NC, BLOCK_NC):
                offs_c = c0 + tl.arange(0, BLOCK_NC)
                m2 = (offs_c < NC)[:, None] & em[None, :]
                tile = tl.load(cnt_ptr + offs_c[:, None] * E + offs_e[None, :], mask=m2, other=0)
                tl.store(off_ptr + offs_c[:, None] * E + offs_e[None, :], run[None, :] + tl.cumsum(tile, 0) - tile,
                         mask=m2)
                run += tl.sum(tile, 0)
            base += tl.sum(pad, 0)
        tl.store(num_rows_ptr, base)
        for f0 in range(0, S, FILL):
            offs_f = f0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + offs_f, tl.full([FILL], 0, tl.int32) + P, mask=offs_f < S)

    @triton.jit(do_not_specialize=["P", "NB", "BPC"])
    def _align_scatter(ids_ptr, off_ptr, pend_ptr, num_rows_ptr, sorted_ptr, eid_ptr, P, E, NB, BPC,
                       C: tl.constexpr, SC: tl.constexpr, CH: tl.constexpr, BLOCK_B: tl.constexpr,
                       CHE: tl.constexpr, BLOCK_M: tl.constexpr):
        """Program (c, s): pairs [c·C + s·SC, +SC) of chunk c go to their (chunk, expert) offset + their rank among
        the chunk's earlier pairs of that expert (moe_align's stable order: only the chunk's first (s+1)·SC pairs
        can be earlier); the chunk's blocks [c·BPC, (c+1)·BPC), tiles strided over its C / SC programs, get their
        expert (the number of experts whose padded segment ends at or before the block), -1 past the used rows."""
        c = tl.program_id(0)
        s = tl.program_id(1)
        offs_p = c * C + s * SC + tl.arange(0, SC)
        pm = offs_p < P
        ids = tl.load(ids_ptr + offs_p, mask=pm, other=-1).to(tl.int32)
        rank = tl.zeros([SC], dtype=tl.int32)
        for q0 in range(0, (s + 1) * SC, CH):
            offs_q = c * C + q0 + tl.arange(0, CH)
            idq = tl.load(ids_ptr + offs_q, mask=offs_q < P, other=-2).to(tl.int32)
            rank += tl.sum(((ids[:, None] == idq[None, :]) & (offs_q[None, :] < offs_p[:, None])).to(tl.int32), 1)
        dest = tl.load(off_ptr + c * E + ids, mask=pm, other=0) + rank
        tl.store(sorted_ptr + dest, offs_p, mask=pm)
        used = tl.load(num_rows_ptr)
        for b0 in range(s * BLOCK_B, BPC, (C // SC) * BLOCK_B):  # fixed-size tiles: one compile for every BPC
            offs_b = c * BPC + b0 + tl.arange(0, BLOCK_B)
            bm_ = (offs_b < NB) & (offs_b < (c + 1) * BPC)
            row = offs_b * BLOCK_M
            n = tl.zeros([BLOCK_B], dtype=tl.int32)
            for e0 in range(0, E, CHE):
                offs_e = e0 + tl.arange(0, CHE)
                pe = tl.load(pend_ptr + offs_e, mask=offs_e < E, other=2147483647)
                n += tl.sum((pe[None, :] <= row[:, None]).to(tl.int32), 1)
            tl.store(eid_ptr + offs_b, tl.where(row < used, n, -1), mask=bm_)

    return _align_count, _align_offsets, _align_scatter


_CHUNKED = None
#: pairs per program of the chunked alignment, and the most chunks its offsets program takes as one tile
CHUNK_PAIRS = 512
MAX_CHUNKS = 1024
#: chunks per tile of the offsets program and blocks per tile of the scatter (fixed: no compile per batch size)
CHUNK_TILE = 64
BLOCK_TILE = 64
#: pairs per scatter program: a chunk's pairs are ranked by CHUNK_PAIRS / SCATTER_PAIRS programs, each comparing its
#: pairs with the chunk's earlier ones only
SCATTER_PAIRS = 64


def moe_align_chunked(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Three launches for up to ``CHUNK_PAIRS · MAX_CHUNKS`` pairs (prefill): per-chunk expert counts, the offsets
    (one program), the scatter; the same result as :func:`moe_align` (its ~35 small launches), pairs of an expert
    in their flat order."""
    import triton

    global _CHUNKED
    if _CHUNKED is None:
        _CHUNKED = _chunked_kernels_src()
    count, offsets, scatter = _CHUNKED
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    P, E = flat.numel(), num_experts
    nc = max(1, -(-P // CHUNK_PAIRS))
    if nc > MAX_CHUNKS:
        raise ValueError(f"moe_align_chunked: {P} pairs exceed {CHUNK_PAIRS * MAX_CHUNKS}; use moe_align")
    dev = flat.device
    nb = max_blocks(P, E, block_m)
    sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(nb, dtype=torch.int32, device=dev)
    num_rows = torch.empty(1, dtype=torch.int32, device=dev)
    cnt = torch.empty(nc, E, dtype=torch.int32, device=dev)
    off = torch.empty(nc, E, dtype=torch.int32, device=dev)
    pend = torch.empty(E, dtype=torch.int32, device=dev)
    ch = min(64, triton.next_power_of_2(E))
    count[(nc,)](flat, cnt, P, E, C=CHUNK_PAIRS, SUB=128, CH=ch, num_warps=4)
    # every constant below depends on (E, block_m) alone, never on P: one compile per model serves every step
    offsets[(1,)](cnt, off, pend, sorted_ids, num_rows, P, E, nb * block_m, nc, BLOCK_M=block_m,
                  BLOCK_NC=CHUNK_TILE, CH=ch, FILL=1024, num_warps=4)
    bpc = -(-nb // nc)
    sc = min(SCATTER_PAIRS, CHUNK_PAIRS)
    scatter[(nc, CHUNK_PAIRS // sc)](flat, off, pend, num_rows, sorted_ids, expert_ids, P, E, nb, bpc, C=CHUNK_PAIRS,
                                     SC=sc, CH=64, BLOCK_B=BLOCK_TILE, CHE=ch, BLOCK_M=block_m, num_warps=4)
    return MoEAlignment(sorted_ids, expert_ids, num_rows, block_m)


_SELF_CHECK: dict[tuple[str, int | None], bool] = {}


def _same_alignment(a: MoEAlignment, b: MoEAlignment) -> bool:
    return (torch.equal(a.expert_ids, b.expert_ids) and torch.equal(a.num_rows, b.num_rows)
            and torch.equal(a.sorted_ids, b.sorted_ids))


def _self_check(kind: str, dev: torch.device) -> bool:
    """A kernel alignment is used on a device once it reproduced ``moe_align`` there (checked on the first call
    outside graph capture, like autotuning); otherwise the multi-kernel torch path is kept (a warning says why)."""
    key = (kind, dev.type, dev.index)
    if key not in _SELF_CHECK:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        fn = moe_align_triton if kind == "one-launch" else moe_align_chunked
        cases = [((torch.arange(60, device=dev).view(15, 4) * 5 + 3) % 7, 7, bm) for bm in (4, 16)]
        cases.append(((torch.arange(256, device=dev).view(16, 16) * 37 + 11) % 131, 131, 8))
        if kind == "chunked":
            cases.append(((torch.arange(3000, device=dev).view(375, 8) * 29 + 5) % 64, 64, 64))
        try:
            ok = all(_same_alignment(moe_align(i, e, bm), fn(i, e, bm)) for i, e, bm in cases)
            why = "disagrees with moe_align"
        except Exception as err:  # a compiler that cannot build it: the torch path, same result
            ok, why = False, f"failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        if not ok:
            import warnings

            warnings.warn(f"{kind} MoE alignment {why} on {dev}; keeping the torch alignment", RuntimeWarning)
        _SELF_CHECK[key] = ok
    return _SELF_CHECK[key]


def _one_launch_ok(dev: torch.device) -> bool:
    return _self_check("one-launch", dev)


def one_launch_ok(dev: torch.device) -> bool:
    """Whether :func:`align_for` takes the one-launch kernel on ``dev`` (its self-check passed there)."""
    return _self_check("one-launch", torch.device(dev))


def chunked_ok(dev: torch.device) -> bool:
    """Whether :func:`align_for` takes the three-launch chunked kernels on ``dev`` (their self-check passed)."""
    return _self_check("chunked", torch.device(dev))


def align_for(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """The alignment the fused kernels use: one launch for decode-sized batches, three (:func:`moe_align_chunked`)
    for larger ones on CUDA, where their self-check passed on the device; else :func:`moe_align` (also under the
    Triton interpreter for large batches, where the torch ops are the faster form). All give one result."""
    if num_experts <= 8192:
        if topk_ids.numel() <= ONE_LAUNCH_PAIRS:
            if _one_launch_ok(topk_ids.device):
                return moe_align_triton(topk_ids, num_experts, block_m)
        elif (topk_ids.device.type == "cuda" and topk_ids.numel() <= CHUNK_PAIRS * MAX_CHUNKS
              and chunked_ok(topk_ids.device)):
            return moe_align_chunked(topk_ids, num_experts, block_m)
    return moe_align(topk_ids, num_experts, block_m)
