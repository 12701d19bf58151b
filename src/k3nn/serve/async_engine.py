"""The Engine on its own thread, driven from asyncio.

:class:`AsyncEngine` owns a :class:`k3nn.engine.Engine` and one thread, the only one that ever calls it. The thread
runs ``warmup()`` first, then loops: take the commands handed over since the last step (add a request, abort one,
run a function on the engine), then ``step()`` while ``has_unfinished()``. With nothing to do it blocks on a
condition variable (no polling); a hand-off wakes it.

The asyncio side (the HTTP server's event loop) calls :meth:`AsyncEngine.add`, which hands the prompts over and
awaits the outcome of ``Engine.add_request`` — so its validation errors (``TypeError`` / ``ValueError`` /
``CacheFullError``) are raised to the caller and nothing is queued — and returns a :class:`RequestStream`. After
every step the engine thread posts the step's outputs to the event loop with one ``loop.call_soon_threadsafe``;
each stream then holds ``(choice index, RequestOutput, time)`` events, one per engine step that produced tokens
for that choice (a verify window may add several tokens at once).

A request may hold several prompts (a completions batch) and ``n`` samples of each: choice ``i = p · n + k`` is
sample k of prompt p. :meth:`AsyncEngine.abort` (a client went away) aborts all of them and frees their rows and
pages. A request that fails inside the Engine gets a finished output with ``finish_reason="error"``; an exception
escaping ``step()`` itself fails the requests in flight and the loop goes on; requests that the engine can never
admit (nothing running, nothing admissible: :class:`~k3nn.engine.EngineStalledError`'s condition) fail rather than
wait forever. Requests that ended are forgotten by the Engine (``Engine.requests``/``parents``), so a server that
runs for days holds only the live ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Sequence

from ..engine import Engine, EngineStalledError, RequestOutput, RequestStatus, SamplingParams

__all__ = ["AsyncEngine", "RequestStream", "EngineNotReadyError"]

log = logging.getLogger("k3nn.serve")

Event = tuple  # (choice index, RequestOutput, perf_counter time of the step)


class EngineNotReadyError(RuntimeError):
    """The engine is still warming up, failed to start, or is shutting down."""


class RequestStream:
    """The asyncio end of one submitted request: its events, in order, as the engine thread posts them.

    ``request_id``; ``prompts`` (token ids, one list per prompt); ``params``; ``num_choices`` = prompts × n;
    ``arrival`` (``time.perf_counter()`` when it was submitted). :meth:`get` waits for the next events."""

    def __init__(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 num_speculative_tokens: int | None):
        self.request_id, self.prompts, self.params = request_id, prompts, params
        self.num_speculative_tokens = num_speculative_tokens
        self.num_choices = len(prompts) * params.n
        self.arrival = time.perf_counter()
        self._items: list[Event] = []
        self._wake = asyncio.Event()
        # engine-thread state
        self.engine_ids: list[str] = []  # one engine request id per prompt
        self.routes: dict[str, int] = {}  # engine (child) request id → choice index
        self.open: set[int] = set()  # choice indices not finished yet

    async def get(self) -> list[Event]:
        """The events posted since the last call (waits until there is at least one)."""
        while not self._items:
            self._wake.clear()
            await self._wake.wait()
        items, self._items = self._items, []
        return items

    def _push(self, items: list[Event]) -> None:
        self._items.extend(items)
        self._wake.set()


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller went away
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _deliver(batch: list[tuple[RequestStream, list[Event]]]) -> None:
    for stream, items in batch:
        stream._push(items)


class AsyncEngine:
    """One :class:`~k3nn.engine.Engine` served from a dedicated thread (see the module docstring).

    ``warmup``: run ``engine.warmup(**warmup_kwargs)`` on the thread before serving (:attr:`ready` turns True
    after it); ``on_fatal(exc)``: called on the event loop if the warmup fails (the server then stops)."""

    def __init__(self, engine: Engine, *, warmup: bool = True, warmup_kwargs: dict[str, Any] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self._warmup, self._warmup_kwargs = warmup, dict(warmup_kwargs or {})
        self.on_fatal = on_fatal
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = False
        self.error: BaseException | None = None  # why the engine thread cannot serve
        self.warmup_s: float | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._routes: dict[str, RequestStream] = {}  # engine (child) id → stream; engine thread only
        self._stalls = 0

    # -- lifecycle ------------------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Warmed up and serving."""
        return self._ready and self.error is None and not self._stopping

    @property
    def running(self) -> bool:
        """The engine thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the outputs go to (set by :meth:`start`)."""
        return self._loop

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; its outputs go to ``loop`` (default: the running loop)."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="k3nn-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 60.0) -> None:
        """Abort every request still in flight (their streams get a finished output with ``finish_reason``
        "abort"), stop the thread and wait up to ``timeout`` seconds for it (a step in progress completes first)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the engine thread did not stop within %.0f s (a step or the warmup is still running)",
                            timeout)

    async def shutdown(self, timeout: float | None = 60.0) -> None:
        """:meth:`stop` without blocking the event loop."""
        await asyncio.get_running_loop().run_in_executor(None, self.stop, timeout)

    # -- hand-offs (event loop side) ------------------------------------------------------------------------------
    def _submit(self, cmd: tuple) -> None:
        with self._cv:
            if self._stopping:
                raise EngineNotReadyError("the server is shutting down")
            self._inbox.append(cmd)
            self._cv.notify()

    async def add(self, request_id: str, prompts: Sequence[Sequence[int]], params: SamplingParams,
                  num_speculative_tokens: int | None = None) -> RequestStream:
        """Queue one request (one engine request per prompt, each with ``params.n`` samples) and return its
        stream. Raises what ``Engine.add_request`` raises for any of the prompts — then none of them is queued —,
        or :class:`EngineNotReadyError`. If the caller is cancelled while waiting, the request is aborted."""
        if not self.ready:
            raise EngineNotReadyError(
                "the engine failed to start: " + repr(self.error) if self.error is not None
                else "the server is shutting down" if self._stopping else "the engine is warming up")
        stream = RequestStream(request_id, [list(p) for p in prompts], params, num_speculative_tokens)
        fut = asyncio.get_running_loop().create_future()
        self._submit(("add", stream, fut))
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (all its prompts and samples), if it is still in flight; no-op otherwise. Thread-safe,
        non-blocking; the engine frees its rows and pages before its next step."""
        try:
            self._submit(("abort", request_id))
        except EngineNotReadyError:  # shutting down: stop() aborts everything
            pass

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """``fn(engine)`` run on the engine thread between two steps; its result (or exception)."""
        if self.error is not None or not self.running:
            raise EngineNotReadyError("the engine thread is not running")
        fut = asyncio.get_running_loop().create_future()
        self._submit(("call", fn, fut))
        return await fut

    # -- the engine thread ----------------------------------------------------------------------------------------
    def _post(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        if self._warmup:
            try:
                self.warmup_s = self.engine.warmup(**self._warmup_kwargs)
                log.info("engine warmup: %.2f s (every step shape up to max_num_seqs=%d compiled and tuned)",
                         self.warmup_s, self.engine.config.max_num_seqs)
            except BaseException as e:  # noqa: BLE001 - reported to the server, which stops
                log.exception("engine warmup failed")
                self.error = e
                if self.on_fatal is not None:
                    self._post(self.on_fatal, e)
        self._ready = True
        while True:
            with self._cv:
                while not self._inbox and not self._stopping and not (self.error is None and self._busy()):
                    self._cv.wait()
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            for cmd in inbox:
                self._execute(cmd)
            if stopping:
                self._end_all("abort", None)
                return
            if self.error is None and self._busy():
                self._step()

    def _busy(self) -> bool:
        return self.engine.has_unfinished()

    def _execute(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, stream, fut = cmd
            if self.error is not None:
                self._post(_settle, fut, None, EngineNotReadyError(f"the engine failed to start: {self.error!r}"))
                return
            try:
                self._add(stream)
            except BaseException as e:  # noqa: BLE001 - the caller's bad input: handed back
                self._post(_settle, fut, None, e)
            else:
                self._post(_settle, fut, stream, None)
        elif kind == "abort":
            stream = self._streams.get(cmd[1])
            if stream is not None:
                self._drop(stream, abort=True)
        elif kind == "call":
            _, fn, fut = cmd
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001
                self._post(_settle, fut, None, e)
            else:
                self._post(_settle, fut, result, None)

    def _add(self, stream: RequestStream) -> None:
        e, n = self.engine, stream.params.n
        if stream.request_id in self._streams:
            raise ValueError(f"request id {stream.request_id!r} is already in use")
        try:
            for p, prompt in enumerate(stream.prompts):
                rid = stream.request_id if len(stream.prompts) == 1 else f"{stream.request_id}-{p}"
                e.add_request(prompt, stream.params, request_id=rid,
                              num_speculative_tokens=stream.num_speculative_tokens)
                stream.engine_ids.append(rid)
                children = list(e.parents.get(rid, ())) if n > 1 else [rid]
                if len(children) != n:
                    raise RuntimeError(f"engine: request {rid!r} has {len(children)} samples, expected n={n}")
                for k, cid in enumerate(children):
                    stream.routes[cid] = p * n + k
        except BaseException:
            self._drop(stream, abort=True)  # the prompts queued before the bad one: nothing ran yet
            raise
        stream.open = set(range(stream.num_choices))
        self._streams[stream.request_id] = stream
        for cid in stream.routes:
            self._routes[cid] = stream
        self._stalls = 0

    def _drop(self, stream: RequestStream, abort: bool) -> None:
        """Forget a request: abort what still runs (``abort``), drop its routes and the Engine's records."""
        e = self.engine
        for rid in stream.engine_ids:
            if abort and (rid in e.requests or rid in getattr(e, "parents", {})):
                try:
                    e.abort(rid)
                except KeyError:
                    pass
            for cid in getattr(e, "parents", {}).pop(rid, None) or ():
                e.requests.pop(cid, None)
            e.requests.pop(rid, None)
        for cid in stream.routes:
            self._routes.pop(cid, None)
        self._streams.pop(stream.request_id, None)

    def _step(self) -> None:
        e = self.engine
        before = (getattr(e, "num_forwards", None), len(e.waiting), len(e.running))
        try:
            outputs = e.step()
        except EngineStalledError as exc:  # the waiting requests can never be admitted
            self._fail_waiting(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - not one request's failure: fail those in flight, keep serving
            log.exception("Engine.step() raised; failing the %d request(s) in flight", len(self._streams))
            self._end_all("error", f"engine step: {type(exc).__name__}: {exc}")
            return
        now = time.perf_counter()
        batch: dict[RequestStream, list[Event]] = defaultdict(list)
        done = []
        for out in outputs:
            stream = self._routes.get(out.request_id)
            if stream is None:
                continue
            index = stream.routes[out.request_id]
            batch[stream].append((index, out, now))
            if out.finished:
                stream.open.discard(index)
                if not stream.open:
                    done.append(stream)
        for stream in done:
            self._drop(stream, abort=False)
        if batch:
            self._post(_deliver, list(batch.items()))
        if outputs or before != (getattr(e, "num_forwards", None), len(e.waiting), len(e.running)) \
                or before[0] is None:
            self._stalls = 0
            return
        self._stalls += 1
        if self._stalls >= 2:  # nothing runs and nothing can be admitted: the waiting requests never will be
            self._fail_waiting(getattr(getattr(e, "scheduler", None), "stall", None) or "no rows or pages free")

    def _fail_waiting(self, why: str) -> None:
        """Fail the requests waiting for admission that no step can admit (nothing runs, nothing frees rows or
        pages: e.g. prefilled requests hold them until released)."""
        waiting = {r.request_id for r in self.engine.waiting}
        stuck = [s for s in self._streams.values() if any(c in waiting for c in s.routes)]
        log.error("the engine cannot admit %d request(s): %s", len(stuck), why)
        for s in stuck:
            self._end(s, "error", f"the engine cannot admit this request ({why})")
        self._stalls = 0

    def _end(self, stream: RequestStream, reason: str, error: str | None) -> None:
        now = time.perf_counter()
        items = []
        for cid, index in stream.routes.items():
            if index in stream.open:
                items.append((index, RequestOutput(cid, [], True, reason, None, error), now))
        stream.open.clear()
        self._drop(stream, abort=True)
        if items:
            self._post(_deliver, [(stream, items)])

    def _end_all(self, reason: str, error: str | None) -> None:
        for stream in list(self._streams.values()):
            try:
                self._end(stream, reason, error)
            except Exception:  # noqa: BLE001 - keep ending the others
                log.exception("could not end request %s", stream.request_id)

    # -- checks -----------------------------------------------------------------------------------------------------
    async def leaks(self) -> list[str]:
        """Problems with the engine's bookkeeping, checked on the engine thread between steps (call it when no
        request is in flight): requests still queued or running, rows with an owner, request records kept, streams
        still routed, or latent pages / KDA snapshot slots held by anything but the prefix index. Empty when
        nothing leaked."""
        return await self.call(self._leaks)

    def _leaks(self, e: Engine) -> list[str]:
        out = []
        if e.has_unfinished() or e.waiting or e.running:
            out.append(f"{len(e.waiting)} waiting / {len(e.running)} running requests")
        owners = [i for i, o in enumerate(e.row_owner) if o is not None]
        if owners:
            out.append(f"rows {owners} have an owner")
        live = [rid for rid, r in e.requests.items() if r.status not in (RequestStatus.FINISHED,
                                                                          RequestStatus.ABORTED,
                                                                          RequestStatus.FAILED)]
        if e.requests:
            out.append(f"{len(e.requests)} request record(s) kept ({len(live)} live)")
        if self._streams or self._routes:
            out.append(f"{len(self._streams)} stream(s) still routed")
        alloc = e.pools.allocator
        cached = set()
        snaps = 0
        if e.prefix is not None:
            for entry in e.prefix.entries.values():
                cached.add(entry.page)
                snaps += entry.snapshot is not None
        if alloc.num_free != alloc.num_blocks - len(cached):
            out.append(f"{alloc.num_blocks - alloc.num_free} pages in use, the prefix index holds {len(cached)}")
        sn = e.pools.snapshots
        if sn.num_free != sn.num_slots - snaps:
            out.append(f"{sn.num_slots - sn.num_free} snapshot slots in use, the prefix index holds {snaps}")
        return out
