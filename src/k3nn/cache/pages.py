"""Paged latent cache for MLA: fixed-size blocks, block tables, slot mapping, a ref-counted allocator.

Layout (one pool per MLA layer)::

    pool  [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]     latent c (post-norm) then k_rope

One contiguous row per token (576 values at K3 dims), so a decode kernel reads a token's key and value
("value" = the first ``kv_lora_rank`` values) from one row. ``block_size`` is 64 by default (FlashMLA's only
page size). A request's ``block_table`` row lists its block ids in order; token ``j`` of a request lives at
``slot = block_table[j // block_size] * block_size + j % block_size`` (a row of ``pool.view(-1, D)``).

Decode context parallelism (DCP, :mod:`k3nn.parallel.dcp`) shards the sequence over ``W`` ranks, interleaved
with size ``I``: global position ``p`` lives on rank ``(p // I) % W``. Every rank keeps its own pools, while
block ids and block tables are shared by the group: one *logical* block covers ``block_size · W`` global
positions, of which each rank stores ``block_size``. For rank ``r`` and global position ``p``::

    k = p // (bs·W),  o = p % (bs·W)
    owned iff (o // I) % W == r,  local row ℓ = (o // (W·I))·I + o % I,  slot = table[k]·bs + ℓ

so rank ``r``'s local token index is ``k·bs + ℓ`` = the number of owned positions before ``p``, and a rank-local
kernel sees an ordinary paged cache of length :func:`local_seq_lens`. ``W = 1`` is the plain cache.

Nothing is evicted silently: allocation past the pool raises :class:`CacheFullError`.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Iterable, Sequence

import torch

from .hybrid import CacheFullError

__all__ = ["BLOCK_SIZE", "BlockAllocator", "PagedLatentCache", "CacheFullError", "slot_mapping",
           "local_seq_lens", "owner_rank", "write_latents", "gather_latents"]

BLOCK_SIZE = 64


def _check_dcp(block_size: int, world_size: int, rank: int, interleave: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if interleave < 1 or block_size % interleave:
        raise ValueError(f"interleave must be >= 1 and divide block_size={block_size}, got {interleave}")


class BlockAllocator:
    """Ref-counted allocator of block ids ``0 .. num_blocks-1``.

    ``allocate`` hands out free blocks with refcount 1; ``incref`` shares blocks (prefix reuse, forks);
    ``free`` drops one reference and returns a block to the free list when its count reaches zero.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def allocate(self, n: int = 1) -> list[int]:
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            raise CacheFullError(f"paged cache full: need {n} free block(s), {len(self._free)} of "
                                 f"{self.num_blocks} free; release requests or create a larger pool")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def _check(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} is outside the pool [0, {self.num_blocks})")
        if self._ref[block] == 0:
            raise ValueError(f"block {block} is not allocated")

    def incref(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        for b in blocks:
            self._check(b)
        for b in blocks:
            self._ref[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        for b in blocks:
            self._check(b)
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)


def owner_rank(positions: torch.Tensor, world_size: int, interleave: int = 1) -> torch.Tensor:
    """DCP rank holding each global position: ``(p // I) % W``."""
    return torch.div(positions, interleave, rounding_mode="floor") % world_size


def local_seq_lens(seq_lens: torch.Tensor, world_size: int = 1, rank: int = 0, interleave: int = 1) -> torch.Tensor:
    """Number of the first ``n`` global positions that rank ``rank`` owns (elementwise; any int tensor).

    ``base = (n // (I·W))·I``; ``len = base + clamp(n - base·W - rank·I, 0, I)``. Also the rank-local causal
    bound of a query at global position ``q`` is ``local_seq_lens(q + 1)``.
    """
    I, W = interleave, world_size
    base = torch.div(seq_lens, I * W, rounding_mode="floor") * I
    rem = seq_lens - base * W
    return base + (rem - rank * I).clamp(0, I)


def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int = BLOCK_SIZE,
                 world_size: int = 1, rank: int = 0, interleave: int = 1) -> torch.Tensor:
    """Pool rows (``pool.view(-1, D)`` indices, int64) for global ``positions`` [B, T] of the requests whose
    block tables are ``block_table`` [B, max_blocks]; ``-1`` where this rank does not own the position or the
    position is negative (padding)."""
    _check_dcp(block_size, world_size, rank, interleave)
    if block_table.dim() != 2 or positions.dim() != 2 or positions.shape[0] != block_table.shape[0]:
        raise ValueError(f"slot_mapping: block_table must be [B, max_blocks] and positions [B, T]; got "
                         f"{tuple(block_table.shape)} and {tuple(positions.shape)}")
    W, I = world_size, interleave
    pos = positions.long()
    valid = pos >= 0
    p = pos.clamp_min(0)
    span = block_size * W
    k = torch.div(p, span, rounding_mode="floor")
    if valid.any() and int(k[valid].max()) >= block_table.shape[1]:
        raise ValueError(f"slot_mapping: position {int(p[valid].max())} needs block-table column "
                         f"{int(k[valid].max())} but the table has {block_table.shape[1]} columns")
    o = p % span
    own = valid & (torch.div(o, I, rounding_mode="floor") % W == rank)
    local = torch.div(o, W * I, rounding_mode="floor") * I + o % I
    blk = torch.gather(block_table.long(), 1, k.clamp_max(block_table.shape[1] - 1))
    return torch.where(own, blk * block_size + local, torch.full_like(p, -1))


