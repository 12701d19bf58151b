"""Asynchronous decode steps (``EngineConfig.async_scheduling``): the host prepares and launches step N+1 while
the device runs step N, and reads step N's tokens after that launch.

A pure decode step (every running request feeds its pending token; no prefill chunk, host-drafted windows,
log-probabilities or images) is *deferred*: its forward and device draws are launched, its draws start a
non-blocking copy to pinned memory, and :meth:`Engine.step <k3nn.engine.Engine.step>` returns. The next ``step()``
launches the *lookahead* step first: the same rows, each fed its token of step N on the device (the runner copies
the draws into the staged ids before the replay), when nothing else waits to be scheduled and every row can still
take its tokens. Then it reads step N's draws (one wait on its copy), appends the tokens and checks the stop
conditions: the host work runs while the device computes step N+1. Outputs therefore come back one ``step()``
later than without it.

**Speculative rounds** (greedy rows with a DSpark drafter, :func:`~k3nn.engine.speculative.greedy_round`) overlap
the same way. A round's acceptance is not known to the host when the next round is launched, so the lookahead
round is staged at the least the last round can leave in the cache (its pending token kept, no draft) and the
device adds the accepted count to each row's cached length and feeds the round's next token; the drafter's graph
then drafts from there. Its pages cover the most the last round can leave (every draft accepted), and its draft
lengths assume that too (the tokens are the same whatever the draft lengths: only the speed depends on them). A
round's commit exports the state at a page boundary it crosses into a slot planned for it (decode-state retention;
the lookahead's rows plan for the boundaries the device shift may bring into reach, ``RowWork.shift_max``); a round
that may end on a boundary without such a slot is read before the next is launched, so that boundary's state is
copied before anything else advances it.

A request that finishes at step N (eos, a stop id or string, its length) was fed more tokens in step N+1: that
row's draws are dropped, and the request's ``num_computed`` is rolled back by them before its pages are indexed,
so the prefix cache never sees the extra tokens (their latents lie past the length; a decode-state snapshot taken
at that position is not indexed). The KDA running state of a finished request is freed with its row; the next
request in that row starts after step N+1 in stream order. Steps that are not pure decodes run as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from .request import RequestStatus
from .runner import Draws, RowWork
from .speculative import round_keys

__all__ = ["Deferred", "OverlapSteps"]


@dataclass
class Deferred:
    """A launched decode step whose draws are not read yet: its rows, the draws on the device (``[n, 2]`` token,
    logits non-finite; a round's packed ``[n, 4 + T]``), their pinned host copy, the event after that copy (None on
    the CPU), and for a round (``windowed``) each row's snapshot pairs, committed when the draws are read."""

    batch: list[RowWork]
    draws: torch.Tensor
    host: torch.Tensor
    done: torch.cuda.Event | None
    absolute: list | None = None  # a round's rows' snapshot pairs (None: a plain step, committed at launch)

    @property
    def windowed(self) -> bool:
        """A speculative round (its rows are verify windows)."""
        return self.absolute is not None


