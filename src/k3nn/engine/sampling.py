"""Per-request stopping and text of the Engine, and the per-request form of its sampling: one
:class:`RequestSampler` per request applies its :class:`~k3nn.engine.SamplingParams` with the logits pipeline
``generate()`` uses (:mod:`k3nn.logits`).

The Engine draws its tokens on the device for a whole batch at once (:class:`k3nn.runtime.sampling.SamplingTable`,
the same processors per row); it uses a request's sampler for :meth:`RequestSampler.check_stop` and
:attr:`RequestSampler.text`. ``choose`` / ``window_scores`` are the one-request form of the same math (host code,
one sync per call), for callers that sample a request on their own.

Interface (build the sampler when the request is added, so bad parameters fail ``add_request``)::

    s = RequestSampler(params, prompt, vocab_size=V, eos_ids=eos, device=dev, generator=g, tokenizer=tok)
    # plain decode: logits [V] or [1, V] of the request's next position
    tok, lp = s.choose(logits, req.output)            # int, TokenLogprobs | None; one host sync
    req.output.append(tok)
    finished, reason, trim = s.check_stop(req.output)  # reason: "stop" | "length" | None
    if trim:
        del req.output[-trim:]                         # tokens after the one that ended the request
    RequestOutput(..., stop_reason=s.stop_reason, logprobs=[lp] if lp else None, text=s.text)

    # speculative verify: logits [T, V], row j scoring the token after req.output + drafts[:j]
    scores = s.window_scores(logits, req.output, drafts)   # processed scores [T, V] fp32; drafts: ints or a
                                                           # device tensor; no host sync
    # greedy: accept while scores[j].argmax() == drafts[j]; sampling: rejection sampling with p = softmax(scores)
    lps = s.logprobs_of(logits[:k + 1], accepted)          # when params.logprobs is set (one host sync)
    req.output += accepted; finished, reason, trim = s.check_stop(req.output)

    s.plain_greedy   # True: the token is argmax(raw logits) and no logprobs are wanted, so a batched argmax
                     # may replace choose() (check_stop must still run)

``output_so_far`` is the request's output list; the sampler keeps the token statistics of the penalties (a [V]
fp32 count tensor of the output and a [V] bool mask of prompt + output, on ``device``) up to date from the tokens
appended since its last call, so a step costs O(new tokens), not O(history). Only appends are tracked cheaply: an
output that shrank, or whose token at the last seen position changed, is recounted from scratch.

``choose`` runs the pipeline of :meth:`k3nn.logits.LogitsPipeline.for_request` (penalties → ``min_tokens`` block
→ temperature / top-k / top-p when sampling), then takes the argmax (greedy) or a sample with the request's
``generator`` (the exponential race of :func:`k3nn.logits.sample_from_scores`; ``generator=None``: torch's
default). Its one host sync reads the token (and, with ``logprobs``, its log-probabilities in the same copy).

Stopping (:meth:`RequestSampler.check_stop`) looks at the tokens appended since its last call, in order; the
first of these ends the request:

* eos (unless ``ignore_eos``) or a ``stop_token_ids`` token, once ``min_tokens`` tokens precede it → "stop"
  (``stop_reason``: None for eos, the id for a stop token id). The token stays in the ids; the text leaves it
  out unless ``include_stop_str_in_output``;
* the text (incremental detokenisation with ``tokenizer.decode``) gains one of the ``stop`` strings, once
  ``min_tokens`` tokens precede the token that completed it → "stop" (``stop_reason``: the string). The ids keep
  the token that completed the string; the text ends before the string (after it with
  ``include_stop_str_in_output``). When several stop strings appear, the one that starts first wins;
* ``max_new_tokens`` tokens → "length".

``trim`` is the number of tokens after the one that ended the request (several tokens appended at once, as in
speculative decoding, can overshoot): the Engine drops them. Finishing is final: later calls return the same
reason with ``trim`` against the ended length.

Detokenisation decodes a sliding window (vLLM's prefix/read offsets, starting from the last prompt tokens as
context) and holds back text that ends in U+FFFD (an incomplete UTF-8 sequence) until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..logits import LogitsPipeline, TokenCounts
from .request import SamplingParams, TokenLogprobs

__all__ = ["RequestSampler", "IncrementalDetokenizer"]

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, so its first token's text is right (leading spaces)


def _ids_on(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """A [n] long tensor of ``ids`` on ``device``; to a GPU through pinned memory, asynchronously (a pageable
    host-to-device copy would wait for the stream)."""
    t = torch.tensor([int(i) for i in ids], dtype=torch.long, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)


class IncrementalDetokenizer:
    """Text of a token stream with ``tokenizer.decode(ids) -> str`` only, one token at a time.

    Each :meth:`push` decodes ``ids[prefix:]`` and ``ids[prefix:read]`` (a few tokens) and appends the difference
    when it grew and does not end in U+FFFD; ``prefix, read`` then move to ``read, len(ids)``. ``context``: tokens
    before the stream (the prompt's last few), decoded for their effect on the first tokens only (a character the
    context began and the stream completes is the stream's)."""

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids = [int(t) for t in context]
        self.prefix, self.read = 0, len(self.ids)
        self.text = ""

    def _before(self) -> str:
        # a context that ends inside a character decodes to U+FFFD there: the character is the output's
        return self.tokenizer.decode(self.ids[self.prefix:self.read]).rstrip("\ufffd") if self.read > self.prefix \
            else ""

    def push(self, token: int) -> int:
        """Add one token; returns the number of characters appended to :attr:`text`."""
        self.ids.append(int(token))
        before = self._before()
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += delta
            return len(delta)
        return 0

    def flush(self) -> int:
        """Append the held-back text (the stream ended)."""
        if self.read == len(self.ids):
            return 0
        before = self._before()
        delta = self.tokenizer.decode(self.ids[self.prefix:])[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return len(delta)


class RequestSampler:
    """Sampling and stopping of one request (see the module docstring for the Engine's calls).

    ``params``: the request's :class:`SamplingParams` (validated here, with ``tokenizer``); ``prompt``: its token
    ids; ``vocab_size``: V of the logits; ``eos_ids``: the resolved eos ids; ``device``: where the logits live;
    ``generator``: the request's torch.Generator on ``device`` (sampling requests); ``tokenizer``: an object with
    ``decode(ids) -> str``, needed for ``stop`` strings and for :attr:`text`."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], *, vocab_size: int,
                 eos_ids: Sequence[int] = (), device: torch.device | str | None = None,
                 generator: torch.Generator | None = None, tokenizer: Any = None):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate(tokenizer)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        V = vocab_size
        bad = [t for t in (params.stop_token_ids or ()) if t >= V]
        if bad:
            raise ValueError(f"stop_token_ids has ids outside [0, vocab_size={V}): {bad}")
        if params.logprobs is not None and params.logprobs > V:
            raise ValueError(f"logprobs must be <= vocab_size={V}, got {params.logprobs}")
        self.params, self.vocab_size = params, V
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.generator = generator
        self.prompt_length = len(prompt)
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.stop_ids = frozenset(int(t) for t in (params.stop_token_ids or ()))
        self.pipeline = LogitsPipeline.for_request(params, prompt_length=self.prompt_length, vocab_size=V,
                                                   eos_ids=sorted(self.eos_ids), device=self.device)
        self._counting = self.pipeline.reads_counts
        self._prompt_seen: torch.Tensor | None = None
        if self._counting:
            seen = torch.zeros(V, dtype=torch.bool, device=self.device)
            if self.prompt_length:
                seen.index_fill_(0, _ids_on(prompt, self.device).clamp_(0, V - 1), True)
            self._prompt_seen = seen
        self._counts: torch.Tensor | None = None
        self._seen: torch.Tensor | None = None
        self._n = 0  # output tokens in the statistics
        self._last = -1  # the last of them
        self._reset_counts()
        # stopping
        self._stops = params.stop_strings
        self._hold = max((len(x) for x in self._stops), default=1) - 1 \
            if not params.include_stop_str_in_output else 0
        self._detok = None if tokenizer is None else IncrementalDetokenizer(tokenizer, list(prompt[-_CONTEXT_TOKENS:]))
        self._checked = 0  # output tokens check_stop has looked at
        self._end: int | None = None  # output length at the end
        self._text_end: int | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    # -- properties -----------------------------------------------------------------------------------------------
    @property
    def plain_greedy(self) -> bool:
        """The next token is always argmax(raw logits) and no log-probabilities are wanted."""
        return not self.params.do_sample and not self.pipeline.processors and self.params.logprobs is None

    @property
    def finished(self) -> bool:
        """A stop condition was met (eos, a stop id or string, the length limit)."""
        return self._end is not None

    @property
    def text(self) -> str | None:
        """The output text so far (None without a tokenizer): the stop string left out unless
        ``include_stop_str_in_output``; while running, without the last ``max(len(stop)) − 1`` characters."""
        if self._detok is None:
            return None
        t = self._detok.text
        if self._text_end is not None:
            return t[:self._text_end]
        if self._end is None and self._hold:
            return t[:max(0, len(t) - self._hold)]
        return t

    # -- token statistics ---------------------------------------------------------------------------------------
    def _reset_counts(self) -> None:
        if self._counting:
            self._counts = torch.zeros(self.vocab_size, dtype=torch.float, device=self.device)
            self._seen = self._prompt_seen.clone()
        self._n, self._last = 0, -1

    def _sync(self, output: Sequence[int]) -> None:
        """Bring the statistics to ``output`` (O(new tokens) for an append)."""
        n = self._n
        if len(output) < n or (n and int(output[n - 1]) != self._last):
            self._reset_counts()
            n = 0
        if len(output) == n:
            return
        new = [int(t) for t in output[n:]]
        if self._counting:
            bad = [t for t in new if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"output has token ids outside [0, vocab_size={self.vocab_size}): {bad[:8]}")
            # explicit in-place ops: item assignment from a Python scalar copies it from the host on a GPU
            if len(new) == 1:
                self._counts.narrow(0, new[0], 1).add_(1)
                self._seen.narrow(0, new[0], 1).fill_(True)
            else:
                idx = _ids_on(new, self.device)
                self._counts.index_add_(0, idx, torch.ones(len(new), device=self.device))
                self._seen.index_fill_(0, idx, True)
        self._n, self._last = len(output), new[-1]

    def _row(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 2 and logits.shape[0] == 1:
            logits = logits[0]
        if logits.dim() != 1 or logits.shape[0] != self.vocab_size:
            raise ValueError(f"logits must be [V] or [1, V] with V={self.vocab_size}, got {tuple(logits.shape)}")
        self._check_device(logits)
        return logits.float()[None]

    def _check_device(self, logits: torch.Tensor) -> None:
        if self._counting and logits.device != self._counts.device:
            raise ValueError(f"logits are on {logits.device}, the sampler's device is {self._counts.device}")

    # -- choosing -----------------------------------------------------------------------------------------------
    def scores(self, logits: torch.Tensor, output_so_far: Sequence[int]) -> torch.Tensor:
        """[1, V] fp32 processed scores of the next token after ``output_so_far`` (no host sync)."""
        x = self._row(logits)
        if not self.pipeline.processors:
            return x
        self._sync(output_so_far)
        counts = TokenCounts(self._counts, self._seen, self.prompt_length + len(output_so_far))
        return self.pipeline.apply_counts(x, counts)

    def choose(self, logits: torch.Tensor, output_so_far: Sequence[int]) -> tuple[int, TokenLogprobs | None]:
        """The next token after ``output_so_far`` from ``logits`` [V] or [1, V] (the raw model logits), and its
        :class:`TokenLogprobs` when ``params.logprobs`` is set (else None). One host sync."""
        x = self._row(logits)
        tok = self.pipeline.choose(self.scores(x, output_so_far), self.generator)  # [1]
        if self.params.logprobs is None:
            return int(tok.item()), None
        lp = self._logprobs(x, tok)[0]
        return lp.token_id, lp

    def window_scores(self, logits: torch.Tensor, output_so_far: Sequence[int],
                      drafts: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Processed scores [T, V] fp32 of a speculative verify window: ``logits`` [T, V] raw, row j scoring the
        token after ``output_so_far + drafts[:j]`` (T ≤ len(drafts) + 1). The penalties count ``drafts[:j]`` as
        output in row j, ``min_tokens`` sees its length; ``drafts``: ints or a [D] long tensor (on the device:
        no host sync)."""
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [T, V] with V={self.vocab_size}, got {tuple(logits.shape)}")
        self._check_device(logits)
        T = logits.shape[0]
        d = drafts if isinstance(drafts, torch.Tensor) else _ids_on(drafts, logits.device)
        if d.dim() != 1 or T > d.shape[0] + 1:
            raise ValueError(f"drafts must be 1-D with at least T - 1 = {T - 1} tokens, got shape {tuple(d.shape)}")
        x = logits.float()
        if not self.pipeline.processors:
            return x
        self._sync(output_so_far)
        dev = x.device
        length = self.prompt_length + len(output_so_far) + torch.arange(T, device=dev)
        counts = seen = None
        if self._counting:
            inc = torch.zeros(T, self.vocab_size, dtype=torch.float, device=dev)
            if T > 1:
                inc[1:].scatter_(1, d[:T - 1, None].to(dev), 1.0)
            inc = inc.cumsum(0)  # row j: the counts of drafts[:j]
            counts, seen = self._counts + inc, self._seen | (inc > 0)
        return self.pipeline.apply_counts(x, TokenCounts(counts, seen, length))

    def logprobs_of(self, logits: torch.Tensor, token_ids: Sequence[int] | torch.Tensor) -> list[TokenLogprobs]:
        """:class:`TokenLogprobs` of ``token_ids`` [T] at the rows of ``logits`` [T, V] (raw), e.g. the accepted
        tokens of a verify window. Needs ``params.logprobs`` set; one host sync."""
        if self.params.logprobs is None:
            raise ValueError("logprobs_of needs SamplingParams.logprobs set")
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [T, V] with V={self.vocab_size}, got {tuple(logits.shape)}")
        ids = (token_ids.to(logits.device) if isinstance(token_ids, torch.Tensor)
               else _ids_on(token_ids, logits.device)).reshape(-1)
        if ids.shape[0] != logits.shape[0]:
            raise ValueError(f"token_ids must have one id per row of logits ({logits.shape[0]}), got {ids.shape[0]}")
        return self._logprobs(logits.float(), ids)

    def _logprobs(self, x: torch.Tensor, ids: torch.Tensor) -> list[TokenLogprobs]:
        """x [T, V] fp32 raw logits, ids [T] → TokenLogprobs per row, copied to the host in one tensor (fp64 holds
        the ids exactly)."""
        k = self.params.logprobs
        logp = torch.log_softmax(x, dim=-1)
        chosen = logp.gather(-1, ids[:, None])  # [T, 1]
        rank = (logp > chosen).sum(-1, keepdim=True) + 1
        top_v, top_i = torch.topk(logp, k, dim=-1, sorted=True)
        packed = torch.cat([ids[:, None].double(), chosen.double(), rank.double(), top_v.double(),
                            top_i.double()], dim=-1).tolist()
        out = []
        for row in packed:
            vals, idx = row[3:3 + k], row[3 + k:]
            out.append(TokenLogprobs(int(row[0]), row[1], int(row[2]), {int(i): v for i, v in zip(idx, vals)}))
        return out

    # -- stopping -----------------------------------------------------------------------------------------------
    def check_stop(self, output_token_ids: Sequence[int]) -> tuple[bool, str | None, int]:
        """(finished, finish_reason, trim) after the tokens appended to ``output_token_ids`` since the last call
        (see the module docstring): ``finish_reason`` "stop" / "length" / None, ``trim`` the tokens after the
        one that ended the request (to drop). Sets :attr:`stop_reason` and advances :attr:`text`."""
        out = output_token_ids
        if self._end is not None:
            return True, self.finish_reason, max(0, len(out) - self._end)
        if len(out) < self._checked:
            raise ValueError(f"output_token_ids shrank below the {self._checked} tokens already checked")
        p = self.params
        for i in range(self._checked, len(out)):
            t, n = int(out[i]), i + 1  # n: tokens generated with this one
            may_stop = n > p.min_tokens
            reason = stop_reason = None
            if may_stop and ((t in self.eos_ids and not p.ignore_eos) or t in self.stop_ids):
                reason = "stop"
                stop_reason = t if t in self.stop_ids and not (t in self.eos_ids and not p.ignore_eos) else None
                if self._detok is not None and p.include_stop_str_in_output:
                    self._detok.push(t)
            else:
                if self._detok is not None:
                    grew = self._detok.push(t)
                    if grew and self._stops and may_stop:
                        hit = self._find_stop(grew)
                        if hit is not None:
                            reason, stop_reason = "stop", hit
                if reason is None and n >= p.max_new_tokens:
                    reason = "length"
            if reason is not None:
                self._checked = self._end = n
                self.finish_reason, self.stop_reason = reason, stop_reason
                if self._detok is not None and self._text_end is None:
                    self._detok.flush()  # text held back for an incomplete UTF-8 sequence
                return True, reason, len(out) - n
        self._checked = len(out)
        return False, None, 0

    def _find_stop(self, grew: int) -> str | None:
        """The stop string that the last ``grew`` characters of the text completed (the earliest starting one);
        sets where the output text ends."""
        text = self._detok.text
        best = None
        for s in self._stops:
            j = text.find(s, max(0, len(text) - grew - len(s) + 1))
            if j >= 0 and (best is None or j < best[0]):
                best = (j, s)
        if best is None:
            return None
        j, s = best
        self._text_end = j + len(s) if self.params.include_stop_str_in_output else j
        return s
