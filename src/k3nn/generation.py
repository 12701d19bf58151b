"""generate(): greedy / sampled decoding over the hybrid cache, HF-style arguments.

The loop: one prefill forward over the (left-padded) prompt, then one forward per token. Sampling uses the
exponential-race form of ``multinomial`` (argmax of p / Exp(1) noise) drawn from a seeded generator, so it
needs no host sync; on GPU the all-rows-finished check runs every ``sync_every`` steps only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GenerationConfig", "GenerationMixin", "sample_next", "process_logits", "loop_setup"]


@dataclass
class GenerationConfig:
    max_new_tokens: int | None = 64
    max_length: int | None = None  # prompt + new tokens; max_new_tokens wins when both are set
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    seed: int | None = None
    num_assistant_tokens: int = 7  # speculative window γ when a drafter is given

    def validate(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.num_assistant_tokens < 1:
            raise ValueError(f"num_assistant_tokens must be >= 1, got {self.num_assistant_tokens}")

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([int(e)] if isinstance(e, int) else [int(x) for x in e])

    def update(self, **kw: Any) -> "GenerationConfig":
        fields = {f.name for f in dataclasses.fields(self)}
        bad = sorted(set(kw) - fields)
        if bad:
            raise TypeError(f"unknown generation argument(s): {bad}")
        return dataclasses.replace(self, **kw)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=2)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "GenerationConfig":
        with open(os.path.join(directory, "generation_config.json")) as f:
            d = json.load(f)
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields})


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[B, V] logits → fp32 logits with temperature, top-k and top-p (nucleus) applied (-inf outside)."""
    x = logits.float() / temperature
    if top_k > 0 and top_k < x.shape[-1]:
        kth = x.topk(top_k, -1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = x.sort(-1, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        drop = (cum - srt.softmax(-1)) >= top_p  # keep the smallest prefix whose mass reaches top_p
        x = x.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return x


def sample_next(logits: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | None) -> torch.Tensor:
    """[B, V] → [B] next ids (greedy argmax, or a sample from the processed distribution)."""
    if not cfg.do_sample:
        return logits.argmax(-1)
    probs = process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p).softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(-1)


def _check_left_padded(mask: torch.Tensor) -> None:
    m = mask.long()
    if (m.diff(dim=1) < 0).any():
        raise ValueError("attention_mask: generate() needs left padding (zeros before the tokens of each row)")
    if (m.sum(1) == 0).any():
        raise ValueError("attention_mask: a row has no tokens (empty prompt)")


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
    return model._make_generator(cfg.seed), eos, pad


class GenerationMixin:
    sync_every = 16  # GPU: how often the loop checks whether every row has finished

    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = torch.Generator(device=self.device)
        g.manual_seed(int(seed))
        return g

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int | None = None, do_sample: bool | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | list[int] | None = None, attention_mask: torch.Tensor | None = None,
                 streamer=None, drafter=None, generation_config: GenerationConfig | None = None,
                 seed: int | None = None, cuda_graph: bool | str | None = None, decode_backend: str | None = None,
                 prefill_chunk_size: int | None = None, **kwargs: Any) -> torch.Tensor:
        """Prompt ids [B, T] (left-padded with ``attention_mask`` when rows differ) → [B, T + n] ids.

        Arguments override ``generation_config`` (HF precedence). Rows that hit an eos id keep emitting
        ``pad_token_id`` (eos if unset) until every row has finished or ``max_new_tokens`` is reached.
        ``streamer``: any object with ``put(tensor)`` / ``end()`` (HF's TextStreamer works); it first receives
        the prompt, then each new token column. ``drafter``: a DSpark drafter for speculative decoding.
        ``cuda_graph``: None (auto: the decode step is captured in a CUDA graph on GPU, falling back to eager
        if capture fails), True, ``"static"`` (the graph-safe step without capture) or False.
        ``decode_backend``: ``"auto"`` (standard layers) or ``"latency_specialized"`` (fused per-layer decode,
        see :mod:`k3nn.decode`); default: the model's ``decode_backend`` attribute, else ``"auto"``.
        ``prefill_chunk_size``: prompts longer than this prefill chunk by chunk (default: the model's
        ``prefill_chunk_size``); the tokens are the same, the activation memory is bounded by the chunk.
        """
        cfg = generation_config or getattr(self, "generation_config", None) or GenerationConfig()
        over = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                    top_p=top_p, eos_token_id=eos_token_id, seed=seed)
        over = {k: v for k, v in over.items() if v is not None}
        cfg = cfg.update(**over, **kwargs)
        cfg.validate()
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a [batch, seq_len] LongTensor")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty: generate() needs at least one prompt token")
        input_ids = input_ids.to(self.device)
        B, T = input_ids.shape
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask must match input_ids' shape {tuple(input_ids.shape)}, "
                                 f"got {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.to(self.device)
            _check_left_padded(attention_mask)
        n_new = cfg.max_new_tokens if cfg.max_new_tokens is not None else max(0, (cfg.max_length or T) - T)
        self._chunk_size(prefill_chunk_size)
        limit = self.config.max_position_embeddings
        if T > limit:
            raise ValueError(f"input_ids has {T} tokens, longer than the model's max_position_embeddings = {limit}")
        if T + n_new > limit:
            raise ValueError(f"prompt of {T} tokens + max_new_tokens {n_new} = {T + n_new} exceeds the model's "
                             f"max_position_embeddings = {limit}")
        if drafter is not None:
            from .spec import speculative_generate

            return speculative_generate(self, drafter, input_ids, attention_mask, cfg, n_new, streamer)
        setup = loop_setup(self, cfg, input_ids, streamer, n_new)
        if setup is None:
            return input_ids
        gen, eos, pad = setup
        from .decode.runner import make_decode_runner

        decode_backend = decode_backend or getattr(self, "decode_backend", None) or "auto"
        if decode_backend == "latency_specialized":
            from .cache.hybrid import HybridCache

            cache = HybridCache(self.config, B, T + n_new, self.dtype, self.device, mla_pool=True)
        else:
            cache = self.new_cache(B, T + n_new)
        logits = self(input_ids, cache=cache, attention_mask=attention_mask, logits_to_keep=1,
                      prefill_chunk_size=prefill_chunk_size).logits[:, -1]
        step = make_decode_runner(self, cache, cuda_graph=cuda_graph, decode_backend=decode_backend,
                                  attention_mask=attention_mask)
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        out = torch.full((B, n_new), pad, dtype=torch.long, device=self.device)
        sync_every = 1 if self.device.type == "cpu" else self.sync_every
        steps = n_new
        for i in range(n_new):
            nxt = sample_next(logits, cfg, gen)
            nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
            out[:, i] = nxt
            if streamer is not None:
                streamer.put(nxt.cpu())
            if eos.numel():
                finished |= torch.isin(nxt, eos)
                if (i + 1) % sync_every == 0 and bool(finished.all()):
                    steps = i + 1
                    break
            if i + 1 < n_new:
                logits = step(nxt[:, None])
        #: which decode path ran (for tests and benchmarks)
        self.last_decode_info = dict(path=step.name, mode=step.mode, graph=step.uses_graph,
                                     fallback=step.fallback_reason)
        step.close()
        if eos.numel() and sync_every > 1:
            # trim the columns after the step at which every row had finished (same length as a per-step check)
            done = torch.isin(out[:, :steps], eos).long().cumsum(1) > 0
            all_done = done.all(0)
            if bool(all_done.any()):
                steps = int(all_done.long().argmax()) + 1
        if streamer is not None:
            streamer.end()
        return torch.cat([input_ids, out[:, :steps]], dim=1)
