"""Shared benchmark plumbing: device ceilings measured in the same run, timing, result files.

Result schema (PERF.md): ``{"meta": {gpu, torch, triton, commit, copy_tbps, bf16_tflops, ...}, "rows": [...]}``;
each row has ``case`` and ``k3nn_ms`` and, where they apply, ``anchor``, ``anchor_ms``, ``speedup``
(= anchor_ms / k3nn_ms), ``tbps``, ``frac_copy_bw``, ``tflops``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable

import torch

from .models import bench_model  # re-exported: it lives in bench/models.py

__all__ = ["device_meta", "bench_ms", "graph_bench_ms", "print_call_times", "write_results", "results_dir",
           "rel_err", "bench_model"]


def _commit() -> str:
    if os.environ.get("K3NN_COMMIT"):  # the device machine gets a copy of the tree without .git
        return os.environ["K3NN_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], stderr=subprocess.DEVNULL,
                                       cwd=Path(__file__).resolve().parent).decode().strip()
    except Exception:
        return "unknown"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64 (NaN anywhere → inf)."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return ((o - r).norm() / r.norm().clamp_min(1e-30)).item()


def bench_ms(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` with CUDA events (triton.testing.do_bench)."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


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


_META: dict[str, Any] | None = None


def device_meta() -> dict[str, Any]:
    """GPU name, versions, commit and the two ceilings (copy TB/s, bf16 8192³ TFLOP/s) measured now."""
    global _META
    if _META is not None:
        return dict(_META)
    import triton

    meta: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__, "commit": _commit(),
                            "date": _dt.date.today().isoformat()}
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name()
        n = 1 << 30  # 1 GiB each way: far larger than L2
        a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
        b = torch.empty_like(a)
        ms = bench_ms(lambda: b.copy_(a))
        meta["copy_tbps"] = round(2 * n / ms / 1e9, 3)
        del a, b
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        ms = bench_ms(lambda: x @ y)
        meta["bf16_tflops"] = round(2 * 8192 ** 3 / ms / 1e9, 1)
        del x, y
        torch.cuda.empty_cache()
    else:
        meta["gpu"] = "none"
    _META = meta
    return dict(meta)


def results_dir() -> Path:
    d = Path(os.environ.get("K3NN_RESULTS_DIR", "bench/results"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_results(suite: str, rows: list[dict[str, Any]], meta_extra: dict[str, Any] | None = None,
                  out_dir: str | os.PathLike | None = None, path: Path | None = None) -> Path:
    """Write (or, given the ``path`` of an earlier call, rewrite: a long suite saves after every row) one result
    file; returns its path."""
    meta = device_meta()
    meta.update(meta_extra or {})
    for r in rows:
        if "tbps" in r and meta.get("copy_tbps"):
            r.setdefault("frac_copy_bw", round(r["tbps"] / meta["copy_tbps"], 3))
        if r.get("anchor_ms") and r.get("k3nn_ms"):
            r.setdefault("speedup", round(r["anchor_ms"] / r["k3nn_ms"], 3))
    if path is None:
        d = Path(out_dir) if out_dir else results_dir()
        d.mkdir(parents=True, exist_ok=True)
        stamp = _dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
        path = d / f"{suite}-{stamp}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return path


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in cols))
