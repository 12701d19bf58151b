"""CUDA graphs of graph-safe steps, keyed by shape, one memory pool: the graph runner every decode loop shares.

A *step* is a function of no arguments that reads persistent device tensors and returns device tensors (it may
write persistent state in place). :meth:`GraphRunner.run` executes ``fn`` for ``key``:

* the first call of a key runs ``fn`` eagerly on a side stream (Triton compilation, autotuning and cuBLAS
  workspaces happen here; its effects are the step's real effects) and returns its outputs;
* the second call captures ``fn`` into a CUDA graph (capture runs no kernel), then replays it once;
* later calls replay it.

So every call applies the step exactly once. :meth:`GraphRunner.capture` instead warms up and captures a step
whose effects are harmless (a batch of padding rows), so serving never pays for a capture. All graphs share one
memory pool (they never run concurrently; a step's outputs are read before the next step replays). Python's cyclic
garbage collector is paused while a graph records (see :meth:`GraphRunner._capture`). A capture that
fails (an op that syncs with the host, an eager kernel) is logged with its reason, remembered, and that key runs
eagerly from then on: same results. ``enabled=False`` (CPU, or the eager backend on a GPU) runs every step
eagerly. Steps that run eagerly for good do so under :func:`~k3nn.kernels.registry.uncaptured_step` (the kernel
choices of a host-bound step); the warm-up run before a capture does not (it builds what the capture records).
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable, Hashable

import torch

from ..kernels.registry import uncaptured_step

log = logging.getLogger(__name__)

__all__ = ["GraphRunner"]


class GraphRunner:
    """Captured steps by key on ``device`` (see the module docstring). ``graphs`` / ``failed``: the keys captured
    and the keys that run eagerly with why."""

    def __init__(self, device: torch.device | str, enabled: bool = True, name: str = "step"):
        self.device = torch.device(device)
        self.enabled = bool(enabled) and self.device.type == "cuda"
        self.name = name
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.failed: dict[Hashable, str] = {}
        self._seen: set = set()
        self._pool = None  # the shared memory pool, made at the first capture

    def __contains__(self, key: Hashable) -> bool:
        return key in self.graphs

    def run(self, key: Hashable, fn: Callable[[], Any], on_capture_failure: Callable[[], None] | None = None):
        """Apply the step once (eagerly, by capture + replay, or by replay; see the module docstring)."""
        if not self.enabled or key in self.failed:
            return self._eager(fn)
        entry = self.graphs.get(key)
        if entry is not None:
            entry[0].replay()
            return entry[1]
        if key not in self._seen:
            self._seen.add(key)
            return self._side_stream(fn)
        outs = self._capture(key, fn, on_capture_failure)
        if key in self.failed:
            return self._eager(fn)
        self.graphs[key][0].replay()
        return outs

    @staticmethod
    def _eager(fn: Callable[[], Any]):
        """A step that runs eagerly for good (no graph for its key): the kernel choices of a host-bound step."""
        with uncaptured_step():
            return fn()

    def capture(self, key: Hashable, fn: Callable[[], Any], warmup: bool = True) -> bool:
        """Warm up (unless ``warmup`` is False) and capture ``fn`` for ``key`` without a real step: ``fn`` must be
        harmless to run (e.g. a batch of padding rows). Returns whether a graph was captured."""
        if not self.enabled or key in self.graphs or key in self.failed:
            return key in self.graphs
        if warmup:
            self._side_stream(fn)
        self._seen.add(key)
        self._capture(key, fn, None)
        return key in self.graphs

    def _side_stream(self, fn: Callable[[], Any]):
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            out = fn()
        torch.cuda.current_stream(self.device).wait_stream(s)
        return out

    def _capture(self, key: Hashable, fn: Callable[[], Any], on_failure: Callable[[], None] | None):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        # No cyclic garbage collection while recording: a collection could free an unreachable engine's CUDA
        # graphs, and destroying a graph is not permitted during a capture (it failed the capture on the H200).
        collect = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(g, pool=self._pool):
                outs = fn()
        except Exception as e:  # noqa: BLE001 - any capture failure means: run this key eagerly
            reason = f"{type(e).__name__}: {e}"
            self.failed[key] = reason
            log.warning("%s: CUDA graph capture of %r failed (%s); that shape runs eagerly", self.name, key,
                        reason.splitlines()[0])
            torch.cuda.synchronize(self.device)
            # an aborted capture can leave its memory pool marked as recording ("beginAllocateToPool: already
            # recording"), which would fail every later capture: the next one starts a new pool
            self._pool = None
            if on_failure is not None:
                on_failure()
            return None
        finally:
            if collect:
                gc.enable()
        self.graphs[key] = (g, outs)
        return outs

    def reset(self) -> None:
        """Drop every graph (after the model's weights or the step's buffers were replaced)."""
        self.graphs.clear()
        self.failed.clear()
        self._seen.clear()
