"""How an :class:`~k3nn.engine.Engine` is sized and scheduled (:class:`EngineConfig`), and the errors it raises
for a whole batch rather than one request."""

from __future__ import annotations

from dataclasses import dataclass

from ..cache.retention import EvictionPolicy, RetentionPolicy
from ..spec.generate import SpecOptions
from .request import _int

__all__ = ["EngineConfig", "EngineStalledError", "RequestFailedError"]


class EngineStalledError(RuntimeError):
    """:meth:`Engine.stream <k3nn.engine.Engine.stream>` found requests waiting that no step can ever admit
    (nothing running would free a row or pages): e.g. every row or the pages are held by prefilled requests awaiting
    export."""


class RequestFailedError(RuntimeError):
    """:meth:`Engine.generate <k3nn.engine.Engine.generate>`: some of its requests failed inside ``step()`` (the
    others completed); ``failures`` maps request id → reason."""

    def __init__(self, failures: dict[str, str]):
        self.failures = failures
        super().__init__("request(s) failed: " + "; ".join(f"{k!r}: {v}" for k, v in failures.items()))


@dataclass
class EngineConfig:
    """How an :class:`~k3nn.engine.Engine` is sized and scheduled (every field also a keyword of
    ``Engine(model, ...)``).

    Capacity: ``max_num_seqs`` running requests (each holds a KDA state row), ``num_pages`` latent pages of 64 tokens
    per MLA layer (or ``cache_memory_bytes``, split between pages and snapshot slots), ``num_snapshots`` KDA snapshot
    slots for the prefix cache. Scheduling: ``max_num_batched_tokens`` per step, ``budget`` "adaptive" (decodes first,
    prefill gets the rest) or "fixed", ``min_prefill_tokens``, ``mixed_forward_max_tokens``, ``watermark`` (the
    fraction of pages admission leaves free for running requests to grow). Prefix reuse: ``enable_prefix_caching``,
    ``retention`` ("marconi", "replay", "interval:N", a policy object or None), ``eviction`` ("lru", "marconi", a
    policy or None), ``retain_decode_state``. Speculation (with a drafter): ``num_speculative_tokens`` (None: the
    drafter's block size), ``spec``. ``cuda_graphs``: replay captured decode / verify steps on a GPU.
    ``async_scheduling`` (default on): launch each pure decode step of captured graphs, and each greedy
    speculative round drafted on the device, before reading the previous one's tokens (:mod:`~k3nn.engine.overlap`;
    outputs come back one ``step()`` later; False: every step reads its tokens before it returns). Errors name the field
    (:meth:`validate`)."""

    max_num_seqs: int = 8  # running rows (KDA running slots)
    num_pages: int | None = 512  # latent pages of 64 tokens (None: from cache_memory_bytes)
    num_snapshots: int | None = 32  # KDA snapshot slots for the prefix cache
    cache_memory_bytes: int | None = None  # alternative sizing: split this budget (see pool_sizes_for_budget)
    max_num_batched_tokens: int = 8192
    budget: str = "adaptive"  # "adaptive" | "fixed"
    reserve_per_seq: int = 1  # tokens reserved per decode (1 + speculative tokens)
    min_prefill_tokens: int = 64  # the prefill budget never drops below this (no starvation)
    mixed_forward_max_tokens: int = 16  # prefill chunks up to this run in the decodes' forward (right-padded)
    retain_decode_state: bool = True  # index prompt + answer and the last 64-aligned decode state on finish
    enable_prefix_caching: bool = True
    retention: str | RetentionPolicy | None = "marconi"
    eviction: str | EvictionPolicy | None = "lru"
    pad_token_id: int = 0
    watermark: float = 0.01  # admission keeps this fraction of the pages free for running requests to grow
    num_speculative_tokens: int | None = None  # per-request default with a drafter (None: the drafter's block size)
    #: decode / verify steps replay CUDA graphs on a GPU (captured by warmup()); "static": the same padded,
    #: graph-safe steps without capture (any device); False: every step eager
    cuda_graphs: bool | str = True
    spec: SpecOptions | None = None  # confidence_threshold, synthetic_acceptance_length (rollback is replay)
    async_scheduling: bool = True  # launch a decode step before reading the last one's tokens (engine.overlap)

    def validate(self) -> None:
        """Check every field (run by the Engine); a ValueError / TypeError naming the field."""
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)) \
                or not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {self.watermark!r}")
        if self.num_speculative_tokens is not None:
            _int("num_speculative_tokens", self.num_speculative_tokens, lo=0)
        if self.spec is not None:
            if not isinstance(self.spec, SpecOptions):
                raise TypeError(f"spec must be a k3nn.spec.SpecOptions, got {type(self.spec).__name__}")
            if self.spec.rollback != "replay":
                raise ValueError(f"the engine rolls KDA back by replay only; got spec.rollback={self.spec.rollback!r}")
        if not isinstance(self.async_scheduling, bool):
            raise TypeError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")
        if self.cuda_graphs not in (True, False, "static"):
            raise ValueError(f"cuda_graphs must be True, False or 'static', got {self.cuda_graphs!r}")
        if self.budget not in ("adaptive", "fixed"):
            raise ValueError(f"budget must be 'adaptive' or 'fixed', got {self.budget!r}")
        if self.max_num_batched_tokens < 1 or self.reserve_per_seq < 1 or self.min_prefill_tokens < 1:
            raise ValueError("max_num_batched_tokens, reserve_per_seq and min_prefill_tokens must be >= 1")
        if self.num_pages is None and self.cache_memory_bytes is None:
            raise ValueError("give num_pages (and num_snapshots) or cache_memory_bytes")
