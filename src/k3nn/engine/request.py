"""Requests, sampling parameters and per-step outputs of :class:`k3nn.engine.Engine`."""

from __future__ import annotations

import enum
import math
import numbers
import time
from dataclasses import dataclass, field, replace
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["SamplingParams", "TokenLogprobs", "ImageInputs", "ContextTokens", "Request", "RequestOutput",
           "RequestStatus", "token_ids"]


@dataclass
class SamplingParams:
    """How one Engine request samples and stops; the names and semantics of vLLM's ``SamplingParams`` where they
    exist there (``max_new_tokens`` is vLLM's ``max_tokens``; ``do_sample=False`` is greedy, vLLM's
    ``temperature=0``). :mod:`k3nn.engine.sampling` applies them.

    * ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k`` (0: off), ``top_p``, ``min_p`` (0: off),
      ``seed`` (None: fresh randomness), ``eos_token_id`` (None: the model's): as in ``generate()``.
    * ``n`` (≥ 1): independent samples of the prompt; the Engine runs :meth:`child` ``(i)`` for i < n.
    * ``stop``: a string or a list of strings; the output ends at the first one its text contains (needs the
      Engine's tokenizer). The text excludes it unless ``include_stop_str_in_output``; the token ids keep the
      token that completed it (vLLM).
    * ``stop_token_ids``: ids that end the request besides eos (kept in the output ids, left out of the text).
    * ``ignore_eos``: eos does not stop the request (nor is it blocked by ``min_tokens``).
    * ``min_tokens`` (≤ ``max_new_tokens``): eos and ``stop_token_ids`` get −inf, and stop strings are not
      looked for, until that many tokens were generated.
    * ``repetition_penalty`` (> 0, 1: off): s / θ if s > 0 else s · θ for every token of prompt + output.
    * ``presence_penalty``, ``frequency_penalty`` (in [−2, 2], 0: off): s − α·[c > 0] − β·c, c = the token's
      count in the output (not the prompt). All penalties apply to greedy requests too.
    * ``logprobs`` (None: off; k ≥ 0): each new token comes with its log-probability, its rank and the k most
      likely tokens' log-probabilities, all of the raw model distribution (log_softmax of the logits before
      any penalty, temperature or top-k/top-p: vLLM's default ``raw_logprobs``).
    """

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    eos_token_id: int | list[int] | None = None  # None: the model config's
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (empty when unset)."""
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def child(self, index: int) -> "SamplingParams":
        """The parameters of sample ``index`` of an ``n``-sample request: ``n=1`` and, when seeded, seed
        ``seed + index`` (mod 2**64), so the samples differ and each is reproducible (vLLM's rule)."""
        i = _int("index", index, lo=0)
        if i >= self.n:
            raise ValueError(f"index must be < n={self.n}, got {i}")
        seed = None if self.seed is None else (int(self.seed) + i) % 2**64
        return replace(self, n=1, seed=seed,
                       stop=None if self.stop is None else (self.stop if isinstance(self.stop, str)
                                                            else list(self.stop)),
                       stop_token_ids=None if self.stop_token_ids is None else list(self.stop_token_ids))

    def validate(self, tokenizer: Any = None) -> None:
        """Types and ranges of every field; each error names the field (TypeError for a wrong type, ValueError
        for a value out of range). ``tokenizer``: what will detokenise the output (an object with
        ``decode(ids) -> str``); ``stop`` strings are refused without one."""
        _int("max_new_tokens", self.max_new_tokens, lo=1)
        for name in ("do_sample", "ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
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
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _int("seed", self.seed, lo=0, hi=2**64 - 1)
        e = self.eos_token_id
        if e is not None:
            if isinstance(e, (list, tuple)):
                for t in e:
                    _int("eos_token_id", t, lo=0)
            else:
                _int("eos_token_id", e, lo=0)
        _int("n", self.n, lo=1)
        _int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens must be <= max_new_tokens={self.max_new_tokens}, got {self.min_tokens}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, lo=0)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise TypeError(f"stop_token_ids must be a list of ints, got {type(self.stop_token_ids).__name__}")
            for t in self.stop_token_ids:
                _int("stop_token_ids", t, lo=0)
        if self.stop is not None:
            if not isinstance(self.stop, (str, list, tuple)) or \
                    any(not isinstance(x, str) for x in ([self.stop] if isinstance(self.stop, str) else self.stop)):
                raise TypeError(f"stop must be a str or a list of str, got {self.stop!r}")
            if any(x == "" for x in self.stop_strings):
                raise ValueError(f"stop must not contain the empty string, got {self.stop!r}")
            if self.stop_strings and not callable(getattr(tokenizer, "decode", None)):
                raise ValueError(f"stop={self.stop!r} needs a tokenizer (an object with decode(ids) -> str) to "
                                 f"find stop strings in the output text; give the Engine one, or use "
                                 f"stop_token_ids")


def _int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``v`` as an int (Python or numpy integers; not bools, floats or strings) in [lo, hi], else raise."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}, got {v}")
    return v


