"""The engine's model runner: stages a step's rows, runs the forward (a replayed CUDA graph for decode and verify
steps, eagerly otherwise), and commits verify windows' KDA state.

Per forward the engine hands the runner its rows (:class:`RowWork`: the request, the tokens it feeds, whether it
is a verify window). The runner

1. writes them into :class:`~k3nn.runtime.metadata.StepInputs` (slots, cached counts, tokens, the pages granted
   since the last step) and copies that staging buffer to the device once;
2. for a batch of decode / verify rows only (on CUDA): pads it to the next captured batch size with padding rows
   (slot −1: no KDA state touched, latents to the trash page) and replays the graph of ``(batch size, tokens,
   verify)``, whose body derives the metadata on the device, runs the model and the LM head over every column;
3. otherwise runs the same body eagerly with the step's :class:`~k3nn.runtime.metadata.StepPlan` (the KDA
   checkpoints of right-padded rows on the chunk path and of planned prefix snapshots, the MLA gather length).

Verify rows read their committed KDA state without writing it (``write_state``); after acceptance
:meth:`ModelRunner.commit_windows` folds each row's accepted prefix into its state with the fused decode op over
the inputs the forward recorded (one launch per KDA layer, graph-safe; a row that keeps nothing of its window
past the pending token still folds that token). MLA pages need nothing: rejected entries lie past the row's
length and are overwritten.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..cache.paged import HybridPools, PagedCache
from ..kernels.registry import backend as use_backend
from ..kernels.registry import current_backend, uncaptured_step
from ..runtime.graphs import GraphRunner
from ..runtime.metadata import MAX_BOUNDARY_EXPORTS, RowInput, StepInputs, StepMetadata, StepPlan

log = logging.getLogger(__name__)

__all__ = ["ModelRunner", "RowWork", "ForwardOut", "graph_batch_sizes", "padding_groups"]


def graph_batch_sizes(max_rows: int) -> list[int]:
    """Padded batch sizes with a captured decode graph: 1, 2, 4, 8, then steps of 8 up to ``max_rows``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_rows] + list(range(16, max_rows, 8)) + [max_rows]
    return sorted(set(sizes))


def padding_groups(rows: Sequence["RowWork"], slack: float = 1.25) -> list[list["RowWork"]]:
    """Split prefill rows into forwards whose right padding stays small: a forward runs [B, T] token slots for
    its rows' tokens, so rows join a group (longest first) while B·T ≤ ``slack`` × their tokens. E.g. chunks of
    2048, 2048, 2048 and 4 tokens run as [2048 × 3] and [4] instead of 4 × 2048 slots for 6148 tokens. Rows keep
    their order within a group; groups come in the order of their first row."""
    order = sorted(range(len(rows)), key=lambda i: -rows[i].num_new)
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        n = rows[i].num_new
        if g is None or (len(g) + 1) * rows[g[0]].num_new > slack * (sum(rows[j].num_new for j in g) + n):
            groups.append([i])
        else:
            g.append(i)
    return [[rows[i] for i in sorted(g)] for g in sorted(groups, key=min)]


def _exports(rows: Sequence["RowWork"]) -> bool:
    """Whether a row of the forward has a page-boundary slot (its verify commit may export that state)."""
    return any(w.boundary is not None for w in rows)


def _variant(key: tuple, boundary: bool) -> tuple:
    """The graph key of a verify step's variant that exports a page boundary's state (``boundary``)."""
    return key + ("boundary",) if boundary else key


@dataclass
class RowWork:
    """One row of a forward: ``req`` feeds ``tokens`` (``len(tokens)`` ≥ 1) from ``req.num_computed``;
    ``decode``: the row feeds its pending token (plus drafts); ``verify``: the tokens are a verify window (the
    pending token + drafts); ``sample``: a token is drawn after the forward; ``snapshots``: (position in this
    chunk, snapshot slot) pairs to export; ``boundary``: a verify row's snapshot slot for the KDA state at the page
    boundary its commit may cross (:meth:`ModelRunner.commit_windows`), ``shift_max``: how far the device may still
    move the row's cached count (an asynchronous round), ``kept``: the window tokens the acceptance kept."""

    req: object
    tokens: list[int]
    decode: bool = False
    verify: bool = False
    sample: bool = False
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    device_drafts: torch.Tensor | None = None  # [n] drafts on the device: fed instead of tokens[1:1 + n]
    boundary: int | None = None
    shift_max: int = 0
    kept: int = 0

    @property
    def num_new(self) -> int:
        return len(self.tokens)


