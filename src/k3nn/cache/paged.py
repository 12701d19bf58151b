"""Paged hybrid cache: MLA latent pages + KDA state slots, and a per-step batch view the model runs on.

Two pools (:class:`HybridPools`), sized in bytes from the config:

* **MLA latent pages** — per MLA layer ``[num_pages, 64, kv_lora_rank + qk_rope_head_dim]`` (the layout of
  :mod:`k3nn.cache.pages`, so ``k3nn.ops.mla_decode`` reads it), one ref-counted
  :class:`~k3nn.cache.pages.BlockAllocator` shared by all MLA layers (a block id names the same 64 tokens in
  every layer). Full pages are immutable and can be shared between requests and the prefix index.
* **KDA state slots** — two :class:`~k3nn.cache.states.StatePool` s: ``running`` (one row per running request)
  and ``snapshots`` (states at prefix boundaries, owned by the prefix index, read-only).

:class:`PagedHybridCache` implements the cache protocol of :mod:`k3nn.cache.hybrid` for B requests whose
running KDA rows are **consecutive** (``running[row0 : row0 + B]``): the KDA layers read and write that slice
in place (no per-layer gather/scatter of the recurrent state). Row b feeds ``num_new[b]`` tokens; rows shorter
than the forward's T are right-padded, and their exact state is taken from a checkpoint exported at
``num_new[b]`` inside the same pass (the padded tail never reaches the cache). Snapshots planned inside the
chunk are exported the same way (``checkpoint_positions``), never by a second forward::

    cache = PagedHybridCache(pools, rows=..., ...)
    out = model(ids, cache=cache, checkpoint_positions=cache.checkpoint_positions)

The conv part of a checkpoint (the W-1 pre-conv inputs before it) is taken from the layer's input, which the KDA
layer shows its state (:meth:`PagedKDAState.observe_input`) before it runs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config import KimiK3Config
from .hybrid import CacheFullError, HybridCache
from .pages import BLOCK_SIZE, BlockAllocator, gather_latents, slot_mapping, write_latents
from .states import StatePool, latent_bytes_per_token, mla_layer_ids, state_bytes_per_slot

__all__ = ["HybridPools", "PagedHybridCache", "PagedKDAState", "PagedMLAState", "pool_sizes_for_budget"]


def pool_sizes_for_budget(config: KimiK3Config, memory_bytes: int, max_running: int, state_fraction: float = 0.25,
                          dtype: torch.dtype = torch.bfloat16, block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """Split a byte budget into (num_pages, num_snapshots): the running slots are paid first, then
    ``state_fraction`` of the rest goes to snapshot slots and the remainder to latent pages."""
    slot = state_bytes_per_slot(config, dtype)
    page = latent_bytes_per_token(config, dtype) * block_size
    rest = memory_bytes - max_running * slot
    if rest <= 0:
        raise ValueError(f"memory_bytes={memory_bytes} does not cover {max_running} running KDA slots of {slot} bytes")
    snaps = int(rest * state_fraction) // slot
    pages = (rest - snaps * slot) // max(page, 1)
    if pages < 1:
        raise ValueError(f"memory_bytes={memory_bytes} leaves no room for one latent page of {page} bytes")
    return int(pages), int(max(snaps, 1))


class HybridPools:
    """All cache memory of one engine: latent pages, running KDA rows, KDA snapshot slots."""

    def __init__(self, config: KimiK3Config, num_pages: int, max_running: int, num_snapshots: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 block_size: int = BLOCK_SIZE):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.config, self.dtype, self.device, self.block_size = config, dtype, torch.device(device), block_size
        self.mla_layer_ids = mla_layer_ids(config)
        self.row_dim = config.kv_lora_rank + config.qk_rope_head_dim
        self.allocator = BlockAllocator(num_pages)
        self.pages = [torch.zeros(num_pages, block_size, self.row_dim, dtype=dtype, device=device)
                      for _ in self.mla_layer_ids]
        self.running = StatePool(config, max_running, dtype, device, name="KDA running rows")
        self.snapshots = StatePool(config, num_snapshots, dtype, device, name="KDA snapshot pool")
        self._mla_index = {l: j for j, l in enumerate(self.mla_layer_ids)}

    @property
    def bytes_per_token(self) -> int:
        """Latent bytes one token takes over all MLA layers (r + dr values per layer)."""
        return sum(p[0, 0].numel() * p.element_size() for p in self.pages)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one KDA state slot (running row or snapshot) over all KDA layers."""
        return self.running.bytes_per_slot

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held: ``latent_pages``, ``running_slots``, ``snapshot_slots`` and their ``total``."""
        pages = self.bytes_per_token * self.block_size * self.allocator.num_blocks
        return {"latent_pages": pages, "running_slots": self.running.memory_bytes,
                "snapshot_slots": self.snapshots.memory_bytes,
                "total": pages + self.running.memory_bytes + self.snapshots.memory_bytes}

    def pages_for(self, num_tokens: int) -> int:
        """Pages ``num_tokens`` tokens occupy (ceil division by the block size)."""
        return -(-num_tokens // self.block_size)

    def mla_pool(self, layer_idx: int) -> torch.Tensor:
        """The page pool [num_pages + 1, block, r + dr] of MLA layer ``layer_idx``
        (model layer index; the last page is the trash page padding writes go to)."""
        return self.pages[self._mla_index[layer_idx]]

    def read_pages(self, blocks: Sequence[int]) -> list[torch.Tensor]:
        """Copies of ``blocks`` from every MLA layer's pool: one [len(blocks), block, r + dr] tensor per layer."""
        idx = torch.as_tensor(list(blocks), dtype=torch.long, device=self.device)
        return [p.index_select(0, idx) for p in self.pages]

    def write_pages(self, blocks: Sequence[int], data: Sequence[torch.Tensor]) -> None:
        """Write :meth:`read_pages`' form (one tensor per MLA layer) into ``blocks``."""
        idx = torch.as_tensor(list(blocks), dtype=torch.long, device=self.device)
        for p, d in zip(self.pages, data):
            p.index_copy_(0, idx, d.to(p.device, p.dtype))


