"""KDA state slots: one slot = the recurrent + short-conv state of every KDA layer at one position.

Layout (one pair of tensors per KDA layer, slot-major so a batch of consecutive slots is a plain slice)::

    recurrent [num_slots, H, K, V]   fp32 (fp64 for fp64 models), layout "HKV" (the cache protocol's)
    conv      [num_slots, W-1, 3·H·D] activation dtype: the last W-1 pre-conv inputs, token-major, q|k|v

Slots are ref-counted: a *running* slot is owned by one request; a *snapshot* slot is owned by the prefix
index (and pinned by readers while they copy it). :class:`StatePool` never evicts anything by itself: asking
for more slots than are free raises :class:`~k3nn.cache.hybrid.CacheFullError`; the caller decides what to
evict (see :mod:`k3nn.cache.prefix`).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Sequence

import torch

from ..config import KimiK3Config
from .hybrid import CacheFullError

__all__ = ["StatePool", "state_bytes_per_slot", "latent_bytes_per_token", "kda_layer_ids", "mla_layer_ids"]


def kda_layer_ids(config: KimiK3Config) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if not config.is_mla_layer(i)]


def mla_layer_ids(config: KimiK3Config) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if config.is_mla_layer(i)]


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def state_bytes_per_slot(config: KimiK3Config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one slot (all KDA layers): H·K·V recurrent in fp32 + (W-1)·3·H·D conv in ``dtype``."""
    H, D, W = config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
    rec = H * D * D * torch.empty((), dtype=_state_dtype(dtype)).element_size()
    conv = (W - 1) * 3 * H * D * torch.empty((), dtype=dtype).element_size()
    return len(kda_layer_ids(config)) * (rec + conv)