def token_ids(prompt: Any, vocab_size: int) -> list[int]:
    """A prompt's token ids (a sequence of ints, a 1-D integer tensor or array) as a list of ints in
    [0, vocab_size): no floats, bools or strings (TypeError / ValueError naming the prompt)."""
    if isinstance(prompt, np.ndarray):
        prompt = torch.from_numpy(prompt) if prompt.dtype.kind in "iub" else prompt.tolist()
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(f"prompt must be a 1-D tensor of token ids, got shape {tuple(prompt.shape)}")
        if prompt.dtype == torch.bool or prompt.is_floating_point() or prompt.is_complex():
            raise TypeError(f"prompt must be an integer tensor of token ids, got dtype {prompt.dtype}")
        prompt = prompt.tolist()
    elif isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise TypeError(f"prompt must be a sequence of token ids (ints) or a 1-D integer tensor, "
                        f"got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise ValueError("prompt is empty: a request needs at least one token")
    if all(type(t) is int for t in prompt):  # the common case, without a per-token call (8K tokens: ~0.3 ms)
        if not (0 <= min(prompt) and max(prompt) < vocab_size):
            raise ValueError(f"prompt has token ids outside [0, vocab_size={vocab_size}): "
                             f"{[t for t in prompt if not 0 <= t < vocab_size][:8]}")
        return list(prompt)
    ids = []
    for i, t in enumerate(prompt):
        try:
            ids.append(_int(f"prompt[{i}]", t))
        except TypeError as e:
            raise TypeError(f"prompt must hold token ids (ints): {e}") from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside [0, vocab_size={vocab_size}): {bad[:8]}")
    return ids


def per_prompt(name: str, values, num_prompts: int) -> list:
    """A per-prompt argument of ``Engine.generate()`` (images) as a list of ``num_prompts`` entries (None: none)."""
    if values is None:
        return [None] * num_prompts
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a list with one entry (a tensor or None) per prompt, got "
                        f"{type(values).__name__}")
    if len(values) != num_prompts:
        raise ValueError(f"{name} has {len(values)} entries for {num_prompts} prompts: give one per prompt "
                         f"(None for a text prompt)")
    return list(values)


class RequestStatus(enum.Enum):
    """Where a request is in its life: WAITING (queued, or preempted to be recomputed), RUNNING (holds a row),
    PREFILLED (``prefill_only``: its state held for export), and the ends FINISHED, ABORTED, FAILED."""

    WAITING = "waiting"
    RUNNING = "running"
    PREFILLED = "prefilled"  # prefill_only: N−1 tokens computed, state held for export
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"  # an error inside step() (its reason in Request.error); the other requests keep running


@dataclass(eq=False)
class ImageInputs:
    """A prompt's images as the Engine holds them (shared by an ``n > 1`` request's samples).

    ``positions``: the prompt positions of the image tokens, ascending (image order: image i owns the next
    ``sizes[i]`` of them); ``content_keys``: one sha256 per image (pixels + grid), mixed into the prefix keys of
    every block holding its tokens; ``features`` [Σ sizes, d]: the projected vision features (on the model's
    device), computed once, by the first forward that feeds an image token — ``pixel_values`` is dropped then."""

    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor
    positions: list[int]
    sizes: list[int]
    content_keys: list[bytes]
    features: torch.Tensor | None = None

    @property
    def num_images(self) -> int:
        return len(self.sizes)


class ContextTokens(Sequence):
    """Token lists read as one concatenated, read-only sequence of ints without copying them (a request's prompt
    + output: a drafter reads the last few, a step the next few). Indexing, slices (lists), ``len``, iteration."""

    __slots__ = ("_parts",)

    def __init__(self, *parts: Sequence[int]):
        self._parts = parts

    def __len__(self) -> int:
        return sum(len(p) for p in self._parts)

    def __getitem__(self, i):
        n = len(self)
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            out: list[int] = []
            for p in self._parts:
                if start < stop:
                    out += p[max(0, start):max(0, stop)]
                start, stop = start - len(p), stop - len(p)
            return out
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"token index {i} out of range for {n} tokens")
        for p in self._parts:
            if j < len(p):
                return p[j]
            j -= len(p)

    def __repr__(self) -> str:
        return f"ContextTokens({len(self)} tokens)"


