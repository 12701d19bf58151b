"""Measured data behind the skinny GEMM's choices (no switches): the launch shape per projection shape and where
``auto`` takes the kernel rather than torch's GEMM.

Source: ``python -m bench.gpu.skinny_linear`` on the H200 (torch 2.11, Triton 3.6, copy 4.22 TB/s), result file
``bench/results/skinny-linear-2026-12-03-120618.json``: every ``k3_slice`` decode projection at 1, 4 and 16 rows,
each launch shape and torch's ``F.linear`` (cuBLAS) timed as CUDA graphs over rotating weight copies. The best
launch shape beat torch's GEMM on 34 of the 39 (shape, rows) cases (up to 1.36×; the large projections at
4.4–4.6 TB/s, read-only streams above the copy bandwidth); the other five are in :data:`TORCH_FASTER`. Row counts
between the measured ones take the nearest measured bucket (:func:`lookup`); shapes not listed take
:func:`.triton_skinny.default_config` and the general rule of :data:`AUTO_RULE`.
"""

from __future__ import annotations

import torch

__all__ = ["TUNED", "TORCH_FASTER", "AUTO_RULE", "lookup", "auto_reason", "row_bucket"]


def row_bucket(m: int) -> int:
    """Rows rounded up to a power of two (1, 2, 4, 8, 16): the key of the tuned table and the kernel's BM."""
    return 1 if m <= 1 else 1 << (m - 1).bit_length()


#: (dtype name, N, K, row bucket) -> SkinnyConfig fields (kind, block_n, block_k, warps, stages, split_k): the
#: fastest launch shape measured for that projection shape
TUNED: dict[tuple[str, int, int, int], tuple] = {
    ('bfloat16', 163840, 7168, 1): ('fma', 8, 512, 4, 1, 1),
    ('bfloat16', 163840, 7168, 4): ('dot', 128, 128, 4, 4, 1),
    ('bfloat16', 163840, 7168, 16): ('dot', 128, 128, 4, 4, 1),
    ('bfloat16', 67584, 7168, 1): ('fma', 8, 512, 4, 1, 1),
    ('bfloat16', 67584, 7168, 4): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 67584, 7168, 16): ('dot', 128, 128, 4, 4, 1),
    ('bfloat16', 49376, 7168, 1): ('fma', 8, 512, 4, 1, 1),
    ('bfloat16', 49376, 7168, 4): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 49376, 7168, 16): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 7168, 33792, 1): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 7168, 33792, 4): ('dot', 32, 256, 4, 4, 1),
    ('bfloat16', 7168, 33792, 16): ('dot', 64, 128, 4, 4, 4),
    ('bfloat16', 14400, 7168, 1): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 14400, 7168, 4): ('dot', 128, 128, 4, 4, 1),
    ('bfloat16', 14400, 7168, 16): ('dot', 128, 128, 4, 4, 1),
    ('bfloat16', 7168, 12288, 1): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 7168, 12288, 4): ('dot', 32, 256, 4, 4, 1),
    ('bfloat16', 7168, 12288, 16): ('dot', 64, 256, 4, 3, 1),
    ('bfloat16', 12288, 7168, 1): ('fma', 8, 512, 4, 1, 1),
    ('bfloat16', 12288, 7168, 4): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 12288, 7168, 16): ('dot', 128, 128, 4, 4, 1),
    ('bfloat16', 7168, 6144, 1): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 7168, 6144, 4): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 7168, 6144, 16): ('dot', 64, 256, 4, 3, 1),
    ('bfloat16', 18432, 1536, 1): ('fma', 8, 512, 4, 1, 1),
    ('bfloat16', 18432, 1536, 4): ('dot', 32, 256, 4, 4, 1),
    ('bfloat16', 18432, 1536, 16): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 3584, 7168, 1): ('fma', 8, 512, 4, 1, 1),
    ('bfloat16', 3584, 7168, 4): ('dot', 32, 256, 4, 4, 1),
    ('bfloat16', 3584, 7168, 16): ('dot', 32, 256, 4, 4, 1),
    ('bfloat16', 7168, 3584, 1): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 7168, 3584, 4): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 7168, 3584, 16): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 12288, 128, 1): ('fma', 8, 512, 4, 1, 1),
    ('bfloat16', 12288, 128, 4): ('dot', 64, 128, 4, 4, 1),
    ('bfloat16', 12288, 128, 16): ('dot', 64, 256, 4, 3, 1),
    ('float32', 128, 7168, 1): ('fma', 16, 256, 4, 1, 8),
    ('float32', 128, 7168, 4): ('fma', 8, 256, 4, 1, 16),
    ('float32', 128, 7168, 16): ('fma', 8, 256, 4, 1, 16),
    # the router with bf16 weights and fp32 logits (out_dtype): the launch shapes measured for the fp32 router;
    # torch's path there casts x and the weight to fp32 first (two more launches and 5.5 MB more traffic)
    ('bfloat16', 128, 7168, 1): ('fma', 16, 256, 4, 1, 8),
    ('bfloat16', 128, 7168, 4): ('fma', 8, 256, 4, 1, 16),
}

