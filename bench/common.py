"""Shared benchmark plumbing: timing, errors, tables. Device ceilings and result files come from
:mod:`bench.records` (re-exported here, so a suite imports its helpers from one place)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

import torch

from bench.records import bench_ms, device_meta, results_dir, write_results

__all__ = ["device_meta", "bench_ms", "graph_bench_ms", "wall_ms", "print_call_times", "write_results", "results_dir",
           "rel_err", "print_table", "init_ranks", "median_call_ms"]


def sync(dev: torch.device) -> None:
    """Wait for the device's work (a no-op off CUDA)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


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


def median_call_ms(fn: Callable[[], Any], reps: int, warmup: int = 1,
                   device: str | torch.device = "cuda") -> tuple[float, int | None]:
    """(median milliseconds of ``reps`` calls of ``fn``, each timed alone after ``warmup`` untimed calls; the peak
    bytes the timed calls allocated above what was allocated before them). On CUDA the calls are timed with CUDA
    events; elsewhere by the host clock, with no memory figure (None)."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) if cuda else None


def wall_ms(fn: Callable[[], Any], iters: int = 20, warmup: int = 3, barrier: bool = False, group=None) -> float:
    """Host wall-clock milliseconds per call of ``fn`` over ``iters`` calls after ``warmup`` (the device synchronised
    before and after; ``barrier``: the ranks of ``group`` start together), as a serving loop's step sees it."""
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if barrier:
        torch.distributed.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def init_ranks() -> torch.device:
    """Join the default process group under torchrun: NCCL on this rank's GPU (``LOCAL_RANK``), gloo on the CPU.
    The NCCL communicator is created at once (``device_id``), so collectives can be captured in CUDA graphs."""
    import torch.distributed as dist

    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return torch.device("cpu")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    return dev


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in cols))
