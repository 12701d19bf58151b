"""Speculative decoding inside the engine: the drafter's paged context, draft rows and per-row KDA replay.

A decoding request with ``num_speculative_tokens = γ > 0`` turns its decode row into a *verify window*: the
pending token and ``n ≤ γ`` drafts, fed in the same target forward as the other decodes and the prefill chunks
(one row of ``1 + n`` tokens). After the forward the engine scores the window through the request's logits
processors, accepts ``m`` drafts (greedy: leading matches of the target's argmax; sampling: lossless rejection
sampling against the drafter's distribution), emits ``m`` drafts + the target's next token and keeps the first
``a = m + 1`` window tokens in the cache:

* **MLA**: a request's latents live in its own pages at its own positions, so rejected entries need no mask:
  ``num_computed`` advances by ``a`` and the next forward overwrites the rejected tail (no holes).
* **KDA**: the verify forward reads each window row's committed state without writing it
  (``ops.kda_fused_decode(write_state=...)``) and records the fused op's inputs; after acceptance one more call of
  the op folds the first ``a`` window tokens into the committed state (:meth:`ModelRunner.commit_windows
  <k3nn.engine.runner.ModelRunner.commit_windows>`): no state copies, one launch per KDA layer.
* **Drafter context** (:class:`PagedDraftContext`): DSpark attends over its own K/V of the target's hidden
  states at every committed position. They are stored in pages parallel to the latent pages (same block ids,
  same 64-token pages), so prefix-cache hits share the drafter's context with the target's, a preempted request
  recomputes both, and a request's context is addressed through its block table like the latents.

Drafters: a :class:`~k3nn.layers.dspark.DSparkDrafter` (wrapped in :class:`DSparkEngineDrafter`), or any object
with the :class:`EngineDrafter` methods (tests use oracle drafters that propose known continuations).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from ..cache.pages import gather_latents
from ..cache.paged import write_rows
from ..layers.dspark import DraftProposal, DraftState, DSparkDrafter
from .request import ContextTokens, Request

__all__ = ["DraftRow", "EngineDrafter", "DSparkEngineDrafter", "PagedDraftContext", "as_engine_drafter", "draft",
           "greedy_round", "round_keys"]

log = logging.getLogger(__name__)


@dataclass
class DraftRow:
    """What a drafter sees of one request when it drafts: every token so far (the last one is the pending
    anchor, not yet in the cache), how many are cached (= the anchor's rope position), its page table, and its
    sampling parameters and generator (sampled drafts draw from the request's own generator)."""

    tokens: Sequence[int]  # a list, or a ContextTokens view
    num_computed: int
    blocks: list[int]
    params: object  # SamplingParams (do_sample, temperature, top_k, top_p)
    generator: torch.Generator | None


@runtime_checkable
class EngineDrafter(Protocol):
    """What the engine needs of a drafter.

    ``target_layers``: target layer outputs the drafter reads (their hidden states are passed to :meth:`write`).
    :meth:`write`: after each target forward, store the context of the tokens it fed (``slots`` [B, T]: pool
    rows; padding tokens point at the trash row of the pools' last page; ``positions`` [B, T] rope positions). :meth:`propose`: drafts for rows that share a
    draft length ``n``, as a :class:`~k3nn.layers.dspark.DraftProposal` (``probs`` None for greedy drafts)."""

    target_layers: list[int]

    def write(self, taps: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Store the drafter's context for the tokens a target forward fed: ``taps`` one [B, T, d] hidden-state
        tensor per layer of ``target_layers``, ``positions`` [B, T] rope positions, ``slots`` [B, T] pool rows."""
        ...

    def propose(self, rows: Sequence[DraftRow], n: int) -> DraftProposal:
        """``n`` drafts for each of ``rows`` (a :class:`~k3nn.layers.dspark.DraftProposal`: tokens [B, n], and
        probs [B, n, V] when the rows sample)."""
        ...


class PagedDraftContext:
    """DSpark's context K/V in pages: one pool per draft layer ``[num_pages + 1, 64, 2·H·Dh]`` (k | v), indexed
    by the engine's block ids (the last page takes padding tokens' writes, as in the latent pools)."""

    def __init__(self, drafter: DSparkDrafter, num_pages: int, block_size: int, device, dtype=None):
        c = drafter.config
        self.H, self.Dh, self.block_size = c.num_heads, c.head_dim, block_size
        dtype = dtype or drafter.fc.weight.dtype
        self.pools = [torch.zeros(num_pages + 1, block_size, 2 * self.H * self.Dh, dtype=dtype, device=device)
                      for _ in drafter.layers]
        #: the most keys one gather holds over its rows (B · L): twice the pool's tokens. A gather is [B, L, 2·H·Dh]
        #: per layer, so one long row among short ones would otherwise cost B × the long row's bucket.
        self.max_keys = 2 * num_pages * block_size

    def fits(self, rows: int, L: int) -> bool:
        """Whether a gather of ``rows`` rows over ``L`` keys stays within :attr:`max_keys`."""
        return rows * L <= self.max_keys

    def batches(self, num_computed: Sequence[int]) -> list[list[int]]:
        """Indices of rows (their cached lengths ``num_computed``) in gathers of at most :attr:`max_keys` keys:
        one batch when they fit, else the rows by length in runs that fit (a row alone always does: its bucket
        is at most twice the pool)."""
        if self.fits(len(num_computed), self.key_length(max(num_computed))):
            return [list(range(len(num_computed)))]
        out: list[list[int]] = []
        for i in sorted(range(len(num_computed)), key=lambda i: num_computed[i]):
            cur = out[-1] if out else None
            if cur is not None and self.fits(len(cur) + 1, self.key_length(num_computed[i])):
                cur.append(i)
            else:
                out.append([i])
        return out

    @property
    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        B, T = slots.shape
        write_rows(self.pools[layer], slots, torch.cat([k.reshape(B, T, -1), v.reshape(B, T, -1)], -1))

    def key_length(self, num_cached: int) -> int:
        """Keys gathered for rows whose longest cached context is ``num_cached`` tokens: that, rounded up to a
        power of two (at least one page), so the attention meets a handful of shapes, not a new one every round;
        the key mask hides the rest."""
        L = max(num_cached, 1)
        return max(self.block_size, 1 << (L - 1).bit_length())

    def tables(self, rows: Sequence[DraftRow], L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host tensors of ``rows`` for a gather of ``L`` keys: the page table [B, L / page] and cached lengths
        [B]."""
        width = -(-L // self.block_size)
        table = torch.zeros(len(rows), width, dtype=torch.long)
        for b, r in enumerate(rows):
            n = min(len(r.blocks), width)
            table[b, :n] = torch.tensor(r.blocks[:n], dtype=torch.long)
        return table, torch.tensor([r.num_computed for r in rows], dtype=torch.long)

    def gather(self, table: torch.Tensor, cached: torch.Tensor, L: int) -> DraftState:
        """The committed context addressed by ``table`` [B, L / page] (device) as a :class:`DraftState` (keys past
        each row's ``cached`` length masked). Graph-safe."""
        B, HD = table.shape[0], self.H * self.Dh
        ks, vs = [], []
        for pool in self.pools:
            kv = gather_latents(pool, table, L)  # [B, L, 2·H·Dh]
            ks.append(kv[..., :HD].reshape(B, L, self.H, self.Dh))
            vs.append(kv[..., HD:].reshape(B, L, self.H, self.Dh))
        mask = torch.arange(L, device=table.device)[None, :] < cached[:, None]
        return DraftState(ks, vs, mask, L)

    def state(self, rows: Sequence[DraftRow]) -> DraftState:
        """The committed context of ``rows`` as a :class:`DraftState` (keys past a row's cached length masked)."""
        dev = self.pools[0].device
        L = self.key_length(max(r.num_computed for r in rows))
        table, cached = self.tables(rows, L)
        return self.gather(table.to(dev), cached.to(dev), L)


class DSparkEngineDrafter:
    """A :class:`~k3nn.layers.dspark.DSparkDrafter` serving the engine: its context in
    :class:`PagedDraftContext` pages, drafts through :meth:`DSparkDrafter.propose`.

    Greedy proposals on CUDA run as CUDA graphs of a :class:`~k3nn.runtime.graphs.GraphRunner`, one per (rows,
    draft length, key length bucket): the page tables, cached lengths, anchors and positions are copied into that
    key's persistent buffers (one host-to-device copy), then the gather, backbone and Markov heads replay. The
    first round of a key runs eagerly, the second captures; their tokens stay on the device (``device_drafts``:
    the engine writes them into the verify step's inputs and reads them back with the acceptance). Sampled
    proposals draw from the request's generator and run eagerly. :meth:`write` is graph-safe
    (``graph_safe_write``): the engine runs it inside each forward, so a decode / verify step's graph stores the
    drafter's context too."""

    graph_safe_write = True
    device_drafts = True  # greedy proposals from a drafter's own argmax: in range, kept on the device

    def __init__(self, drafter: DSparkDrafter, num_pages: int, block_size: int, device):
        from ..runtime.graphs import GraphRunner

        self.drafter = drafter
        self.target_layers = list(drafter.target_layers)
        self.context = PagedDraftContext(drafter, num_pages, block_size, device)
        self.graphs = GraphRunner(device, name="drafter proposal")
        # per graph key: the device buffer its graph reads and the pinned staging buffer copied into it
        self._buffers: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def write(self, taps: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> None:
        ctx = self.drafter.project_context(taps)
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.keys_values(ctx, positions)
            self.context.write(i, slots, k, v)

    @torch.no_grad()
    def propose(self, rows: Sequence[DraftRow], n: int) -> DraftProposal:
        """Drafts for ``rows``, in gathers of at most ``context.max_keys`` keys (:meth:`PagedDraftContext.batches`;
        one call when they fit)."""
        parts = self.context.batches([r.num_computed for r in rows])
        if len(parts) == 1:
            return self._propose(rows, n)
        props = []
        for part in parts:  # copied at once: parts of one shape replay one graph into the same outputs
            p = self._propose([rows[i] for i in part], n)
            props.append(DraftProposal(*(None if t is None else t.clone() for t in (p.tokens, p.probs, p.confidence))))
        order = torch.tensor([i for part in parts for i in part], device=props[0].tokens.device).argsort()

        def join(xs):
            return None if xs[0] is None else torch.cat(xs)[order]

        return DraftProposal(join([p.tokens for p in props]), join([p.probs for p in props]),
                             join([p.confidence for p in props]))

    def _propose(self, rows: Sequence[DraftRow], n: int) -> DraftProposal:
        p = rows[0].params
        if getattr(p, "do_sample", False):
            return self._propose_eager(rows, n, p)
        ctx = self.context
        L = ctx.key_length(max(r.num_computed for r in rows))
        table, cached = ctx.tables(rows, L)
        anchor = torch.tensor([r.tokens[-1] for r in rows], dtype=torch.long)
        host = torch.cat([table.flatten(), cached, anchor])  # anchor_pos = cached: the anchor is the next position
        key = (len(rows), n, L)
        if key not in self._buffers:
            dev = ctx.pools[0].device
            self._buffers[key] = (torch.empty(host.numel(), dtype=torch.long, device=dev),
                                  torch.empty(host.numel(), dtype=torch.long, pin_memory=dev.type == "cuda"))
        buf, staging = self._buffers[key]
        staging.copy_(host)  # the last round's copy out of it finished: the step's draws were read since
        buf.copy_(staging, non_blocking=True)
        B, W = table.shape

        def step() -> DraftProposal:
            tab = buf[:B * W].view(B, W)
            cached_d, anchor_d = buf[B * W:B * W + B], buf[B * W + B:]
            return self.drafter.propose(ctx.gather(tab, cached_d, L), anchor_d, cached_d, n)

        return self.graphs.run(key, step)

    @torch.no_grad()
    def step_drafts(self, tables: torch.Tensor, cached: torch.Tensor, anchor: torch.Tensor, n: int,
                    L: int) -> torch.Tensor:
        """Greedy drafts [B, n] for the rows of a staged step, graph-safe (what the engine's greedy rounds
        replay): each row's committed context through its latent block table ``tables`` [B, ≥ L / page] (the
        drafter's pages share the latents' block ids) over ``L`` keys, past ``cached`` [B] masked, anchored at
        the pending token ``anchor`` [B] at position ``cached``."""
        W = min(-(-L // self.context.block_size), tables.shape[1])
        state = self.context.gather(tables[:, :W], cached, L)
        return self.drafter.propose(state, anchor, cached, n, confidence=False).tokens[:, :n]

    def _propose_eager(self, rows: Sequence[DraftRow], n: int, params) -> DraftProposal:
        dev = self.context.pools[0].device
        state = self.context.state(rows)
        anchor = torch.tensor([r.tokens[-1] for r in rows], dtype=torch.long, device=dev)
        anchor_pos = torch.tensor([r.num_computed for r in rows], dtype=torch.long, device=dev)
        return self.drafter.propose(state, anchor, anchor_pos, n, params, rows[0].generator)


def as_engine_drafter(drafter, num_pages: int, block_size: int, device):
    """The engine-side drafter for ``drafter`` (a DSparkDrafter is wrapped; an :class:`EngineDrafter` is used as
    it is)."""
    if isinstance(drafter, DSparkDrafter):
        return DSparkEngineDrafter(drafter, num_pages, block_size, device)
    missing = [a for a in ("target_layers", "write", "propose") if not hasattr(drafter, a)]
    if missing:
        raise TypeError(f"drafter must be a DSparkDrafter or provide {missing} (see k3nn.engine.speculative."
                        f"EngineDrafter), got {type(drafter).__name__}")
    return drafter


def draft(drafter: EngineDrafter, decodes: Sequence[Request], draft_len: Callable[[Request], int],
          confidence_threshold: float, vocab_size: int) -> None:
    """Drafts for this step's decode rows (``req.drafts``, ``req.draft_probs``; at most ``draft_len(req)``, cut
    at the first draft below ``confidence_threshold`` when > 0). Greedy rows of one draft length share one
    drafter call; a sampling row drafts alone, from its own generator. A drafter error costs only the speedup:
    those rows decode plainly this step (logged)."""
    for r in decodes:
        r.clear_drafts()
    groups: dict[tuple, list[Request]] = {}
    for r in decodes:
        n = draft_len(r)
        if n > 0:
            groups.setdefault((n, r.request_id) if r.params.do_sample else (n,), []).append(r)
    for key, group in groups.items():
        n = key[0]
        rows = [DraftRow(ContextTokens(r.prompt, r.output), r.num_computed, r.blocks, r.params, r.generator)
                for r in group]
        try:
            with torch.inference_mode():
                prop = drafter.propose(rows, n)
            toks = prop.tokens[:, :n]
            if tuple(toks.shape) != (len(group), n):
                raise ValueError(f"expected drafts of shape {(len(group), n)}, got {tuple(toks.shape)}")
            if getattr(drafter, "device_drafts", False) and prop.probs is None and not (
                    confidence_threshold > 0 and prop.confidence is not None):
                # the count is known on the host: the drafts stay on the device and are written into the
                # verify step's inputs there (no host read before the verify forward)
                for k, r in enumerate(group):
                    r.drafts, r.device_drafts = [0] * n, toks[k]
                continue
            if confidence_threshold > 0 and prop.confidence is not None:
                ok = (prop.confidence[:, :n] >= confidence_threshold).long().cumprod(1).sum(1)
                both = torch.cat([toks, ok[:, None].to(toks.dtype)], 1).tolist()  # one host read
                toks_l, lim = [row[:n] for row in both], [row[n] for row in both]
            else:
                toks_l, lim = toks.tolist(), [n] * len(group)
            if any(not 0 <= t < vocab_size for row in toks_l for t in row):
                raise ValueError(f"draft token ids outside [0, vocab_size={vocab_size})")
        except Exception as e:  # noqa: BLE001 - drafting is an optimisation: fall back to plain decoding
            log.warning("engine: drafting failed for %s (%s: %s); decoding them without drafts",
                        [r.request_id for r in group], type(e).__name__, e)
            continue
        for k, r in enumerate(group):
            r.drafts = toks_l[k][:lim[k]]
            if prop.probs is not None and r.drafts:
                r.draft_probs = prop.probs[k, :lim[k]]


def greedy_round(engine, decodes: Sequence[Request]) -> int | None:
    """Whether ``engine``'s decode rows of this step run as one greedy round (drafts written on the device by the
    drafter's graph, then the verify forward, acceptance and KDA commit in one graph; see
    :meth:`ModelRunner.forward <k3nn.engine.runner.ModelRunner.forward>`). If so, give each row its draft count
    (as placeholder drafts) and return the drafter's key bucket; else None (:func:`draft` proposes). Needs a
    drafter with ``step_drafts``, graph-shaped greedy rows without penalties, stop blocks, log-probabilities or
    images, and no confidence cut or synthetic acceptance."""
    opts, runner = engine.spec_options, engine.runner
    if (runner.drafter is None or not runner.static or not decodes or len(decodes) > runner.max_rows
            or opts.confidence_threshold > 0 or opts.synthetic_acceptance_length is not None):
        return None
    ns = [engine.scheduler.draft_len(r) for r in decodes]
    if not 0 < max(ns) < runner.max_window:
        return None
    if any(r.params.logprobs is not None or (engine.multimodal is not None and r.images is not None)
           for r in decodes):
        return None
    v = engine.sampling.variant([r.row for r in decodes])
    if v.sampling or v.penalties or v.min_tokens:
        return None
    L = round_keys(engine, decodes)
    if L is None:  # the host path drafts it in bounded gathers
        return None
    for r, n in zip(decodes, ns):
        r.clear_drafts()
        r.drafts = [0] * n  # fed by the round's draft graph
    return L


def round_keys(engine, reqs: Sequence[Request]) -> int | None:
    """The drafter's key bucket of a greedy round over ``reqs`` (the bucket of their longest cached context), or
    None when the padded batch's gather would exceed the drafter context's key budget."""
    ctx = engine.runner.drafter.context
    L = ctx.key_length(max(r.num_computed for r in reqs))
    return L if ctx.fits(engine.runner.padded_size(len(reqs)), L) else None
