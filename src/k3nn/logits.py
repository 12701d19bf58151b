"""Logits processing shared by ``generate()``, the speculative path and the Engine.

Each processor maps next-token scores ``[N, V]`` fp32 to new scores, with transformers' call signature
``proc(input_ids [N, L] long, scores [N, V]) -> scores`` and the same ops as the transformers class named in
brackets (equal inputs give equal scores):

* ``RepetitionPenalty`` [``RepetitionPenaltyLogitsProcessor``]: s_v / θ if s_v > 0 else s_v · θ, for every token
  v of ``input_ids`` (the prompt's left padding left out). Over prompt + output this is also vLLM's
  ``repetition_penalty``.
* ``FrequencyPenalty`` / ``PresencePenalty`` [no transformers class; vLLM's / OpenAI's ``frequency_penalty`` /
  ``presence_penalty``]: s_v − β·c_v / s_v − α·[c_v > 0], c_v = occurrences of v among the *generated* tokens
  (``input_ids[:, prompt_length:]``).
* ``NoRepeatNGram`` [``NoRepeatNGramLogitsProcessor``]: −inf for the tokens that would repeat an n-gram.
* ``NoBadWords`` [``NoBadWordsLogitsProcessor``]: −inf for the last token of each banned sequence whose other
  tokens end ``input_ids`` (single tokens: always).
* ``MinLength`` [``MinLengthLogitsProcessor``] / ``MinNewTokens`` [``MinNewTokensLengthLogitsProcessor``]: eos
  → −inf while the sequence is shorter than ``min_length`` / fewer than ``min_new_tokens`` were generated.
* ``Temperature`` [``TemperatureLogitsWarper``]: s / T.
* ``TopK`` [``TopKLogitsWarper``]: −inf below the k-th largest score.
* ``TopP`` [``TopPLogitsWarper``]: −inf where the ascending cumulative probability is ≤ 1 − p.
* ``MinP`` [``MinPLogitsWarper``]: −inf where p_v < min_p · max_u p_u.
* ``TypicalP`` [``TypicalLogitsWarper``]: keep the tokens of least |−log p_v − H(p)| up to mass τ.

:class:`LogitsPipeline` chains them in transformers' ``_get_logits_processor`` order: repetition penalty,
no-repeat n-gram, bad words, min length, min new tokens, the caller's processors, then — when sampling only —
temperature, top-k, top-p, min-p, typical-p. Everything runs on the scores' device without host syncs.

Processors that read only the sequence *length* (min length, min new tokens) or nothing (the warpers, single-token
bad words) are *history-free*: :meth:`LogitsPipeline.window` applies them to every row of a speculative window
``[B, T, V]`` exactly, the length of row j being known on the device. Processors that read the tokens themselves
(repetition penalty, n-grams, multi-token bad words, user callables) are not, and the speculative path refuses
them (:meth:`LogitsPipeline.check_history_free`).

The three penalties also run from token statistics kept incrementally by the caller (:class:`TokenCounts`: a
``[N, V]`` count tensor of the generated tokens and a ``[N, V]`` seen-mask of the whole sequence) instead of
``input_ids``: :meth:`LogitsPipeline.apply_counts`. The Engine's per-request sampler (:mod:`k3nn.engine.sampling`)
uses that path with the pipeline :meth:`LogitsPipeline.for_request` builds for a ``SamplingParams``: repetition,
frequency and presence penalties (vLLM's order), the ``min_tokens`` stop-token block, then — when sampling only —
temperature, top-k, top-p. The counts of a speculative window's row j include the drafts before it, so the
penalties are exact there too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["RepetitionPenalty", "FrequencyPenalty", "PresencePenalty", "TokenCounts", "NoRepeatNGram", "NoBadWords", "MinLength", "MinNewTokens", "Temperature", "TopK",
           "TopP", "MinP", "TypicalP", "LogitsPipeline", "sample_from_scores", "process_logits", "sample_next"]

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _Base:
    #: the transformers class with the same math (a caller's instance of it replaces this one, as in transformers)
    hf_name: str = ""
    #: reads the tokens of ``input_ids`` (not only their number)
    reads_tokens: bool = True
    #: only applied when sampling (transformers' "warpers")
    warper: bool = False

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class _HistoryFree(_Base):
    """A processor of the scores and the sequence length only: ``apply(scores [N, V], length)`` with ``length`` an
    int or a device tensor [N] (tokens before the scored one, prompt included)."""

    reads_tokens = False

    def __call__(self, input_ids: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
        return self.apply(scores, None if input_ids is None else input_ids.shape[-1])

    def apply(self, scores: torch.Tensor, length: int | torch.Tensor) -> torch.Tensor:
        """New scores [N, V] fp32 from ``scores`` [N, V] fp32; ``length``: tokens before the scored one (prompt
        included), an int or a device tensor [N] (the rows of a speculative window differ)."""
        raise NotImplementedError


# -- token-history processors ----------------------------------------------------------------------------------
class RepetitionPenalty(_Base):
    """Penalise every token already in the sequence: s / θ if s > 0 else s · θ (θ > 1 discourages repeats).
    ``prompt_ignore_length`` [N]: leading positions of each row left out (the prompt's left padding)."""

    hf_name = "RepetitionPenaltyLogitsProcessor"

    def __init__(self, penalty: float, prompt_ignore_length: torch.Tensor | None = None):
        if not penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {penalty}")
        self.penalty = float(penalty)
        self.prompt_ignore_length = prompt_ignore_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        V = scores.shape[-1]
        if self.prompt_ignore_length is not None:
            pos = torch.arange(input_ids.shape[1], device=input_ids.device)
            ignore = self.prompt_ignore_length.to(input_ids.device)
            input_ids = input_ids.masked_fill(pos[None, :] < ignore[:, None], V)
        ids = input_ids.clamp(max=V)  # column V is a spare one, dropped below
        s = torch.nn.functional.pad(scores, (0, 1))
        g = s.gather(1, ids)
        g = torch.where(g < 0, g * self.penalty, g / self.penalty)
        return s.scatter(1, ids, g)[..., :V]

    def apply_counts(self, scores: torch.Tensor, counts: "TokenCounts") -> torch.Tensor:
        """The same penalty for the tokens of ``counts.seen`` (the whole sequence: prompt and output)."""
        pen = torch.where(scores > 0, scores / self.penalty, scores * self.penalty)
        return torch.where(counts.seen, pen, scores)


def _real(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite real number, got {v!r}")
    return float(v)


class TokenCounts:
    """What the history processors read of a sequence, as tensors a caller can keep up to date token by token
    (no re-scan of the history per step).

    * ``output`` [N, V] (or [V]) fp32: c_v, the occurrences of token v among the generated tokens;
    * ``seen`` [N, V] (or [V]) bool: v occurs anywhere in the sequence (prompt included);
    * ``length``: int or [N] long device tensor, the tokens in the sequence (prompt included) before the scored
      one, for the length processors.

    Either tensor may be None when no processor of the pipeline reads it.
    """

    __slots__ = ("output", "seen", "length")

    def __init__(self, output: torch.Tensor | None, seen: torch.Tensor | None, length: int | torch.Tensor):
        self.output, self.seen, self.length = output, seen, length

    @classmethod
    def from_ids(cls, input_ids: torch.Tensor, prompt_length: int, vocab_size: int) -> "TokenCounts":
        """The statistics of ``input_ids`` [N, L] long whose first ``prompt_length`` positions are the prompt
        (ids >= ``vocab_size`` are left out)."""
        N, L = input_ids.shape
        V = vocab_size
        ids = input_ids.clamp(min=0, max=V)  # column V is a spare one, dropped
        gen = ids[:, prompt_length:]
        out = torch.zeros(N, V + 1, dtype=torch.float, device=ids.device)
        out.scatter_add_(1, gen, torch.ones_like(gen, dtype=torch.float))
        seen = torch.zeros(N, V + 1, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)
        return cls(out[:, :V], seen[:, :V], L)


class FrequencyPenalty(_Base):
    """s_v − β · c_v, c_v = occurrences of v among the generated tokens (positions ≥ ``prompt_length`` of
    ``input_ids``): vLLM's / OpenAI's ``frequency_penalty`` (β > 0 discourages repeats, β < 0 encourages them)."""

    def __init__(self, penalty: float, prompt_length: int = 0):
        self.penalty = _real("frequency_penalty", penalty)
        self.prompt_length = int(prompt_length)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.apply_counts(scores, TokenCounts.from_ids(input_ids, self.prompt_length, scores.shape[-1]))

    def apply_counts(self, scores: torch.Tensor, counts: TokenCounts) -> torch.Tensor:
        """The same penalty from ``counts.output`` [N, V] (occurrences among the generated tokens)."""
        return scores - self.penalty * counts.output


class PresencePenalty(_Base):
    """s_v − α · [c_v > 0], c_v = occurrences of v among the generated tokens (positions ≥ ``prompt_length`` of
    ``input_ids``): vLLM's / OpenAI's ``presence_penalty``."""

    def __init__(self, penalty: float, prompt_length: int = 0):
        self.penalty = _real("presence_penalty", penalty)
        self.prompt_length = int(prompt_length)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.apply_counts(scores, TokenCounts.from_ids(input_ids, self.prompt_length, scores.shape[-1]))

    def apply_counts(self, scores: torch.Tensor, counts: TokenCounts) -> torch.Tensor:
        """The same penalty from ``counts.output`` [N, V] (occurrences among the generated tokens)."""
        return scores - self.penalty * (counts.output > 0).to(scores.dtype)


class NoRepeatNGram(_Base):
    """−inf for every token that would complete an n-gram already in the sequence."""

    hf_name = "NoRepeatNGramLogitsProcessor"

    def __init__(self, ngram_size: int):
        if not isinstance(ngram_size, int) or ngram_size <= 0:
            raise ValueError(f"no_repeat_ngram_size must be a positive int, got {ngram_size!r}")
        self.ngram_size = ngram_size

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n, L = self.ngram_size, input_ids.shape[-1]
        if L < n:
            return scores
        prefix = input_ids[:, L + 1 - n:]
        windows = input_ids.unfold(1, n, 1)  # [N, L - n + 1, n]
        match = (windows[..., :-1] == prefix[:, None]).all(-1)
        V = scores.shape[-1]
        banned = scores.new_zeros((scores.shape[0], V + 1), dtype=torch.bool)
        banned.scatter_(1, torch.where(match, windows[..., -1].clamp(max=V), V), True)
        return scores.masked_fill(banned[:, :V], -float("inf"))


class NoBadWords(_Base):
    """−inf for the last token of each banned sequence whose other tokens end the sequence (single tokens: always).
    Sequences equal to ``[eos]`` are dropped (as in transformers)."""

    hf_name = "NoBadWordsLogitsProcessor"

    def __init__(self, bad_words_ids: Sequence[Sequence[int]], eos_token_id: Sequence[int] = (), *,
                 vocab_size: int | None = None, device: torch.device | str | None = None):
        if not isinstance(bad_words_ids, (list, tuple)) or not bad_words_ids or \
                any(not isinstance(w, (list, tuple)) or not w for w in bad_words_ids) or \
                any(not isinstance(t, int) or t < 0 for w in bad_words_ids for t in w):
            raise ValueError(f"bad_words_ids must be a non-empty list of non-empty lists of token ids, "
                             f"got {bad_words_ids!r}")
        eos = [int(e) for e in eos_token_id]
        words = [list(map(int, w)) for w in bad_words_ids if not (len(w) == 1 and int(w[0]) in eos)]
        self.bad_words_ids = words
        self.single = sorted({w[0] for w in words if len(w) == 1})
        self.multi = [w for w in words if len(w) > 1]
        self.reads_tokens = bool(self.multi)
        self._bias: torch.Tensor | None = None
        self._groups: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if vocab_size is not None:
            self._prepare(vocab_size, device)

    def _prepare(self, V: int, device) -> None:
        bad = [t for w in self.bad_words_ids for t in w if t >= V]
        if bad:
            raise ValueError(f"bad_words_ids has token ids outside the vocabulary of {V}: {sorted(set(bad))}")
        bias = torch.zeros(V, dtype=torch.float, device=device)
        bias[self.single] = float("-inf")
        self._bias = bias
        by_len: dict[int, list[list[int]]] = {}
        for w in self.multi:
            by_len.setdefault(len(w) - 1, []).append(w)
        self._groups = [(torch.tensor([w[:-1] for w in g], device=device), torch.tensor([w[-1] for w in g],
                                                                                        device=device))
                        for g in by_len.values()]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._bias is None or self._bias.device != scores.device:
            self._prepare(scores.shape[-1], scores.device)
        bias = torch.zeros_like(scores)
        bias += self._bias
        for prefixes, last in self._groups:
            k = prefixes.shape[1]
            if k > input_ids.shape[1]:
                continue
            hit = (input_ids[:, None, -k:] == prefixes).all(-1)  # [N, words]
            bias.index_add_(1, last, torch.where(hit, float("-inf"), 0.0).to(bias.dtype))
        return scores + bias

    def apply(self, scores: torch.Tensor, length=None) -> torch.Tensor:
        """The single-token bans only (history-free: what a speculative window can apply to every row)."""
        if self._bias is None or self._bias.device != scores.device:
            self._prepare(scores.shape[-1], scores.device)
        return scores + self._bias


# -- length processors -------------------------------------------------------------------------------------------
def _eos_mask(eos: Sequence[int] | torch.Tensor, V: int, device) -> torch.Tensor:
    e = torch.as_tensor(eos, dtype=torch.long, device=device).reshape(-1)
    return torch.isin(torch.arange(V, device=device), e)


class _EosBlock(_HistoryFree):
    def __init__(self, eos_token_id: Sequence[int], vocab_size: int | None = None, device=None):
        self.eos_token_id = [int(e) for e in eos_token_id]
        self._mask = None if vocab_size is None else _eos_mask(self.eos_token_id, vocab_size, device)

    def _block(self, scores: torch.Tensor, active) -> torch.Tensor:
        if active is None:
            raise ValueError(f"{type(self).__name__} needs the sequence length (input_ids)")
        if self._mask is None or self._mask.device != scores.device or self._mask.numel() != scores.shape[-1]:
            self._mask = _eos_mask(self.eos_token_id, scores.shape[-1], scores.device)
        if isinstance(active, bool):
            return torch.where(self._mask, -math.inf, scores) if active else scores
        return torch.where(active[..., None] & self._mask, -math.inf, scores)


class MinLength(_EosBlock):
    """eos scores → −inf while the sequence (prompt included) is shorter than ``min_length``."""

    hf_name = "MinLengthLogitsProcessor"

    def __init__(self, min_length: int, eos_token_id: Sequence[int], vocab_size: int | None = None, device=None):
        if not isinstance(min_length, int) or min_length < 0:
            raise ValueError(f"min_length must be a non-negative int, got {min_length!r}")
        super().__init__(eos_token_id, vocab_size, device)
        self.min_length = min_length

    def apply(self, scores, length):
        return self._block(scores, None if length is None else length < self.min_length)


class MinNewTokens(_EosBlock):
    """eos scores → −inf while fewer than ``min_new_tokens`` tokens follow the prompt of ``prompt_length``."""

    hf_name = "MinNewTokensLengthLogitsProcessor"

    def __init__(self, prompt_length: int, min_new_tokens: int, eos_token_id: Sequence[int],
                 vocab_size: int | None = None, device=None):
        if not isinstance(min_new_tokens, int) or min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be a non-negative int, got {min_new_tokens!r}")
        super().__init__(eos_token_id, vocab_size, device)
        self.prompt_length, self.min_new_tokens = int(prompt_length), min_new_tokens

    def apply(self, scores, length):
        return self._block(scores, None if length is None else length - self.prompt_length < self.min_new_tokens)


# -- warpers (sampling only) -------------------------------------------------------------------------------------
class Temperature(_HistoryFree):
    """s / T: ``temperature`` T > 0 (below 1 sharpens the distribution, above 1 flattens it)."""

    hf_name = "TemperatureLogitsWarper"
    warper = True

    def __init__(self, temperature: float):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        self.temperature = float(temperature)

    def apply(self, scores, length=None):
        return scores / self.temperature


class TopK(_HistoryFree):
    """−inf below the k-th largest score of each row (ties at the k-th kept); k ≥ ``min_tokens_to_keep``."""

    hf_name = "TopKLogitsWarper"
    warper = True

    def __init__(self, top_k: int, min_tokens_to_keep: int = 1):
        if not isinstance(top_k, int) or top_k <= 0:
            raise ValueError(f"top_k must be a positive int (0 turns it off), got {top_k!r}")
        self.top_k = max(top_k, min_tokens_to_keep)

    def apply(self, scores, length=None):
        k = min(self.top_k, scores.shape[-1])
        return scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))


