"""Shared benchmark plumbing: timing, errors, tables; device ceilings and result files come from
:mod:`k3nn.results` (re-exported here)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..results import bench_ms, device_meta, results_dir, write_results  # re-exported: library code writes results too
from .models import bench_model  # re-exported: it lives in bench/models.py

__all__ = ["device_meta", "bench_ms", "graph_bench_ms", "print_call_times", "write_results", "results_dir",
           "rel_err", "bench_model"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64 (NaN anywhere → inf)."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return ((o - r).norm() / r.norm().clamp_min(1e-30)).item()


def print_call_times(name: str, fn: Callable[[], Any], reps: int = 1, warmup: int = 2) -> None:
    """``warmup`` untimed calls (compilation, tuning), then ``reps`` calls each timed alone with CUDA events and
    printed in µs: the launches a profiler driver (``ncu --launch-skip warmup``) names what it profiled by."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        print(f"{name}{f' call {i}' if reps > 1 else ''}: {a.elapsed_time(b) * 1e3:.1f} us", flush=True)


def graph_bench_ms(fn: Callable[..., Any], inner: int = 50, rep: int = 20, indexed: bool = False) -> float:
    """Per-call milliseconds of ``fn`` replayed ``inner`` times inside one captured CUDA graph (median of rep).
    ``indexed``: ``fn`` takes the call's index 0 … inner − 1 (e.g. to rotate over input copies larger than L2)."""
    call = fn if indexed else (lambda i: fn())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            call(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(inner):
            call(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    times.sort()
    return times[len(times) // 2]


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in cols))