def write_latents(pool: torch.Tensor, slots: torch.Tensor, c: torch.Tensor, k_rope: torch.Tensor) -> None:
    """``pool.view(-1, D)[slot] = [c ; k_rope]`` for every slot ≥ 0 (slots [...], c [..., r], k_rope [..., dr])."""
    D = pool.shape[-1]
    if c.shape[-1] + k_rope.shape[-1] != D:
        raise ValueError(f"write_latents: c [..., {c.shape[-1]}] + k_rope [..., {k_rope.shape[-1]}] must fill "
                         f"the pool row of {D} values")
    if c.shape[:-1] != slots.shape or k_rope.shape[:-1] != slots.shape:
        raise ValueError(f"write_latents: c {tuple(c.shape)} / k_rope {tuple(k_rope.shape)} do not match "
                         f"slots {tuple(slots.shape)}")
    flat = pool.view(-1, D)
    s = slots.reshape(-1)
    keep = s >= 0
    if keep.any() and int(s[keep].max()) >= flat.shape[0]:
        raise ValueError(f"write_latents: slot {int(s[keep].max())} is outside the pool ({flat.shape[0]} rows)")
    rows = torch.cat([c, k_rope], -1).reshape(-1, D).to(pool.dtype)
    flat[s[keep]] = rows[keep]


def gather_latents(pool: torch.Tensor, block_table: torch.Tensor, length: int, start: int = 0) -> torch.Tensor:
    """Rows ``start .. start+length-1`` of every request (local token indices), contiguous: [B, length, D].
    Rows past a request's own length are whatever its table points to (clamped to the table): mask them."""
    bs, D = pool.shape[1], pool.shape[2]
    j = torch.arange(start, start + length, device=pool.device).clamp_max(block_table.shape[1] * bs - 1)
    blocks = block_table.long()[:, torch.div(j, bs, rounding_mode="floor")]  # [B, length]
    return pool.view(-1, D)[blocks * bs + j % bs]


