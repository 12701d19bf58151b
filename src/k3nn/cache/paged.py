"""Paged hybrid cache: MLA latent pages + KDA state slots, and the persistent cache view the engine runs on.

Two pools (:class:`HybridPools`), sized in bytes from the config:

* **MLA latent pages** — per MLA layer ``[num_pages + 1, 64, kv_lora_rank + qk_rope_head_dim]`` (the layout of
  :mod:`k3nn.cache.pages`, so ``k3nn.ops.mla_decode`` reads it), one ref-counted
  :class:`~k3nn.cache.pages.BlockAllocator` of ``num_pages`` pages shared by all MLA layers (a block id names the
  same 64 tokens in every layer). Full pages are immutable and can be shared between requests and the prefix
  index. The extra last page is never allocated: padding tokens write there (``trash_row``), so a write needs no
  mask and no host sync.
* **KDA state slots** — two :class:`~k3nn.cache.states.StatePool` s: ``running`` (one slot per running request,
  addressed by slot index: a request keeps its slot while it runs, nothing is moved to make a batch contiguous)
  and ``snapshots`` (states at prefix boundaries, owned by the prefix index, read-only).

:class:`PagedCache` implements the cache protocol of :mod:`k3nn.cache.hybrid` over the pools, once per engine:
its layer states are persistent and read the step's :class:`~k3nn.runtime.metadata.StepMetadata`
(``cache.meta``), which the runner fills before each forward::

    cache.meta = inputs.derive(B, T)            # slots, positions, block tables, slot mapping, ...
    out = model(meta.input_ids, cache=cache, checkpoint_positions=meta.plan.checkpoint_positions)

KDA layers read and write their rows of the running pool by slot (``state_indices``); rows feeding fewer than T
tokens end in their exact state (the fused decode op's ``num_tokens``, or on the chunk path a checkpoint exported
at the row's length inside the same pass). Snapshots planned inside the chunk are exported the same way
(``checkpoint_positions``), never by a second forward. MLA layers write the new latents through
``slot_mapping`` and decode-shaped steps read the pages in place (``ops.mla_decode``); prefill steps gather them.

The conv part of a checkpoint (the W-1 pre-conv inputs before it) is taken from the layer's input, which the KDA
layer shows its state (:meth:`PagedKDAState.observe_input`) before it runs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config import KimiK3Config
from .hybrid import HybridCache, KDAState
from .pages import BLOCK_SIZE, BlockAllocator, gather_latents
from .states import StatePool, latent_bytes_per_token, mla_layer_ids, state_bytes_per_slot

__all__ = ["HybridPools", "PagedCache", "PagedKDAState", "PagedMLAState", "pool_sizes_for_budget",
           "write_rows"]


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
        # + one trash page that is never allocated: padding tokens write their latents there
        self.pages = [torch.zeros(num_pages + 1, block_size, self.row_dim, dtype=dtype, device=device)
                      for _ in self.mla_layer_ids]
        self.trash_row = num_pages * block_size
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

    def max_blocks(self, num_tokens: int) -> int:
        """Block-table columns a request of up to ``num_tokens`` tokens can need (at most the whole pool)."""
        return max(1, min(self.allocator.num_blocks, self.pages_for(num_tokens)))

    def read_pages(self, blocks: Sequence[int]) -> list[torch.Tensor]:
        """Copies of ``blocks`` from every MLA layer's pool: one [len(blocks), block, r + dr] tensor per layer."""
        idx = torch.as_tensor(list(blocks), dtype=torch.long, device=self.device)
        return [p.index_select(0, idx) for p in self.pages]

    def write_pages(self, blocks: Sequence[int], data: Sequence[torch.Tensor]) -> None:
        """Write :meth:`read_pages`' form (one tensor per MLA layer) into ``blocks``."""
        idx = torch.as_tensor(list(blocks), dtype=torch.long, device=self.device)
        for p, d in zip(self.pages, data):
            p.index_copy_(0, idx, d.to(p.device, p.dtype))