class TopP(_HistoryFree):
    """Nucleus sampling: −inf for the tokens whose ascending cumulative probability is ≤ 1 − ``top_p``
    (the smallest set with mass ≥ top_p survives; at least ``min_tokens_to_keep``)."""

    hf_name = "TopPLogitsWarper"
    warper = True

    def __init__(self, top_p: float, min_tokens_to_keep: int = 1):
        if not 0 <= top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.top_p, self.min_tokens_to_keep = float(top_p), int(min_tokens_to_keep)

    def apply(self, scores, length=None):
        srt, idx = torch.sort(scores, descending=False)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= (1 - self.top_p)
        drop[..., -self.min_tokens_to_keep:] = 0
        return scores.masked_fill(drop.scatter(-1, idx, drop), -float("inf"))


class MinP(_HistoryFree):
    """−inf where p_v < ``min_p`` · max_u p_u (p = softmax of the row); at least ``min_tokens_to_keep`` kept."""

    hf_name = "MinPLogitsWarper"
    warper = True

    def __init__(self, min_p: float, min_tokens_to_keep: int = 1):
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        self.min_p, self.min_tokens_to_keep = float(min_p), int(min_tokens_to_keep)

    def apply(self, scores, length=None):
        probs = torch.softmax(scores, dim=-1)
        remove = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
        k = min(self.min_tokens_to_keep, probs.shape[-1])
        remove.scatter_(-1, torch.topk(probs, k, dim=-1).indices, False)
        return scores.masked_fill(remove, -float("inf"))


