"""The hybrid cache: per KDA layer a recurrent + conv state, per MLA layer a latent (+ rope key) cache.

Cache protocol (what :class:`k3nn.model.KimiK3Model` and the layers rely on; paged caches implement it too):

* ``cache.begin(T, attention_mask) -> (start, positions [B, T])`` before a forward of T new tokens, and
  ``cache.commit(T, attention_mask)`` after it; ``cache.layers[i]`` is the state of layer i; ``cache.splittable``:
  whether the model may cut a long forward into consecutive chunks (chunked prefill).
* KDA state: ``.recurrent [B, H, K, V]`` fp32 and ``.conv [B, W-1, 3·H·D]`` (read), and
  ``.update(recurrent, conv, checkpoints=None)`` (write back after the forward).
* MLA state: ``.append(c, k_r, attention_mask, start) -> (latent [B, L, r], rope [B, L, dr],
  key_mask [B, L] bool or None, q_pos [B, T])``: store the new tokens' latents, return everything visible (no
  mask when the cache knows on the host that no key is masked); and
  ``.paged_decode(c, k_r) -> (kv_pool, block_table, seq_lens) | None``: for a decode-shaped step whose latents
  the decode kernel can read in place, store them and return its inputs (None: take ``append``).

This is the contiguous cache used by ``model(input_ids, cache=...)`` and ``generate()``: every row of a batch
shares one write position (left padding is recorded in ``key_mask``; ``holes``, a host flag, says whether any
entry below the write position may be False: code that masks entries sets it).

Static (graph-safe) mode, ``cache.set_static(True)``: the write position also lives on the device
(``write_pos``, a 0-dim int64 kept in step with ``seen_tokens``); ``begin``/``append``/``commit`` then write at
that device position and ``append`` returns the *whole* buffers (``L = max_length``; unwritten slots are
masked by causality and ``key_mask``), so a decode step has fixed shapes, no Python-int slicing and no host
sync, and can be captured in a CUDA graph. After replaying a captured step call ``advance_host(T)`` (the
host counter is not touched by a replay). ``mla_pool=True`` stores each MLA layer's latent and rope key in one
``kv [B, L', r + dr]`` buffer (L' = max_length rounded up to ``POOL_BLOCK``) that doubles as a paged pool with
an identity block table (``MLAState.pool()``), the layout of ``ops.mla_decode``. Layouts:

* KDA: ``recurrent [B, H, K, V]`` fp32; ``conv [B, W-1, 3·H·D]`` activation dtype (q, k, v channels).
* MLA: ``latent [B, L, kv_lora_rank]`` and ``rope [B, L, qk_rope_head_dim]`` activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import KimiK3Config

__all__ = ["KDAState", "MLAState", "HybridCache", "CacheFullError", "POOL_BLOCK"]


class CacheFullError(ValueError):
    """Raised when a write would go past the cache's capacity (nothing is evicted silently)."""


@dataclass
class KDAState:
    """One KDA layer's state for the B rows of a forward (the protocol every KDA cache entry implements).

    ``recurrent`` / ``conv``: the state tensors, rows ``0..B−1`` (or, with ``state_indices``, the whole pool the
    rows live in); ``state_indices`` [B] (None: rows 0..B−1), ``num_tokens`` [B] (None: every row feeds all T
    tokens) and ``write_state`` [B] bool (None: every row is stored) go to ``ops.kda_fused_decode``.
    :meth:`read` gives the rows' (conv, recurrent) for the chunk path, :meth:`update` stores the new state,
    :meth:`observe_input` sees the layer input and :meth:`record_decode` the fused op's inputs (no-ops here)."""

    recurrent: torch.Tensor
    conv: torch.Tensor
    checkpoints: torch.Tensor | None = None  # states exported by the last call with checkpoint_positions
    state_indices = None
    num_tokens = None
    write_state = None

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [B, W−1, 3·H·D] in the activation dtype, recurrent [B, H, D, D] fp32) of the rows, for the chunked
        path's initial state."""
        return self.conv, self.recurrent

    def update(self, recurrent: torch.Tensor, conv: torch.Tensor, checkpoints: torch.Tensor | None = None) -> None:
        """Store the rows' new state (copied in place unless it is the same tensor) and the states exported by
        ``checkpoint_positions`` ([M, H, D, D] fp32, or None)."""
        if recurrent is not self.recurrent:
            self.recurrent.copy_(recurrent)
        if conv is not self.conv:
            self.conv.copy_(conv)
        self.checkpoints = checkpoints

    def observe_input(self, module, x: torch.Tensor) -> None:
        """The layer's (masked) input before it runs (caches that export conv checkpoints or record windows)."""

    def record_decode(self, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor) -> None:
        """The fused decode op's inputs of this forward (caches that commit verify windows later)."""


POOL_BLOCK = 64  # block size of the MLA pool view (the paged cache's block)