def write_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``pool.view(-1, D)[slots] = rows`` (slots [...] long, every one valid: padding points at a trash row;
    rows [..., D]). No mask, no host sync: graph-safe."""
    D = pool.shape[-1]
    pool.view(-1, D).index_copy_(0, slots.reshape(-1), rows.reshape(-1, D).to(pool.dtype))


class PagedKDAState(KDAState):
    """One KDA layer's rows of the running pool, addressed by the step's slots (updated in place)."""

    def __init__(self, owner: "PagedCache", j: int):
        self.owner, self.j = owner, j
        self.checkpoints: torch.Tensor | None = None
        self._conv_ckpt: torch.Tensor | None = None

    @property
    def recurrent(self) -> torch.Tensor:  # [num_slots, H, K, V]: the whole pool
        return self.owner.pools.running.recurrent[self.j]

    @property
    def conv(self) -> torch.Tensor:
        return self.owner.pools.running.conv[self.j]

    @property
    def state_indices(self) -> torch.Tensor:
        return self.owner.meta.slots

    @property
    def num_tokens(self) -> torch.Tensor:
        return self.owner.meta.num_new

    @property
    def write_state(self) -> torch.Tensor | None:
        return self.owner.meta.write_state

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.owner.meta.slots
        return self.conv.index_select(0, idx), self.recurrent.index_select(0, idx)

    def observe_input(self, module, x: torch.Tensor) -> None:
        """The KDA layer's (masked) input, shown by the layer before it runs: the conv part of the planned
        checkpoints is taken from it."""
        plan = self.owner.meta.plan
        if plan is not None and plan.ckpt_pairs:
            self._capture_conv(module, x, plan.ckpt_pairs)

    def record_decode(self, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor) -> None:
        """The fused decode op's inputs of this forward, kept for the speculative commit (when armed)."""
        rec = self.owner.recorder
        if rec is not None:
            rec[self.j] = (qkv, f, b)

    def _capture_conv(self, module, x: torch.Tensor, pairs) -> None:
        """Pre-conv inputs before every requested checkpoint: [M, W-1, 3·H·D] (M = number of checkpoints)."""
        W1 = self.conv.shape[1]
        dev = x.device
        b = torch.tensor([p[0] for p in pairs], device=dev)
        t = torch.tensor([p[1] for p in pairs], device=dev)[:, None] - W1 + torch.arange(W1, device=dev)
        xs = x[b[:, None], t.clamp_min(0)]  # [M, W-1, d]
        qkv = torch.cat([module.q_proj(xs), module.k_proj(xs), module.v_proj(xs)], -1)
        slot = self.owner.meta.slots[b]
        prev = self.conv[slot[:, None], (t + W1).clamp(0, W1 - 1)].to(qkv.dtype)
        self._conv_ckpt = torch.where((t >= 0)[..., None], qkv, prev)

    def update(self, recurrent: torch.Tensor, conv: torch.Tensor, checkpoints: torch.Tensor | None = None) -> None:
        meta = self.owner.meta
        self.checkpoints = checkpoints
        if recurrent is not self.recurrent:  # the chunk path: write the rows back by slot
            self.recurrent.index_copy_(0, meta.slots, recurrent.to(self.recurrent.dtype))
            self.conv.index_copy_(0, meta.slots, conv.to(self.conv.dtype))
        plan = meta.plan
        if plan is None or not plan.ckpt_pairs:
            return
        if checkpoints is None or checkpoints.shape[0] != len(plan.ckpt_pairs) or self._conv_ckpt is None:
            raise RuntimeError("PagedCache: the forward did not export the planned KDA checkpoints; pass "
                               "checkpoint_positions=meta.plan.checkpoint_positions")
        snap = self.owner.pools.snapshots
        rows = self.owner.plan_rows
        for k, (b, _p, kind, dst) in enumerate(plan.ckpt_targets):
            if kind == "row":  # a right-padded row: its state is the checkpoint at its own length
                self.recurrent[rows[b]].copy_(checkpoints[k])
                self.conv[rows[b]].copy_(self._conv_ckpt[k])
            else:
                snap.recurrent[self.j][dst].copy_(checkpoints[k])
                snap.conv[self.j][dst].copy_(self._conv_ckpt[k])
        self._conv_ckpt = None