class PagedKDAState:
    """One KDA layer's view: ``recurrent``/``conv`` are slices of the running pool (updated in place)."""

    def __init__(self, owner: "PagedHybridCache", j: int):
        self.owner, self.j = owner, j
        pool = owner.pools.running
        r0, B = owner.row0, owner.batch_size
        self.recurrent = pool.recurrent[j][r0:r0 + B]
        self.conv = pool.conv[j][r0:r0 + B]
        self.checkpoints: torch.Tensor | None = None
        self._conv_ckpt: torch.Tensor | None = None
        self.window_x: torch.Tensor | None = None  # this layer's input [B, T, d] when the owner records inputs

    def observe_input(self, module, x: torch.Tensor) -> None:
        """The KDA layer's (masked) input, shown by the layer before it runs: the conv part of the planned
        checkpoints is taken from it, and the engine's speculative replay keeps it when asked (``record_inputs``)."""
        if self.owner.ckpt_pairs:
            self.capture_conv(module, x)
        if self.owner.record_inputs:
            self.window_x = x

    def capture_conv(self, module, x: torch.Tensor) -> None:
        """Pre-conv inputs before every requested checkpoint: [M, W-1, 3·H·D] (M = number of checkpoints)."""
        W1 = self.conv.shape[1]
        pairs = self.owner.ckpt_pairs
        b = torch.tensor([p[0] for p in pairs], device=x.device)
        t = torch.tensor([p[1] for p in pairs], device=x.device)[:, None] - W1 + torch.arange(W1, device=x.device)
        xs = x[b[:, None], t.clamp_min(0)]  # [M, W-1, d]
        qkv = torch.cat([module.q_proj(xs), module.k_proj(xs), module.v_proj(xs)], -1)
        prev = self.conv[b[:, None], (t + W1).clamp(0, W1 - 1)].to(qkv.dtype)
        self._conv_ckpt = torch.where((t >= 0)[..., None], qkv, prev)

    def update(self, recurrent: torch.Tensor, conv: torch.Tensor, checkpoints: torch.Tensor | None = None) -> None:
        o = self.owner
        self.recurrent.copy_(recurrent)
        self.conv.copy_(conv)
        self.checkpoints = checkpoints
        if not o.ckpt_pairs:
            return
        if checkpoints is None or checkpoints.shape[0] != len(o.ckpt_pairs) or self._conv_ckpt is None:
            raise RuntimeError("PagedHybridCache: the forward did not export the planned KDA checkpoints; pass "
                               "checkpoint_positions=cache.checkpoint_positions")
        snap = o.pools.snapshots
        for k, (b, _p, kind, dst) in enumerate(o.ckpt_targets):
            if kind == "row":  # a right-padded row: its state is the checkpoint at its own length
                self.recurrent[b].copy_(checkpoints[k])
                self.conv[b].copy_(self._conv_ckpt[k])
            else:
                snap.recurrent[self.j][dst].copy_(checkpoints[k])
                snap.conv[self.j][dst].copy_(self._conv_ckpt[k])
        self._conv_ckpt = None


