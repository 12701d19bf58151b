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
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .generation_config import GenerationConfig  # re-exported: checkpoint loading reads it too
from .logits import LogitsPipeline, process_logits, sample_next  # re-exported: the drafter samples too

log = logging.getLogger(__name__)

__all__ = ["GenerationConfig", "GenerationMixin", "GenerateDecoderOnlyOutput", "StopStringCriteria",
           "sample_next", "process_logits", "loop_setup", "DEFAULT_MAX_NEW_TOKENS"]

#: new tokens when neither ``max_new_tokens`` nor ``max_length`` is given (transformers: max_length = 20)
DEFAULT_MAX_NEW_TOKENS = 64

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
        """The names of the fields that are set (a ``ModelOutput``'s keys in transformers)."""
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
    """``generate()`` for a causal LM with k3nn's cache (:class:`~k3nn.model.KimiK3` inherits it): greedy and sampled
    decoding, speculative decoding with a drafter, with transformers' ``GenerationMixin`` argument names and
    precedence (see the module docstring). The model provides ``config``, ``device``, ``new_cache`` and a forward that
    takes ``cache=``; ``generation_config`` (optional) holds its defaults.

    Example::

        out = model.generate(input_ids, max_new_tokens=32)                                # greedy, [B, T + 32]
        out = model.generate(input_ids, do_sample=True, temperature=0.7, top_p=0.9, seed=0)
        out = model.generate(input_ids, drafter=drafter, num_assistant_tokens=5)           # speculative
    """

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
