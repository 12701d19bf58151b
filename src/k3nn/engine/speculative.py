"""Speculative decoding inside the engine: the drafter's paged context, draft rows and per-row KDA replay.

A decoding request with ``num_speculative_tokens = γ > 0`` turns its decode row into a *verify window*: the
pending token and ``n ≤ γ`` drafts, fed in the same target forward as the other decodes and the prefill chunks
(one row of ``1 + n`` tokens). After the forward the engine scores the window through the request's logits
processors, accepts ``m`` drafts (greedy: leading matches of the target's argmax; sampling: lossless rejection
sampling against the drafter's distribution), emits ``m`` drafts + the target's next token and keeps the first
``a = m + 1`` window tokens in the cache:

* **MLA**: a request's latents live in its own pages at its own positions, so rejected entries need no mask:
  ``num_computed`` advances by ``a`` and the next forward overwrites the rejected tail (no holes).
* **KDA** (ReplaySSM): before the forward the committed recurrent + conv state of every verify row is copied
  aside and each KDA layer's input of the window is recorded; a row that rejected part of its window gets its
  committed state back and the layer re-runs over the accepted inputs only (the same op, as a forward over the
  accepted prefix would). Rows that accept the whole window keep the forward's state.
* **Drafter context** (:class:`PagedDraftContext`): DSpark attends over its own K/V of the target's hidden
  states at every committed position. They are stored in pages parallel to the latent pages (same block ids,
  same 64-token pages), so prefix-cache hits share the drafter's context with the target's, a preempted request
  recomputes both, and a request's context is addressed through its block table like the latents.

Drafters: a :class:`~k3nn.layers.dspark.DSparkDrafter` (wrapped in :class:`DSparkEngineDrafter`), or any object
with the :class:`EngineDrafter` methods (tests use oracle drafters that propose known continuations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from ..cache.hybrid import KDAState
from ..cache.pages import gather_latents, write_latents
from ..layers.dspark import DraftProposal, DraftState, DSparkDrafter

__all__ = ["DraftRow", "EngineDrafter", "DSparkEngineDrafter", "PagedDraftContext", "KDAReplay",
           "as_engine_drafter"]


@dataclass
class DraftRow:
    """What a drafter sees of one request when it drafts: every token so far (the last one is the pending
    anchor, not yet in the cache), how many are cached (= the anchor's rope position), its page table, and its
    sampling parameters and generator (sampled drafts draw from the request's own generator)."""

    tokens: list[int]
    num_computed: int
    blocks: list[int]
    params: object  # SamplingParams (do_sample, temperature, top_k, top_p)
    generator: torch.Generator | None


@runtime_checkable
class EngineDrafter(Protocol):
    """What the engine needs of a drafter.

    ``target_layers``: target layer outputs the drafter reads (their hidden states are passed to :meth:`write`).
    :meth:`write`: after each target forward, store the context of the tokens it fed (``slots`` [B, T]: pool
    slots, −1 for padding; ``positions`` [B, T] rope positions). :meth:`propose`: drafts for rows that share a
    draft length ``n``, as a :class:`~k3nn.layers.dspark.DraftProposal` (``probs`` None for greedy drafts)."""

    target_layers: list[int]

    def write(self, taps: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> None: ...

    def propose(self, rows: Sequence[DraftRow], n: int) -> DraftProposal: ...


class PagedDraftContext:
    """DSpark's context K/V in pages: one pool per draft layer ``[num_pages, 64, 2·H·Dh]`` (k | v), indexed by
    the engine's block ids."""

    def __init__(self, drafter: DSparkDrafter, num_pages: int, block_size: int, device, dtype=None):
        c = drafter.config
        self.H, self.Dh, self.block_size = c.num_heads, c.head_dim, block_size
        dtype = dtype or drafter.fc.weight.dtype
        self.pools = [torch.zeros(num_pages, block_size, 2 * self.H * self.Dh, dtype=dtype, device=device)
                      for _ in drafter.layers]

    @property
    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        B, T = slots.shape
        write_latents(self.pools[layer], slots, k.reshape(B, T, -1), v.reshape(B, T, -1))

    def state(self, rows: Sequence[DraftRow]) -> DraftState:
        """The committed context of ``rows`` as a :class:`DraftState` (keys past a row's cached length masked)."""
        dev = self.pools[0].device
        U = self.block_size
        L = max(max(r.num_computed for r in rows), 1)
        width = -(-L // U)
        table = torch.zeros(len(rows), width, dtype=torch.long)
        for b, r in enumerate(rows):
            n = min(len(r.blocks), width)
            table[b, :n] = torch.tensor(r.blocks[:n], dtype=torch.long)
        table = table.to(dev)
        HD = self.H * self.Dh
        ks, vs = [], []
        for pool in self.pools:
            kv = gather_latents(pool, table, L)  # [B, L, 2·H·Dh]
            ks.append(kv[..., :HD].reshape(len(rows), L, self.H, self.Dh))
            vs.append(kv[..., HD:].reshape(len(rows), L, self.H, self.Dh))
        cached = torch.tensor([r.num_computed for r in rows], device=dev)
        mask = torch.arange(L, device=dev)[None, :] < cached[:, None]
        return DraftState(ks, vs, mask, L)


class DSparkEngineDrafter:
    """A :class:`~k3nn.layers.dspark.DSparkDrafter` serving the engine: its context in
    :class:`PagedDraftContext` pages, drafts through :meth:`DSparkDrafter.propose`."""

    def __init__(self, drafter: DSparkDrafter, num_pages: int, block_size: int, device):
        self.drafter = drafter
        self.target_layers = list(drafter.target_layers)
        self.context = PagedDraftContext(drafter, num_pages, block_size, device)

    @torch.no_grad()
    def write(self, taps: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> None:
        ctx = self.drafter.project_context(taps)
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.keys_values(ctx, positions)
            self.context.write(i, slots, k, v)

    @torch.no_grad()
    def propose(self, rows: Sequence[DraftRow], n: int) -> DraftProposal:
        dev = self.context.pools[0].device
        state = self.context.state(rows)
        anchor = torch.tensor([r.tokens[-1] for r in rows], dtype=torch.long, device=dev)
        anchor_pos = torch.tensor([r.num_computed for r in rows], dtype=torch.long, device=dev)
        p = rows[0].params
        sample_cfg = p if getattr(p, "do_sample", False) else None
        return self.drafter.propose(state, anchor, anchor_pos, n, sample_cfg, rows[0].generator)


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


class KDAReplay:
    """ReplaySSM for the verify rows of one forward (see the module docstring).

    ``begin(rows)`` before the forward: saves the committed state of the batch rows ``rows`` (absolute running
    rows ``running_rows``) and asks the cache to record the KDA layers' inputs. ``commit(keep)`` after the
    forward: for every batch row b with ``keep[b] < fed[b]`` the committed state is restored and the first
    ``keep[b]`` recorded inputs are folded in by the layer itself."""

    def __init__(self, model, pools):
        self.pools = pools
        self.layers = [l.self_attn for i, l in enumerate(model.model.layers) if not model.config.is_mla_layer(i)]
        self.backend = getattr(model, "backend", None)
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.batch_rows: list[int] = []

    def begin(self, cache, batch_rows: Sequence[int]) -> None:
        self.batch_rows = list(batch_rows)
        self.saved = []
        if not self.batch_rows:
            return
        run = self.pools.running
        idx = torch.tensor([cache.row0 + b for b in self.batch_rows], device=self.pools.device)
        self.saved = [(run.recurrent[j].index_select(0, idx), run.conv[j].index_select(0, idx))
                      for j in range(len(self.layers))]
        cache.record_inputs = set(self.batch_rows)

    @torch.no_grad()
    def commit(self, cache, keep: dict[int, int]) -> None:
        """keep: batch row → tokens kept (rows whose whole window was kept may be omitted)."""
        from ..kernels.registry import backend as use_backend

        groups: dict[int, list[int]] = {}
        for k, b in enumerate(self.batch_rows):
            a = keep.get(b)
            if a is not None and a < cache.num_new[b]:
                groups.setdefault(a, []).append(k)
        run = self.pools.running
        with use_backend(self.backend):
            for j, mod in enumerate(self.layers):
                x = cache.layers_kda[j].window_x
                rec0, conv0 = self.saved[j]
                for a, ks in groups.items():
                    sel = torch.tensor(ks, device=rec0.device)
                    bsel = torch.tensor([self.batch_rows[k] for k in ks], device=rec0.device)
                    st = KDAState(rec0.index_select(0, sel).clone(), conv0.index_select(0, sel).clone())
                    mod(x.index_select(0, bsel)[:, :a], st)
                    dst = bsel + cache.row0
                    run.recurrent[j].index_copy_(0, dst, st.recurrent.to(run.recurrent[j].dtype))
                    run.conv[j].index_copy_(0, dst, st.conv.to(run.conv[j].dtype))
        self.saved = []
        for st in cache.layers_kda:
            st.window_x = None