@dataclass(eq=False)
class Request:
    """One request inside the Engine (``engine.requests[request_id]``): its prompt ids, :class:`SamplingParams`,
    ``status``, the ``output`` ids so far, and the bookkeeping the scheduler and the cache use (``row``: its KDA state
    row while running; ``blocks``: its latent pages; ``num_computed``: tokens whose latents and state are cached;
    prefix-cache keys and hits; timing: ``arrival_time``, ``first_token_time``, ``finish_time``; speculation counters).
    ``finish_reason`` is "stop", "length", "abort", "exported" or "error" (then ``error`` says why). Users read it;
    only the Engine changes it."""

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
    spare_snap: int | None = None  # a private snapshot slot for the next page-boundary export of a verify commit
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "exported" | "error"
    error: str | None = None  # why a FAILED request failed
    eos_ids: list[int] | None = None  # resolved when added (None: resolve on first use)
    generator: torch.Generator | None = None  # the drafter's sampled drafts
    seed: int = 0  # the sampling seed (SamplingParams.seed, or drawn when the request is added)
    sampling_row: int | None = None  # the row whose device sampling parameters are this request's
    synced_blocks: int = 0  # blocks of ``blocks`` written to the device block table of ``row``
    logits_pipeline: Any = None  # k3nn.logits.LogitsPipeline of the sampling params (built on first use)
    sampler: Any = None  # k3nn.engine.sampling.RequestSampler of the sampling params (built when added)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_forwards: int = 0  # forwards this request took part in before its first token
    num_spec: int = 0  # drafts per verify window (0: plain decoding)
    drafts: list[int] = field(default_factory=list)  # this step's drafts (fed after the pending token)
    draft_probs: Any = None  # [n, V] draft distribution of sampled drafts (None: greedy drafts)
    device_drafts: Any = None  # [n] the drafts on the device (``drafts`` then holds placeholders, fed as these)
    spec_rounds: int = 0  # verify windows with at least one draft
    spec_drafted: int = 0
    spec_accepted: int = 0
    num_preemptions: int = 0
    parent: str | None = None  # the id of the n > 1 request this is one sample of
    images: ImageInputs | None = None  # the prompt's images (dropped when the request ends)
    image_keys: dict[int, bytes] | None = None  # block index → image content keys in that block (prefix keys)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt)

    def all_tokens(self) -> list[int]:
        """Prompt + output ids so far (a new list)."""
        return self.prompt + self.output

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next sample (prefill_only: before the export point)."""
        end = self.num_prompt_tokens - 1 if self.prefill_only else self.num_prompt_tokens + len(self.output)
        return end - self.num_computed

    def tokens_to_feed(self, n: int) -> list[int]:
        """The next ``n`` tokens the model has not computed yet (prompt, output, then this step's drafts)."""
        return ContextTokens(self.prompt, self.output, self.drafts)[self.num_computed:self.num_computed + n]

    def clear_drafts(self) -> None:
        """Forget this step's drafts (host, device and their distribution)."""
        self.drafts, self.draft_probs, self.device_drafts = [], None, None

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify window (accepted drafts + the target's token); 0 without windows."""
        return (self.spec_accepted + self.spec_rounds) / self.spec_rounds if self.spec_rounds else 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one generated position, of the raw model distribution (log_softmax of the fp32
    logits before any processing).

    ``token_id``/``logprob``: the chosen token and its log-probability; ``rank``: 1 + the number of tokens with a
    larger log-probability (1: the most likely one); ``top``: the ``SamplingParams.logprobs`` most likely tokens
    → log-probability, in descending order (insertion order; the order of equal values is unspecified). The chosen token need not be
    in ``top``."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]

    @classmethod
    def from_row(cls, row: list[float], k: int) -> "TokenLogprobs":
        """A :func:`~k3nn.runtime.sampling.token_logprobs` row → the position's log-probabilities, top ``k``."""
        vals, idx = row[3:3 + k], row[3 + len(row[3:]) // 2:][:k]
        return cls(int(row[0]), row[1], int(row[2]), {int(i): v for i, v in zip(idx, vals)})


@dataclass
class RequestOutput:
    """One step's news of one request.

    ``new_token_ids``: tokens added this step; ``finish_reason``: "stop" (eos, a stop token id or a stop
    string), "length", "abort", "exported", "error"; ``output_token_ids``: every output token (when finished);
    ``stop_reason``: what stopped it under "stop" — the stop token id (``stop_token_ids``), the stop string,
    or None (eos); ``logprobs``: one :class:`TokenLogprobs` per new token (None unless
    ``SamplingParams.logprobs`` is set); ``text``: the output text so far (None without a tokenizer), stop string
    left out unless ``include_stop_str_in_output``; while the request runs it holds back the last
    ``max(len(stop)) − 1`` characters, which could begin a stop string."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    output_token_ids: list[int] | None = None
    error: str | None = None  # finish_reason "error": what failed
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    text: str | None = None
