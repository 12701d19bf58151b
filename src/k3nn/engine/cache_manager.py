"""The requests' hold on the paged hybrid cache: running rows, latent pages, prefix lookups and inserts, KDA
snapshot slots.

* **Admission** (:meth:`CacheManager.admit`): prefix lookup (pages + KDA snapshot at L ≤ N−1), copy the
  snapshot into the request's running row (copy-on-write), share the pages, allocate the pages of the rest of what
  it feeds before its first sample — keeping ``watermark`` of the pool free for the running requests to grow into
  — and plan its snapshot positions (retention policy). Decoding requests :meth:`~CacheManager.grow` page by page.
* **Rows**: a request keeps its running row (KDA state slot) while it runs; forwards address the rows by slot,
  nothing is moved.
* **Commit** (:meth:`~CacheManager.commit_prefix`, :meth:`~CacheManager.track_decode_state`,
  :meth:`~CacheManager.retain_finished`): after a forward, index the new full pages and the written snapshots
  (visible to lookups from the next step on); keep the last page-aligned decode state, indexed with prompt +
  answer when the request ends (the next chat turn resumes past the answer).

Which requests run, and when one is preempted, is the :class:`~k3nn.engine.scheduler.Scheduler`'s choice.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..cache.paged import HybridPools
from ..cache.prefix import PrefixCache, PrefixMatch, block_hashes
from ..cache.retention import PlanInput, RetentionPolicy
from ..runtime.metadata import MAX_BOUNDARY_EXPORTS
from .request import Request, RequestStatus

__all__ = ["CacheManager"]


class CacheManager:
    """Rows, pages and snapshot slots of the requests in ``pools``; ``prefix``: the prefix index (None: prefix
    caching off); ``retention``: where a new prompt's KDA snapshots go; ``watermark``: the fraction of the pages
    admission leaves free while requests run; ``retain_decode_state``: index prompt + answer and the last aligned
    decode state when a request ends.

    ``row_owner[i]``: the request holding running row i. Statistics: ``computed_prompt_tokens`` (prompt tokens
    admission had to compute: not served by the prefix index), ``recomputed_tokens`` (tokens preempted requests
    computed again)."""

    def __init__(self, pools: HybridPools, prefix: PrefixCache | None, retention: RetentionPolicy | None, *,
                 watermark: float, retain_decode_state: bool):
        self.pools, self.prefix, self.retention = pools, prefix, retention
        self.watermark, self.retain_decode_state = watermark, retain_decode_state
        self.row_owner: list[Request | None] = [None] * pools.running.num_slots
        self.computed_prompt_tokens = self.recomputed_tokens = 0

    @property
    def keeps_decode_state(self) -> bool:
        """Decode-state retention is on: ``retain_decode_state`` with a prefix index to keep the states in."""
        return self.prefix is not None and self.retain_decode_state

    def reset_stats(self) -> None:
        self.computed_prompt_tokens = self.recomputed_tokens = 0

    def block_keys(self, req: Request, tokens: Sequence[int], keys: Sequence[bytes] = ()) -> list[bytes]:
        """The chained prefix keys of the full blocks of ``tokens`` (the prompt, or prompt + output), continuing
        ``keys`` (those of the first ``len(keys)`` blocks): token ids and the content hashes of the request's images.
        Every place that keys a request's blocks goes through here, so the keys agree."""
        keys = list(keys)
        return keys + block_hashes(tokens, self.pools.block_size, self.prefix.salt, keys[-1] if keys else None,
                                   len(keys), req.image_keys)

    # -- rows and pages ------------------------------------------------------------------------------------------
    def free_row(self) -> int | None:
        for r, o in enumerate(self.row_owner):
            if o is None:
                return r
        return None

    def watermark_pages(self) -> int:
        """Pages admission leaves free for the running requests to grow into (none when nothing runs)."""
        if not any(o is not None and o.status == RequestStatus.RUNNING for o in self.row_owner):
            return 0
        return int(self.watermark * self.pools.allocator.num_blocks + 0.999999)

    def admit(self, req: Request) -> str | None:
        """Give ``req`` a running row, its cached prefix and the pages of what it feeds before its first sample
        (its prompt; a preempted request: prompt + output so far, minus what the prefix index still holds); the
        pages of the tokens it generates are added as it decodes (:meth:`grow`). Sets ``num_computed`` (the hit),
        ``kv_len``, ``indexed_blocks``, and for a new request ``hit_len`` and its snapshot ``plan``.

        Returns None when admitted, else why not (nothing is taken). If it raises, what ``req`` holds is freed by
        :meth:`free`."""
        row = self.free_row()
        if row is None:
            return f"all {len(self.row_owner)} running rows are held"
        resumed = bool(req.output)
        tokens = req.all_tokens()
        N = len(tokens)
        keys = req.keys
        if resumed and self.prefix is not None:
            keys = self.block_keys(req, tokens, req.keys)
        m = self.prefix.match(tokens, keys, record=False) if self.prefix is not None else PrefixMatch()
        total = self.pools.pages_for(max(N - 1, 1) if req.prefill_only else N)
        need = max(total - len(m.pages), 0)
        alloc = self.pools.allocator
        alloc.incref(m.pages)
        req.blocks = list(m.pages)  # owned from here on: free() gives them back if anything below fails
        reserve = self.watermark_pages()
        if alloc.num_free < need + reserve and self.prefix is not None:
            self.prefix.make_room(pages=need + reserve)
        if alloc.num_free < need + reserve:
            alloc.free(m.pages)
            req.blocks = []
            return (f"request {req.request_id!r} needs {need} free latent pages (+ {reserve} kept free), "
                    f"{alloc.num_free} of {alloc.num_blocks} are free and nothing is running that would release more")
        req.blocks += alloc.allocate(need)
        req.row = row
        self.row_owner[row] = req
        if m.snapshot is not None:
            self.pools.running.copy_([row], self.pools.snapshots, [m.snapshot])  # copy-on-write
        else:
            self.pools.running.zero_([row])
        req.num_computed = m.hit_len
        req.kv_len = m.kv_len
        req.indexed_blocks = len(m.pages)
        if resumed:
            self.recomputed_tokens += N - m.hit_len
        else:
            req.hit_len = m.hit_len
            self.computed_prompt_tokens += N - m.hit_len
        if self.prefix is not None and not resumed:
            self.prefix.record(m, N)
            req.plan = self.retention.plan(PlanInput(N, m.hit_len, m.kv_len, req.boundaries, self.pools.block_size))
        return None

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Make ``req``'s pages cover ``num_tokens`` tokens from the free pages, evicting prefix-index pages when
        they do not suffice; False (nothing taken) when even that is not enough."""
        need = self.pools.pages_for(num_tokens) - len(req.blocks)
        if need <= 0:
            return True
        alloc = self.pools.allocator
        if alloc.num_free < need and not (self.prefix is not None and self.prefix.make_room(pages=need)):
            return False
        req.blocks += alloc.allocate(need)
        return True

    def place(self, req: Request, num_pages: int, pages: Sequence[torch.Tensor], recurrent: Sequence[torch.Tensor],
              conv: Sequence[torch.Tensor]) -> None:
        """Give ``req`` (its prompt partly computed elsewhere) a row and the pages of its prompt, writing the
        transferred state: the first ``num_pages`` latent pages ``pages`` per MLA layer and the KDA state
        ``recurrent`` / ``conv`` per KDA layer (shapes checked first, ValueError naming the tensor).
        CacheFullError when no row or not enough pages are free; on any error nothing is taken."""
        from ..cache.hybrid import CacheFullError

        row = self.free_row()
        if row is None:
            raise CacheFullError(f"adopt: all {len(self.row_owner)} running rows are busy")
        self._check_state_tensors(num_pages, pages, recurrent, conv)
        total = self.pools.pages_for(len(req.prompt))
        if self.pools.allocator.num_free < total and self.prefix is not None:
            self.prefix.make_room(pages=total)
        blocks = self.pools.allocator.allocate(total)  # raises CacheFullError before anything is taken
        try:
            if num_pages:
                self.pools.write_pages(blocks[:num_pages], [p[:num_pages] for p in pages])
            self.pools.running.write(row, recurrent, conv)
        except BaseException:
            self.pools.allocator.free(blocks)
            raise
        req.row, req.blocks = row, blocks
        self.row_owner[row] = req
        self.computed_prompt_tokens += len(req.prompt) - req.num_computed

    def _check_state_tensors(self, n_pages: int, pages, recurrent, conv) -> None:
        """Shapes of a transferred state against the pools (ValueError naming the tensor)."""
        pl = self.pools
        if len(pages) != len(pl.pages):
            raise ValueError(f"adopt: pages must hold one tensor per MLA layer ({len(pl.pages)}), got {len(pages)}")
        for i, (p, ref) in enumerate(zip(pages, pl.pages)):
            if p.dim() != 3 or p.shape[0] < n_pages or tuple(p.shape[1:]) != tuple(ref.shape[1:]):
                raise ValueError(f"adopt: pages[{i}] must be [>= {n_pages}, {ref.shape[1]}, {ref.shape[2]}], got "
                                 f"{tuple(p.shape)}")
        run = pl.running
        for name, got, ref in (("recurrent", recurrent, run.recurrent), ("conv", conv, run.conv)):
            if len(got) != len(ref):
                raise ValueError(f"adopt: {name} must hold one tensor per KDA layer ({len(ref)}), got {len(got)}")
            for j, (t, r) in enumerate(zip(got, ref)):
                if tuple(t.shape) != tuple(r.shape[1:]):
                    raise ValueError(f"adopt: {name}[{j}] must be {tuple(r.shape[1:])}, got {tuple(t.shape)}")

    def free(self, req: Request) -> None:
        """Give back ``req``'s private decode snapshot (and spare slot), running row and page references
        (idempotent)."""
        if req.decode_snap is not None:
            self.pools.snapshots.free([req.decode_snap[1]])
            req.decode_snap = None
        if req.spare_snap is not None:
            self.pools.snapshots.free([req.spare_snap])
            req.spare_snap = None
        if req.row is not None:
            self.row_owner[req.row] = None
            req.row = None
        req.sampling_row, req.synced_blocks = None, 0  # a later row is loaded afresh
        if req.blocks:
            self.pools.allocator.free(req.blocks)
            req.blocks = []

    # -- snapshots and the prefix index ----------------------------------------------------------------------------
    def plan_snapshots(self, req: Request, n: int) -> list[tuple[int, int]]:
        """Snapshot slots for the planned positions inside the next ``n`` tokens of ``req`` (positions relative to
        the chunk); best effort: a position is skipped when it is cached already or no slot can be freed."""
        if self.prefix is None or not req.plan:
            return []
        U, lo, hi = self.pools.block_size, req.num_computed, req.num_computed + n
        out = []
        try:
            for p in [p for p in req.plan if lo < p <= hi]:
                req.plan.remove(p)
                if p // U > len(req.keys):
                    continue
                e = self.prefix.entries.get(req.keys[p // U - 1])
                if e is not None and e.snapshot is not None:
                    continue  # already cached (by another request)
                if self.pools.snapshots.num_free == 0 and not self.prefix.make_room(snapshots=1):
                    continue  # retention is best effort: never block a request for a snapshot
                out.append((p - lo, self.pools.snapshots.allocate(1)[0]))
        except Exception:
            self.pools.snapshots.free([s for _, s in out])
            raise
        return out

    def commit_prefix(self, req: Request, snapshots: Sequence[tuple[int, int]]) -> None:
        """After the forward: index ``req``'s new full prompt pages, then attach the written snapshots
        ((absolute position, slot) pairs; a slot the index does not take is freed)."""
        if self.prefix is None:
            return
        full = min(req.num_computed, req.num_prompt_tokens) // self.pools.block_size
        full = min(full, len(req.keys))
        if full > req.indexed_blocks:
            self.prefix.insert(req.keys, req.blocks, full)
            req.indexed_blocks = full
        for p, slot in snapshots:
            if not self.prefix.add_snapshot(req.keys[p // self.pools.block_size - 1], slot):
                self.pools.snapshots.free([slot])

    def plan_rows(self, batch: Sequence, fail) -> tuple[list, list[list[tuple[int, int]]]]:
        """Plan each forward row's prefix snapshots (:meth:`plan_snapshots` into ``row.snapshots``) and a verify
        row's page-boundary slot (:meth:`plan_boundary` into ``row.boundary``); a row whose plan raises is failed
        (``fail(req, exc, where)``) and left out. Returns the rest and, per row, its snapshots as (absolute
        position, slot) pairs for :meth:`commit_rows`."""
        ok = []
        exports = 0
        for w in batch:
            try:
                w.snapshots = self.plan_snapshots(w.req, w.num_new)
                w.boundary = self.plan_boundary(w) if w.verify and exports < MAX_BOUNDARY_EXPORTS else None
                exports += w.boundary is not None
                ok.append(w)
            except Exception as e:
                self.pools.snapshots.free([s for _, s in w.snapshots])
                fail(w.req, e, "snapshot plan")
        return ok, [[(w.req.num_computed + p, s) for p, s in w.snapshots] for w in ok]

    def may_cross(self, w) -> bool:
        """Whether verify row ``w``'s commit can leave the request's decode state past a page boundary beyond its
        prompt: its cached count (moved by up to ``w.shift_max`` on the device) plus the kept window tokens."""
        U, lo = self.pools.block_size, w.req.num_computed
        b = (lo // U + 1) * U  # the next boundary
        return b <= lo + w.shift_max + w.num_new and b > w.req.num_prompt_tokens

    def plan_boundary(self, w) -> int | None:
        """A snapshot slot for the KDA state at the page boundary a verify row's commit may cross (decode-state
        retention; :meth:`ModelRunner.commit_windows <k3nn.engine.runner.ModelRunner.commit_windows>` writes it),
        or None: no retention, no boundary in reach, or no slot to be had (best effort). The request's spare slot
        when it has one (:meth:`keep_boundary` hands slots back and forth), else a free one, evicting a prefix
        snapshot for it as a plain decode row's first boundary copy does: a request takes at most two slots,
        each once."""
        r = w.req
        if not self.keeps_decode_state or r.prefill_only or not r.output or not self.may_cross(w):
            return None
        if r.spare_snap is not None:
            slot, r.spare_snap = r.spare_snap, None
            return slot
        if self.pools.snapshots.num_free == 0 and not self.prefix.make_room(snapshots=1):
            return None
        return self.pools.snapshots.allocate(1)[0]

    def drop_plans(self, batch: Sequence) -> None:
        """Free the snapshot slots planned for ``batch``'s rows (their forward failed or they ended unread)."""
        self.pools.snapshots.free([s for w in batch for _, s in w.snapshots]
                                  + [w.boundary for w in batch if w.boundary is not None])
        for w in batch:
            w.snapshots, w.boundary = [], None

    def commit_rows(self, batch: Sequence, absolute: Sequence[list[tuple[int, int]]], fail) -> None:
        """After a forward: index each row's new prompt pages and written snapshots (``absolute``: (position,
        slot) pairs per row) and keep its decode state; a failed row's snapshots are freed."""
        for w, sn in zip(batch, absolute):
            r = w.req
            if r.status == RequestStatus.FAILED:
                self.drop_plans([w])
                continue
            try:
                self.commit_prefix(r, sn)
                if w.boundary is not None:
                    self.keep_boundary(w)
                else:
                    self.track_decode_state(r)
            except Exception as e:
                fail(r, e, "cache commit")

    def keep_boundary(self, w) -> None:
        """After a verify row's commit (``w.kept`` window tokens kept, ``num_computed`` exact): its boundary slot
        becomes the request's decode state when the commit crossed the page boundary (the old decode state's slot
        its spare), else the request keeps it as its spare."""
        r, slot, U = w.req, w.boundary, self.pools.block_size
        w.boundary = None
        b = ((r.num_computed - w.kept) // U + 1) * U
        if b > r.num_computed:  # stopped short of it: the slot holds a state past no boundary
            spare = slot
        else:
            spare = r.decode_snap[1] if r.decode_snap is not None else None
            r.decode_snap = (b, slot)
        if spare is not None:
            if r.spare_snap is not None:
                self.pools.snapshots.free([r.spare_snap])
            r.spare_snap = spare

    def track_decode_state(self, req: Request) -> None:
        """Decode-state retention (input+output reuse): keep a private copy of the state each time a decoding
        request completes a 64-token block past its prompt; it is indexed when the request finishes, so the
        next chat turn (prompt + answer + more) resumes past the answer."""
        if not self.keeps_decode_state:
            return
        n = req.num_computed
        if req.prefill_only or not req.output or n % self.pools.block_size or n <= req.num_prompt_tokens:
            return
        if req.decode_snap is None:
            if self.pools.snapshots.num_free == 0 and not self.prefix.make_room(snapshots=1):
                return
            req.decode_snap = (n, self.pools.snapshots.allocate(1)[0])
        slot = req.decode_snap[1]
        self.pools.snapshots.copy_([slot], self.pools.running, [req.row])
        req.decode_snap = (n, slot)

    def retain_finished(self, req: Request) -> None:
        """Index the full pages of everything ``req`` fed (prompt + answer) and its last decode state."""
        if not self.keeps_decode_state or req.prefill_only:
            return
        U = self.pools.block_size
        fed = req.all_tokens()[:req.num_computed]
        keys = self.block_keys(req, fed, req.keys)
        full = min(len(keys), req.num_computed // U, len(req.blocks))
        if full > req.indexed_blocks:
            self.prefix.insert(keys, req.blocks, full)
            req.indexed_blocks = full
        if req.decode_snap is not None:
            p, slot = req.decode_snap
            if p // U <= full and self.prefix.add_snapshot(keys[p // U - 1], slot):
                req.decode_snap = None  # the index owns the slot now
