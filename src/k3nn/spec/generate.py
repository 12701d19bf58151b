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
output has the target's distribution. The target's scores go through the call's
:class:`~k3nn.logits.LogitsPipeline` row by row of the window (history-free processors: min length / min new
tokens, single-token bad words, the sampling warpers), the same processors plain decoding applies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..generation import loop_setup
from ..logits import LogitsPipeline
from ..decode.runner import eager_backend_on_cuda
from ..kernels.registry import uncaptured_step
from .rollback import WindowRollback
from .session import accept, capacity_bucket, emit, leading_confident, session_for

__all__ = ["SpecOptions", "SpecStats", "speculative_generate"]

log = logging.getLogger(__name__)


@dataclass
class SpecOptions:
    """Knobs of the speculative loop (``drafter.spec_options``, or the ``options`` argument).

    rollback: ``"replay"`` (ReplaySSM, default) or ``"slots"`` (per-position KDA state slots).
    confidence_threshold: verify only the leading drafts whose confidence is ≥ this (0 = verify all γ); the
        cut depends on drafter outputs only, so it stays lossless.
    synthetic_acceptance_length: benchmark mode — every round accepts exactly L − 1 drafts (L counts the bonus
        token) whatever they are; the output is then NOT the target's.
    cuda_graph: the round's execution path when ``speculative_generate`` is not given one (``generate()``
        passes none): None / ``"auto"`` → CUDA graphs on CUDA devices, eager elsewhere; True → graphs (the
        static path off CUDA); ``"static"`` → the graph-safe path without capture (any device); False → eager.
    """

    rollback: str = "replay"
    confidence_threshold: float = 0.0
    synthetic_acceptance_length: int | None = None
    cuda_graph: bool | str | None = None


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
    mode: str = "eager"  # round execution path: "eager" | "static" | "graph"
    graphs: dict = field(default_factory=dict)  # graph mode: step name → captured (True) / not (False)
    fallback: str | None = None  # why a capture failed or the graph path was not taken (None: no fallback)
    compactions: int = 0  # times the eager loop packed away the holes of rejected drafts
    session_calls: int = 0  # graph-safe rounds: calls served by this call's session (1: it was made for this call)

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per (row, round), the corrected or bonus token included: (accepted + row_rounds) /
        row_rounds; 1.0 means no draft was ever accepted, γ + 1 every draft."""
        return (self.accepted + self.row_rounds) / max(1, self.row_rounds)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / verified drafts."""
        return self.accepted / max(1, self.drafted)

    @property
    def position_acceptance(self) -> list[float]:
        """Per draft position k: P(draft k+1 accepted | the drafts before it accepted and it was verified); NaN
        where no draft was tried at that position."""
        return [a / t if t else float("nan") for a, t in zip(self.position_accepted, self.position_tried)]

    def as_dict(self) -> dict:
        """The counters and the derived rates as a JSON-able dict (rounded to 4 digits)."""
        return {"gamma": self.gamma, "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_length": round(self.acceptance_length, 4),
                "acceptance_rate": round(self.acceptance_rate, 4),
                "position_acceptance": [round(x, 4) for x in self.position_acceptance],
                "mode": self.mode, "graphs": dict(self.graphs), "fallback": self.fallback,
                "compactions": self.compactions, "session_calls": self.session_calls}


