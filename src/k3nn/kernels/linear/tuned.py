"""Measured data behind the skinny GEMM's choices (no switches): the launch shape per projection shape and where
``auto`` takes the kernel rather than torch's GEMM. Filled from ``python -m bench.gpu.skinny_linear`` on the H200
(``docs/perf.md``, section "Skinny GEMM"); shapes not listed take :func:`.triton_skinny.default_config` and the
general rule of :data:`AUTO_RULE`.
"""

from __future__ import annotations

import torch

__all__ = ["TUNED", "TORCH_FASTER", "AUTO_RULE", "auto_reason"]

#: (dtype name, N, K, row bucket) -> SkinnyConfig fields (kind, block_n, block_k, warps, stages, split_k): the
#: fastest launch shape measured for that projection shape
TUNED: dict[tuple[str, int, int, int], tuple] = {}

#: (dtype name, N, K, row bucket) where torch's GEMM measured faster than the best skinny launch shape
TORCH_FASTER: set[tuple[str, int, int, int]] = set()

#: the rule for every other shape: dtypes, the most rows, and the least weight bytes (below, the weight read is
#: too short for the launch to pay off against torch's kernel choice)
AUTO_RULE = {"dtypes": ("bfloat16", "float16"), "max_rows": 16, "min_weight_bytes": 8 << 20}


def auto_reason(dtype: torch.dtype, rows: int, n: int, k: int, elem_size: int) -> str | None:
    """None when ``auto`` takes the skinny GEMM for this call, else why torch's GEMM runs it."""
    from .triton_skinny import row_bucket

    name = str(dtype).removeprefix("torch.")
    key = (name, n, k, row_bucket(rows))
    if key in TORCH_FASTER:
        return f"torch's GEMM measured faster at [{n}, {k}] with {rows} rows"
    if key in TUNED:
        return None
    if name not in AUTO_RULE["dtypes"]:
        return f"{name}: auto takes the skinny GEMM for {'/'.join(AUTO_RULE['dtypes'])} only"
    if rows > AUTO_RULE["max_rows"]:
        return f"{rows} rows above {AUTO_RULE['max_rows']}"
    if n * k * elem_size < AUTO_RULE["min_weight_bytes"]:
        return f"weight of {n * k * elem_size} bytes below {AUTO_RULE['min_weight_bytes']}"
    return None