class MLAState:
    """One MLA layer's latent cache (see the protocol in the module docstring)."""

    #: every short forward may take the absorbed decode path through :meth:`paged_decode` (paged caches: each
    #: row has its own cached length); here only calls continuing a non-empty cache do
    paged = False

    def __init__(self, owner: "HybridCache", latent: torch.Tensor, rope: torch.Tensor,
                 kv: torch.Tensor | None = None):
        self.owner, self.latent, self.rope, self.kv = owner, latent, rope, kv

    def pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``mla_pool`` caches: (kv_pool [B·L'/64, 64, r + dr], block_table [B, L'/64] int32) over the same
        memory (row b owns blocks b·L'/64 ...), for ``ops.mla_decode``."""
        if self.kv is None:
            raise ValueError("MLAState.pool(): the cache was not created with mla_pool=True")
        B, Lp, w = self.kv.shape
        nb = Lp // POOL_BLOCK
        if getattr(self, "_table", None) is None:
            self._table = torch.arange(B * nb, dtype=torch.int32, device=self.kv.device).view(B, nb)
        return self.kv.view(B * nb, POOL_BLOCK, w), self._table

    def write_static(self, c: torch.Tensor, k_r: torch.Tensor) -> torch.Tensor:
        """Graph-safe store of T new tokens at the device write position; returns their indices [T]."""
        idx = self.owner.write_indices(c.shape[1])
        self.latent.index_copy_(1, idx, c.to(self.latent.dtype))
        self.rope.index_copy_(1, idx, k_r.to(self.rope.dtype))
        return idx

    def paged_decode(self, c: torch.Tensor, k_r: torch.Tensor):
        """With ``owner.pool_decode`` on (static ``mla_pool`` caches of unpadded batches, set by the decode
        runner): store the new tokens and return ``(kv_pool, block_table, seq_lens)`` for ``ops.mla_decode``, which
        reads the pool in place; else None (the caller takes :meth:`append`)."""
        o = self.owner
        if not (o.pool_decode and o.static and self.kv is not None):
            return None
        self.write_static(c, k_r)
        pool, table = self.pool()
        return pool, table, o.decode_seq_lens

    def append(self, c: torch.Tensor, k_r: torch.Tensor, attention_mask: torch.Tensor | None, start: int):
        """Store T new tokens' latents c [B, T, r] and rope keys k_r [B, T, dr] at positions [start, start + T);
        returns (every latent [B, L, r], rope key [B, L, dr], key mask [B, L] bool or None when no key is masked,
        the new queries' absolute indices [B, T]). Writing past ``max_length`` raises :class:`CacheFullError`."""
        T = c.shape[1]
        if self.owner.static:
            idx = self.write_static(c, k_r)
            return self.latent, self.rope, self.owner.key_mask, idx.expand(c.shape[0], T)
        end = start + T
        if end > self.latent.shape[1]:
            raise CacheFullError(f"cache exhausted: writing tokens [{start}, {end}) into a cache of max_length "
                                 f"{self.latent.shape[1]}; create it with a larger max_length")
        self.latent[:, start:end] = c.to(self.latent.dtype)
        self.rope[:, start:end] = k_r.to(self.rope.dtype)
        q_pos = (start + torch.arange(T, device=c.device)).expand(c.shape[0], T)
        mask = self.owner.key_mask[:, :end] if self.owner.holes else None  # None: every key so far is real
        return self.latent[:, :end], self.rope[:, :end], mask, q_pos


class HybridCache:
    """Cache for B rows and up to ``max_length`` tokens. ``seen_tokens`` is the shared write position."""

    #: a forward of T new tokens may run as consecutive forwards of its pieces (chunked prefill); caches whose
    #: forwards are planned ahead by their owner (the engine's paged cache) say False
    splittable = True

    def __init__(self, config: KimiK3Config, batch_size: int, max_length: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", mla_pool: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.config, self.batch_size, self.max_length = config, batch_size, max_length
        self.dtype, self.device = dtype, torch.device(device)
        H, D, W = config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
        # every KDA layer's states are views of one recurrent and one conv buffer: two fill kernels for the whole
        # stack instead of two per layer (a short prompt's forward allocates its cache inside the call)
        n_kda = sum(not config.is_mla_layer(i) for i in range(config.num_hidden_layers))
        states = (torch.zeros(n_kda, batch_size, H, D, D, dtype=torch.float32 if dtype != torch.float64 else dtype,
                              device=device),
                  torch.zeros(n_kda, batch_size, W - 1, 3 * H * D, dtype=dtype, device=device))
        self._kda_buffers = states
        # indexed views (iterating would unbind, whose views refuse in-place writes under autograd)
        kda_views = ((states[0][j], states[1][j]) for j in range(n_kda))
        self.layers: list[KDAState | MLAState] = []
        for i in range(config.num_hidden_layers):
            if config.is_mla_layer(i) and mla_pool:
                r, dr = config.kv_lora_rank, config.qk_rope_head_dim
                Lp = -(-max_length // POOL_BLOCK) * POOL_BLOCK
                kv = torch.zeros(batch_size, Lp, r + dr, dtype=dtype, device=device)
                self.layers.append(MLAState(self, kv[:, :max_length, :r], kv[:, :max_length, r:], kv))
            elif config.is_mla_layer(i):
                self.layers.append(MLAState(
                    self,
                    torch.zeros(batch_size, max_length, config.kv_lora_rank, dtype=dtype, device=device),
                    torch.zeros(batch_size, max_length, config.qk_rope_head_dim, dtype=dtype, device=device)))
            else:
                self.layers.append(KDAState(*next(kda_views)))
        self.key_mask = torch.zeros(batch_size, max_length, dtype=torch.bool, device=device)
        counts = torch.zeros(batch_size + 1, dtype=torch.long, device=device)  # one fill for both counters
        self.valid_counts = counts[:batch_size]  # real tokens per row
        self.seen_tokens = 0
        #: host-side: some key_mask column below seen_tokens may be False (left padding, a rejected draft). While
        #: it is False the mask is all True up to seen_tokens and the prefill path passes none (no host read)
        self.holes = False
        self.static = False  # graph-safe mode (see the module docstring)
        self.write_pos = counts[batch_size]
        #: static mla_pool caches of unpadded batches: decode steps read the pool through ops.mla_decode
        #: (MLAState.paged_decode); mla_decode masks by length only, so left-padded rows must stay off
        self.pool_decode = False
        self.decode_seq_lens: torch.Tensor | None = None  # [B] key count of the current step (pool_decode)
        self._write_idx: torch.Tensor | None = None  # static mode: the slots of the open forward's tokens [T]

    def write_indices(self, T: int) -> torch.Tensor:
        """Static mode: the slots [T] of the T tokens being written (``write_pos`` onward), computed once per forward
        by :meth:`begin` and shared by the key mask and every MLA layer (a decode step's is a view of
        ``write_pos``: no kernel)."""
        idx = self._write_idx
        return idx if idx is not None and idx.numel() == T else self._slots(T)

    def _slots(self, T: int) -> torch.Tensor:
        return self.write_pos.view(1) if T == 1 else self.write_pos + torch.arange(T, device=self.device)

    def set_static(self, on: bool = True) -> None:
        """Enter (or leave) graph-safe mode; entering syncs the device write position from ``seen_tokens``."""
        if on and not self.static:
            self.write_pos.fill_(self.seen_tokens)
        self.static = bool(on)

    def advance_host(self, T: int) -> None:
        """Host bookkeeping after replaying a captured static step (the device counters advanced in the graph)."""
        self.seen_tokens += T

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached so far (padding included; the same for every layer)."""
        return self.seen_tokens

    def reset(self) -> None:
        """Empty the cache in place (zeros, no reallocation) for a new batch of the same shape."""
        for t in self._kda_buffers:
            t.zero_()
        for st in self.layers:
            if isinstance(st, MLAState):
                st.latent.zero_()
                st.rope.zero_()
        self.key_mask.zero_()
        self.valid_counts.zero_()
        self.seen_tokens = 0
        self.holes = False
        self.write_pos.zero_()

    def begin(self, T: int, attention_mask: torch.Tensor | None) -> tuple[int, torch.Tensor]:
        """Reserve [seen, seen+T) for the next forward; returns (start, rope positions [B, T])."""
        start = self.seen_tokens
        if start + T > self.max_length:
            raise CacheFullError(f"cache exhausted: {start} tokens cached + {T} new > max_length {self.max_length}")
        m = None if attention_mask is None else attention_mask.to(self.device).bool()
        self.holes |= m is not None
        if self.static:
            self._write_idx = idx = self._slots(T)
            if m is None:
                self.key_mask.index_fill_(1, idx, True)
            else:
                self.key_mask.index_copy_(1, idx, m)
            if self.pool_decode:
                self.decode_seq_lens = (self.write_pos + T).expand(self.batch_size)
        else:
            self.key_mask[:, start:start + T] = True if m is None else m
        if m is None:  # every new token is real: the rows continue at their counts
            positions = (self.valid_counts[:, None].clone() if T == 1
                         else self.valid_counts[:, None] + torch.arange(T, device=self.device))
        else:
            positions = (self.valid_counts[:, None] + m.long().cumsum(1) - 1).clamp_min(0)
        return start, positions

    def commit(self, T: int, attention_mask: torch.Tensor | None) -> None:
        """Close the forward :meth:`begin` opened: T tokens are now cached (``attention_mask`` [B, T]: which of
        them count as real tokens for the rope positions)."""
        m = None if attention_mask is None else attention_mask.to(self.device).long()
        self.valid_counts += T if m is None else m.sum(1)
        self.seen_tokens += T
        if self.static:
            self.write_pos += T
        self._write_idx = None

    def memory_bytes(self) -> int:
        """Bytes held by the cache's tensors (KDA states, MLA latents, the key mask)."""
        n = self.key_mask.numel()
        for st in self.layers:
            ts = ((st.recurrent, st.conv) if isinstance(st, KDAState)
                  else (st.kv,) if st.kv is not None else (st.latent, st.rope))
            n += sum(t.numel() * t.element_size() for t in ts)
        return n