@torch.no_grad()
def speculative_generate(model, drafter, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cfg,
                         n_new: int, streamer=None, options: SpecOptions | None = None,
                         cuda_graph: bool | str | None = None,
                         pipeline: LogitsPipeline | None = None) -> torch.Tensor:
    """Speculative decoding with ``drafter`` (a :class:`~k3nn.layers.dspark.DSparkDrafter` or any object with
    ``target_layers``, ``new_state``, ``extend``, ``propose``). Arguments as passed by ``generate()``; the
    statistics land in ``drafter.last_stats`` (:class:`SpecStats`).

    ``cuda_graph`` (default: ``options.cuda_graph``, else auto): None / ``"auto"`` → on CUDA the verify forward
    and the KDA commit of each round replay captured CUDA graphs (fixed window T = γ + 1, cache in static mode,
    acceptance and MLA rewind on device tensors, one host read per round), eager elsewhere; True → graphs on
    CUDA, the static path elsewhere; ``"static"`` → the same graph-safe round without capture (any device);
    False → the eager round (window of 1 + max n_b tokens). A failed capture is logged and the round goes on
    with the graph-safe step run eagerly (same tokens). ``rollback="slots"`` stays eager-only (the static path
    needs ``"replay"``). A drafter with the graph-safe methods ``draft_logits`` / ``markov_draft`` /
    ``extend_at`` (:class:`~k3nn.layers.dspark.DSparkDrafter`) has its per-round work captured too (steps
    ``draft`` and ``extend``; with sampling only the backbone is: the Markov draft sampling draws from the
    call's generator, which the graphs do not own, so it runs eagerly); other drafters run eagerly. The path taken lands in ``last_stats.mode`` / ``.graphs`` /
    ``.fallback``.

    ``pipeline``: the logits processors (default: built from ``cfg``); processors that read the token history
    raise NotImplementedError. A NaN or Inf in the target's logits raises FloatingPointError naming the round.
    """
    opts = options or getattr(drafter, "spec_options", None) or SpecOptions()
    gamma = int(cfg.num_assistant_tokens)
    dev = model.device
    B, T0 = input_ids.shape
    if pipeline is None:
        pipeline = LogitsPipeline.from_config(cfg, prompt_length=T0, vocab_size=model.config.vocab_size,
                                              device=dev, attention_mask=attention_mask)
    pipeline.check_history_free("speculative decoding")
    pipe = pipeline
    stats = SpecStats(gamma=gamma, position_tried=[0] * gamma, position_accepted=[0] * gamma)
    drafter.last_stats = stats
    mode = _resolve_mode(opts.cuda_graph if cuda_graph is None else cuda_graph, dev)
    if mode != "eager" and opts.rollback != "replay":
        stats.fallback = f"rollback={opts.rollback!r} runs eagerly (the static round needs 'replay')"
        mode = "eager"
    if mode == "graph" and eager_backend_on_cuda(model, dev):
        # the eager kernels sync with the host: a capture attempt would fail and leave the CUDA context
        # unusable (cudaErrorStreamCaptureInvalidated), so run the same round uncaptured
        stats.fallback = "the eager backend is not capturable: graph-safe rounds run without CUDA graphs"
        mode = "static"
    setup = loop_setup(model, cfg, input_ids, streamer, n_new)
    if setup is None:
        return input_ids
    gen, eos, pad = setup
    if mode != "eager":
        stats.mode = mode
        # a call without logits processors reuses the drafter's session of its shape (graphs captured once);
        # processors' parameters would be baked into the captured steps, so such a call gets a session of its own
        session = session_for(model, drafter, batch_size=B, capacity=capacity_bucket(T0, n_new, B, gamma),
                              gamma=gamma, eos=eos, opts=opts, do_sample=bool(cfg.do_sample),
                              graphs=mode == "graph", keep=len(pipe) == 0)
        try:
            out, streamed = session.run(input_ids, attention_mask, cfg, n_new, streamer, stats, gen, pad, pipe,
                                        _prefill)
        finally:
            session.busy = False
        return _finish(input_ids, out, n_new, eos, streamer, streamed)
    taps = list(drafter.target_layers)
    # the shared write position advances by the longest kept prefix per round: rows that kept fewer tokens
    # leave masked holes, which _reclaim_holes packs away whenever the next window would not fit (the cache
    # holds the prompt, the answer, one window and HOLE_SLACK columns, whatever the acceptance pattern)
    cap = T0 + n_new + gamma + 2 + HOLE_SLACK
    cache = model.new_cache(B, cap)
    dstate = drafter.new_state(B, cap)
    out = torch.full((B, n_new + 1), pad, dtype=torch.long, device=dev)  # + a spare column for masked writes
    n_out = torch.zeros(B, dtype=torch.long, device=dev)
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    streamed = 0

    def emit_(tokens: torch.Tensor, counts: torch.Tensor) -> None:
        emit(out, n_out, finished, tokens, counts, eos, n_new)

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
    with WindowRollback(model, cache, opts.rollback) as rb, uncaptured_step():
        pending = _prefill(model, drafter, dstate, cache, input_ids, attention_mask, taps, pipe, gen)
        emit_(pending[:, None], torch.ones(B, dtype=torch.long, device=dev))
        stream()
        done = bool(finished.all())
        while not done:
            remaining = n_new - n_out  # tokens each row may still emit
            n_b = torch.where(finished, torch.zeros_like(remaining), (remaining - 1).clamp(0, gamma))
            n = int(n_b.max())
            anchor_pos = cache.valid_counts.clone()  # rope position of the pending token
            if n > 0:
                prop = drafter.propose(dstate, pending, anchor_pos, n, cfg, gen)
                drafts, q, conf = prop.tokens[:, :n], prop.probs, prop.confidence
                n_b = torch.minimum(n_b, leading_confident(conf, opts.confidence_threshold, n, B, dev))
                n = int(n_b.max())
                drafts = drafts[:, :n]
                q = None if q is None else q[:, :n]
            else:
                drafts, q = pending.new_zeros(B, 0), None
            window = torch.cat([pending[:, None], drafts], 1)
            T = n + 1
            if cache.seen_tokens + T > cap:
                _reclaim_holes(cache, dstate)
                stats.compactions += 1
            rb.begin()
            start = cache.seen_tokens
            res = model(window, cache=cache, output_hidden_layers=taps,
                        checkpoint_positions=rb.checkpoint_positions(T))
            logits = res.logits
            nonfinite = ~torch.isfinite(logits).all()
            scores = pipe.window(logits.float(), T0 + n_out)  # row j scores new token n_out + j
            m, nxt = accept(scores, drafts, q, n_b, opts, pipe, gen)
            active = ~finished
            keep = torch.where(active, m + 1, torch.ones_like(m))  # finished rows: keep only the pending token
            rb.commit(keep)
            # ... and not even that in the MLA columns: a finished row's pending column becomes a hole too
            cache.key_mask[:, start] &= active
            cache.holes = True
            cache.valid_counts -= (~active).long()
            j = torch.arange(T, device=dev)
            drafter.extend(dstate, res.hidden_states, anchor_pos[:, None] + j,
                           (j[None, :] < keep[:, None]) & active[:, None], start=start)
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
            emit_(toks, m + 1)
            pending = nxt
            done, bad = torch.stack([finished.all(), nonfinite]).tolist()
            if bad:
                _raise_nonfinite(rounds)
            stream()
    stats.rounds, stats.row_rounds = rounds, int(row_rounds)
    stats.drafted, stats.accepted = int(drafted), int(accepted)
    stats.emitted = int(n_out.sum()) - B
    stats.position_tried, stats.position_accepted = pos_tried.tolist(), pos_acc.tolist()
    return _finish(input_ids, out, n_new, eos, streamer, streamed)