class PagedLatentCache:
    """Latent pages of every MLA layer for a set of requests (one pool per layer, one allocator, shared block
    tables). Under DCP (``world_size > 1``) every rank builds the same object with its own ``rank``; calling
    the same sequence of ``add``/``extend``/``release`` on each rank yields identical block tables.

    Typical decode step::

        pos = cache.extend(ids, T)                  # reserve T new positions per request → [B, T] global
        cache.write(layer, ids, pos, c, k_rope)     # store this layer's new latents (owned rows only)
        o, lse = k3nn.ops.mla_decode(q_lat, q_rope, cache.pools[layer], cache.block_table(ids),
                                     cache.local_seq_lens(ids), scale)
    """

    def __init__(self, num_layers: int, num_blocks: int, kv_lora_rank: int, qk_rope_head_dim: int, *,
                 block_size: int = BLOCK_SIZE, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", world_size: int = 1, rank: int = 0, interleave: int = 1):
        _check_dcp(block_size, world_size, rank, interleave)
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.block_size, self.world_size, self.rank, self.interleave = block_size, world_size, rank, interleave
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.device = torch.device(device)
        self.allocator = BlockAllocator(num_blocks)
        self.pools = [torch.zeros(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim, dtype=dtype,
                                  device=device) for _ in range(num_layers)]
        self._blocks: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}

    @property
    def tokens_per_block(self) -> int:
        """Global positions covered by one block id (``block_size · world_size``)."""
        return self.block_size * self.world_size

    def add(self, seq_id: Hashable) -> None:
        if seq_id in self._blocks:
            raise ValueError(f"request {seq_id!r} is already in the cache")
        self._blocks[seq_id], self._lens[seq_id] = [], 0

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._blocks

    def seq_len(self, seq_id: Hashable) -> int:
        return self._lens[self._known(seq_id)]

    def _known(self, seq_id: Hashable) -> Hashable:
        if seq_id not in self._blocks:
            raise KeyError(f"request {seq_id!r} is not in the cache; add() it first")
        return seq_id

    def extend(self, seq_ids: Sequence[Hashable], num_tokens: int | Sequence[int]) -> torch.Tensor:
        """Reserve positions for new tokens; returns their global positions [B, T] (int64, ``-1`` padding
        where a request gets fewer than ``T = max(num_tokens)``). All-or-nothing: raises
        :class:`CacheFullError` without changing anything if the pool cannot hold them."""
        ns = [num_tokens] * len(seq_ids) if isinstance(num_tokens, int) else list(num_tokens)
        if len(ns) != len(seq_ids) or any(n < 0 for n in ns):
            raise ValueError(f"extend: num_tokens must be >= 0, one per request; got {num_tokens}")
        tpb = self.tokens_per_block
        need = []
        for s, n in zip(seq_ids, ns):
            new_len = self._lens[self._known(s)] + n
            need.append(max(0, -(-new_len // tpb) - len(self._blocks[s])))
        if sum(need) > self.allocator.num_free:
            raise CacheFullError(f"paged cache full: {sum(need)} more block(s) needed for {len(seq_ids)} "
                                 f"request(s), {self.allocator.num_free} of {self.allocator.num_blocks} free")
        T = max(ns, default=0)
        pos = torch.full((len(seq_ids), T), -1, dtype=torch.long)
        for i, (s, n, k) in enumerate(zip(seq_ids, ns, need)):
            self._blocks[s] += self.allocator.allocate(k)
            pos[i, :n] = torch.arange(self._lens[s], self._lens[s] + n)
            self._lens[s] += n
        return pos.to(self.device)

    def release(self, seq_id: Hashable) -> None:
        self.allocator.free(self._blocks.pop(self._known(seq_id)))
        del self._lens[seq_id]

    def blocks(self, seq_id: Hashable) -> list[int]:
        return list(self._blocks[self._known(seq_id)])

    def block_table(self, seq_ids: Sequence[Hashable], width: int | None = None) -> torch.Tensor:
        """int32 [B, width] (default: the longest request's block count); unused entries are 0 (a valid id
        that kernels never read, since they stop at the request's length)."""
        rows = [self._blocks[self._known(s)] for s in seq_ids]
        w = max((len(r) for r in rows), default=0) if width is None else width
        if any(len(r) > w for r in rows):
            raise ValueError(f"block_table: width {w} is smaller than a request's {max(len(r) for r in rows)} blocks")
        t = torch.zeros(len(rows), max(w, 1), dtype=torch.int32)
        for i, r in enumerate(rows):
            t[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
        return t.to(self.device)

    def seq_lens(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """Global lengths, int32 [B]."""
        return torch.tensor([self.seq_len(s) for s in seq_ids], dtype=torch.int32, device=self.device)

    def local_seq_lens(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """Lengths of this rank's shard (equal to :meth:`seq_lens` when ``world_size == 1``), int32 [B]."""
        return local_seq_lens(self.seq_lens(seq_ids), self.world_size, self.rank, self.interleave)

    def slots(self, seq_ids: Sequence[Hashable], positions: torch.Tensor) -> torch.Tensor:
        return slot_mapping(self.block_table(seq_ids), positions, self.block_size, self.world_size, self.rank,
                            self.interleave)

    def write(self, layer: int, seq_ids: Sequence[Hashable], positions: torch.Tensor, c: torch.Tensor,
              k_rope: torch.Tensor) -> None:
        """Store latents c [B, T, r] and k_rope [B, T, dr] at global ``positions`` [B, T] (rows this rank
        does not own, and ``-1`` padding, are skipped)."""
        write_latents(self.pools[layer], self.slots(seq_ids, positions), c, k_rope)