class TypicalP(_HistoryFree):
    """Locally typical sampling: keep the tokens of least |−log p_v − H(p)| until their mass reaches ``mass``
    (τ in (0, 1)); at least ``min_tokens_to_keep``."""

    hf_name = "TypicalLogitsWarper"
    warper = True

    def __init__(self, mass: float, min_tokens_to_keep: int = 1):
        if not 0 < mass < 1:
            raise ValueError(f"typical_p must be in (0, 1) (1 turns it off), got {mass}")
        self.mass, self.min_tokens_to_keep = float(mass), int(min_tokens_to_keep)

    def apply(self, scores, length=None):
        logp = torch.nn.functional.log_softmax(scores, dim=-1)
        p = torch.exp(logp)
        ent = -(logp * p).nansum(-1, keepdim=True)
        shifted = torch.abs((-logp) - ent)
        srt, idx = torch.sort(shifted, descending=False)
        cum = scores.gather(-1, idx).softmax(dim=-1).cumsum(dim=-1)
        last = (cum < self.mass).sum(dim=-1).clamp_(max=srt.shape[-1] - 1)
        drop = srt > srt.gather(-1, last[..., None])
        drop[..., :self.min_tokens_to_keep] = 0
        return scores.masked_fill(drop.scatter(-1, idx, drop), -float("inf"))