HOLE_SLACK = 64  # spare cache columns of the eager loop: holes are packed away when they fill these


@torch.no_grad()
def _reclaim_holes(cache, dstate) -> None:
    """Pack every row's kept entries to the front of the contiguous cache (order kept), in the MLA latents, the
    key mask and the drafter's context alike (both have the same columns), and rewind the shared write position
    to the longest row. Rope positions are per row (``valid_counts``), so nothing else moves; KDA state is per
    row and has no columns."""
    from ..cache.hybrid import MLAState
    from ..layers.dspark import DraftState

    L = cache.seen_tokens
    keep = cache.key_mask[:, :L]
    count = keep.sum(1)
    Ln = int(count.max())
    idx = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :Ln]  # kept columns first, in order
    tensors = [t for st in cache.layers if isinstance(st, MLAState) for t in (st.latent, st.rope)]
    if isinstance(dstate, DraftState):
        tensors += list(dstate.k) + list(dstate.v)
    for t in tensors:
        g = idx.view(*idx.shape, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:])
        t[:, :Ln] = t[:, :L].gather(1, g)
    packed = torch.arange(Ln, device=keep.device)[None, :] < count[:, None]
    masks = [cache.key_mask] + ([dstate.key_mask] if isinstance(dstate, DraftState) else [])
    for m in masks:
        m[:, :L] = False
        m[:, :Ln] = packed
    cache.seen_tokens = Ln
    if isinstance(dstate, DraftState):
        dstate.length = Ln


def _finish(input_ids, out, n_new, eos, streamer, streamed) -> torch.Tensor:
    """Trim like generate() (all rows hit eos → cut after the last row's eos), flush the streamer."""
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


def _resolve_mode(cuda_graph, dev: torch.device) -> str:
    on_cuda = dev.type == "cuda"
    if cuda_graph in (None, "auto"):
        return "graph" if on_cuda else "eager"
    if cuda_graph == "static":
        return "static"
    if cuda_graph is True:
        return "graph" if on_cuda else "static"
    if cuda_graph is False:
        return "eager"
    raise ValueError(f"cuda_graph must be None, 'auto', 'static', True or False, got {cuda_graph!r}")


def _prefill(model, drafter, dstate, cache, input_ids, attention_mask, taps, pipe: LogitsPipeline,
             gen) -> torch.Tensor:
    """The prompt through the target (hidden states of the drafter's taps into its context); the first token."""
    res = model(input_ids, cache=cache, attention_mask=attention_mask, logits_to_keep=1, output_hidden_layers=taps)
    m0 = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    drafter.extend(dstate, res.hidden_states, (m0.long().cumsum(1) - 1).clamp_min(0), m0, start=0)
    logits = res.logits[:, -1:].float()
    if not bool(torch.isfinite(logits).all()):
        raise FloatingPointError("speculative decoding: the target's logits contain NaN or Inf at step 0 (the "
                                 "prefill's next-token logits)")
    B, T0 = input_ids.shape
    scores = pipe.window(logits, torch.full((B,), T0, dtype=torch.long, device=logits.device))[:, 0]
    return pipe.choose(scores, gen)


def _raise_nonfinite(round_index: int) -> None:
    raise FloatingPointError(f"speculative decoding: the target's logits contain NaN or Inf in verify round "
                             f"{round_index} (0-based)")