#: (dtype name, N, K, row bucket) where torch's GEMM measured faster than the best skinny launch shape
TORCH_FASTER: set[tuple[str, int, int, int]] = {
    ('bfloat16', 7168, 33792, 1),
    ('bfloat16', 18432, 1536, 4),
    ('bfloat16', 18432, 1536, 16),
    ('float32', 128, 7168, 1),
    ('float32', 128, 7168, 16),
}

#: the rule for every other shape: dtypes, the most rows, and the least weight bytes (below, the weight read is
#: too short for the launch to pay off against torch's kernel choice)
AUTO_RULE = {"dtypes": ("bfloat16", "float16"), "max_rows": 16, "min_weight_bytes": 8 << 20}

_BUCKETS = (1, 2, 4, 8, 16)


def lookup(dtype_name: str, n: int, k: int, bucket: int) -> tuple[tuple | None, bool]:
    """(measured launch shape or None, torch measured faster) for a row bucket: the bucket itself, else the nearest
    measured one that can serve it (a ``dot`` shape serves any row count; an ``fma`` shape only smaller buckets
    than twice its own, its accumulators growing with the rows)."""
    key = (dtype_name, n, k, bucket)
    if key in TUNED or key in TORCH_FASTER:
        return TUNED.get(key), key in TORCH_FASTER
    near = sorted((b for b in _BUCKETS if (dtype_name, n, k, b) in TUNED), key=lambda b: (abs(b - bucket), b))
    for b in near:
        cfg = TUNED[(dtype_name, n, k, b)]
        if cfg[0] == "dot" or bucket <= 2 * b:
            return cfg, (dtype_name, n, k, b) in TORCH_FASTER
    return None, False


def auto_reason(dtype: torch.dtype, rows: int, n: int, k: int, elem_size: int) -> str | None:
    """None when ``auto`` takes the skinny GEMM for this call, else why torch's GEMM runs it."""

    name = str(dtype).removeprefix("torch.")
    cfg, slower = lookup(name, n, k, row_bucket(rows))
    if slower:
        return f"torch's GEMM measured faster at [{n}, {k}] with {rows} rows"
    if cfg is not None:
        return None
    if name not in AUTO_RULE["dtypes"]:
        return f"{name}: auto takes the skinny GEMM for {'/'.join(AUTO_RULE['dtypes'])} only"
    if rows > AUTO_RULE["max_rows"]:
        return f"{rows} rows above {AUTO_RULE['max_rows']}"
    if n * k * elem_size < AUTO_RULE["min_weight_bytes"]:
        return f"weight of {n * k * elem_size} bytes below {AUTO_RULE['min_weight_bytes']}"
    return None
