"""Result files of measured runs: device ceilings measured in the same run, the commit, one JSON file per run.

Used by every suite and sweep in ``bench/`` (through :mod:`bench.common`).

Result schema (docs/perf.md): ``{"meta": {gpu, torch, triton, commit, copy_tbps, bf16_tflops, ...}, "rows": [...]}``;
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

__all__ = ["bench_ms", "device_meta", "results_dir", "write_results"]


def _commit() -> str:
    if os.environ.get("K3NN_COMMIT"):  # the device machine gets a copy of the tree without .git
        return os.environ["K3NN_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], stderr=subprocess.DEVNULL,
                                       cwd=Path(__file__).resolve().parent).decode().strip()
    except Exception:
        return "unknown"


def bench_ms(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` with CUDA events (triton.testing.do_bench)."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


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
