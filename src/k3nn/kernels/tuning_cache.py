"""Tuning results kept on disk across processes, so a served shape is never timed again after a restart.

* Triton autotuners are built with :data:`AUTOTUNE_KW` (``cache_results=True`` where the installed Triton has
  it): Triton then stores each key's chosen config in its own cache directory, keyed by the kernel source,
  the GPU and the versions.
* k3nn's own plans (the MLA decode split plan) go through :class:`TuningCache`: one JSON file per table and
  device under ``$K3NN_HOME/tuning`` (else ``$XDG_CACHE_HOME/k3nn/tuning``, else ``~/.cache/k3nn/tuning``), named
  after the GPU, its compute capability and the torch / Triton versions; keys are the shape buckets the plan is
  chosen by. A file that cannot be read is ignored (tuning runs again); writes are atomic (rename).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["AUTOTUNE_KW", "TuningCache", "tuning_dir", "device_tag"]


def _autotune_kw() -> dict:
    try:
        import triton
    except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
        return {}
    return {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


#: keyword arguments for ``triton.autotune``: persist the chosen configs across processes where supported
AUTOTUNE_KW = _autotune_kw()


def tuning_dir() -> Path:
    base = os.environ.get("K3NN_HOME")
    if base:
        return Path(base) / "tuning"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "k3nn" / "tuning"


def device_tag(device: torch.device) -> str:
    """``<gpu>-sm<cc>-torch<version>-triton<version>`` (file-name safe) for a CUDA device."""
    try:
        import triton

        tv = triton.__version__
    except ImportError:  # pragma: no cover
        tv = "none"
    props = torch.cuda.get_device_properties(device)
    tag = f"{props.name}-sm{props.major}{props.minor}-torch{torch.__version__}-triton{tv}"
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", tag)


class TuningCache:
    """A persistent ``key → value`` table (JSON-serialisable values) per ``name`` and device."""

    def __init__(self, name: str):
        self.name = name
        self._tables: dict[str, dict[str, Any]] = {}

    def _path(self, device: torch.device) -> Path:
        return tuning_dir() / f"{self.name}-{device_tag(device)}.json"

    def _table(self, device: torch.device) -> dict[str, Any]:
        tag = device_tag(device)
        t = self._tables.get(tag)
        if t is None:
            try:
                t = json.loads(self._path(device).read_text())
                if not isinstance(t, dict):
                    t = {}
            except (OSError, ValueError):
                t = {}
            self._tables[tag] = t
        return t

    def get(self, device: torch.device, key: Any) -> Any:
        return self._table(device).get(repr(key))

    def put(self, device: torch.device, key: Any, value: Any) -> None:
        t = self._table(device)
        t[repr(key)] = value
        path = self._path(device)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(t, f, indent=0, sort_keys=True)
            os.replace(tmp, path)
        except OSError:  # a read-only home: the choice is kept for this process only
            pass
