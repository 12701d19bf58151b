"""Asynchronous decode steps (``EngineConfig.async_scheduling``): the host prepares and launches step N+1 while
the device runs step N, and reads step N's tokens after that launch.

A pure decode step (every running request feeds its pending token; no prefill chunk, drafts, log-probabilities or
images) is *deferred*: its forward and device draws are launched, its ``[n, 2]`` draws (token, logits non-finite)
start a non-blocking copy to pinned memory, and :meth:`Engine.step <k3nn.engine.Engine.step>` returns. The next
``step()`` launches the *lookahead* step first: the same rows, each fed its token of step N on the device (the
runner copies the draws into the staged ids before the replay), when nothing else waits to be scheduled and every
row can still take two more tokens. Then it reads step N's draws (one wait on its copy), appends the tokens and
checks the stop conditions: the host work runs while the device computes step N+1. Outputs therefore come back one
``step()`` later than without it.

A request that finishes at step N (eos, a stop id or string) was fed one more token in step N+1: that row's draw
is dropped, and the request's ``num_computed`` is rolled back by it before its pages are indexed, so the prefix
cache never sees the extra token (its latent lies past the length; a decode-state snapshot taken at that
position is not indexed). The KDA running state of a finished request is freed with its row; the next request in
that row starts after step N+1 in stream order. Steps that are not pure decodes run as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .request import RequestStatus
from .runner import Draws, RowWork

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

__all__ = ["Deferred", "deferrable", "launch", "advance"]


@dataclass
class Deferred:
    """A launched decode step whose draws are not read yet: its rows, the draws on the device ``[n, 2]``, their
    pinned host copy and the event after that copy (None on the CPU)."""

    batch: list[RowWork]
    draws: torch.Tensor
    host: torch.Tensor
    done: torch.cuda.Event | None


def _plain(engine: "Engine", reqs: Sequence) -> bool:
    """Rows whose draws need nothing from the host: no drafter, images or log-probabilities, graph-shaped steps."""
    return (engine.drafter is None and engine.runner.static and bool(reqs)
            and len(reqs) <= engine.runner.max_rows
            and all(r.params.logprobs is None and (engine.multimodal is None or r.images is None) for r in reqs))


def deferrable(engine: "Engine", batches: Sequence[Sequence[RowWork]]) -> bool:
    """This step is one forward of decode rows only (every row feeds its pending token and samples) that can be
    deferred."""
    if not engine.config.async_scheduling or len(batches) != 1 or engine.waiting:
        return False  # with requests waiting the next step schedules anyway: no lookahead to gain
    rows = batches[0]
    return (all(w.decode and not w.verify and w.sample and w.num_new == 1 for w in rows)
            and _plain(engine, [w.req for w in rows]))


def launch(engine: "Engine", batch: list[RowWork], feed: torch.Tensor | None = None) -> Deferred | None:
    """Run ``batch``'s forward and draws without reading them (``feed`` [n]: the rows' tokens on the device,
    instead of their staged ids). A forward error fails the batch's requests (reported by the next step) and
    returns None."""
    def fail(r, e: Exception, where: str) -> None:
        engine._failed_outputs.append(engine._fail(r, e, where))

    batch, absolute = engine.cache.plan_rows(batch, fail)
    if not batch:
        return None
    try:
        out = engine._forward(batch, None, feed)
        draws = engine.runner.sample(out, batch, engine.sampling, defer=True)
    except Exception as e:  # noqa: BLE001 - the whole forward: its requests fail, the engine goes on
        engine.pools.snapshots.free([s for w in batch for _, s in w.snapshots])
        for w in batch:
            fail(w.req, e, "forward")
        return None
    engine.cache.commit_rows(batch, absolute, fail)
    cuda = draws.device.type == "cuda"
    host = torch.empty(draws.shape, dtype=draws.dtype, pin_memory=cuda)
    host.copy_(draws, non_blocking=cuda)
    done = None
    if cuda:
        done = torch.cuda.Event()
        done.record()
    return Deferred(batch, draws, host, done)


def _lookahead(engine: "Engine", d: Deferred) -> list[RowWork] | None:
    """The next step's rows when it can be launched before ``d``'s draws are read: the same requests (and no other
    running or waiting), each able to take two more tokens and given a page for the next one."""
    reqs = [w.req for w in d.batch]
    if engine.waiting or engine._failed_outputs or not _plain(engine, reqs):
        return None
    running = [r for r in engine.running if r.status == RequestStatus.RUNNING]
    if len(running) != len(reqs) or {id(r) for r in running} != {id(r) for r in reqs}:
        return None
    if any(r.remaining != 0 or len(r.output) + 2 > r.params.max_new_tokens for r in reqs):
        return None
    if not all(engine.scheduler.cache.grow(r, r.num_computed + 1) for r in reqs):
        return None
    return [RowWork(r, [engine.config.pad_token_id], decode=True, sample=True) for r in reqs]


def advance(engine: "Engine") -> list:
    """One ``step()`` with a deferred step in flight: launch the lookahead step when it can go, then read the
    deferred draws and emit their tokens (the lookahead becomes the deferred step)."""
    d, engine._ahead = engine._ahead, None
    rows = _lookahead(engine, d)
    nxt = launch(engine, rows, d.draws[:, 0]) if rows is not None else None
    if nxt is not None:
        engine.num_steps += 1
    ahead = {id(w.req) for w in nxt.batch} if nxt is not None else set()
    if d.done is not None:
        d.done.synchronize()
    outputs, engine._failed_outputs = engine._failed_outputs, []
    now = time.perf_counter()
    for w, res in zip(d.batch, engine._emissions(d.batch, Draws(d.host.tolist(), {}, False))):
        r = w.req
        if r.status != RequestStatus.RUNNING:  # finished at the step before, aborted or failed since
            continue
        extra = id(r) in ahead
        if extra:  # the lookahead fed one more token: out of the cache's view until this token is kept
            r.num_computed -= 1
        if isinstance(res, Exception):
            outputs.append(engine._fail(r, res, "sampling"))
        else:
            try:
                outputs.append(engine._append_tokens(r, *res, now))
            except Exception as e:  # noqa: BLE001 - this request alone fails
                outputs.append(engine._fail(r, e, "stop check"))
        if extra and r.status == RequestStatus.RUNNING:
            r.num_computed += 1
    engine._ahead = nxt
    return outputs
