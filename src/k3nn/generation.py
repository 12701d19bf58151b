"""generate(): greedy / sampled decoding over the hybrid cache with transformers' ``GenerationMixin`` arguments.

The loop: one prefill forward over the (left-padded) prompt, then one forward per token. The next-token scores go
through one :class:`k3nn.logits.LogitsPipeline` (transformers' processors and warpers, in transformers' order);
sampling uses the exponential-race form of ``multinomial`` (argmax of p / Exp(1) noise) drawn from a seeded
generator, so it needs no host sync. On GPU the stop check (every row finished) and the NaN / Inf check of the
logits run every ``sync_every`` steps only, from device flags; caller-supplied processors / stopping criteria and
``stop_strings`` are host code and make the loop check every step.

Argument precedence follows transformers: ``generate()`` arguments > ``generation_config=`` > the model's
``generation_config`` (its ``generation_config.json``; else the eos / pad / bos ids of the model config) >
defaults. Defaults are transformers' except the length: without ``max_new_tokens`` or ``max_length``, 64 new
tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .logits import LogitsPipeline, sample_from_scores

log = logging.getLogger(__name__)

__all__ = ["GenerationConfig", "GenerationMixin", "GenerateDecoderOnlyOutput", "StopStringCriteria",
           "sample_next", "process_logits", "loop_setup", "DEFAULT_MAX_NEW_TOKENS"]

#: new tokens when neither ``max_new_tokens`` nor ``max_length`` is given (transformers: max_length = 20)
DEFAULT_MAX_NEW_TOKENS = 64

# values a field takes when it is not set (GenerationConfig fields are None until set, as in transformers)
_DEFAULTS: dict[str, Any] = dict(
    min_length=0, do_sample=False, temperature=1.0, top_k=50, top_p=1.0, typical_p=1.0, repetition_penalty=1.0,
    no_repeat_ngram_size=0, num_return_sequences=1, num_beams=1, output_scores=False, output_logits=False,
    return_dict_in_generate=False, use_cache=True, num_assistant_tokens=7)

# transformers GenerationConfig fields that do not change the tokens here (caching, compilation, bookkeeping)
_IGNORED = frozenset({
    "transformers_version", "_from_model_config", "_commit_hash", "_original_object_hash", "bos_token_id",
    "decoder_start_token_id", "cache_implementation", "cache_config", "max_cache_len", "compile_config",
    "disable_compile", "continuous_batching_config", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_early_exit", "assistant_lookbehind", "target_lookbehind", "assistant_ensemble_weight",
    "prompt_lookup_num_tokens", "max_matching_ngram_size", "is_assistant", "speculation_type", "low_memory"})

# transformers GenerationConfig fields k3nn does not implement, with the value that means "off"
_UNSUPPORTED_OFF: dict[str, Any] = {
    "early_stopping": False, "length_penalty": 1.0, "num_beam_groups": 1, "diversity_penalty": 0.0,
    "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "remove_invalid_values": False, "renormalize_logits": False, "output_attentions": False,
    "output_hidden_states": False, "guidance_scale": 1.0, "token_healing": False, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "sequence_bias": None, "watermarking_config": None, "max_time": None,
    "top_h": None, "penalty_alpha": None, "dola_layers": None, "constraints": None, "force_words_ids": None,
    "use_mtp": False}


@dataclass
class GenerationConfig:
    """Generation arguments, named as in transformers' ``GenerationConfig``. Every field is None until set;
    :meth:`resolved` fills the defaults (transformers' global defaults, e.g. ``top_k=50`` when sampling, except
    64 new tokens when no length is given). ``seed`` (a seeded generator for sampling) and
    ``num_assistant_tokens`` (the speculative window γ with a drafter, default 7) are k3nn's."""

    max_new_tokens: int | None = None  # wins over max_length when set
    max_length: int | None = None  # prompt + new tokens
    min_new_tokens: int | None = None  # eos masked until this many new tokens; wins over min_length
    min_length: int | None = None  # eos masked until the sequence (prompt included) is this long
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None  # default 50 (transformers); 0 = off
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    bad_words_ids: list[list[int]] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    num_return_sequences: int | None = None
    num_beams: int | None = None  # > 1: NotImplementedError (no beam search)
    stop_strings: str | list[str] | None = None  # needs generate(tokenizer=...)
    output_scores: bool | None = None
    output_logits: bool | None = None
    return_dict_in_generate: bool | None = None
    use_cache: bool | None = None  # False runs with the cache too (same tokens)
    prefill_chunk_size: int | None = None
    seed: int | None = None
    num_assistant_tokens: int | None = None

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def fields(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "generation config", strict: bool = True) -> "GenerationConfig":
        """A config from transformers-style keys. Keys that do not change the tokens here (caching, compilation,
        ``transformers_version``) are skipped; a field k3nn does not implement, set to anything but its "off"
        value, raises ValueError naming it (``strict``) or is dropped with a warning; an unknown key raises
        TypeError ("unknown generation argument") or is dropped with a warning."""
        known = cls.fields()
        kept, unsupported, unknown = {}, [], []
        for k, v in d.items():
            if k in known:
                if v is not None:
                    kept[k] = v
            elif k in _IGNORED or k.startswith("_"):
                continue
            elif k in _UNSUPPORTED_OFF:
                if v is not None and v != _UNSUPPORTED_OFF[k]:
                    unsupported.append(f"{k}={v!r}")
            elif v is not None:
                unknown.append(k)
        if unsupported:
            msg = (f"{source}: k3nn's generate() does not implement {', '.join(sorted(unsupported))} "
                   f"(supported fields: {', '.join(sorted(known))})")
            if strict:
                raise ValueError(msg)
            warnings.warn(msg + "; ignored", stacklevel=3)
        if unknown:
            if strict:
                raise TypeError(f"unknown generation argument(s): {sorted(unknown)}")
            warnings.warn(f"{source}: unknown generation field(s) {sorted(unknown)} ignored", stacklevel=3)
        return cls(**kept)

    @classmethod
    def coerce(cls, obj: Any, *, source: str = "generation_config") -> "GenerationConfig":
        """A k3nn GenerationConfig, a dict or a transformers ``GenerationConfig`` (its set fields) → a k3nn one."""
        if isinstance(obj, GenerationConfig):
            return obj
        if isinstance(obj, dict):
            return cls.from_dict(obj, source=source)
        if callable(getattr(obj, "to_dict", None)):  # transformers.GenerationConfig: unset fields are None
            return cls.from_dict(obj.to_dict(), source=f"{source} ({type(obj).__name__})")
        raise TypeError(f"{source} must be a k3nn or transformers GenerationConfig or a dict, "
                        f"got {type(obj).__name__}")

    @classmethod
    def from_model_config(cls, config: Any) -> "GenerationConfig":
        """The special tokens of a model config (what transformers uses when there is no generation_config.json)."""
        return cls(**{k: getattr(config, k) for k in ("eos_token_id", "pad_token_id", "bos_token_id")
                      if getattr(config, k, None) is not None})

    def merge(self, other: "GenerationConfig") -> "GenerationConfig":
        """This config with the fields ``other`` sets (``other`` wins)."""
        return dataclasses.replace(self, **{k: v for k, v in dataclasses.asdict(other).items() if v is not None})

    def update(self, **kw: Any) -> "GenerationConfig":
        """A copy with ``kw`` set (None values are skipped); unknown names raise TypeError."""
        bad = sorted(set(kw) - self.fields())
        if bad:
            raise TypeError(f"unknown generation argument(s): {bad}")
        return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})

    def resolved(self) -> "GenerationConfig":
        """A copy with every unset field at its default (the lengths stay None: they depend on the prompt)."""
        return dataclasses.replace(self, **{k: v for k, v in _DEFAULTS.items() if getattr(self, k) is None})

    def validate(self) -> None:
        """Check a :meth:`resolved` config."""
        def nonneg_int(name):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")

        for name in ("max_new_tokens", "max_length", "min_new_tokens", "min_length", "top_k",
                     "no_repeat_ngram_size"):
            nonneg_int(name)
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.typical_p <= 1:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.num_return_sequences, int) or self.num_return_sequences < 1:
            raise ValueError(f"num_return_sequences must be an int >= 1, got {self.num_return_sequences!r}")
        if self.num_return_sequences > 1 and not self.do_sample and self.num_beams == 1:
            raise ValueError("Greedy methods (do_sample != True) without beam search do not support "
                             f"`num_return_sequences` different than 1 (got {self.num_return_sequences}); "
                             f"pass do_sample=True for several samples per prompt")
        if self.num_assistant_tokens < 1:
            raise ValueError(f"num_assistant_tokens must be >= 1, got {self.num_assistant_tokens}")
        if self.stop_strings is not None and not (isinstance(self.stop_strings, str) or (
                isinstance(self.stop_strings, (list, tuple)) and self.stop_strings
                and all(isinstance(s, str) and s for s in self.stop_strings))):
            raise ValueError(f"stop_strings must be a string or a list of non-empty strings, got {self.stop_strings!r}")

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        if isinstance(e, torch.Tensor):
            e = e.tolist()
        return [] if e is None else ([int(e)] if isinstance(e, int) else [int(x) for x in e])

    # -- files --------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The set fields (what transformers' ``to_diff_dict`` writes)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "GenerationConfig":
        """``generation_config.json`` (k3nn's or transformers'); fields k3nn does not implement are dropped with a
        warning naming them."""
        path = os.path.join(directory, "generation_config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f), source=str(path), strict=False)


@dataclass
class GenerateDecoderOnlyOutput:
    """``generate(..., return_dict_in_generate=True)``: transformers' ``GenerateDecoderOnlyOutput`` fields.
    ``scores`` / ``logits``: one [B, V] fp32 tensor per generated token (processed / raw), with
    ``output_scores`` / ``output_logits``."""

    sequences: torch.Tensor
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    attentions: None = None
    hidden_states: None = None
    cache: Any = None

    def __getitem__(self, key: str):
        return getattr(self, key)

    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]


