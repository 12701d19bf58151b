"""GenerationConfig: ``generate()`` arguments named as in transformers, and ``generation_config.json``.

Kept apart from :mod:`k3nn.generation` (the decoding loop) so that checkpoint loading, which reads the file,
does not import the loop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GenerationConfig"]


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


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside k3nn and torch (the user's call)."""
    import sys

    pkg = os.path.dirname(os.path.abspath(__file__))
    skip = (pkg + os.sep, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    level, f = 1, sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(skip):
        f = f.f_back
        level += 1
    return level


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
        """The names of the fields (what ``generate()`` accepts by name)."""
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

    def validate(self, user_set: set[str] | None = None) -> None:
        """Check a :meth:`resolved` config: a ValueError naming the field for a value out of range.

        As in transformers 5: ``max_new_tokens`` must be >= 1 (the Engine's ``SamplingParams`` agrees), and sampling
        fields set while ``do_sample`` is not True (``temperature`` != 1, ``top_k`` != 50, ``top_p`` != 1,
        ``typical_p`` != 1, ``min_p``) give one ``UserWarning`` naming them: greedy decoding ignores them.
        ``user_set``: the fields the caller passed; a sampling field is then not warned about when ``do_sample``
        was passed and the field was inherited (from a checkpoint's ``generation_config.json``). None: every set
        field counts as passed."""
        def nonneg_int(name, lo=0):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")

        nonneg_int("max_new_tokens", lo=1)
        for name in ("max_length", "min_new_tokens", "min_length", "top_k", "no_repeat_ngram_size"):
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
        ignored = self.ignored_sampling_flags(user_set)
        if ignored:
            warnings.warn(f"The following generation flags are not valid and may be ignored: {ignored}. `do_sample` "
                          f"is not set to `True`, and these flags are only used in sample-based generation modes: "
                          f"greedy decoding ignores them. Set `do_sample=True` or unset them.", UserWarning,
                          stacklevel=_caller_stacklevel())

    def ignored_sampling_flags(self, user_set: set[str] | None = None) -> list[str]:
        """The sampling fields set to a non-default value while ``do_sample`` is not True (transformers'
        ``GenerationConfig.validate`` rule; see :meth:`validate` for ``user_set``)."""
        if self.do_sample is True:
            return []

        def counts(name: str) -> bool:  # transformers' _should_warn("do_sample", name, user_set)
            if user_set is None:
                return True
            return name in user_set or "do_sample" not in user_set

        off = {"temperature": 1.0, "top_p": 1.0, "typical_p": 1.0, "top_k": 50}
        out = [n for n, v in off.items() if getattr(self, n) is not None and getattr(self, n) != v and counts(n)]
        if self.min_p is not None and counts("min_p"):
            out.append("min_p")
        return sorted(out)
    @property
    def eos_ids(self) -> list[int]:
        """``eos_token_id`` as a list of ints (empty when unset)."""
        e = self.eos_token_id
        if isinstance(e, torch.Tensor):
            e = e.tolist()
        return [] if e is None else ([int(e)] if isinstance(e, int) else [int(x) for x in e])

    # -- files --------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The set fields (what transformers' ``to_diff_dict`` writes)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def to_diff_dict(self) -> dict:
        """:meth:`to_dict` under transformers' name (pipelines read the model's generation config through it)."""
        return self.to_dict()

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write ``directory/generation_config.json`` (the set fields, :meth:`to_dict`)."""
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "GenerationConfig":
        """``generation_config.json`` (k3nn's or transformers'); fields k3nn does not implement are dropped with a
        warning naming them."""
        path = os.path.join(directory, "generation_config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f), source=str(path), strict=False)
