"""Requests, sampling parameters and per-step outputs of :class:`k3nn.engine.Engine`."""

from __future__ import annotations

import enum
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SamplingParams", "Request", "RequestOutput", "RequestStatus"]


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_id: int | list[int] | None = None  # None: the model config's
    seed: int | None = None

    def validate(self) -> None:
        """Types and ranges of every field; each error names the field (TypeError for a wrong type, ValueError
        for a value out of range)."""
        _int("max_new_tokens", self.max_new_tokens, lo=1)
        if not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample must be a bool, got {type(self.do_sample).__name__}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
            if not math.isfinite(v):
                raise ValueError(f"{name} must be finite, got {v}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        _int("top_k", self.top_k, lo=0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _int("seed", self.seed, lo=0, hi=2**64 - 1)
        e = self.eos_token_id
        if e is not None:
            if isinstance(e, (list, tuple)):
                for t in e:
                    _int("eos_token_id", t, lo=0)
            else:
                _int("eos_token_id", e, lo=0)


def _int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``v`` as an int (Python or numpy integers; not bools, floats or strings) in [lo, hi], else raise."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}, got {v}")
    return v


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREFILLED = "prefilled"  # prefill_only: N−1 tokens computed, state held for export
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"  # an error inside step() (its reason in Request.error); the other requests keep running


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    boundaries: list[int] = field(default_factory=list)
    prefill_only: bool = False
    status: RequestStatus = RequestStatus.WAITING
    output: list[int] = field(default_factory=list)
    row: int | None = None  # running KDA row
    blocks: list[int] = field(default_factory=list)  # latent pages (own references)
    num_computed: int = 0  # tokens whose latents + state are in the cache
    keys: list[bytes] = field(default_factory=list)  # chained block hashes of the prompt
    hit_len: int = 0
    kv_len: int = 0
    plan: list[int] = field(default_factory=list)  # absolute snapshot positions still to export
    indexed_blocks: int = 0
    decode_snap: tuple[int, int] | None = None  # (position, private snapshot slot) of the last aligned decode state
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "exported" | "error"
    error: str | None = None  # why a FAILED request failed
    eos_ids: list[int] | None = None  # resolved when added (None: resolve on first use)
    generator: torch.Generator | None = None
    logits_pipeline: Any = None  # k3nn.logits.LogitsPipeline of the sampling params (built on first use)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_forwards: int = 0  # forwards this request took part in before its first token

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next sample (prefill_only: before the export point)."""
        end = self.num_prompt_tokens - 1 if self.prefill_only else self.num_prompt_tokens + len(self.output)
        return end - self.num_computed

    def tokens_to_feed(self, n: int) -> list[int]:
        return self.all_tokens()[self.num_computed:self.num_computed + n]


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    output_token_ids: list[int] | None = None
    error: str | None = None  # finish_reason "error": what failed