class StopStringCriteria:
    """Stop a row when its text ends with one of ``stop_strings``, the match overlapping the last token (it may
    end inside it): transformers' ``StopStringCriteria`` semantics, checked on the host by decoding the row's last
    tokens with ``tokenizer.decode``. ``__call__(input_ids [B, L], scores) -> bool [B]``."""

    def __init__(self, stop_strings: str | Sequence[str], tokenizer):
        if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
            raise ValueError("stop_strings needs the model's tokenizer: pass generate(..., tokenizer=tokenizer) "
                             "(any object with decode(ids) -> str)")
        self.stop_strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        self.tokenizer = tokenizer
        self.tail = max(len(s) for s in self.stop_strings) + 1  # tokens decoded per check (each ≥ 1 character)

    def _row(self, ids: list[int]) -> bool:
        full = self.tokenizer.decode(ids)
        prev = self.tokenizer.decode(ids[:-1]) if len(ids) > 1 else ""
        last_start = len(prev) if full.startswith(prev) else len(full) - len(self.tokenizer.decode(ids[-1:]))
        return any(full.find(s, max(0, last_start - len(s) + 1)) >= 0 for s in self.stop_strings)

    def __call__(self, input_ids: torch.Tensor, scores=None) -> torch.Tensor:
        rows = input_ids[:, -self.tail:].tolist()
        return torch.tensor([self._row(r) for r in rows], dtype=torch.bool, device=input_ids.device)


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[N, V] logits → fp32 scores after the temperature, top-k and top-p warpers (transformers' math, −inf
    outside)."""
    return LogitsPipeline.for_sampling(True, temperature, top_k, top_p)(None, logits.float())


def sample_next(logits: torch.Tensor, cfg, generator: torch.Generator | None) -> torch.Tensor:
    """[B, V] → [B] next ids: argmax, or a sample after temperature / top-k / top-p of ``cfg``."""
    if not cfg.do_sample:
        return logits.argmax(-1)
    return sample_from_scores(process_logits(logits, cfg.temperature, cfg.top_k or 0, cfg.top_p), generator)


def _check_left_padded(mask: torch.Tensor) -> None:
    m = mask.long()
    if (m.diff(dim=1) < 0).any():
        raise ValueError("attention_mask: generate() needs left padding (zeros before the tokens of each row)")
    if (m.sum(1) == 0).any():
        raise ValueError("attention_mask: a row has no tokens (empty prompt)")


def _infer_attention_mask(input_ids: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor | None:
    """transformers infers a mask from ``pad_token_id`` when none is given (pad in the prompt, pad not an eos).
    Here only left padding can be expressed: leading pad ids become the mask's zeros; pad ids elsewhere are kept as
    tokens, with a warning (transformers would mask them)."""
    pad = cfg.pad_token_id
    if pad is None or int(pad) in cfg.eos_ids:
        return None
    is_pad = input_ids == int(pad)
    if not bool(is_pad.any()):
        return None
    mask = is_pad.logical_not().long().cummax(1).values  # 0 on the leading pads only
    if bool((is_pad & mask.bool()).any()) or bool((mask.sum(1) == 0).any()):
        warnings.warn(f"input_ids contain pad_token_id={pad} after the first token of a row and no attention_mask "
                      f"was given: those positions are attended to (transformers would mask them); pass an "
                      f"attention_mask to be explicit", stacklevel=3)
        return None
    return mask if bool((mask == 0).any()) else None


def loop_setup(model, cfg: GenerationConfig, input_ids: torch.Tensor, streamer, n_new: int):
    """The start shared by every decoding loop: hand the prompt to the streamer; then None when there is nothing
    to generate (the streamer is ended), else ``(generator, eos ids [E] long, pad id)``."""
    if streamer is not None:
        streamer.put(input_ids.cpu())
    if n_new == 0:
        if streamer is not None:
            streamer.end()
        return None
    eos = torch.tensor(cfg.eos_ids, device=model.device, dtype=torch.long)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_ids[0] if cfg.eos_ids else 0)
    return model._make_generator(cfg.seed), eos, int(pad)


def _criterion_result(out, B: int, device) -> torch.Tensor:
    """A stopping criterion's answer (bool, or a bool tensor [B] / []) → bool [B] on ``device``."""
    if isinstance(out, torch.Tensor):
        return out.to(device=device, dtype=torch.bool).reshape(-1).expand(B)
    return torch.full((B,), bool(out), dtype=torch.bool, device=device)