def latent_bytes_per_token(config: KimiK3Config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one token's MLA latent rows (all MLA layers): (kv_lora_rank + qk_rope_head_dim) values."""
    D = config.kv_lora_rank + config.qk_rope_head_dim
    return len(mla_layer_ids(config)) * D * torch.empty((), dtype=dtype).element_size()


class StatePool:
    """``num_slots`` KDA state slots for every KDA layer of ``config``, with a ref-counted slot allocator.

    ``recurrent[j]`` / ``conv[j]`` are the tensors of the j-th KDA layer (model layer ``layer_ids[j]``).
    """

    def __init__(self, config: KimiK3Config, num_slots: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", name: str = "KDA state pool"):
        if num_slots < 1:
            raise ValueError(f"{name}: num_slots must be >= 1, got {num_slots}")
        self.config, self.num_slots, self.name = config, num_slots, name
        self.dtype, self.device = dtype, torch.device(device)
        H, D, W = config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
        self.layer_ids = kda_layer_ids(config)
        self.recurrent = [torch.zeros(num_slots, H, D, D, dtype=_state_dtype(dtype), device=device)
                          for _ in self.layer_ids]
        self.conv = [torch.zeros(num_slots, W - 1, 3 * H * D, dtype=dtype, device=device) for _ in self.layer_ids]
        self._free: deque[int] = deque(range(num_slots))
        self._ref = [0] * num_slots

    # -- accounting ---------------------------------------------------------------------------------------
    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot over all KDA layers (recurrent + conv state)."""
        return sum(t[0].numel() * t.element_size() for t in self.recurrent + self.conv)

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the whole pool."""
        return self.bytes_per_slot * self.num_slots

    @property
    def num_free(self) -> int:
        """Slots not allocated."""
        return len(self._free)

    def refcount(self, slot: int) -> int:
        """References held on ``slot`` (0: free)."""
        return self._ref[slot]

    # -- allocation -----------------------------------------------------------------------------------------
    def allocate(self, n: int = 1) -> list[int]:
        """``n`` free slots, each with one reference (their contents are stale: :meth:`zero_` or :meth:`write`
        them). No room is a :class:`~k3nn.cache.CacheFullError` saying how many are free; nothing is evicted."""
        if n < 0:
            raise ValueError(f"{self.name}: allocate n must be >= 0, got {n}")
        if n > len(self._free):
            raise CacheFullError(f"{self.name} full: need {n} free slot(s), {len(self._free)} of {self.num_slots} "
                                 f"free ({self.bytes_per_slot} bytes per slot); finish requests, evict prefix "
                                 f"snapshots or create a larger pool")
        out = [self._free.popleft() for _ in range(n)]
        for s in out:
            self._ref[s] = 1
        return out

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"{self.name}: slot {slot} is outside [0, {self.num_slots})")
        if self._ref[slot] == 0:
            raise ValueError(f"{self.name}: slot {slot} is not allocated")

    def incref(self, slots: Iterable[int]) -> None:
        """One more reference on each of ``slots`` (shared snapshots: copy-on-write users); all allocated, else a
        ValueError and nothing changes."""
        slots = list(slots)
        for s in slots:
            self._check(s)
        for s in slots:
            self._ref[s] += 1

    def free(self, slots: Iterable[int]) -> None:
        """Drop one reference on each of ``slots``; a slot whose count reaches 0 is free again. A slot that is not
        allocated is a ValueError (nothing changes)."""
        slots = list(slots)
        for s in slots:
            self._check(s)
        for s in slots:
            self._ref[s] -= 1
            if self._ref[s] == 0:
                self._free.append(s)

    # -- data movement ---------------------------------------------------------------------------------------
    def zero_(self, slots: Sequence[int]) -> None:
        """Zero the recurrent and conv state of ``slots`` in every layer (a fresh sequence)."""
        idx = torch.as_tensor(list(slots), dtype=torch.long, device=self.device)
        for r, c in zip(self.recurrent, self.conv):
            r.index_fill_(0, idx, 0)
            c.index_fill_(0, idx, 0)

    def copy_(self, dst: Sequence[int], src_pool: "StatePool", src: Sequence[int]) -> None:
        """``self[dst[i]] = src_pool[src[i]]`` for every layer, as one simultaneous assignment (sources are read
        before any destination is written, so permutations within one pool are safe)."""
        if len(dst) != len(src):
            raise ValueError(f"copy_: {len(dst)} destinations for {len(src)} sources")
        if not dst:
            return
        if src_pool.layer_ids != self.layer_ids:
            raise ValueError("copy_: the pools were made for different configs")
        di = torch.as_tensor(list(dst), dtype=torch.long, device=self.device)
        si = torch.as_tensor(list(src), dtype=torch.long, device=src_pool.device)
        for j in range(len(self.layer_ids)):
            self.recurrent[j].index_copy_(0, di, src_pool.recurrent[j].index_select(0, si).to(self.device))
            self.conv[j].index_copy_(0, di, src_pool.conv[j].index_select(0, si).to(self.device, self.conv[j].dtype))

    def read(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of one slot: (recurrent per KDA layer [H, K, V], conv per KDA layer [W-1, C])."""
        return [r[slot].clone() for r in self.recurrent], [c[slot].clone() for c in self.conv]

    def write(self, slot: int, recurrent: Sequence[torch.Tensor], conv: Sequence[torch.Tensor]) -> None:
        """Set ``slot`` from one recurrent [H, K, V] and one conv [W−1, C] tensor per KDA layer (:meth:`read`'s
        form); wrong counts or shapes are a ValueError naming the layer."""
        if len(recurrent) != len(self.layer_ids) or len(conv) != len(self.layer_ids):
            raise ValueError(f"write: expected {len(self.layer_ids)} KDA layers, got {len(recurrent)}/{len(conv)}")
        for j in range(len(self.layer_ids)):
            if recurrent[j].shape != self.recurrent[j].shape[1:] or conv[j].shape != self.conv[j].shape[1:]:
                raise ValueError(f"write: KDA layer {self.layer_ids[j]} expects recurrent "
                                 f"{tuple(self.recurrent[j].shape[1:])} and conv {tuple(self.conv[j].shape[1:])}, got "
                                 f"{tuple(recurrent[j].shape)} and {tuple(conv[j].shape)}")
            self.recurrent[j][slot].copy_(recurrent[j])
            self.conv[j][slot].copy_(conv[j])