class OverlapSteps:
    """The asynchronous decode steps of :class:`~k3nn.engine.Engine` (a base class of it): what the module docstring
    describes, as methods over the engine's scheduler, cache manager, runner and request state."""

    def _plain_rows(self, reqs: Sequence) -> bool:
        """Rows whose draws need nothing from the host: no drafter, images or log-probabilities, graph-shaped steps."""
        return (self.drafter is None and self.runner.static and bool(reqs)
                and len(reqs) <= self.runner.max_rows
                and all(r.params.logprobs is None and (self.multimodal is None or r.images is None) for r in reqs))

    def _deferrable(self, batches: Sequence[Sequence[RowWork]], draft_keys: int | None = None) -> bool:
        """This step is one forward of decode rows only (every row feeds its pending token and samples) that can be
        deferred: plain rows, or a greedy round (``draft_keys``: drafted on the device)."""
        if not self.config.async_scheduling or len(batches) != 1 or self.waiting:
            return False  # with requests waiting the next step schedules anyway: no lookahead to gain
        rows = batches[0]
        if draft_keys is not None:  # greedy_round checked the rows
            return all(w.decode and w.sample for w in rows)
        return (all(w.decode and not w.verify and w.sample and w.num_new == 1 for w in rows)
                and self._plain_rows([w.req for w in rows]))

    def _launch_deferred(self, batch: list[RowWork], feed: torch.Tensor | None = None, *,
                         draft_keys: int | None = None, shift: torch.Tensor | None = None) -> Deferred | None:
        """Run ``batch``'s forward and device draws without reading them (``feed`` [n]: the rows' tokens on the device,
        instead of their staged ids; ``shift`` [n]: added to their staged cached counts; ``draft_keys``: a greedy
        round). A forward error fails the batch's requests (reported by the next step) and returns None."""
        def fail(r, e: Exception, where: str) -> None:
            self._failed_outputs.append(self._fail(r, e, where))

        batch, absolute = self.cache.plan_rows(batch, fail)
        if not batch:
            return None
        try:
            out = self._forward(batch, draft_keys, feed, shift)
            draws = (out.packed if draft_keys is not None
                     else self.runner.sample(out, batch, self.sampling, defer=True))
        except Exception as e:  # noqa: BLE001 - the whole forward: its requests fail, the engine goes on
            self.cache.drop_plans(batch)
            for w in batch:
                fail(w.req, e, "forward")
            return None
        if draft_keys is None:  # a round's rows know their length when its draws are read
            self.cache.commit_rows(batch, absolute, fail)
        cuda = draws.device.type == "cuda"
        host = torch.empty(draws.shape, dtype=draws.dtype, pin_memory=cuda)
        host.copy_(draws, non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        return Deferred(batch, draws, host, done, absolute if draft_keys is not None else None)

    def _same_rows(self, d: Deferred) -> list | None:
        """``d``'s requests when they are all that runs and nothing waits (the next step would schedule just them) and
        each fed every token it had (a window's drafts are past its tokens until they are read)."""
        reqs = [w.req for w in d.batch]
        if self.waiting or self._failed_outputs:
            return None
        running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        if len(running) != len(reqs) or {id(r) for r in running} != {id(r) for r in reqs}:
            return None
        if any(w.req.remaining != 1 - w.num_new for w in d.batch):
            return None
        return reqs

    def _lookahead(self, d: Deferred) -> list[RowWork] | None:
        """The next step's rows when it can be launched before ``d``'s draws are read: the same requests (and no other
        running or waiting), each able to take two more tokens and given a page for the next one."""
        reqs = self._same_rows(d)
        if reqs is None or not self._plain_rows(reqs):
            return None
        if any(len(r.output) + 2 > r.params.max_new_tokens for r in reqs):
            return None
        if not all(self.scheduler.cache.grow(r, r.num_computed + 1) for r in reqs):
            return None
        return [RowWork(r, [self.config.pad_token_id], decode=True, sample=True) for r in reqs]

    def _round_lookahead(self, d: Deferred) -> tuple[list[RowWork], int] | None:
        """The next greedy round's rows and drafter key bucket when it can be launched before round ``d``'s draws are
        read (see the module docstring): each row with the draft length and pages of the most ``d`` can accept."""
        reqs = self._same_rows(d)
        if reqs is None:
            return None
        U = self.pools.block_size
        retain = self.cache.keeps_decode_state
        lens = []
        for w in d.batch:
            r, n = w.req, w.num_new - 1  # the window's drafts: the round leaves 1 .. 1 + n tokens in the cache
            least = r.num_computed - n
            if retain and w.boundary is None and (least + n) // U != (least - 1) // U:
                return None  # it may end on a page boundary with no slot for that state: read it first
            emitted = len(r.output) + 1 + n  # the most the request has emitted after the round
            if emitted + 1 > r.params.max_new_tokens:
                return None
            lens.append(min(self.scheduler.draft_len(r), r.params.max_new_tokens - emitted - 1))
        keys = round_keys(self, reqs)
        if keys is None or not max(lens) > 0:
            return None
        if not all(self.scheduler.cache.grow(r, r.num_computed + 1 + k) for r, k in zip(reqs, lens)):
            return None
        pad = self.config.pad_token_id
        return [RowWork(r, [pad] * (1 + k), decode=True, verify=k > 0, sample=True, shift_max=w.num_new - 1)
                for r, k, w in zip(reqs, lens, d.batch)], keys

    def _launch_next(self, d: Deferred) -> Deferred | None:
        """Launch the step after ``d`` when it can go before ``d``'s draws are read (None otherwise)."""
        if not d.windowed:
            rows = self._lookahead(d)
            return self._launch_deferred(rows, d.draws[:, 0]) if rows is not None else None
        nxt = self._round_lookahead(d)
        if nxt is None:
            return None
        rows, keys = nxt
        drafted = {id(w.req): w.num_new - 1 for w in d.batch}
        for w in rows:  # staged at the least the last round leaves; the device adds its accepted drafts
            w.req.num_computed -= drafted[id(w.req)]
        try:
            return self._launch_deferred(rows, d.draws[:, 3], draft_keys=keys, shift=d.draws[:, 2])
        finally:
            for w in rows:
                w.req.num_computed += drafted[id(w.req)]

    def _advance(self) -> list:
        """One ``step()`` with a deferred step in flight: launch the lookahead step when it can go, then read the
        deferred draws and emit their tokens (the lookahead becomes the deferred step)."""
        d, self._ahead = self._ahead, None
        nxt = self._launch_next(d)
        if nxt is not None:
            self.num_steps += 1
        ahead = {id(w.req): w.num_new for w in nxt.batch} if nxt is not None else {}
        if d.done is not None:
            d.done.synchronize()
        outputs, self._failed_outputs = self._failed_outputs, []

        def fail(r, e: Exception, where: str) -> None:
            outputs.append(self._fail(r, e, where))

        now = time.perf_counter()
        draws = Draws(d.host.tolist(), {}, d.windowed)
        for i, (w, res) in enumerate(zip(d.batch, self._emissions(d.batch, draws))):
            r = w.req
            if r.status != RequestStatus.RUNNING or isinstance(res, Exception):  # ended since, or its draws failed
                if r.status == RequestStatus.RUNNING:
                    fail(r, res, "verification" if w.verify else "sampling")
                if d.windowed:  # a round's plans are committed at its read: give its slots back
                    self.cache.drop_plans([w])
                continue
            extra = ahead.get(id(r), 0)
            r.num_computed -= extra  # the lookahead's tokens: out of the cache's view until they are kept
            if d.windowed:
                self.cache.commit_rows([w], [d.absolute[i]], fail)
            if r.status != RequestStatus.RUNNING:
                continue
            try:
                outputs.append(self._append_tokens(r, *res, now))
            except Exception as e:  # noqa: BLE001 - this request alone fails
                fail(r, e, "stop check")
            if r.status == RequestStatus.RUNNING:
                r.num_computed += extra
        self._ahead = nxt
        return outputs