@dataclass
class ForwardOut:
    """A forward's outputs: ``logits`` [B, V] at each row's last fed token; ``columns`` [B, T, V] every column's
    logits; ``verify``: the forward has verify windows; ``hidden``: the drafter's tapped hidden states [B, T, d]
    per tap; ``meta``: the step's metadata (device views); ``graphed``: the forward replayed a CUDA graph;
    ``greedy`` [B, 2]: a replayed decode step's argmax and non-finite flag per row (computed inside the graph);
    ``padded``: the graph body's logits over the padded batch (the acceptance step of a verify forward reads them);
    ``packed``: a greedy round's draws, computed inside its graph (:meth:`ModelRunner.sample`'s packed layout)."""

    logits: torch.Tensor
    columns: torch.Tensor
    verify: bool
    hidden: list[torch.Tensor] | None
    meta: StepMetadata
    graphed: bool = False
    greedy: torch.Tensor | None = None
    padded: torch.Tensor | None = None
    packed: torch.Tensor | None = None


class ModelRunner:
    """Runs ``model`` (a :class:`k3nn.KimiK3`) over the engine's ``pools``; see the module docstring.

    ``max_rows``: rows per forward (the engine's ``max_num_seqs``); ``max_window``: the longest verify window
    (1 + drafts); ``taps``: target layers whose outputs the drafter reads; ``tap_sink(hidden, positions,
    slot_mapping)``: a graph-safe function the step calls with them (the drafter's context write), captured with the
    step; ``cuda_graphs``: True captures decode
    steps (CUDA devices; the eager backend is never captured), ``"static"`` runs the same padded, graph-safe
    decode steps without capture (any device), False runs every step as the eager path does. ``drafter``: an
    engine drafter with ``step_drafts`` (:class:`~k3nn.engine.speculative.DSparkEngineDrafter`): greedy rounds
    (:meth:`forward` with ``draft_keys``) draft from the staged step's own buffers."""

    def __init__(self, model, pools: HybridPools, *, max_rows: int, max_window: int = 1,
                 taps: Sequence[int] | None = None, pad_id: int = 0, cuda_graphs: bool | str = True,
                 max_context: int | None = None, tap_sink=None, drafter=None, boundary_snapshots: bool = False):
        self.model, self.pools = model, pools
        self.drafter = drafter if hasattr(drafter, "step_drafts") else None
        self.cache = PagedCache(pools)
        self.max_rows, self.max_window = max_rows, max(1, max_window)
        self.taps = list(taps) if taps else None
        self.tap_sink = tap_sink if self.taps else None
        ctx = max_context or model.config.max_position_embeddings
        self.inputs = StepInputs(max_rows, self.max_window, pools.running.num_slots,
                                 pools.max_blocks(ctx + self.max_window), pools.block_size, pools.trash_row,
                                 pools.device, pad_id)
        eager = (getattr(model, "backend", None) or current_backend()) == "eager"
        self.graphs = GraphRunner(pools.device, enabled=cuda_graphs is True and not eager, name="engine decode")
        self.static = self.graphs.enabled or cuda_graphs == "static"  # decode steps take the padded graph body
        self.batch_sizes = graph_batch_sizes(max_rows)
        self.kda = [l.self_attn for i, l in enumerate(model.model.layers) if not model.config.is_mla_layer(i)]
        self.fused_max = min((m.fused_decode_max_tokens for m in self.kda), default=0)
        self._recorded: dict | None = None
        # verify commits may export the state at a page boundary (decode-state retention): their captured steps
        # come in two variants, with and without the export
        self.boundary_snapshots = boundary_snapshots

    # -- staging --------------------------------------------------------------------------------------------------
    @staticmethod
    def _new_pages(req) -> list[tuple[int, int]]:
        """Block-table entries of ``req``'s row not yet on the device (``req.synced_blocks`` of them are; a row
        change or a freed block list resets it)."""
        done = req.synced_blocks if req.synced_blocks <= len(req.blocks) else 0
        req.synced_blocks = len(req.blocks)
        return [(c, req.blocks[c]) for c in range(done, len(req.blocks))]

    def padded_size(self, n: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= n), None)

    def graphable(self, rows: Sequence[RowWork]) -> bool:
        """Decode / verify rows only (each feeds its pending token, plus drafts), within the captured shapes."""
        return (self.static and 0 < len(rows) <= self.max_rows and all(w.decode for w in rows)
                and max(w.num_new for w in rows) <= self.max_window)

    # -- the forward ------------------------------------------------------------------------------------------
    def _body(self, B: int, T: int, verify: bool, plan: StepPlan | None, embeds=None, last=None):
        """Derive the metadata, run the model and the LM head over every column, or over each row's column
        ``last[b]`` when given ([B, 1, V]: a prefill chunk needs no more); graph-safe without a plan."""
        meta = self.inputs.derive(B, T, verify)
        meta.plan = plan
        self.cache.meta = meta
        self.cache.recorder = {} if verify else None
        with use_backend(self.model.backend):
            h, hidden = self.model.model(None if embeds is not None else meta.input_ids, embeds, self.cache, None,
                                         self.taps, plan.checkpoint_positions if plan is not None else None)
            if last is not None:
                h = h[torch.arange(h.shape[0], device=h.device), last][:, None]
            logits = self.model.lm_head(h)
            if self.tap_sink is not None:  # the drafter's context of every fed token, inside the step (graph too)
                self.tap_sink(hidden, meta.positions, meta.slot_mapping)
        return logits, hidden, meta, self.cache.recorder

    def _graph_body(self, B: int, T: int, verify: bool):
        """The captured step: :meth:`_body`, plus for decode steps each row's argmax and non-finite flag [B, 2]
        (greedy rows then need one copy of them, no launch after the replay)."""
        logits, hidden, meta, rec = self._body(B, T, verify, None)
        greedy = None
        if T == 1 and not verify:
            last = logits[:, 0]
            greedy = torch.stack([last.argmax(-1), (~torch.isfinite(last).all(-1)).long()], 1)
        return logits, hidden, meta, rec, greedy

    def _round_body(self, B: int, T: int, boundary: bool = False):
        """The verify forward of a greedy round and its acceptance (with the KDA commit) in one graph-safe step:
        :meth:`_body`, then :meth:`_greedy_accept_body` over its logits."""
        logits, hidden, meta, rec = self._body(B, T, True, None)
        return (logits, hidden, meta, self._last_columns(logits, meta),
                self._greedy_accept_body(logits, meta, rec, boundary))

    @staticmethod
    def _last_columns(W: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """Each row's logits at its last fed column, [B, V] of ``W`` [B, T, V] (graph-safe)."""
        B, T = W.shape[:2]
        return W[torch.arange(B, device=W.device), (meta.num_new[:B].long() - 1).clamp(0, T - 1)]

    def _draft_body(self, B: int, T: int, L: int) -> None:
        """The drafter's greedy drafts for a staged (B, T) step, written into its token columns 1 .. T − 1
        (graph-safe; ``L`` keys of drafter context)."""
        tables, cached, ids = self.inputs.draft_view(B, T)
        ids[:, 1:].copy_(self.drafter.step_drafts(tables, cached, ids[:, 0], T - 1, L))

    def round_width(self) -> int:
        """The token columns of every greedy round: the longest verify window (rows with fewer drafts feed fewer
        tokens), so a round's graphs depend on the batch size and the drafter's key bucket alone."""
        return self.max_window

    @torch.no_grad()
    def forward(self, rows: Sequence[RowWork], embeds_fn=None, all_columns: bool = False,
                draft_keys: int | None = None, feed: torch.Tensor | None = None,
                shift: torch.Tensor | None = None) -> ForwardOut:
        """One forward over ``rows`` (see the module docstring). ``embeds_fn(input_ids [B, T]) → [B, T, d]``: input
        embeddings instead of ids (image tokens). The eager path's ``columns`` are every fed column's logits in a
        verify forward or with ``all_columns``, else each row's last ([B, 1, V]: the LM head skips the rest of
        a prefill chunk).

        ``draft_keys``: run the rows as a *greedy round* (greedy decode rows whose drafts are placeholders): the
        step is staged with :meth:`round_width` columns, the drafter's graph (per batch size and ``draft_keys``,
        the drafter's key bucket) writes every row's drafts into it on the device, then one graph runs the verify
        forward, the greedy acceptance and the KDA commit; the draws come back in ``packed`` (no host step
        between drafting and acceptance). ``feed`` [n]: each row's first token on the device, copied over its
        staged id, and ``shift`` [n]: added to its staged cached count (an asynchronous step fed the previous
        step's draws, :mod:`~k3nn.engine.overlap`; :meth:`StepInputs.feed
        <k3nn.runtime.metadata.StepInputs.feed>`)."""
        n = len(rows)
        T = max(w.num_new for w in rows)
        verify = any(w.verify for w in rows)
        graph = embeds_fn is None and self.graphable(rows)
        if draft_keys is not None:
            if not (graph and self.drafter is not None):
                raise ValueError("ModelRunner.forward: draft_keys needs graph-shaped decode rows and a drafter with "
                                 "step_drafts")
            T = self.round_width()
        B = self.padded_size(n) if graph else n
        self.inputs.stage([RowInput(w.req.row, w.req.num_computed, w.tokens, self._new_pages(w.req), w.verify,
                                    w.sample, -1 if w.boundary is None else w.boundary) for w in rows], B, T)
        snap = _exports(rows)
        if feed is not None:
            self.inputs.feed(B, T, feed[:n], None if shift is None else shift[:n])
        if draft_keys is not None:
            self.graphs.run(("draft", B, T, draft_keys), lambda: self._draft_body(B, T, draft_keys))
            key = _variant((B, T, "round"), snap)
            logits, hidden, meta, last, packed = self.graphs.run(key, lambda: self._round_body(B, T, snap))
            self.cache.meta, self._recorded = meta, None  # committed inside the round
            return ForwardOut(last[:n], logits[:n], True, None if hidden is None else [x[:n] for x in hidden], meta,
                              key in self.graphs, packed=packed[:n])
        self._feed_device_drafts(rows, B, T)
        if graph:
            key = (B, T, verify)
            logits, hidden, meta, rec, greedy = self.graphs.run(key, lambda: self._graph_body(B, T, verify))
            self.cache.meta, self._recorded = meta, rec
            last = logits[:n, 0] if T == 1 else logits[torch.arange(n, device=logits.device),
                                                       self._last_index(rows, logits.device)]
            return ForwardOut(last, logits[:n], verify, None if hidden is None else [x[:n] for x in hidden], meta,
                              key in self.graphs, None if greedy is None else greedy[:n], logits)
        plan = self._plan(rows, T)
        self.cache.plan_rows = [w.req.row for w in rows]
        embeds = None
        if embeds_fn is not None:
            embeds = embeds_fn(self.inputs.derive(B, T).input_ids)
        idx = self._last_index(rows, self.inputs.device)
        every = verify or all_columns
        with uncaptured_step():
            logits, hidden, meta, rec = self._body(B, T, verify, plan, embeds, None if every else idx)
        self._recorded = rec
        if not every:
            last = logits[:, 0]
        else:
            last = logits[:, -1] if all(w.num_new == T for w in rows) else logits[torch.arange(n, device=idx.device),
                                                                                   idx]
        return ForwardOut(last, logits, verify, hidden, meta, False)

    def _feed_device_drafts(self, rows: Sequence[RowWork], B: int, T: int) -> None:
        """Copy each row's device drafts into its token ids after the pending token (stream-ordered after the
        staging copy; one copy per run of consecutive rows with drafts of one length)."""
        ids = None
        b = 0
        while b < len(rows):
            d = rows[b].device_drafts
            if d is None:
                b += 1
                continue
            e = b + 1
            while e < len(rows) and rows[e].device_drafts is not None and rows[e].device_drafts.shape == d.shape:
                e += 1
            ids = self.inputs.ids(B, T) if ids is None else ids
            n = d.shape[0]
            ids[b:e, 1:1 + n].copy_(torch.stack([w.device_drafts for w in rows[b:e]]) if e - b > 1 else d[None])
            b = e

    @torch.no_grad()
    def capture_padding(self, B: int, T: int, verify: bool) -> bool:
        """Warm up and capture the graph of ``(B, T, verify)`` over a batch of padding rows (slot −1: no KDA
        state is read or written, latents go to the trash page): no request is touched."""
        self.inputs.stage([], B, T)
        ok = self.graphs.capture((B, T, verify), lambda: self._graph_body(B, T, verify))
        if ok and verify:  # the greedy acceptance over that graph's outputs (padding rows: nothing committed)
            graph, (logits, _, meta, rec, _) = self.graphs.graphs[(B, T, verify)]
            graph.replay()  # a capture computes nothing: fill the outputs the acceptance's warm-up run reads
            for snap in (False, True)[:1 + self.boundary_snapshots]:
                ok = ok and self.graphs.capture(_variant(("accept", B, T), snap),
                                                lambda: self._greedy_accept_body(logits, meta, rec, snap))
        if ok and verify and self.drafter is not None and T == self.round_width():
            for snap in (False, True)[:1 + self.boundary_snapshots]:
                ok = ok and self.graphs.capture(_variant((B, T, "round"), snap),
                                                lambda: self._round_body(B, T, snap))
        return ok

    def draft_key_buckets(self, batch_size: int) -> list[int]:
        """The drafter's key buckets whose draft graphs ``Engine.warmup()`` captures at a padded batch size:
        powers of two from one page up to the bucket of the longest context a request can hold (the model's
        context, the page pool), while the batch's gather fits the context's key budget (``fits``: twice the pool's
        tokens; a larger round drafts on the host path). Empty without a drafter that drafts in rounds."""
        if self.drafter is None:
            return []
        pool = self.pools.allocator.num_blocks * self.pools.block_size
        ctx = self.drafter.context
        top = ctx.key_length(min(self.model.config.max_position_embeddings, pool))
        out, L = [], ctx.key_length(1)
        while L <= top and ctx.fits(batch_size, L):
            out.append(L)
            L *= 2
        return out

    @torch.no_grad()
    def capture_draft(self, B: int, L: int) -> bool:
        """Warm up and capture the drafter's graph of a greedy round of ``B`` rows over ``L`` keys, on a batch of
        padding rows (it writes only the staged token ids). Returns whether a graph was captured."""
        T = self.round_width()
        self.inputs.stage([], B, T)
        return self.graphs.capture(("draft", B, T, L), lambda: self._draft_body(B, T, L))

    @staticmethod
    def _last_index(rows: Sequence[RowWork], device) -> torch.Tensor:
        return torch.tensor([w.num_new - 1 for w in rows], device=device)

    def _plan(self, rows: Sequence[RowWork], T: int) -> StepPlan:
        """The eager step's host facts: checkpoints for planned snapshots, and (on the chunk path) for the rows
        that feed fewer than T tokens."""
        plan = StepPlan([w.req.num_computed for w in rows], [w.num_new for w in rows])
        plan.gather_len = max(c + T for c in plan.num_cached)
        chunk_path = T > self.fused_max or any(w.snapshots for w in rows)
        targets, per_row = [], [[] for _ in rows]
        for b, w in enumerate(rows):
            for p, slot in w.snapshots:
                if not 0 < p <= w.num_new:
                    raise ValueError(f"snapshot position {p} of row {b} is outside (0, {w.num_new}]")
                per_row[b].append(p)
                targets.append((b, p, "snap", slot))
            if chunk_path and w.num_new < T:
                per_row[b].append(w.num_new)
                targets.append((b, w.num_new, "row", b))
        targets.sort(key=lambda t: t[0])  # the order the KDA op returns them: row-major, in the order given
        if targets:
            plan.ckpt_targets = targets
            plan.ckpt_pairs = [(b, p) for b, p, _, _ in targets]
            plan.checkpoint_positions = per_row
        return plan

    # -- verify windows ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def commit_windows(self, verify_rows: torch.Tensor, keep: torch.Tensor, rec=None, meta=None,
                       boundary: bool = False) -> None:
        """After a verify forward: fold the first ``keep[b]`` window tokens of every verify row into its KDA state
        (``verify_rows`` [B] bool, ``keep`` [B] long, device tensors; rows of the forward in order). ``rec`` /
        ``meta``: the forward's recorded inputs and metadata (default: the last forward's).

        ``boundary``: rows with a snapshot slot (``meta.snap``) also export their state at the next page boundary
        after their cached count: the fold stops there (or at ``keep``, whichever comes first), every KDA layer's
        state is copied into the slot, and the rest of the window is folded after it. Graph-safe. A row whose
        window keeps fewer tokens than the boundary needs leaves its state at ``keep`` in the slot (the host,
        knowing the acceptance, drops it)."""
        rec = self._recorded if rec is None else rec
        if not rec:
            return
        meta = self.cache.meta if meta is None else meta
        B = keep.shape[0]
        slots = torch.where(verify_rows, meta.slots[:B], torch.full_like(meta.slots[:B], -1))
        if not boundary:
            self._fold(rec, B, slots, keep)
        else:
            U = self.pools.block_size
            cached = meta.num_cached[:B]
            snap = meta.snap[:B]
            export = verify_rows & (snap >= 0)
            first = torch.where(export, torch.minimum(keep, (cached // U + 1) * U - cached), keep)
            self._fold(rec, B, slots, first)
            self._export_states(export, slots, snap)
            self._fold(rec, B, slots, keep - first, first)
        self._recorded = None

    def _fold(self, rec, B: int, slots: torch.Tensor, count: torch.Tensor, start: torch.Tensor | None = None) -> None:
        """Fold ``count[b]`` recorded window tokens of row b, from its token ``start[b]`` on (default 0), into the
        KDA state of ``slots[b]`` in every KDA layer (one fused decode call per layer)."""
        run = self.pools.running
        cols = None
        with use_backend(self.model.backend):
            for j, mod in enumerate(self.kda):
                qkv, f, b = (x[:B] for x in rec[j])
                if start is not None:  # each row's window from its own start (the tail past T is not folded)
                    T = qkv.shape[1]
                    if cols is None:
                        cols = (torch.arange(T, device=qkv.device)[None, :] + start[:, None]).clamp_max(T - 1)
                    qkv, f, b = (x.gather(1, cols[:, :, None].expand(-1, -1, x.shape[2])) for x in (qkv, f, b))
                mod.commit_window(qkv, f, b, run.recurrent[j], run.conv[j], slots, count.to(torch.int32))

    def _export_states(self, export: torch.Tensor, slots: torch.Tensor, snap: torch.Tensor) -> None:
        """Copy the running KDA state of the rows where ``export`` [B] (at most ``MAX_BOUNDARY_EXPORTS`` of them:
        the planner's cap) into their snapshot slots ``snap`` [B], graph-safe with a fixed number of copies: the
        exporting rows first, the other copies rewrite the first exporting row's state into its slot (identical
        writes), or, with no row exporting, snapshot slot 0 its own content."""
        run, pool = self.pools.running, self.pools.snapshots
        n = export.shape[0]
        E = min(n, MAX_BOUNDARY_EXPORTS)
        # exporting rows first, each group in row order: a scatter by rank, and the first row as a 1-element index
        # (an argsort(stable=True) and a 0-dim tensor index here did not capture on the H200)
        ex = export.long()
        rank = torch.where(export, ex.cumsum(0) - 1, ex.sum() + (1 - ex).cumsum(0) - 1)
        order = torch.empty_like(rank).scatter_(0, rank, torch.arange(n, device=rank.device))[:E]
        on, first, anyone = export[order], order[:1], export.any()
        dst = torch.where(on, snap[order], torch.where(anyone, snap.index_select(0, first), torch.zeros_like(order)))
        src = torch.where(on, slots[order], torch.where(anyone, slots.index_select(0, first),
                                                        torch.full_like(order, -1)))
        for states, into in ((run.recurrent, pool.recurrent), (run.conv, pool.conv)):
            for r, p in zip(states, into):
                rows = r.index_select(0, src.clamp_min(0))
                old = p[:1].expand_as(rows)  # slot 0 as it is (no row exports)
                keep = (src >= 0).view(-1, *[1] * (rows.dim() - 1))
                p.index_copy_(0, dst, torch.where(keep, rows, old).to(p.dtype))

    def _greedy_accept_body(self, W: torch.Tensor, meta: StepMetadata, rec, boundary: bool = False) -> torch.Tensor:
        """Greedy draws of a padded verify forward, graph-safe (captured as the step after the forward's graph):
        per row [token, logits non-finite, accepted drafts, next token, window non-finite, the T − 1 fed drafts]
        ([B, 4 + T], the layout of :meth:`sample`'s packed rows), the verify rows' KDA state committed. The same
        choices as :meth:`sample` for greedy rows without penalties or stop blocks (their processed scores are the
        logits)."""
        from ..runtime.sampling import greedy_accept

        B, T, _ = W.shape
        nn = meta.num_new[:B].long()
        ver = meta.verify[:B]
        last = self._last_columns(W, meta)
        target = W.argmax(-1)  # [B, T]
        limit = torch.where(ver, nn - 1, torch.zeros_like(nn)).clamp_min(0)
        m = greedy_accept(target, meta.input_ids[:B, 1:T], limit)
        nxt = target.gather(1, m[:, None])[:, 0]
        m = torch.where(ver, m, torch.zeros_like(m))
        self.commit_windows(ver, m + 1, rec, meta, boundary)
        seen = torch.arange(T, device=W.device)[None, :] <= limit[:, None]
        bad = (~torch.isfinite(W).all(-1) & seen).any(-1) & ver
        return torch.cat([torch.stack([last.argmax(-1), (~torch.isfinite(last).all(-1)).long(), m, nxt, bad.long()],
                                      1), meta.input_ids[:B, 1:T]], 1)

    # -- drawing tokens -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, out: ForwardOut, rows: Sequence[RowWork], table, synthetic_length: int | None = None,
               draft_probs: dict[int, torch.Tensor] | None = None, logprobs: dict[int, int] | None = None,
               defer: bool = False):
        """Draw every row's tokens on the device and bring them to the host in one copy (plus one for rows that
        asked for log-probabilities).

        Rows with ``sample``: the next token from the logits at the row's last fed token (``table``'s per-row
        processing and warpers; counter = the token's position). Verify rows: the leading drafts equal to the
        target's choice (greedy) or lossless rejection sampling (sampling rows, ``draft_probs`` b → [n_b, V] for
        sampled drafts), or ``synthetic_length`` − 1 drafts (benchmarks); then their KDA state is committed
        (:meth:`commit_windows`). ``logprobs``: row → k (raw-distribution log-probabilities of its tokens and its
        k most likely tokens). ``defer``: plain rows without log-probabilities only; return the ``[n, 2]`` draws
        (token, logits non-finite) on the device instead of reading them."""
        from ..runtime.rng import RowRNG
        from ..runtime.sampling import greedy_accept, rejection_accept, token_logprobs

        n = len(rows)
        meta = out.meta
        if out.packed is not None:  # a greedy round: drawn and committed inside its graph
            return Draws(out.packed.tolist(), {}, True)
        variant = table.variant([w.req.row for w in rows if w.sample])
        if defer and (out.verify or logprobs):
            raise ValueError("ModelRunner.sample: defer takes plain rows without log-probabilities")
        if not (out.verify or logprobs or variant.sampling or variant.penalties or variant.min_tokens):
            # greedy rows only: the argmax and the non-finite flag, one copy (the decode loop's common case)
            if out.greedy is not None:  # computed inside the replayed graph
                return out.greedy if defer else Draws(out.greedy.tolist(), {}, False)
            ids = out.logits.argmax(-1)
            bad = (~torch.isfinite(out.logits).all(-1)).long()
            packed = torch.stack([ids, bad], 1)
            return packed if defer else Draws(packed.tolist(), {}, False)
        if (out.verify and out.padded is not None and not (logprobs or draft_probs or variant.sampling
                                                            or variant.penalties or variant.min_tokens)
                and synthetic_length is None):
            # greedy verify rows of a graph-shaped forward: acceptance and commit as one more replayed step
            B, T = out.padded.shape[:2]
            rec = self._recorded
            snap = _exports(rows)

            def accept():
                return self._greedy_accept_body(out.padded, meta, rec, snap)

            # captured only over a replayed forward's outputs (an eager forward's are new tensors every call)
            key = _variant(("accept", B, T), snap)
            packed = self.graphs.run(key, accept) if out.graphed else accept()
            self._recorded = None
            return Draws(packed[:n].tolist(), {}, True)
        slots = meta.slots[:n]
        nn = meta.num_new[:n].long()
        ver = meta.verify[:n]
        base = meta.num_cached[:n] + torch.where(ver, torch.ones_like(nn), nn)  # position of the first draw
        out_len = base - table.prompt_len[slots]
        ids = table.choose(out.logits[:, None], slots, out_len, variant)[0][:, 0]
        cols = [ids, (~torch.isfinite(out.logits).all(-1)).long()]
        plain = meta.sample[:n] & ~ver
        table.record(slots, ids[:, None], plain[:, None])
        chosen = None
        if out.verify:
            W = out.columns
            T = W.shape[1]
            drafts = meta.input_ids[:n, 1:T]
            limit = torch.where(ver, nn - 1, torch.zeros_like(nn)).clamp_min(0)
            s = table.scores(W, slots, out_len, variant, drafts)
            target = s.argmax(-1)  # [n, T]
            if synthetic_length is not None:
                m = limit.clamp(max=max(0, int(synthetic_length) - 1))
            else:
                m = greedy_accept(target, drafts, limit)
            nxt = target.gather(1, m[:, None])[:, 0]
            if variant.sampling:
                w = table.warp(s, slots, variant)
                rng = RowRNG(table.seed[slots], base)
                if synthetic_length is not None:
                    ms, ns = m, rng.gumbel_argmax(w.gather(1, m[:, None, None].expand(n, 1, w.shape[-1]))[:, 0],
                                                  offset=m)
                else:
                    q = None
                    if draft_probs:
                        q = torch.zeros(n, T - 1, W.shape[-1], dtype=torch.float32, device=W.device)
                        q.scatter_(2, drafts[..., None], 1.0)
                        for b, pr in draft_probs.items():
                            q[b, :pr.shape[0]] = pr.float()
                    ms, ns = rejection_accept(w, drafts, q, limit, rng)
                samp = table.do_sample[slots]
                m, nxt = torch.where(samp, ms, m), torch.where(samp, ns, nxt)
            m = torch.where(ver, m, torch.zeros_like(m))
            self.commit_windows(ver, m + 1, boundary=_exports(rows))
            j = torch.arange(T, device=W.device)[None, :]
            seen_cols = j <= limit[:, None]
            bad = (~torch.isfinite(W).all(-1) & seen_cols).any(-1) & ver
            chosen = torch.where(j[:, :T - 1] < m[:, None], drafts, nxt[:, None].expand(n, T - 1)) if T > 1 else None
            chosen = torch.cat([chosen, nxt[:, None]], 1) if chosen is not None else nxt[:, None]  # [n, T]
            table.record(slots, chosen, (j <= m[:, None]) & ver[:, None])
            cols += [m, nxt, bad.long(), *drafts.unbind(1)]
        packed = torch.stack(cols, 1)
        if defer:
            return packed
        packed = packed.tolist()  # the one host copy of the step's draws
        lps: dict[int, list] = {}
        if logprobs:
            idx = sorted(logprobs)
            k = max(logprobs.values())
            plain_rows = [b for b in idx if not rows[b].verify]
            rows_lp = []
            if plain_rows:
                pr = torch.tensor(plain_rows, device=ids.device)
                rows_lp.append(token_logprobs(out.logits[pr], ids[pr], k))
            ver_rows = [b for b in idx if rows[b].verify]
            if ver_rows:
                vr = torch.tensor(ver_rows, device=ids.device)
                Wv = out.columns[vr]
                rows_lp.append(token_logprobs(Wv.reshape(-1, Wv.shape[-1]), chosen[vr].reshape(-1), k))
            host = torch.cat(rows_lp).tolist() if rows_lp else []
            pos = 0
            for b in plain_rows:
                lps[b] = [host[pos]]
                pos += 1
            T = out.columns.shape[1]
            for b in ver_rows:
                lps[b] = host[pos:pos + T]
                pos += T
        return Draws(packed, lps, out.verify)


@dataclass
class Draws:
    """One forward's draws on the host: per row, ``packed[b]`` = [token, logits non-finite] (+ [accepted drafts,
    next token, window non-finite, the fed drafts (T − 1 columns)] in a verify forward); ``logprobs[b]``: rows of
    :func:`~k3nn.runtime.sampling.token_logprobs` (one per window column for verify rows), trimmed by the caller."""

    packed: list[list[int]]
    logprobs: dict[int, list[list[float]]]
    windowed: bool
