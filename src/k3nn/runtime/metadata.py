"""The per-step interface between a runner and the layers: :class:`StepMetadata`, filled from :class:`StepInputs`.

A forward over the paged cache needs, per row b of the batch (B rows, T token columns, right-padded):

==================  =============  ====================================================================
``input_ids``       [B, T] long    the tokens fed (padding columns hold ``pad_id``)
``slots``           [B] long       the row's KDA running slot (−1: a padding row of a CUDA-graph batch)
``num_cached``      [B] long       tokens already in the cache (the first new token's position)
``num_new``         [B] int32      tokens the row feeds (≤ T); the rest of its columns are padding
``positions``       [B, T] long    rope / causal positions ``num_cached + t``
``context_lens``    [B] int32      ``num_cached + T``: the keys the paged decode kernel sees (query t sees
                                   the keys before ``num_cached + t + 1``)
``block_table``     [B, W] int32   the row's latent pages (a row of the persistent per-slot table)
``slot_mapping``    [B, T] long    the pool row each new token's latent goes to (``trash_row`` for padding)
``query_start_loc`` [B + 1] int32  prefix sums of ``num_new``
``verify``          [B] bool       the row is a speculative verify window (the pending token + drafts)
``sample``          [B] bool       a token is drawn after this forward (the row fed its last pending token)
``snap``            [B] long       a verify row's KDA snapshot slot for the state at the next page boundary
                                   its commit may cross (−1: none; :meth:`ModelRunner.commit_windows
                                   <k3nn.engine.runner.ModelRunner.commit_windows>`)
==================  =============  ====================================================================

plus host counts of decode rows / verify windows / prefill chunks and, for steps that run eagerly, a
:class:`StepPlan` (host lists the eager paths read: per-row counts, the in-pass KDA checkpoints, the gather
length of the MLA prefill path).

:class:`StepInputs` owns the persistent buffers: a pinned host staging buffer and its device twin laid out as
``[slots | num_cached | num_new | flags | snap | input_ids]`` (fixed offsets for the CUDA-graph batch sizes), the
per-slot block tables on the device (updated in place from the pages a step granted), and the derived tensors. A step writes
its rows into the staging buffer and issues **one** host-to-device copy; :meth:`StepInputs.derive` computes the
rest on the device (graph-safe: no host sync), so a captured step reads the same addresses every replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

__all__ = ["StepMetadata", "StepPlan", "StepInputs", "RowInput", "MAX_BOUNDARY_EXPORTS"]

#: verify rows of one forward that may export a page-boundary state (``snap`` ≥ 0): the export copies this many
#: states per KDA layer whatever the batch size (a fixed shape for the captured steps)
MAX_BOUNDARY_EXPORTS = 16


@dataclass
class StepPlan:
    """Host-side facts of an eagerly run step (see the module docstring)."""

    num_cached: list[int]
    num_new: list[int]
    gather_len: int = 0  # keys the MLA prefill path gathers per row: max(num_cached + T)
    ckpt_pairs: list[tuple[int, int]] = field(default_factory=list)  # (row, position) exported in the pass
    ckpt_targets: list[tuple[int, int, str, int]] = field(default_factory=list)  # (row, pos, "snap" | "row", dst)
    checkpoint_positions: list[list[int]] | None = None  # per row, for the KDA op


@dataclass
class StepMetadata:
    """One forward's inputs (device views of :class:`StepInputs`' buffers; see the module docstring)."""

    input_ids: torch.Tensor
    slots: torch.Tensor
    num_cached: torch.Tensor
    num_new: torch.Tensor
    positions: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    verify: torch.Tensor
    sample: torch.Tensor
    write_state: torch.Tensor | None = None  # [B] bool: False for verify rows (their KDA state is committed later)
    snap: torch.Tensor | None = None  # [B] long: the snapshot slot of a verify row's page-boundary state (−1: none)
    num_decodes: int = 0
    num_verify: int = 0
    num_prefills: int = 0
    plan: StepPlan | None = None

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


@dataclass
class RowInput:
    """What the runner stages for one row: its slot, cached count, tokens (``len(tokens)`` = ``num_new``), and the
    pages granted since the last step (``(column, page)`` pairs of its block table), whether it is a verify window,
    whether a token is drawn after it, and the snapshot slot for its page-boundary state (−1: none)."""

    slot: int
    num_cached: int
    tokens: Sequence[int]
    new_pages: Sequence[tuple[int, int]] = ()
    verify: bool = False
    sample: bool = False
    snap: int = -1


class StepInputs:
    """Persistent step buffers for up to ``max_rows`` rows: a pinned host staging buffer, its device twin (one
    copy per step), the per-slot block tables ``[num_slots, max_blocks]`` and the derived metadata.

    ``graph_tokens``: the largest T of a captured step; longer (eager) steps stage their ids in a growable tail
    region (still one copy). ``trash_row``: the latent pool row padding tokens write to."""

    def __init__(self, max_rows: int, graph_tokens: int, num_slots: int, max_blocks: int, block_size: int,
                 trash_row: int, device: torch.device | str, pad_id: int = 0):
        self.R, self.Tg = max_rows, graph_tokens
        self.block_size, self.trash_row, self.pad_id = block_size, trash_row, pad_id
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.tables = torch.zeros(num_slots, max_blocks, dtype=torch.int32, device=self.device)
        self._fixed = 5 * max_rows + max_rows * graph_tokens  # slots | num_cached | num_new | flags | snap | ids
        self._host = self._alloc_host(self._fixed + 64)
        self._dev = torch.zeros(self._fixed, dtype=torch.long, device=self.device)
        self._tail = torch.zeros(0, dtype=torch.long, device=self.device)  # long ids, table updates
        self._arange: dict[int, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None  # after the last staging copy (the host buffer is reused)

    def _alloc_host(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.long, pin_memory=self.pinned)

    def _arange_t(self, T: int) -> torch.Tensor:
        a = self._arange.get(T)
        if a is None:
            a = self._arange[T] = torch.arange(T, device=self.device)
        return a

    @property
    def max_blocks(self) -> int:
        return self.tables.shape[1]

    # -- staging -------------------------------------------------------------------------------------------------
    def stage(self, rows: Sequence[RowInput], B: int, T: int) -> None:
        """Write ``rows`` (padded with padding rows up to ``B``, each right-padded to ``T`` tokens) and their new
        block-table entries into the staging buffer and copy it to the device (one copy; the table updates are
        applied on the device)."""
        n = len(rows)
        if n > B or B > self.R:
            raise ValueError(f"StepInputs.stage: {n} rows padded to B={B}, at most max_rows={self.R}")
        upd = sum(len(r.new_pages) for r in rows)
        if self._copied is not None:  # the previous step's copy has left the pinned buffer (an asynchronous
            self._copied.synchronize()  # engine stages the next step before reading the last one's draws)
        big = T > self.Tg
        tail = (B * T if big else 0) + 3 * upd
        need = self._fixed + tail
        if self._host.numel() < need:
            self._host = self._alloc_host(max(need, 2 * self._host.numel()))
        h = self._host.numpy()
        R = self.R
        h[0:B] = -1
        h[R:R + B] = 0
        h[2 * R:2 * R + B] = 0
        h[3 * R:3 * R + B] = 0
        h[4 * R:4 * R + B] = -1
        ids_at = self._fixed if big else 5 * R
        ids = h[ids_at:ids_at + B * T].reshape(B, T)
        ids[:] = self.pad_id
        u = self._fixed + (B * T if big else 0)
        cols, pages, slots_u = [], [], []
        for b, r in enumerate(rows):
            h[b] = r.slot
            h[R + b] = r.num_cached
            h[2 * R + b] = len(r.tokens)
            h[3 * R + b] = int(r.verify) | (int(r.sample) << 1)
            h[4 * R + b] = r.snap
            if len(r.tokens):
                ids[b, :len(r.tokens)] = np.asarray(r.tokens, dtype=np.int64)
            for c, p in r.new_pages:
                slots_u.append(r.slot)
                cols.append(c)
                pages.append(p)
        if upd:
            h[u:u + upd] = slots_u
            h[u + upd:u + 2 * upd] = cols
            h[u + 2 * upd:u + 3 * upd] = pages
        src = torch.from_numpy(h[:need]) if not self.pinned else self._host[:need]
        if tail:
            if self._tail.numel() < tail:
                self._tail = torch.zeros(max(tail, 2 * self._tail.numel()), dtype=torch.long, device=self.device)
            self._dev.copy_(src[:self._fixed], non_blocking=True)
            self._tail[:tail].copy_(src[self._fixed:need], non_blocking=True)
        else:
            self._dev.copy_(src[:self._fixed], non_blocking=True)
        if self.pinned and not torch.cuda.is_current_stream_capturing():
            self._copied = self._copied or torch.cuda.Event()
            self._copied.record()
        self._big_ids = self._tail[:B * T].view(B, T) if big else None
        if upd:
            t = self._tail[(B * T if big else 0):(B * T if big else 0) + 3 * upd].view(3, upd)
            self.tables.index_put_((t[0], t[1]), t[2].to(torch.int32))

    def ids(self, B: int, T: int) -> torch.Tensor:
        """The staged token ids [B, T] on the device (a view: writing it changes the step's inputs)."""
        if T > self.Tg and self._big_ids is not None:
            return self._big_ids
        return self._dev[5 * self.R:5 * self.R + B * T].view(B, T)

    def feed(self, B: int, T: int, tokens: torch.Tensor, shift: torch.Tensor | None = None) -> None:
        """Overwrite the first token of the staged (B, T) step's first ``len(tokens)`` rows on the device and add
        ``shift`` [n] to their cached counts (an asynchronous step launched before the host read the draws that
        decide them: the previous step's tokens, a speculative round's accepted drafts). Stream-ordered after
        the staging copy; graph-safe."""
        n = tokens.shape[0]
        self.ids(B, T)[:n, 0].copy_(tokens)
        if shift is not None:
            self._dev[self.R:self.R + n] += shift

    def draft_view(self, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a drafter reads of a staged (B, T) step, graph-safe: each row's block table [B, max_blocks]
        (int32; padding rows read slot 0's, masked by their zero cached count), cached counts [B] and the token
        ids [B, T] (a view: column 0 is each row's pending token, the drafts go after it)."""
        slots = self._dev[0:B]
        return self.tables.index_select(0, slots.clamp_min(0)), self._dev[self.R:self.R + B], self.ids(B, T)

    # -- derived ---------------------------------------------------------------------------------------------
    def derive(self, B: int, T: int, verify_rows: bool = False) -> StepMetadata:
        """The metadata of a staged (B, T) step as device tensors (graph-safe: device ops only). For a captured
        step call it inside the capture: its outputs are the graph's, recomputed by every replay.
        ``verify_rows``: the step has verify windows (their KDA state is not written: ``write_state``)."""
        R = self.R
        slots = self._dev[0:B]
        num_cached = self._dev[R:R + B]
        num_new = self._dev[2 * R:2 * R + B]
        flags = self._dev[3 * R:3 * R + B]
        ids = self.ids(B, T)
        t = self._arange_t(T)
        positions = num_cached[:, None] + t[None, :]
        live = slots >= 0
        table = self.tables.index_select(0, slots.clamp_min(0))
        col = torch.div(positions, self.block_size, rounding_mode="floor").clamp_max(self.max_blocks - 1)
        page = table.gather(1, col).long()
        fed = (t[None, :] < num_new[:, None]) & live[:, None]
        slot_mapping = torch.where(fed, page * self.block_size + positions % self.block_size,
                                   torch.full_like(positions, self.trash_row))
        nn32 = num_new.to(torch.int32)
        qsl = torch.cat([nn32.new_zeros(1), nn32.cumsum(0).to(torch.int32)])
        verify = (flags & 1) != 0
        return StepMetadata(input_ids=ids, slots=slots, num_cached=num_cached, num_new=nn32, positions=positions,
                            context_lens=(num_cached + T).to(torch.int32), block_table=table,
                            slot_mapping=slot_mapping, query_start_loc=qsl, verify=verify,
                            sample=(flags & 2) != 0, write_state=~verify if verify_rows else None,
                            snap=self._dev[4 * R:4 * R + B])
