"""Decode steps for ``generate()``: the standard step, the static (graph-safe) step and its CUDA-graph replay.

A *step* maps the previous tokens ``ids [B, 1]`` to next-token logits ``[B, V]`` and advances the cache by one.

* ``standard``: the model's forward without input validation (no ``int(ids.min())`` host sync per token).
* ``static``: the same math with the cache in graph-safe mode (:meth:`HybridCache.set_static`): MLA attends
  over the whole static buffer with ``key_mask`` and writes at a device-tensor position. Fixed shapes, no
  host sync, so the step can be captured.
* ``graph``: the static step captured once in a CUDA graph and replayed. The first call runs the step
  eagerly on a side stream (warm-up: Triton compilation, cuBLAS workspaces), the second captures and
  replays, later calls replay. If capture fails (an op that syncs with the host, an eager fallback that
  cannot be captured) the runner logs why and keeps running the static step eagerly: same tokens.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..kernels.registry import backend as use_backend
from ..kernels.registry import current_backend, uncaptured_step
from ..runtime.graphs import GraphRunner

log = logging.getLogger(__name__)

__all__ = ["standard_step", "DecodeRunner", "make_decode_runner"]

StepFn = Callable[[torch.Tensor], torch.Tensor]


def standard_step(model, cache) -> StepFn:
    """ids [B, 1] → logits [B, V] through ``model.model`` and ``lm_head`` (validation skipped: generate's own
    sampled ids are in range by construction)."""

    def step(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), use_backend(model.backend):
            h, _ = model.model(ids, None, cache, None, None, None)
            return model.lm_head(h[:, -1])

    return step


class DecodeRunner:
    """Runs a decode step eagerly or as a replayed CUDA graph. ``mode``: ``"standard"`` | ``"static"`` |
    ``"graph"``. ``fn`` must be graph-safe for ``"static"``/``"graph"`` (the cache is put in static mode). The
    graph is a :class:`~k3nn.runtime.graphs.GraphRunner`'s (the runner the engine's steps use): the first call
    runs eagerly on a side stream, the second captures and replays, later calls replay; a failed capture is logged
    and the static step keeps running eagerly."""

    def __init__(self, fn: StepFn, cache, mode: str = "standard", name: str = "standard"):
        if mode not in ("standard", "static", "graph"):
            raise ValueError(f"DecodeRunner: mode must be 'standard', 'static' or 'graph', got {mode!r}")
        self.fn, self.cache, self.mode, self.name = fn, cache, mode, name
        self.graphs = GraphRunner(cache.device, enabled=mode == "graph", name="decode step")
        self.calls = 0
        self._note: str | None = None
        self._ids: torch.Tensor | None = None
        cache.set_static(mode in ("static", "graph"))

    @property
    def uses_graph(self) -> bool:
        """The step replays a captured CUDA graph."""
        return "step" in self.graphs

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured step (replaying it advances the device state only: the caller advances the cache's host
        bookkeeping), or None before the capture or without one."""
        entry = self.graphs.graphs.get("step")
        return None if entry is None else entry[0]

    @property
    def fallback_reason(self) -> str | None:
        """Why the step does not run as asked (a failed capture, or the note set by :func:`make_decode_runner`);
        None when it does."""
        return self.graphs.failed.get("step", self._note)

    @fallback_reason.setter
    def fallback_reason(self, note: str | None) -> None:
        self._note = note

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.mode != "graph" or not self.graphs.enabled:
            with uncaptured_step():
                return self.fn(ids)
        if self._ids is None or self._ids.shape != ids.shape:
            self._ids = ids.clone()  # the step's input: a static buffer the graph reads
        else:
            self._ids.copy_(ids)
        replay = "step" in self.graphs
        seen = self.cache.seen_tokens  # a capture pass runs the step's host bookkeeping once, a replay does not

        def undo() -> None:  # the aborted capture pass ran the Python side of the cache's commit
            self.cache.seen_tokens = seen

        out = self.graphs.run("step", lambda: self.fn(self._ids), on_capture_failure=undo)
        if replay:
            self.cache.advance_host(ids.shape[1])
        return out

    def close(self) -> None:
        """Leave static mode (the cache stays valid for further standard forwards)."""
        self.cache.set_static(False)
        self.cache.pool_decode = False
        self.graphs.reset()


def eager_backend_on_cuda(model, device: torch.device) -> bool:
    """The model runs the eager backend on a CUDA device: its kernels sync with the host, so there is nothing
    to capture, and a failed capture attempt can leave the CUDA context unusable
    (cudaErrorStreamCaptureInvalidated, seen on the H200)."""
    return device.type == "cuda" and (getattr(model, "backend", None) or current_backend()) == "eager"


def latency_unsupported(model, cache, attention_mask: torch.Tensor | None) -> str | None:
    """None when the latency-specialized step can decode this batch, else why not (the caller falls back)."""
    from ..cache.hybrid import HybridCache, KDAState

    if type(cache) is not HybridCache:
        return "needs the contiguous HybridCache"
    if any(not isinstance(st, KDAState) and st.kv is None for st in cache.layers):
        return "the cache was created without mla_pool=True"
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        return "left-padded (mixed-length) batch"
    if model.device.type == "meta":
        return "weights on the meta device"
    if not hasattr(model, "prepare_decode"):
        return f"{type(model).__name__} has no prepare_decode()"
    return None


def make_decode_runner(model, cache, *, cuda_graph: bool | str | None = None, decode_backend: str = "auto",
                       attention_mask: torch.Tensor | None = None) -> DecodeRunner:
    """Pick the decode step for ``generate()``.

    ``cuda_graph``: None/"auto" → graphs on CUDA devices; True → graphs (static eager off-CUDA);
    ``"static"`` → the graph-safe step without capture (any device); False → the standard step.
    ``decode_backend``: ``"auto"`` (the layers as they are) or ``"latency_specialized"``: the same layers with
    their decode weights prepared (:meth:`k3nn.KimiK3.prepare_decode`: packed projections) and MLA reading the
    ``mla_pool`` cache through the paged decode kernel (``cache.pool_decode``), always graph-safe; falls back to
    the standard step for left-padded batches and caches without the pool layout.
    """
    if decode_backend not in ("auto", "latency_specialized"):
        raise ValueError(f"decode_backend must be 'auto' or 'latency_specialized', got {decode_backend!r}")
    on_cuda = cache.device.type == "cuda"
    if cuda_graph in (None, "auto"):
        mode = "graph" if on_cuda else "standard"
    elif cuda_graph == "static":
        mode = "static"
    elif cuda_graph is True:
        mode = "graph" if on_cuda else "static"
    elif cuda_graph is False:
        mode = "standard"
    else:
        raise ValueError(f"cuda_graph must be None, 'auto', 'static', True or False, got {cuda_graph!r}")
    eager_note = None
    if mode == "graph" and eager_backend_on_cuda(model, cache.device):
        mode, eager_note = "static", "the eager backend is not capturable: the graph-safe step runs uncaptured"
    if decode_backend == "latency_specialized":
        why = latency_unsupported(model, cache, attention_mask)
        if why is None:
            if not model.decode_prepared:
                model.prepare_decode()
            cache.pool_decode = True
            runner = DecodeRunner(standard_step(model, cache), cache, "static" if mode == "standard" else mode,
                                  name="latency_specialized")
            runner.fallback_reason = eager_note
            return runner
        log.info("latency_specialized decode falls back to the standard path: %s", why)
    runner = DecodeRunner(standard_step(model, cache), cache, mode, name="standard")
    runner.fallback_reason = eager_note
    return runner