class GenerationMixin:
    sync_every = 16  # GPU: how often the loop reads the stop and NaN flags back

    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = torch.Generator(device=self.device)
        g.manual_seed(int(seed))
        return g

    def _generation_config(self, generation_config, args: dict) -> GenerationConfig:
        """The call's resolved config: defaults < the model's < ``generation_config`` < ``args`` (transformers'
        precedence)."""
        base = getattr(self, "generation_config", None)
        base = (GenerationConfig.coerce(base, source="model.generation_config") if base is not None
                else GenerationConfig.from_model_config(self.config))
        if generation_config is not None:
            base = base.merge(GenerationConfig.coerce(generation_config))
        cfg = base.merge(GenerationConfig.from_dict({k: v for k, v in args.items() if v is not None},
                                                    source="generate()")).resolved()
        cfg.validate()
        if cfg.num_beams > 1:
            raise NotImplementedError(
                f"beam search (num_beams={cfg.num_beams}) is not implemented in k3nn: sample several candidates "
                f"with do_sample=True, num_return_sequences=N, or run transformers' generate() on the same "
                f"checkpoint (KimiLinearForCausalLM.from_pretrained)")
        return cfg

    def _new_tokens(self, cfg: GenerationConfig, T: int) -> int:
        """transformers' length rule: max_new_tokens when set, else max_length − T, else the default."""
        limit = self.config.max_position_embeddings
        if cfg.max_new_tokens is not None:
            return cfg.max_new_tokens
        if cfg.max_length is not None:
            if T >= cfg.max_length:
                raise ValueError(f"Input length of input_ids is {T}, but `max_length` is set to {cfg.max_length}: "
                                 f"nothing to generate; increase `max_length` or, better, set `max_new_tokens`")
            return cfg.max_length - T
        return max(0, min(DEFAULT_MAX_NEW_TOKENS, limit - T))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int | None = None, do_sample: bool | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | list[int] | None = None, attention_mask: torch.Tensor | None = None,
                 streamer=None, drafter=None, generation_config=None, seed: int | None = None,
                 cuda_graph: bool | str | None = None, decode_backend: str | None = None,
                 prefill_chunk_size: int | None = None, *, logits_processor: Sequence[Callable] | None = None,
                 stopping_criteria: Sequence[Callable] | None = None, tokenizer=None,
                 **kwargs: Any) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """Prompt ids [B, T] (left-padded with ``attention_mask`` when rows differ) → [B·n, T + new] ids, or a
        :class:`GenerateDecoderOnlyOutput` with ``return_dict_in_generate=True``.

        Any transformers ``GenerationConfig`` field k3nn implements may be passed by name (see
        :class:`GenerationConfig`: ``max_length``, ``min_new_tokens``, ``repetition_penalty``,
        ``no_repeat_ngram_size``, ``bad_words_ids``, ``min_p``, ``typical_p``, ``num_return_sequences``,
        ``output_scores``, ``output_logits``, ``stop_strings``, ...); ``generation_config`` may be a k3nn or a
        transformers ``GenerationConfig`` or a dict. Rows that finished (eos, a stopping criterion) emit
        ``pad_token_id`` (eos if unset) until every row has finished or the length is reached; as in
        transformers, only when ``eos_token_id`` is configured (``eos_token_id=[]``: no eos, finished rows still
        padded; no eos_token_id anywhere: a row stopped by a criterion keeps its tokens).
        ``num_return_sequences=n`` repeats each prompt n times (each prompt's copies adjacent, as in transformers).

        ``logits_processor``: callables ``(input_ids [B, L], scores [B, V]) -> scores`` (transformers'
        ``LogitsProcessorList`` works), run after the built-in processors and before the sampling warpers.
        ``stopping_criteria``: callables ``(input_ids, scores) -> bool [B] | bool`` (``StoppingCriteriaList``
        works; ``scores`` is the tuple of processed scores so far with ``output_scores``, else None, as in
        transformers). ``stop_strings`` needs ``tokenizer`` (any object with ``decode``). These three are host
        code: the loop then reads its flags every step; the decode step itself stays as chosen (a captured graph
        on GPU: the processors run on its output).

        ``streamer``: any object with ``put(tensor)`` / ``end()`` (HF's TextStreamer works); it first receives
        the prompt, then each new token column. ``drafter``: a DSpark drafter for speculative decoding (the
        history-free processors only: repetition penalty, n-gram and multi-token bad-word bans, caller processors,
        stopping criteria, stop strings and score outputs raise NotImplementedError there).
        ``cuda_graph``: None (auto: the decode step is captured in a CUDA graph on GPU, falling back to eager
        if capture fails), True, ``"static"`` (the graph-safe step without capture) or False.
        ``decode_backend``: ``"auto"`` (standard layers) or ``"latency_specialized"`` (fused per-layer decode,
        see :mod:`k3nn.decode`); default: the model's ``decode_backend`` attribute, else ``"auto"``.
        ``prefill_chunk_size``: prompts longer than this prefill chunk by chunk (default: the model's
        ``prefill_chunk_size``); the tokens are the same, the activation memory is bounded by the chunk.
        ``use_cache=False`` is accepted and runs with the cache (the tokens are the same). A NaN or Inf in the
        logits raises FloatingPointError naming the step.
        """
        cfg = self._generation_config(generation_config, dict(
            max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
            eos_token_id=eos_token_id, seed=seed, prefill_chunk_size=prefill_chunk_size, **kwargs))
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a [batch, seq_len] LongTensor")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty: generate() needs at least one prompt token")
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask must match input_ids' shape {tuple(input_ids.shape)}, "
                                 f"got {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.to(self.device)
            _check_left_padded(attention_mask)
        else:
            attention_mask = _infer_attention_mask(input_ids, cfg)
        if not cfg.use_cache:
            log.debug("generate(use_cache=False): k3nn always decodes with its cache (the tokens are the same)")
        n_seq = cfg.num_return_sequences
        if n_seq > 1:  # transformers' _expand_inputs_for_generation: each prompt's copies adjacent
            input_ids = input_ids.repeat_interleave(n_seq, dim=0)
            attention_mask = None if attention_mask is None else attention_mask.repeat_interleave(n_seq, dim=0)
        B, T = input_ids.shape
        n_new = self._new_tokens(cfg, T)
        self._chunk_size(cfg.prefill_chunk_size)
        limit = self.config.max_position_embeddings
        if T > limit:
            raise ValueError(f"input_ids has {T} tokens, longer than the model's max_position_embeddings = {limit}")
        if T + n_new > limit:
            raise ValueError(f"prompt of {T} tokens + max_new_tokens {n_new} = {T + n_new} exceeds the model's "
                             f"max_position_embeddings = {limit}")
        pipe = LogitsPipeline.from_config(cfg, prompt_length=T, vocab_size=self.config.vocab_size,
                                          device=self.device, attention_mask=attention_mask,
                                          logits_processor=logits_processor)
        criteria = list(stopping_criteria or [])
        if cfg.stop_strings is not None:
            criteria.append(StopStringCriteria(cfg.stop_strings, tokenizer))
        if drafter is not None:
            return self._speculative(drafter, input_ids, attention_mask, cfg, n_new, streamer, pipe, criteria)
        return self._decode(input_ids, attention_mask, cfg, n_new, streamer, pipe, criteria, cuda_graph,
                            decode_backend, logits_processor)

    def _speculative(self, drafter, input_ids, attention_mask, cfg, n_new, streamer, pipe, criteria):
        from .spec import speculative_generate

        pipe.check_history_free("speculative decoding (drafter=)")
        if criteria:
            raise NotImplementedError("speculative decoding (drafter=) does not run stopping_criteria / "
                                      "stop_strings: a window emits several tokens at once; generate without the "
                                      "drafter")
        if cfg.output_scores or cfg.output_logits:
            raise NotImplementedError("speculative decoding (drafter=) does not return per-token scores / logits "
                                      "(output_scores, output_logits); generate without the drafter")
        seqs = speculative_generate(self, drafter, input_ids, attention_mask, cfg, n_new, streamer, pipeline=pipe)
        return GenerateDecoderOnlyOutput(seqs) if cfg.return_dict_in_generate else seqs

    def _decode(self, input_ids, attention_mask, cfg, n_new, streamer, pipe, criteria, cuda_graph, decode_backend,
                user_processors):
        B, T = input_ids.shape
        dev = self.device
        want_scores = cfg.return_dict_in_generate and cfg.output_scores
        want_logits = cfg.return_dict_in_generate and cfg.output_logits
        setup = loop_setup(self, cfg, input_ids, streamer, n_new)
        if setup is None:
            return GenerateDecoderOnlyOutput(input_ids) if cfg.return_dict_in_generate else input_ids
        gen, eos, pad = setup
        from .decode.runner import make_decode_runner

        decode_backend = decode_backend or getattr(self, "decode_backend", None) or "auto"
        if decode_backend == "latency_specialized":
            from .cache.hybrid import HybridCache

            cache = HybridCache(self.config, B, T + n_new, self.dtype, dev, mla_pool=True)
        else:
            cache = self.new_cache(B, T + n_new)
        logits = self(input_ids, cache=cache, attention_mask=attention_mask, logits_to_keep=1,
                      prefill_chunk_size=cfg.prefill_chunk_size).logits[:, -1]
        step = make_decode_runner(self, cache, cuda_graph=cuda_graph, decode_backend=decode_backend,
                                  attention_mask=attention_mask)
        host = bool(criteria) or bool(user_processors)
        if host:
            log.debug("generate(): caller processors / stopping criteria / stop strings run on the host every "
                      "step; the decode step (%s) is unchanged, they read its logits", step.mode)
        # the step's output may be a graph's static buffer, overwritten by the next replay: copy what is kept
        copy = want_scores or want_logits or bool(user_processors)
        seq = torch.full((B, T + n_new), pad, dtype=torch.long, device=dev)
        seq[:, :T] = input_ids
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        finish_step = torch.full((B,), n_new, dtype=torch.long, device=dev)
        bad_step = torch.full((), -1, dtype=torch.long, device=dev)
        bad_rows = torch.zeros(B, dtype=torch.bool, device=dev)
        scores_out: list[torch.Tensor] = []
        logits_out: list[torch.Tensor] = []
        sync_every = 1 if dev.type == "cpu" or host else self.sync_every
        # transformers pads finished rows when an eos is configured (even an empty list), not otherwise: without
        # one, a row stopped by a criterion keeps its tokens until every row has stopped
        pad_finished = cfg.eos_token_id is not None
        steps = n_new
        try:
            for i in range(n_new):
                L = T + i
                raw = logits.to(torch.float32, copy=True) if copy else logits.float()
                nonfinite = ~torch.isfinite(raw).all(-1)
                first = nonfinite.any() & (bad_step < 0)
                bad_rows = torch.where(first, nonfinite, bad_rows)
                bad_step = torch.where(first, i, bad_step)
                scores = pipe(seq[:, :L] if not user_processors else seq[:, :L].contiguous(), raw) if len(pipe) \
                    else raw
                if want_scores:
                    scores_out.append(scores)
                if want_logits:
                    logits_out.append(raw)
                nxt = pipe.choose(scores, gen)
                if pad_finished:
                    nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
                seq[:, L] = nxt
                if streamer is not None:
                    streamer.put(nxt.cpu())
                done = torch.isin(nxt, eos) if eos.numel() else torch.zeros_like(finished)
                if criteria:
                    ids = seq[:, :L + 1].contiguous()
                    past = tuple(scores_out) if want_scores else None
                    for c in criteria:
                        done = done | _criterion_result(c(ids, past), B, dev)
                finish_step = torch.where(done & ~finished, i, finish_step)
                finished = finished | done
                if (i + 1) % sync_every == 0 or i + 1 == n_new:
                    all_done, bad = torch.stack([finished.all().long(), bad_step]).tolist()
                    if bad >= 0:
                        self._raise_nonfinite(bad, bad_rows, T)
                    if all_done:
                        steps = i + 1
                        break
                if i + 1 < n_new:
                    logits = step(nxt[:, None])
        finally:
            #: which decode path ran (for tests and benchmarks)
            self.last_decode_info = dict(path=step.name, mode=step.mode, graph=step.uses_graph,
                                         fallback=step.fallback_reason)
            step.close()
        if bool(finished.all()):  # cut after the step at which the last row finished (as a per-step check would)
            steps = min(steps, int(finish_step.max()) + 1)
        if streamer is not None:
            streamer.end()
        seqs = seq[:, :T + steps]
        if not cfg.return_dict_in_generate:
            return seqs
        return GenerateDecoderOnlyOutput(seqs, scores=tuple(scores_out[:steps]) if want_scores else None,
                                         logits=tuple(logits_out[:steps]) if want_logits else None)

    @staticmethod
    def _raise_nonfinite(step: int, rows: torch.Tensor, T: int) -> None:
        bad = rows.nonzero().flatten().tolist()
        raise FloatingPointError(
            f"generate(): the model's logits contain NaN or Inf at step {step} (new token {step}, sequence position "
            f"{T + step}) in rows {bad}: the weights, the inputs or the dtype's range produced non-finite values")
