"""Batched sampling on the device: per-row parameter tensors, one set of launches for the whole batch.

:class:`SamplingTable` keeps, for every cache row (a running request) and one spare padding row, the parameters of
:class:`k3nn.engine.SamplingParams` as device tensors, and the token statistics the penalties read (output counts
and a prompt + output mask, allocated when a request first asks for a penalty). A step then processes and samples
``[B, T, V]`` logits of B rows in one pass, with no host sync, so it can run inside a captured CUDA graph:

1. penalties (vLLM's order): repetition (prompt + output; s / θ if s > 0 else s · θ), frequency and presence
   (output counts); ``min_tokens``: −inf for the stop ids (eos unless ``ignore_eos``, and ``stop_token_ids``)
   while fewer tokens were generated;
2. greedy rows: argmax of those scores;
3. sampling rows: temperature, top-k, top-p (transformers' ``TopPLogitsWarper``: a token is dropped when the
   mass of the tokens above it reaches ``top_p``), min-p, then a draw from :class:`~k3nn.runtime.rng.RowRNG` with
   the request's seed and the output position as counter (so the same seed gives the same tokens whatever the
   batch, preemptions included).

Window positions (speculative verify rows, T > 1) score the token after ``output + drafts[:j]``: the penalties
count ``drafts[:j]`` as output and ``min_tokens`` sees the window position.

The math is :mod:`k3nn.logits`' (the same processors ``generate()`` applies), per row instead of per call; the
variant flags (``penalties``, ``min_tokens``, ``sampling``, ``sort``) are host-known properties of the batch that
choose which of these stages run (a captured graph is keyed by them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .rng import ACCEPT, RESIDUAL, TOKEN, GeneratorRNG, RowRNG

__all__ = ["SamplingTable", "SamplingVariant", "apply_penalties", "greedy_accept", "rejection_accept",
           "token_logprobs"]


@dataclass(frozen=True)
class SamplingVariant:
    """Which stages a batch needs (host-known; part of a captured step's key)."""

    penalties: bool = False  # repetition / frequency / presence penalty on some row
    min_tokens: bool = False  # some row blocks its stop ids
    sampling: bool = False  # some row samples
    sort: bool = False  # some sampling row uses top-k, top-p or min-p


class SamplingTable:
    """Per-row sampling parameters on ``device`` for ``num_rows`` rows (+ one padding row, index ``num_rows``).

    ``set_row(row, params, prompt, eos_ids, seed)`` when a request takes a row; ``release(row)`` when it leaves
    (the row becomes neutral greedy). ``record(rows, ids)`` after each step adds the sampled tokens to the
    penalty statistics (graph-safe)."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device | str):
        self.num_rows, self.vocab_size, self.device = num_rows, vocab_size, torch.device(device)
        R = num_rows + 1
        f32 = dict(dtype=torch.float32, device=self.device)
        i64 = dict(dtype=torch.long, device=self.device)
        self.temperature = torch.ones(R, **f32)
        self.top_k = torch.zeros(R, **i64)
        self.top_p = torch.ones(R, **f32)
        self.min_p = torch.zeros(R, **f32)
        self.repetition = torch.ones(R, **f32)
        self.frequency = torch.zeros(R, **f32)
        self.presence = torch.zeros(R, **f32)
        self.do_sample = torch.zeros(R, dtype=torch.bool, device=self.device)
        self.seed = torch.zeros(R, **i64)
        self.min_tokens = torch.zeros(R, **i64)
        self.prompt_len = torch.zeros(R, **i64)
        # statistics and stop masks: [R, V], allocated on first use
        self.counts: torch.Tensor | None = None  # output token counts (fp32)
        self.prompt_seen: torch.Tensor | None = None  # the prompt's tokens (seen = prompt_seen | counts > 0)
        self.stop_mask: torch.Tensor | None = None  # ids blocked before min_tokens
        self._host: list[dict | None] = [None] * R  # what each row asked for (variant flags)

    @property
    def pad_row(self) -> int:
        return self.num_rows

    # -- rows -------------------------------------------------------------------------------------------------
    def set_row(self, row: int, params, prompt, eos_ids=(), seed: int = 0, output=()) -> None:
        """Load a request's parameters into ``row`` (a few small host-to-device copies; once per admission).
        ``output``: tokens the request generated already (a resumed request: they count for the penalties)."""
        p = params
        sample = bool(p.do_sample)
        vals = torch.tensor([p.temperature if sample else 1.0, p.top_p if sample else 1.0,
                             getattr(p, "min_p", 0.0) if sample else 0.0, p.repetition_penalty,
                             p.frequency_penalty, p.presence_penalty], dtype=torch.float32)
        ints = torch.tensor([p.top_k if sample else 0, seed & (2 ** 63 - 1), p.min_tokens, int(sample),
                             len(prompt)], dtype=torch.long)
        vals, ints = vals.to(self.device, non_blocking=True), ints.to(self.device, non_blocking=True)
        for t, v in zip((self.temperature, self.top_p, self.min_p, self.repetition, self.frequency,
                         self.presence), vals):
            t[row] = v
        self.top_k[row], self.seed[row], self.min_tokens[row] = ints[0], ints[1], ints[2]
        self.do_sample[row] = ints[3].bool()
        self.prompt_len[row] = ints[4]
        pen = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        stops = sorted({int(t) for t in (p.stop_token_ids or ())} |
                       (set() if p.ignore_eos else {int(e) for e in eos_ids}))
        mint = p.min_tokens > 0 and bool(stops)
        if pen:
            self._ensure_stats()
            self.counts[row].zero_()
            self.prompt_seen[row].zero_()
            if len(prompt):
                ids = torch.as_tensor(list(prompt), dtype=torch.long).clamp_(0, self.vocab_size - 1)
                self.prompt_seen[row].index_fill_(0, ids.to(self.device, non_blocking=True), True)
            if len(output):
                ids = torch.as_tensor(list(output), dtype=torch.long).clamp_(0, self.vocab_size - 1)
                self.counts[row].index_add_(0, ids.to(self.device), torch.ones(len(ids), device=self.device))
        if mint:
            if self.stop_mask is None:
                self.stop_mask = torch.zeros(self.num_rows + 1, self.vocab_size, dtype=torch.bool,
                                             device=self.device)
            self.stop_mask[row].zero_()
            self.stop_mask[row, torch.tensor(stops, device=self.device)] = True
        self._host[row] = dict(penalties=pen, min_tokens=mint, sampling=sample,
                               sort=sample and (p.top_k > 0 or p.top_p < 1.0 or getattr(p, "min_p", 0.0) > 0))

    def release(self, row: int) -> None:
        self._host[row] = None

    def _ensure_stats(self) -> None:
        if self.counts is None:
            R, V = self.num_rows + 1, self.vocab_size
            self.counts = torch.zeros(R, V, dtype=torch.float32, device=self.device)
            self.prompt_seen = torch.zeros(R, V, dtype=torch.bool, device=self.device)

    def variant(self, rows) -> SamplingVariant:
        """The stages the requests in ``rows`` (host ints) need."""
        flags = [self._host[r] for r in rows if self._host[r] is not None]
        return SamplingVariant(*(any(f[k] for f in flags) for k in ("penalties", "min_tokens", "sampling", "sort")))

    def record(self, rows: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add sampled ``ids`` [B, T] of ``rows`` [B] (padding rows: :attr:`pad_row`) to the penalty statistics;
        ``valid`` [B, T] bool masks the entries that are not new tokens. Graph-safe (no host sync)."""
        if self.counts is None:
            return
        ids = ids.reshape(rows.shape[0], -1)
        w = torch.ones_like(ids, dtype=torch.float32) if valid is None else valid.float()
        r = rows[:, None].expand_as(ids)
        self.counts.index_put_((r, ids), w, accumulate=True)

    # -- processing ------------------------------------------------------------------------------------------
    def scores(self, logits: torch.Tensor, rows: torch.Tensor, out_len: torch.Tensor, variant: SamplingVariant,
               drafts: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, T, V] (row b position j scores the token after ``output + drafts[b, :j]``) → fp32 scores
        after the penalties and the min_tokens block (before the sampling warpers). ``out_len`` [B]: tokens
        generated before position 0."""
        x = logits.float()
        B, T, V = x.shape
        if variant.penalties and self.counts is not None:
            counts = self.counts[rows]  # [B, V]
            seen = self.prompt_seen[rows] | (counts > 0)
            if T > 1 and drafts is not None:
                inc = torch.zeros(B, T, V, dtype=torch.float32, device=x.device)
                inc[:, 1:].scatter_(2, drafts[:, :T - 1, None], 1.0)
                inc = inc.cumsum(1)
                x = apply_penalties(x, counts[:, None] + inc, seen[:, None] | (inc > 0), self.repetition[rows],
                                    self.frequency[rows], self.presence[rows])
            else:
                x = apply_penalties(x, counts[:, None], seen[:, None], self.repetition[rows],
                                    self.frequency[rows], self.presence[rows])
        if variant.min_tokens and self.stop_mask is not None:
            n = out_len[:, None] + torch.arange(T, device=x.device)[None, :]  # tokens generated before each position
            block = (n < self.min_tokens[rows][:, None])[..., None] & self.stop_mask[rows][:, None]
            x = x.masked_fill(block, -math.inf)
        return x

    def warp(self, scores: torch.Tensor, rows: torch.Tensor, variant: SamplingVariant) -> torch.Tensor:
        """Sampling warpers per row (temperature, top-k, top-p, min-p) on scores [B, T, V]; rows that do not
        sample come back unchanged where it matters (their choice is the argmax of the unwarped scores)."""
        if not variant.sampling:
            return scores
        t = self.temperature[rows].clamp_min(1e-6)[:, None, None]
        x = scores / t
        if variant.sort:
            x = _top_k_p_min_p(x, self.top_k[rows], self.top_p[rows], self.min_p[rows])
        return x

    def choose(self, logits: torch.Tensor, rows: torch.Tensor, out_len: torch.Tensor, variant: SamplingVariant,
               drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, T, V] → (ids [B, T], processed scores [B, T, V] before the warpers): the greedy argmax, or
        for sampling rows a draw at counter ``out_len + j``."""
        s = self.scores(logits, rows, out_len, variant, drafts)
        ids = s.argmax(-1)
        if variant.sampling:
            w = self.warp(s, rows, variant)
            B, T, V = w.shape
            rng = RowRNG(self.seed[rows], out_len)
            drawn = torch.stack([rng.gumbel_argmax(w[:, j], TOKEN, j) for j in range(T)], 1)
            ids = torch.where(self.do_sample[rows][:, None], drawn, ids)
        return ids, s


def apply_penalties(x: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, rep: torch.Tensor,
                    freq: torch.Tensor, pres: torch.Tensor) -> torch.Tensor:
    """x [B, T, V] fp32; counts / seen broadcastable to it; rep / freq / pres [B]. Repetition penalty over ``seen``,
    then frequency and presence over ``counts`` (:class:`k3nn.logits.RepetitionPenalty`, ``FrequencyPenalty``,
    ``PresencePenalty``)."""
    r = rep[:, None, None]
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    return x - freq[:, None, None] * counts - pres[:, None, None] * (counts > 0).float()


def _top_k_p_min_p(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Per-row top-k (0: off), top-p (1: off) and min-p (0: off) on x [B, T, V], one sort: transformers' warpers
    (ties at the k-th value are kept, as ``TopKLogitsWarper`` keeps them; top-p keeps at least one token)."""
    B, T, V = x.shape
    srt, idx = torch.sort(x, dim=-1, descending=True)
    kk = torch.where(k > 0, k.clamp(max=V), torch.full_like(k, V))[:, None, None]  # [B, 1, 1]
    kth = srt.gather(-1, (kk - 1).expand(B, T, 1))
    x = x.masked_fill(x < kth, -math.inf)
    srt = srt.masked_fill(srt < kth, -math.inf)
    probs = srt.softmax(-1)
    above = probs.cumsum(-1) - probs  # mass strictly before each sorted token
    drop = (above >= p[:, None, None]) | (probs < min_p[:, None, None] * probs[..., :1])
    drop[..., 0] = False
    return x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), -math.inf)


def greedy_accept(target: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """target [B, n+1] (the target's choice at each window position), drafts [B, n], limit [B] → accepted
    drafts m [B]: the leading run of drafts equal to the target's choice, at most ``limit``."""
    n = drafts.shape[1]
    ok = (drafts == target[:, :n]) & (torch.arange(n, device=drafts.device)[None, :] < limit[:, None])
    return ok.long().cumprod(1).sum(1)


def rejection_accept(scores: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                     limit: torch.Tensor, rng: RowRNG | GeneratorRNG) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling over warped scores [B, n+1, V] (log-weights): accept draft k with probability
    min(1, p_k(d_k) / q_k(d_k)); at the first rejection draw from norm(max(0, p − q)), after n accepted drafts
    from the bonus row. ``draft_probs`` [B, n, V] (None: greedy drafts, q one-hot). Draws from ``rng`` (streams
    ACCEPT and RESIDUAL, counter offset = the window position) or a :class:`~k3nn.runtime.rng.GeneratorRNG`
    (``generate()``'s generator: the same draws as before this routine was shared). Returns (m [B], next token
    [B]). The one acceptance routine of ``generate(drafter=)`` and the Engine."""
    B, n = drafts.shape
    p = scores.float().softmax(-1)
    V = p.shape[-1]
    if n == 0:
        return torch.zeros(B, dtype=torch.long, device=p.device), rng.gumbel_argmax(scores[:, 0].float(), RESIDUAL)
    q = (torch.zeros(B, n, V, device=p.device).scatter_(-1, drafts[..., None], 1.0) if draft_probs is None
         else draft_probs.float())
    pd = p[:, :n].gather(-1, drafts[..., None])[..., 0]
    qd = q.gather(-1, drafts[..., None])[..., 0].clamp_min(1e-20)
    u = rng.uniform(ACCEPT, n, rows=B, device=p.device)
    ok = (u * qd < pd) & (torch.arange(n, device=p.device)[None, :] < limit[:, None])
    m = ok.long().cumprod(1).sum(1)
    pm = p.gather(1, m[:, None, None].expand(B, 1, V))[:, 0]
    qm = q.gather(1, m.clamp(max=n - 1)[:, None, None].expand(B, 1, V))[:, 0]
    resid = (pm - qm).clamp_min(0)
    mass = resid.sum(-1, keepdim=True)
    use_resid = (m < limit)[:, None] & (mass > 1e-12)
    dist = torch.where(use_resid, resid / mass.clamp_min(1e-30), pm)
    return m, rng.gumbel_argmax(torch.log(dist), RESIDUAL, m)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Raw-distribution log-probabilities: logits [N, V], ids [N], k ≥ 0 → [N, 3 + 2k] fp64 rows
    (id, logprob, rank, top-k logprobs, top-k ids) for one host copy."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, ids[:, None])
    rank = (logp > chosen).sum(-1, keepdim=True) + 1
    top_v, top_i = torch.topk(logp, k, dim=-1, sorted=True)
    return torch.cat([ids[:, None].double(), chosen.double(), rank.double(), top_v.double(), top_i.double()], -1)