# -- the pipeline --------------------------------------------------------------------------------------------------
def _merge(defaults: list, custom: list) -> list:
    """transformers' ``_merge_criteria_processor_list``: a caller's processor of the same kind as a built-in one
    takes its place; the other caller processors follow the built-in ones."""
    if not custom:
        return list(defaults)
    out = []
    for d in defaults:
        rep = next((c for c in custom if type(c) is type(d) or type(c).__name__ == d.hf_name), None)
        out.append(rep if rep is not None else d)
    return out + [c for c in custom if not any(c is o for o in out)]


class LogitsPipeline:
    """Processors applied in order to ``[N, V]`` scores, then the token choice (argmax, or a sample).

    ``LogitsPipeline.from_config(cfg, ...)`` builds transformers' processor list for a resolved generation config;
    ``pipe(input_ids, scores)`` runs it; ``pipe.window(scores [B, T, V], length [B])`` runs it over speculative
    windows (history-free processors only); ``pipe.choose(scores, generator)`` picks the next ids.
    """

    def __init__(self, processors: Sequence[Processor] = (), *, do_sample: bool = False):
        self.processors = list(processors)
        self.do_sample = bool(do_sample)

    def __repr__(self) -> str:
        return f"LogitsPipeline({self.processors!r}, do_sample={self.do_sample})"

    def __len__(self) -> int:
        return len(self.processors)

    def __iter__(self):
        return iter(self.processors)

    @classmethod
    def from_config(cls, cfg: Any, *, prompt_length: int = 0, vocab_size: int | None = None,
                    device: torch.device | str | None = None, attention_mask: torch.Tensor | None = None,
                    logits_processor: Sequence[Processor] | None = None) -> "LogitsPipeline":
        """transformers' ``_get_logits_processor`` for the fields of ``cfg`` (a resolved
        :class:`k3nn.generation.GenerationConfig`, or any object with some of its attributes; a missing attribute
        counts as unset). ``attention_mask`` [N, L0]: the prompt mask (its left padding is left out of the
        repetition penalty)."""
        def get(name, default=None):
            v = getattr(cfg, name, None)
            return default if v is None else v

        eos = get("eos_token_id")
        if isinstance(eos, torch.Tensor):
            eos = eos.tolist()
        eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        kw = dict(vocab_size=vocab_size, device=device)
        procs: list = []
        rp = get("repetition_penalty", 1.0)
        if rp != 1.0:
            ignore = None if attention_mask is None else (attention_mask != 0).int().argmax(dim=1)
            procs.append(RepetitionPenalty(rp, ignore))
        ngram = get("no_repeat_ngram_size", 0)
        if ngram > 0:
            procs.append(NoRepeatNGram(ngram))
        if get("bad_words_ids") is not None:
            procs.append(NoBadWords(get("bad_words_ids"), eos, **kw))
        min_new = get("min_new_tokens")
        if eos and min_new is not None and min_new > 0:
            # transformers adds MinLength(T + min_new_tokens) too: the same mask, so one suffices
            procs.append(MinNewTokens(prompt_length, min_new, eos, **kw))
        elif eos and get("min_length", 0) > 0:
            procs.append(MinLength(get("min_length"), eos, **kw))
        procs = _merge(procs, list(logits_processor or []))
        sample = bool(get("do_sample", False))
        if sample:
            t = get("temperature", 1.0)
            if t != 1.0:
                procs.append(Temperature(t))
            k = get("top_k", 0)
            if k != 0:
                procs.append(TopK(int(k)))
            p = get("top_p", 1.0)
            if p < 1.0:
                procs.append(TopP(p))
            mp = get("min_p")
            if mp is not None:
                procs.append(MinP(mp))
            tp = get("typical_p", 1.0)
            if tp < 1.0:
                procs.append(TypicalP(tp))
        return cls(procs, do_sample=sample)

    @classmethod
    def for_sampling(cls, do_sample: bool, temperature: float = 1.0, top_k: int = 0,
                     top_p: float = 1.0) -> "LogitsPipeline":
        """The warpers only (temperature, top-k, top-p), as the Engine's per-request sampling uses them."""
        from types import SimpleNamespace

        return cls.from_config(SimpleNamespace(do_sample=do_sample, temperature=temperature, top_k=top_k,
                                               top_p=top_p))

    @classmethod
    def for_request(cls, params: Any, *, prompt_length: int, vocab_size: int, eos_ids: Sequence[int] = (),
                    device: torch.device | str | None = None) -> "LogitsPipeline":
        """The pipeline of one Engine request (``params``: a :class:`k3nn.engine.SamplingParams`, or any object
        with some of its attributes; a missing one counts as unset), in vLLM's order:

        1. ``RepetitionPenalty(repetition_penalty)`` over prompt + output, ``FrequencyPenalty`` and
           ``PresencePenalty`` over the output (positions ≥ ``prompt_length``), each only when not neutral;
        2. ``MinNewTokens``: while fewer than ``min_tokens`` tokens were generated, −inf for the tokens that would
           stop the request: ``stop_token_ids`` and ``eos_ids`` (eos left out under ``ignore_eos``, as vLLM);
        3. when ``do_sample``: ``Temperature``, ``TopK``, ``TopP`` (as :meth:`for_sampling`), ``MinP``.

        A greedy request keeps 1–2: its token is the argmax of the processed scores. ``__call__(input_ids [1, L],
        scores)`` with ``input_ids`` = prompt + output runs it from the ids; :meth:`apply_counts` from incremental
        :class:`TokenCounts` (equal results)."""
        def get(name, default):
            v = getattr(params, name, None)
            return default if v is None else v

        procs: list = []
        rp = float(get("repetition_penalty", 1.0))
        if rp != 1.0:
            procs.append(RepetitionPenalty(rp))
        fp = float(get("frequency_penalty", 0.0))
        if fp != 0.0:
            procs.append(FrequencyPenalty(fp, prompt_length))
        pp = float(get("presence_penalty", 0.0))
        if pp != 0.0:
            procs.append(PresencePenalty(pp, prompt_length))
        min_tokens = int(get("min_tokens", 0))
        stops = [int(t) for t in get("stop_token_ids", ())]
        if not get("ignore_eos", False):
            stops += [int(e) for e in eos_ids]
        stops = sorted(set(stops))
        if min_tokens > 0 and stops:
            procs.append(MinNewTokens(int(prompt_length), min_tokens, stops, vocab_size, device))
        sample = bool(get("do_sample", False))
        if sample:
            procs += cls.for_sampling(True, get("temperature", 1.0), get("top_k", 0), get("top_p", 1.0)).processors
            if float(get("min_p", 0.0)) > 0:
                procs.append(MinP(float(get("min_p", 0.0))))
        return cls(procs, do_sample=sample)

    # -- properties ----------------------------------------------------------------------------------------------
    @property
    def reads_counts(self) -> bool:
        """Some processor reads :class:`TokenCounts` tensors (``apply_counts`` needs ``output`` / ``seen``)."""
        return any(hasattr(p, "apply_counts") for p in self.processors)

    @property
    def history_free(self) -> bool:
        """Every processor reads only the scores and the sequence length (none reads the tokens)."""
        return all(isinstance(p, _Base) and not p.reads_tokens for p in self.processors)

    def check_history_free(self, where: str) -> None:
        """Raise NotImplementedError naming the processors that read the token history (``where`` cannot run them
        exactly)."""
        bad = [p for p in self.processors if not (isinstance(p, _Base) and not p.reads_tokens)]
        if bad:
            names = ", ".join(_describe(p) for p in bad)
            raise NotImplementedError(
                f"{where} cannot apply logits processors that read the generated tokens ({names}): the scores of "
                f"a drafted window would need the draft tokens as history. Generate without the drafter, or drop "
                f"these arguments.")

    # -- running -------------------------------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
        """scores [N, V] fp32 after every processor; ``input_ids`` [N, L] is the sequence so far (prompt and
        left padding included). ``input_ids`` may be None for a history-free pipeline (length unknown: the length
        processors must then be absent)."""
        for p in self.processors:
            scores = p(input_ids, scores)
        return scores

    def window(self, scores: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """scores [B, T, V] of T consecutive positions → processed scores; ``length`` [B] (device) = tokens before
        the one row 0 scores (prompt included), so row j scores the token at ``length + j``. History-free
        processors only; graph-safe (no host sync)."""
        if not self.processors:
            return scores
        B, T, V = scores.shape
        lengths = (length[:, None] + torch.arange(T, device=scores.device)[None, :]).reshape(B * T)
        x = scores.reshape(B * T, V)
        for p in self.processors:
            if not (isinstance(p, _Base) and not p.reads_tokens):
                raise NotImplementedError(f"LogitsPipeline.window: {_describe(p)} reads the token history")
            x = p.apply(x, lengths)
        return x.view(B, T, V)

    def apply_counts(self, scores: torch.Tensor, counts: TokenCounts) -> torch.Tensor:
        """scores [N, V] fp32 after every processor, the history read from ``counts`` (kept by the caller) instead
        of ``input_ids``: the penalties through their ``apply_counts``, the history-free processors through
        ``apply(scores, counts.length)``. Equal to ``self(input_ids, scores)`` when ``counts`` are those of
        ``input_ids``; no host sync. Raises NotImplementedError for a processor that needs the ids themselves."""
        for p in self.processors:
            if hasattr(p, "apply_counts"):
                scores = p.apply_counts(scores, counts)
            elif isinstance(p, _Base) and not p.reads_tokens:
                scores = p.apply(scores, counts.length)
            else:
                raise NotImplementedError(f"LogitsPipeline.apply_counts: {_describe(p)} reads the token ids")
        return scores

    def choose(self, scores: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """[..., V] processed scores → [...] next ids: argmax, or (``do_sample``) a sample of softmax(scores)."""
        return sample_from_scores(scores, generator) if self.do_sample else scores.argmax(-1)


def _describe(p) -> str:
    if isinstance(p, RepetitionPenalty):
        return f"repetition_penalty={p.penalty}"
    if isinstance(p, NoRepeatNGram):
        return f"no_repeat_ngram_size={p.ngram_size}"
    if isinstance(p, (FrequencyPenalty, PresencePenalty)):
        return f"{type(p).__name__}({p.penalty})"
    if isinstance(p, NoBadWords):
        return f"bad_words_ids with multi-token sequences {p.multi}"
    return f"logits_processor {type(p).__name__}"


def sample_from_scores(scores: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[..., V] scores → [...] ids drawn from softmax(scores) with the exponential race argmax(p / E), E ~ Exp(1):
    the law of ``torch.multinomial`` without its host sync. Seeded by ``generator``."""
    probs = scores.float().softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(-1)


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[N, V] logits → fp32 scores after the temperature, top-k and top-p warpers (transformers' math, −inf
    outside)."""
    return LogitsPipeline.for_sampling(True, temperature, top_k, top_p)(None, logits.float())


def sample_next(logits: torch.Tensor, cfg, generator: torch.Generator | None) -> torch.Tensor:
    """[B, V] → [B] next ids: argmax, or a sample after temperature / top-k / top-p of ``cfg``."""
    if not cfg.do_sample:
        return logits.argmax(-1)
    return sample_from_scores(process_logits(logits, cfg.temperature, cfg.top_k or 0, cfg.top_p), generator)