class PagedMLAState:
    """One MLA layer's view: writes the new latents into the requests' pages, returns every visible latent."""

    def __init__(self, owner: "PagedHybridCache", layer_idx: int):
        self.owner, self.pool_tensor = owner, owner.pools.mla_pool(layer_idx)

    def pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_pool [num_pages, 64, r + dr], block_table [B, n] int32) — the layout ``ops.mla_decode`` reads
        (same interface as :meth:`k3nn.cache.hybrid.MLAState.pool`); lengths are ``owner.num_cached``."""
        return self.pool_tensor, self.owner.block_table

    def paged_decode(self, c: torch.Tensor, k_r: torch.Tensor):
        """Decode-shaped steps (every request adds the same T tokens): store them and return
        ``(kv_pool, block_table, seq_lens)`` for ``ops.mla_decode``, which reads the pages in place (no gather);
        None for mixed steps (requests adding different counts), which take :meth:`append`."""
        o = self.owner
        if any(n != o.T for n in o.num_new):
            return None
        write_latents(self.pool_tensor, o.write_slots, c, k_r)
        return self.pool_tensor, o.block_table, o.seq_lens

    def append(self, c: torch.Tensor, k_r: torch.Tensor, attention_mask, start: int):
        o = self.owner
        B, T = c.shape[:2]
        write_latents(self.pool_tensor, o.write_slots, c, k_r)
        rows = gather_latents(self.pool_tensor, o.block_table, o.gather_len)
        r = c.shape[-1]
        return rows[..., :r], rows[..., r:], o.key_mask, o.q_pos


class PagedHybridCache(HybridCache):
    """The cache protocol over :class:`HybridPools` for one forward of B requests (the engine plans each forward's
    tokens, and chunks long prompts itself: not splittable).

    Args:
        pools: the engine's pools.
        row0: first running row; request b uses running row ``row0 + b`` (rows must be consecutive).
        blocks: per request, its page ids in order (covering at least ``num_cached[b] + num_new[b]`` tokens).
        num_cached: tokens already in the cache per request (its latents in the pages, its state in the row).
        num_new: tokens this forward feeds per request (1 ≤ num_new[b] ≤ T; row b is right-padded to T).
        snapshots: per request, ``(position, snapshot_slot)`` pairs with ``0 < position ≤ num_new[b]``
            (relative to this forward): the state after that many of its new tokens is written into the slot.
    """

    def __init__(self, pools: HybridPools, row0: int, blocks: Sequence[Sequence[int]], num_cached: Sequence[int],
                 num_new: Sequence[int], snapshots: Sequence[Sequence[tuple[int, int]]] | None = None):
        B = len(blocks)
        if not (B == len(num_cached) == len(num_new)) or B == 0:
            raise ValueError(f"PagedHybridCache: blocks/num_cached/num_new must have one entry per request "
                             f"(got {len(blocks)}/{len(num_cached)}/{len(num_new)})")
        if row0 < 0 or row0 + B > pools.running.num_slots:
            raise ValueError(f"PagedHybridCache: rows [{row0}, {row0 + B}) are outside the running pool "
                             f"({pools.running.num_slots} rows)")
        if any(n < 1 for n in num_new) or any(n < 0 for n in num_cached):
            raise ValueError(f"PagedHybridCache: num_new must be >= 1 and num_cached >= 0 (got {list(num_new)}, "
                             f"{list(num_cached)})")
        self.pools, self.config = pools, pools.config
        self.batch_size, self.row0 = B, row0
        self.static = False  # never graph-captured: shapes change every step
        self.splittable = False
        self.dtype, self.device = pools.dtype, pools.device
        self.max_length = max(len(b) for b in blocks) * pools.block_size
        self.blocks = [list(b) for b in blocks]
        self.num_cached = [int(n) for n in num_cached]
        self.num_new = [int(n) for n in num_new]
        for b in range(B):
            need = self.num_cached[b] + self.num_new[b]
            if need > len(self.blocks[b]) * pools.block_size:
                raise CacheFullError(f"PagedHybridCache: request {b} needs {need} tokens but holds "
                                     f"{len(self.blocks[b])} page(s) of {pools.block_size}; allocate pages first")
        self.T = max(self.num_new)
        snapshots = snapshots or [[] for _ in range(B)]
        # checkpoints: planned snapshots, then the exact state of every right-padded row
        self.ckpt_pairs: list[tuple[int, int]] = []
        self.ckpt_targets: list[tuple[int, int, str, int]] = []
        per_row: list[list[int]] = [[] for _ in range(B)]
        for b in range(B):
            for p, slot in snapshots[b]:
                if not 0 < p <= self.num_new[b]:
                    raise ValueError(f"PagedHybridCache: snapshot position {p} of request {b} is outside "
                                     f"(0, {self.num_new[b]}]")
                per_row[b].append(p)
                self.ckpt_targets.append((b, p, "snap", slot))
            if self.num_new[b] < self.T:
                per_row[b].append(self.num_new[b])
                self.ckpt_targets.append((b, self.num_new[b], "row", b))
        # order the targets the way the kernel returns them (row-major, in the order given)
        order = sorted(range(len(self.ckpt_targets)), key=lambda k: self.ckpt_targets[k][0])
        self.ckpt_targets = [self.ckpt_targets[k] for k in order]
        self.ckpt_pairs = [(b, p) for b, p, _, _ in self.ckpt_targets]
        self.checkpoint_positions = per_row if self.ckpt_pairs else None
        # MLA geometry, shared by every MLA layer of this forward
        dev = pools.device
        cached = torch.tensor(self.num_cached, device=dev)
        new = torch.tensor(self.num_new, device=dev)
        t = torch.arange(self.T, device=dev)
        self.q_pos = cached[:, None] + t  # [B, T]
        self.gather_len = int(max(c + self.T for c in self.num_cached))
        width = pools.pages_for(self.gather_len)
        table = torch.zeros(B, width, dtype=torch.int32)
        for b, bl in enumerate(self.blocks):
            n = min(len(bl), width)
            table[b, :n] = torch.tensor(bl[:n], dtype=torch.int32)
        self.block_table = table.to(dev)
        pos = torch.where(t < new[:, None], self.q_pos, torch.full_like(self.q_pos, -1))
        self.write_slots = slot_mapping(self.block_table, pos, pools.block_size)
        self.seq_lens = cached + new  # tokens of each request once this forward has written its own
        self.key_mask = torch.arange(self.gather_len, device=dev)[None, :] < self.seq_lens[:, None]
        self.record_inputs: set[int] = set()  # batch rows whose KDA layer inputs are kept (speculative replay)
        self.layers = []
        j = 0
        for i in range(self.config.num_hidden_layers):
            if self.config.is_mla_layer(i):
                self.layers.append(PagedMLAState(self, i))
            else:
                self.layers.append(PagedKDAState(self, j))
                j += 1
        self.layers_kda = [st for st in self.layers if isinstance(st, PagedKDAState)]
        self.seen_tokens = min(self.num_cached)

    # -- protocol ------------------------------------------------------------------------------------------
    def begin(self, T: int, attention_mask: torch.Tensor | None) -> tuple[int, torch.Tensor]:
        if T != self.T:
            raise ValueError(f"PagedHybridCache was planned for a forward of {self.T} tokens, got {T}")
        return min(self.num_cached), self.q_pos

    def commit(self, T: int, attention_mask: torch.Tensor | None) -> None:
        self.num_cached = [c + n for c, n in zip(self.num_cached, self.num_new)]
        self.seen_tokens = min(self.num_cached)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def reset(self) -> None:
        raise NotImplementedError("PagedHybridCache is a per-step view; free requests through the engine")

    def memory_bytes(self) -> int:
        return self.pools.memory_bytes()["total"]

    def input_ids(self, tokens: Sequence[Sequence[int]], pad_id: int = 0) -> torch.Tensor:
        """Right-padded ``[B, T]`` ids for the per-request token lists (lengths must equal ``num_new``)."""
        ids = torch.full((self.batch_size, self.T), pad_id, dtype=torch.long)
        for b, tk in enumerate(tokens):
            if len(tk) != self.num_new[b]:
                raise ValueError(f"input_ids: request {b} has {len(tk)} tokens, planned {self.num_new[b]}")
            ids[b, :len(tk)] = torch.as_tensor(list(tk), dtype=torch.long)
        return ids.to(self.device)

    def last_index(self) -> torch.Tensor:
        """Index of each row's last real token in the forward ([B] long)."""
        return torch.tensor(self.num_new, device=self.device) - 1
