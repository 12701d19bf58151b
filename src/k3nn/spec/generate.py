"""speculative_generate(): draft γ tokens, verify them in one target forward, commit the accepted prefix.

One round, per row b (all rows share one window of T = 1 + max_b n_b tokens)::

    pending token x0 (emitted, not yet in the cache) ─ drafter ─▶ d_1 … d_γ   (+ draft probs q, confidence c)
    n_b   = min(γ, tokens still allowed − 1, leading run of c ≥ threshold)          (verify length)
    logits = target([x0, d_1 … d_{T−1}], cache)                                      (one forward)
    m_b, next_b = greedy / rejection / synthetic acceptance over the first n_b drafts
    emit d_1 … d_{m_b}, next_b (cut at eos and at max_new_tokens)
    commit a_b = m_b + 1 window tokens in every layer (KDA rollback, MLA mask + rewind)
    drafter context += target hidden states of the committed window rows

The output has ``generate()``'s format: prompt + new columns, rows that finished padded with ``pad_token_id``
(eos when unset), as many columns as plain decoding would produce. With greedy decoding the tokens equal plain
greedy decoding (up to floating-point differences between a T-token and a 1-token forward); with sampling the
output has the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..generation import loop_setup, sample_next
from .rollback import WindowRollback
from .verify import greedy_accept, rejection_accept, synthetic_accept

__all__ = ["SpecOptions", "SpecStats", "speculative_generate"]


@dataclass
class SpecOptions:
    """Knobs of the speculative loop (``drafter.spec_options``, or the ``options`` argument).

    rollback: ``"replay"`` (ReplaySSM, default) or ``"slots"`` (per-position KDA state slots).
    confidence_threshold: verify only the leading drafts whose confidence is ≥ this (0 = verify all γ); the
        cut depends on drafter outputs only, so it stays lossless.
    synthetic_acceptance_length: benchmark mode — every round accepts exactly L − 1 drafts (L counts the bonus
        token) whatever they are; the output is then NOT the target's.
    """

    rollback: str = "replay"
    confidence_threshold: float = 0.0
    synthetic_acceptance_length: int | None = None


@dataclass
class SpecStats:
    """Acceptance statistics of one call. ``acceptance_length`` = tokens emitted per row-round (incl. the
    corrected / bonus token); ``position_acceptance[k]`` = P(draft k+1 accepted | drafts ≤ k accepted and
    draft k+1 verified)."""

    gamma: int = 0
    rounds: int = 0  # target verify forwards
    row_rounds: int = 0  # (row, round) pairs of unfinished rows
    drafted: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted
    emitted: int = 0  # tokens emitted by the rounds (excludes the prefill token)
    position_tried: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        return (self.accepted + self.row_rounds) / max(1, self.row_rounds)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(1, self.drafted)

    @property
    def position_acceptance(self) -> list[float]:
        return [a / t if t else float("nan") for a, t in zip(self.position_accepted, self.position_tried)]

    def as_dict(self) -> dict:
        return {"gamma": self.gamma, "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_length": round(self.acceptance_length, 4),
                "acceptance_rate": round(self.acceptance_rate, 4),
                "position_acceptance": [round(x, 4) for x in self.position_acceptance]}


def _leading_confident(conf: torch.Tensor | None, threshold: float, n: int, B: int, device) -> torch.Tensor:
    if conf is None or threshold <= 0:
        return torch.full((B,), n, dtype=torch.long, device=device)
    return (conf[:, :n] >= threshold).long().cumprod(1).sum(1)


@torch.no_grad()
def speculative_generate(model, drafter, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cfg,
                         n_new: int, streamer=None, options: SpecOptions | None = None) -> torch.Tensor:
    """Speculative decoding with ``drafter`` (a :class:`~k3nn.layers.dspark.DSparkDrafter` or any object with
    ``target_layers``, ``new_state``, ``extend``, ``propose``). Arguments as passed by ``generate()``; the
    statistics land in ``drafter.last_stats`` (:class:`SpecStats`)."""
    opts = options or getattr(drafter, "spec_options", None) or SpecOptions()
    gamma = int(cfg.num_assistant_tokens)
    dev = model.device
    B, T0 = input_ids.shape
    stats = SpecStats(gamma=gamma, position_tried=[0] * gamma, position_accepted=[0] * gamma)
    drafter.last_stats = stats
    setup = loop_setup(model, cfg, input_ids, streamer, n_new)
    if setup is None:
        return input_ids
    gen, eos, pad = setup
    taps = list(drafter.target_layers)
    # rejected window entries stay as masked holes in rows that kept fewer tokens than the longest row:
    # the shared write position advances by the longest kept prefix per round (≤ γ + 1, ≤ Σ rows' emissions)
    cap = T0 + min(B, gamma + 1) * n_new + gamma + 2
    cache = model.new_cache(B, cap)
    dstate = drafter.new_state(B, cap)
    out = torch.full((B, n_new + 1), pad, dtype=torch.long, device=dev)  # + a spare column for masked writes
    n_out = torch.zeros(B, dtype=torch.long, device=dev)
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    streamed = 0

    def emit(tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Append tokens [B, k] (the first counts[b] of row b) to the output, cut at eos and the budget."""
        nonlocal finished
        k = tokens.shape[1]
        j = torch.arange(k, device=dev)[None, :]
        valid = (j < counts[:, None]) & ~finished[:, None]
        if eos.numel():
            is_eos = torch.isin(tokens, eos) & valid
            first = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full_like(counts, k))
            valid &= j <= first[:, None]
            finished |= is_eos.any(1)
        valid &= (n_out[:, None] + j) < n_new
        cols = torch.where(valid, n_out[:, None] + j, n_new)  # invalid writes land in the spare last column
        out.scatter_(1, cols, tokens)
        n_out.add_(valid.sum(1))
        finished |= n_out >= n_new

    def stream() -> None:
        nonlocal streamed
        if streamer is None or bool(finished.all()):
            return  # the final flush streams up to the trimmed length
        ready = int(torch.where(finished, torch.full_like(n_out, n_new), n_out).min())
        for c in range(streamed, ready):
            streamer.put(out[:, c].cpu())
        streamed = max(streamed, ready)

    rounds = 0
    row_rounds, drafted, accepted = (torch.zeros((), dtype=torch.long, device=dev) for _ in range(3))
    pos_tried = torch.zeros(gamma, dtype=torch.long, device=dev)
    pos_acc = torch.zeros(gamma, dtype=torch.long, device=dev)
    with WindowRollback(model, cache, opts.rollback) as rb:
        res = model(input_ids, cache=cache, attention_mask=attention_mask, logits_to_keep=1,
                    output_hidden_layers=taps)
        m0 = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool())
        pos0 = (m0.long().cumsum(1) - 1).clamp_min(0)
        drafter.extend(dstate, res.hidden_states, pos0, m0, start=0)
        pending = sample_next(res.logits[:, -1], cfg, gen)
        emit(pending[:, None], torch.ones(B, dtype=torch.long, device=dev))
        stream()
        while not bool(finished.all()):
            remaining = n_new - n_out  # tokens each row may still emit
            n_b = torch.where(finished, torch.zeros_like(remaining), (remaining - 1).clamp(0, gamma))
            n = int(n_b.max())
            anchor_pos = cache.valid_counts.clone()  # rope position of the pending token
            if n > 0:
                prop = drafter.propose(dstate, pending, anchor_pos, n, cfg, gen)
                drafts, q, conf = prop.tokens[:, :n], prop.probs, prop.confidence
                n_b = torch.minimum(n_b, _leading_confident(conf, opts.confidence_threshold, n, B, dev))
                n = int(n_b.max())
                drafts = drafts[:, :n]
                q = None if q is None else q[:, :n]
            else:
                drafts, q = pending.new_zeros(B, 0), None
            window = torch.cat([pending[:, None], drafts], 1)
            T = n + 1
            rb.begin()
            start = cache.seen_tokens
            res = model(window, cache=cache, output_hidden_layers=taps,
                        checkpoint_positions=rb.checkpoint_positions(T))
            logits = res.logits
            if opts.synthetic_acceptance_length is not None:
                m, nxt = synthetic_accept(logits, drafts, n_b, opts.synthetic_acceptance_length, cfg, gen)
            elif cfg.do_sample:
                m, nxt = rejection_accept(logits, drafts, q, n_b, cfg, gen)
            else:
                m, nxt = greedy_accept(logits, drafts, n_b)
            active = ~finished
            keep = torch.where(active, m + 1, torch.ones_like(m))  # finished rows: keep only the pending token
            rb.commit(keep)
            j = torch.arange(T, device=dev)
            drafter.extend(dstate, res.hidden_states, anchor_pos[:, None] + j, j[None, :] < keep[:, None],
                           start=start)
            # statistics over unfinished rows (device counters: no host sync per round)
            act = active.long()
            rounds += 1
            row_rounds += act.sum()
            drafted += (n_b * act).sum()
            accepted += (m * act).sum()
            k = torch.arange(gamma, device=dev)[None, :]
            tried = (n_b[:, None] > k) & (m[:, None] >= k) & active[:, None]
            pos_tried += tried.long().sum(0)
            pos_acc += (tried & (m[:, None] > k)).long().sum(0)
            # emit d_1..d_m then next
            toks = torch.cat([drafts, drafts.new_zeros(B, 1)], 1)
            toks.scatter_(1, m[:, None], nxt[:, None])
            emit(toks, m + 1)
            pending = nxt
            stream()
    stats.rounds, stats.row_rounds = rounds, int(row_rounds)
    stats.drafted, stats.accepted = int(drafted), int(accepted)
    stats.emitted = int(n_out.sum()) - B
    stats.position_tried, stats.position_accepted = pos_tried.tolist(), pos_acc.tolist()
    out = out[:, :n_new]
    if eos.numel():
        has = torch.isin(out, eos)
        if bool(has.any(1).all()):
            steps = int((has.long().argmax(1) + 1).max())
        else:
            steps = n_new
    else:
        steps = n_new
    if streamer is not None:
        for c in range(streamed, steps):
            streamer.put(out[:, c].cpu())
        streamer.end()
    return torch.cat([input_ids, out[:, :steps]], dim=1)