class PagedMLAState:
    """One MLA layer's pages: stores the new latents through the step's slot mapping; decode-shaped steps read
    the pages in place, prefill steps get every visible latent gathered."""

    paged = True  # any short forward reads the pages in place (see MLAState.paged)

    def __init__(self, owner: "PagedCache", layer_idx: int):
        self.owner, self.pool_tensor = owner, owner.pools.mla_pool(layer_idx)

    def pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_pool [num_pages + 1, 64, r + dr], block_table [B, W] int32) — the layout ``ops.mla_decode`` reads."""
        return self.pool_tensor, self.owner.meta.block_table

    def _write(self, c: torch.Tensor, k_r: torch.Tensor) -> None:
        write_rows(self.pool_tensor, self.owner.meta.slot_mapping, torch.cat([c, k_r], -1))

    def paged_decode(self, c: torch.Tensor, k_r: torch.Tensor):
        """Store the new latents and return ``(kv_pool, block_table, context_lens)`` for ``ops.mla_decode`` (any
        step of at most ``absorb_max_tokens`` columns: query t of row b sees the keys before
        ``num_cached[b] + t + 1``; a right-padded row's padding queries see garbage and are never read)."""
        self._write(c, k_r)
        m = self.owner.meta
        return self.pool_tensor, m.block_table, m.context_lens

    def append(self, c: torch.Tensor, k_r: torch.Tensor, attention_mask, start: int):
        m = self.owner.meta
        self._write(c, k_r)
        L = m.plan.gather_len
        rows = gather_latents(self.pool_tensor, m.block_table, L)
        r = c.shape[-1]
        plan = m.plan
        if len(plan.num_cached) == c.shape[0] and all(a + b == L for a, b in zip(plan.num_cached, plan.num_new)):
            key_mask = None  # every row fills the gathered keys (the host plan says so: no host read)
        else:
            seq_lens = m.num_cached + m.num_new.long()
            key_mask = torch.arange(L, device=c.device)[None, :] < seq_lens[:, None]
        return rows[..., :r], rows[..., r:], key_mask, m.positions


class PagedCache(HybridCache):
    """The cache protocol over :class:`HybridPools` for the engine's forwards: persistent layer states that read
    the step metadata set in :attr:`meta` before each forward (see the module docstring). Not splittable: the
    engine plans each forward's tokens and chunks long prompts itself."""

    splittable = False

    def __init__(self, pools: HybridPools):
        self.pools, self.config = pools, pools.config
        self.dtype, self.device = pools.dtype, pools.device
        self.static = False
        self.meta = None  # the step's runtime.metadata.StepMetadata (set by the engine's runner), or None
        self.plan_rows: list[int] = []  # running slot of each batch row (host), for eager steps' checkpoints
        #: KDA layer j → (qkv, f, b) of the fused decode op in the last forward, when armed (speculative commit)
        self.recorder: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self.layers = []
        j = 0
        for i in range(self.config.num_hidden_layers):
            if self.config.is_mla_layer(i):
                self.layers.append(PagedMLAState(self, i))
            else:
                self.layers.append(PagedKDAState(self, j))
                j += 1
        self.layers_kda = [st for st in self.layers if isinstance(st, PagedKDAState)]

    @property
    def batch_size(self) -> int:
        """Rows of the current step (from the staged step metadata)."""
        return self.meta.batch_size

    @property
    def seen_tokens(self) -> int:
        """Always 0: each row's cached length lives in the step metadata, not in the cache object."""
        return 0

    # -- protocol ------------------------------------------------------------------------------------------
    def begin(self, T: int, attention_mask: torch.Tensor | None) -> tuple[int, torch.Tensor]:
        m = self.meta
        if m is None or T != m.num_tokens:
            raise ValueError(f"PagedCache: the step metadata was staged for {None if m is None else m.num_tokens} "
                             f"tokens per row, the forward has {T}")
        return 0, m.positions

    def commit(self, T: int, attention_mask: torch.Tensor | None) -> None:
        pass

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def reset(self) -> None:
        raise NotImplementedError("PagedCache holds the engine's requests; free them through the engine")

    def memory_bytes(self) -> int:
        return self.pools.memory_bytes()["total"]
