"""The graph-safe speculative round and the session that keeps it (cache, buffers, CUDA graphs) across calls.

Every window has T = γ + 1 tokens, the cache is in static mode, and acceptance, emission, statistics and the MLA
rewind run on device tensors; the host reads [B] acceptance + finished flags once per round (termination, which
KDA commit functions to run, the host write position). A graph-safe drafter (``draft_logits``,
``markov_draft``, ``extend_at``) drafts and extends from the same persistent buffers.

A :class:`SpecSession` owns everything a round's graphs point at: the target's cache and the drafter's state at
a bucketed capacity, the round buffers, the per-call scalars (prompt length, token budget) as device tensors,
and the captured steps. ``generate(drafter=)`` keeps the sessions of a drafter (:func:`session_for`), so a
second call with the same batch size, capacity bucket, γ and eos ids replays the graphs the first captured
instead of capturing them again. :func:`clear_sessions` frees them.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels.registry import backend as use_backend
from ..kernels.registry import uncaptured_step
from ..logits import LogitsPipeline
from ..runtime.graphs import GraphRunner
from .rollback import WindowRollback
from .verify import greedy_accept, rejection_accept, synthetic_accept

__all__ = ["SpecSession", "session_for", "clear_sessions", "MAX_SESSIONS"]

#: sessions kept per drafter (least recently used dropped first); each holds a cache of its capacity bucket
MAX_SESSIONS = 2
MIN_CAPACITY = 256  # the smallest capacity bucket (positions)

_sessions: "weakref.WeakKeyDictionary[object, OrderedDict]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def capacity_bucket(T0: int, n_new: int, batch_size: int, gamma: int) -> int:
    """Cache positions a call needs, rounded up to a power of two (≥ :data:`MIN_CAPACITY`): the prompt, the
    answer of the rows (a row's rejected drafts leave holes: up to min(B, T) positions a token) and B + 2 spare
    windows (fixed windows write T positions past the shared position even in the last rounds)."""
    T = gamma + 1
    need = T0 + min(batch_size, T) * n_new + (batch_size + 2) * (T + 1)
    return max(MIN_CAPACITY, 1 << (need - 1).bit_length())


def _fingerprint(*modules) -> tuple:
    """Where the modules' tensors live: a captured graph reads these addresses, so a changed one (``.to()``,
    reassigned parameters) retires the session."""
    return tuple(t.data_ptr() for m in modules if isinstance(m, torch.nn.Module)
                 for t in (*m.parameters(), *m.buffers()))


def clear_sessions(drafter=None) -> None:
    """Free the kept sessions of ``drafter`` (every drafter's when None): their caches and CUDA graphs."""
    with _lock:
        if drafter is None:
            _sessions.clear()
        else:
            _sessions.pop(drafter, None)


def session_for(model, drafter, *, batch_size: int, capacity: int, gamma: int, eos: torch.Tensor, opts,
                do_sample: bool, graphs: bool, keep: bool) -> "SpecSession":
    """The session of this key, made on first use. ``keep``: remember it for later calls (only when every
    value the captured steps bake in is part of the key, i.e. the call has no logits processors); a session in
    use by another thread is never shared (a fresh one is made)."""
    key = (id(model), getattr(model, "backend", None), batch_size, capacity, gamma, tuple(eos.tolist()),
           bool(do_sample), float(opts.confidence_threshold), opts.synthetic_acceptance_length, bool(graphs))
    prints = _fingerprint(model, drafter)
    try:
        weakref.ref(drafter)
        hash(drafter)
    except TypeError:  # sessions are kept per drafter, weakly
        keep = False
    if keep:
        with _lock:
            kept = _sessions.setdefault(drafter, OrderedDict())
            s = kept.get(key)
            if s is not None and s.fingerprint == prints and not s.busy:
                kept.move_to_end(key)
                s.busy = True
                return s
    s = SpecSession(model, drafter, batch_size=batch_size, capacity=capacity, gamma=gamma, eos=eos, opts=opts,
                    do_sample=do_sample, graphs=graphs)
    s.fingerprint, s.busy = prints, True
    if keep:
        with _lock:
            kept = _sessions.setdefault(drafter, OrderedDict())
            kept[key] = s
            kept.move_to_end(key)
            while len(kept) > MAX_SESSIONS:
                kept.popitem(last=False)
    return s


class GraphStep:
    """A graph-safe function of no arguments (it reads and writes persistent device tensors) run eagerly, or
    (``capture=True``) as a CUDA graph of a :class:`~k3nn.runtime.graphs.GraphRunner` (the runner ``generate()``'s
    decode step and the engine's steps use): the first call warms up on a side stream, the second captures and
    replays, later calls replay. A failed capture is logged, its reason kept in ``fallback_reason``, and the
    function keeps running eagerly (same results). ``on_capture_failure`` undoes host-side effects of the aborted
    capture pass. ``graph`` / ``out``: the captured graph and its static outputs once captured."""

    def __init__(self, fn: Callable, name: str, capture: bool, on_capture_failure: Callable | None = None):
        self.fn, self.name, self.capture = fn, name, capture
        self.on_capture_failure = on_capture_failure
        self.runner = GraphRunner("cuda" if capture else "cpu", enabled=capture, name=f"speculative round {name}")
        self.graph = None
        self.out = None
        self.calls = 0
        self.fallback_reason: str | None = None

    def __call__(self):
        self.calls += 1
        if not self.capture or self.fallback_reason is not None:
            with uncaptured_step():
                return self.fn()
        out = self.runner.run(self.name, self.fn, self.on_capture_failure)
        entry = self.runner.graphs.get(self.name)
        if entry is not None:
            self.graph, self.out = entry
        failed = self.runner.failed.get(self.name)
        if failed is not None:
            self.fallback_reason = f"{self.name}: {failed}"
        return out


def leading_confident(conf: torch.Tensor | None, threshold: float, n: int, B: int, device) -> torch.Tensor:
    """[B] count of the leading drafts whose confidence is ≥ ``threshold`` (n for all rows without a threshold)."""
    if conf is None or threshold <= 0:
        return torch.full((B,), n, dtype=torch.long, device=device)
    return (conf[:, :n] >= threshold).long().cumprod(1).sum(1)


def accept(scores, drafts, q, n_b, opts, pipe: LogitsPipeline, gen):
    """Acceptance of one window over processed scores [B, n+1, V]: synthetic, rejection sampling or greedy."""
    if opts.synthetic_acceptance_length is not None:
        return synthetic_accept(scores, drafts, n_b, opts.synthetic_acceptance_length, None, gen,
                                do_sample=pipe.do_sample)
    if pipe.do_sample:
        return rejection_accept(scores, drafts, q, n_b, None, gen)
    return greedy_accept(scores, drafts, n_b)


def emit(out: torch.Tensor, n_out: torch.Tensor, finished: torch.Tensor, tokens: torch.Tensor,
         counts: torch.Tensor, eos: torch.Tensor, limit) -> None:
    """Append tokens [B, k] (the first counts[b] of row b) to ``out``, cut at eos and at ``limit`` tokens (an int,
    or a 0-dim device tensor); ``n_out`` and ``finished`` are updated in place (graph-safe: no host sync).
    ``out``'s last column is a spare that takes the invalid writes."""
    k = tokens.shape[1]
    j = torch.arange(k, device=tokens.device)[None, :]
    valid = (j < counts[:, None]) & ~finished[:, None]
    if eos.numel():
        is_eos = torch.isin(tokens, eos) & valid
        first = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full_like(counts, k))
        valid &= j <= first[:, None]
        finished.logical_or_(is_eos.any(1))
    valid &= (n_out[:, None] + j) < limit
    out.scatter_(1, torch.where(valid, n_out[:, None] + j, out.shape[1] - 1), tokens)
    n_out.add_(valid.sum(1))
    finished.logical_or_(n_out >= limit)


@dataclass
class _Call:
    """What one call brings (read by the eager parts of the round; the captured parts read device tensors)."""

    cfg: object
    pipe: LogitsPipeline
    gen: torch.Generator | None
    n_new: int


class SpecSession:
    """The graph-safe round of one key (see the module docstring): cache and drafter state of ``capacity``
    positions for ``batch_size`` rows, persistent round buffers, and the round's steps (CUDA graphs when
    ``graphs``). :meth:`run` serves one call; state is reset at its start, the graphs are kept."""

    def __init__(self, model, drafter, *, batch_size: int, capacity: int, gamma: int, eos: torch.Tensor, opts,
                 do_sample: bool, graphs: bool):
        self.model, self.drafter, self.opts = model, drafter, opts
        self.B, self.capacity, self.gamma, self.do_sample = batch_size, capacity, gamma, do_sample
        self.T = T = gamma + 1
        self.busy = False
        self.fingerprint: tuple = ()
        self.calls = 0
        dev = self.dev = model.device
        B = batch_size
        self.eos = eos.clone()
        self.taps = list(drafter.target_layers)
        self.cache = model.new_cache(B, capacity)
        self.dstate = drafter.new_state(B, capacity)
        # the drafter's steps run on persistent buffers when it has the graph-safe methods (and its state can be
        # emptied in place for the next call)
        self.graph_draft = (all(callable(getattr(drafter, a, None))
                                for a in ("draft_logits", "markov_draft", "extend_at"))
                            and callable(getattr(self.dstate, "reset", None)))
        self.rb = WindowRollback(model, self.cache, "replay")
        long0 = {"dtype": torch.long, "device": dev}
        self.out = torch.zeros(B, capacity + 1, **long0)  # + the spare column of masked writes
        self.n_out = torch.zeros(B, **long0)
        self.finished = torch.zeros(B, dtype=torch.bool, device=dev)
        self.pending = torch.zeros(B, **long0)
        self.t0 = torch.zeros((), **long0)  # the call's prompt length
        self.limit = torch.zeros((), **long0)  # the call's max new tokens
        self.window = torch.zeros(B, T, **long0)
        self.n_b = torch.zeros(B, **long0)
        self.anchor_pos = torch.zeros(B, **long0)
        self.wstart = torch.zeros((), **long0)
        self.kacc = torch.zeros(B, **long0)
        self.ext_pos = torch.zeros(B, T, **long0)
        self.ext_mask = torch.zeros(B, T, dtype=torch.bool, device=dev)
        self.sync_buf = torch.zeros(2 * B + 1, **long0)  # kept tokens, finished flags, non-finite logits flag
        self.counters = torch.zeros(3, **long0)  # row_rounds, drafted, accepted
        self.pos_tried = torch.zeros(gamma, **long0)
        self.pos_acc = torch.zeros(gamma, **long0)
        self.jT = torch.arange(T, device=dev)
        self.kG = torch.arange(gamma, device=dev)[None, :]
        self.box: dict = {}  # host-side references written by the steps' Python (window refs, draft probs)
        self.call: _Call | None = None
        # a window every KDA layer runs through the fused op is read without writing and committed inside the
        # acceptance step (one op call per layer, whatever the accepted counts): no per-count commit steps
        self.fused = self.rb.fused_window(T)
        # ... and then, greedy with a graph-safe drafter, the whole round (draft, verify, accept, commit, the
        # drafter's extension) is one step: one capture per session, one replay and one host read a round
        self.one_step = self.fused and self.graph_draft and not do_sample
        self.verify_step = GraphStep(self._verify, "verify", graphs, self._undo_verify_capture)
        # sampling draws from a host generator inside acceptance: keep that step eager
        self.post_step = GraphStep(self._post, "accept", graphs and not do_sample)
        self.draft_step = GraphStep(self._draft, "draft", graphs and self.graph_draft)
        self.extend_step = GraphStep(self._extend, "extend", graphs and self.graph_draft)
        self.commit_steps: dict[int, GraphStep] = {}
        self.round_step = (GraphStep(self._whole_round, "round", graphs, self._undo_verify_capture)
                           if self.one_step else None)
        self.graphs = graphs

    # -- the steps (graph-safe: device tensors only, read at run time) ---------------------------------------
    def _verify(self):
        cache, rb, model = self.cache, self.rb, self.model
        self.wstart.copy_(cache.write_pos)
        rb.begin_static(self.fused)
        with use_backend(model.backend):
            h, hid = model.model(self.window, None, cache, None, self.taps, None)
            logits = model.lm_head(h)
        self.box["refs"] = rb.end_static()
        return logits, hid

    def _post(self):
        B, T, jT, kG = self.B, self.T, self.jT, self.kG
        cache, box, n_b, call = self.cache, self.box, self.n_b, self.call
        logits = self.verify_step.out[0] if self.verify_step.graph is not None else box["logits"]
        drafts = self.window[:, 1:]
        scores = call.pipe.window(logits.float(), self.t0 + self.n_out)  # row j scores new token n_out + j
        m, nxt = accept(scores, drafts, box.get("q"), n_b, self.opts, call.pipe, call.gen)
        active = ~self.finished
        keep = torch.where(active, m + 1, torch.ones_like(m))
        self.kacc.copy_(torch.where(active, keep, torch.zeros_like(keep)))  # finished rows: KDA state untouched
        # MLA / shared bookkeeping: mask the rejected tail, count only kept tokens, rewind the write position
        idx = self.wstart + jT
        cache.key_mask.index_copy_(1, idx, cache.key_mask.index_select(1, idx) & (jT[None, :] < keep[:, None]))
        cache.holes = True
        cache.valid_counts.sub_(T - keep)
        cache.write_pos.copy_(self.wstart + keep.max())
        if self.fused:
            self.rb.fused_commit(self.kacc, box["refs"])
        self.ext_pos.copy_(self.anchor_pos[:, None] + jT)
        self.ext_mask.copy_(jT[None, :] < keep[:, None])
        act = active.long()
        self.counters[0] += act.sum()
        self.counters[1] += (n_b * act).sum()
        self.counters[2] += (m * act).sum()
        tried = (n_b[:, None] > kG) & (m[:, None] >= kG) & active[:, None]
        self.pos_tried.add_(tried.long().sum(0))
        self.pos_acc.add_((tried & (m[:, None] > kG)).long().sum(0))
        toks = torch.cat([drafts, drafts.new_zeros(B, 1)], 1)
        toks.scatter_(1, m[:, None], nxt[:, None])
        emit(self.out, self.n_out, self.finished, toks, m + 1, self.eos, self.limit)
        self.pending.copy_(nxt)
        self.sync_buf[:B].copy_(self.kacc)
        self.sync_buf[B:2 * B].copy_(self.finished.long())
        self.sync_buf[2 * B].copy_((~torch.isfinite(logits).all()).long())
        if self.one_step:
            self._extend()
        return self.sync_buf

    def _round_inputs(self) -> None:  # per-row verify budget and the pending token's rope position
        remaining = self.limit - self.n_out
        self.n_b.copy_(torch.where(self.finished, torch.zeros_like(remaining), (remaining - 1).clamp(0, self.gamma)))
        self.anchor_pos.copy_(self.cache.valid_counts)

    @property
    def _cut(self) -> bool:  # drafts are cut by confidence: the confidence head runs
        return self.opts.confidence_threshold > 0

    def _set_window(self, prop) -> None:
        self.n_b.copy_(torch.minimum(self.n_b, leading_confident(prop.confidence, self.opts.confidence_threshold,
                                                                 self.gamma, self.B, self.dev)))
        self.window[:, 0].copy_(self.pending)
        self.window[:, 1:].copy_(prop.tokens[:, :self.gamma])

    def _draft(self):  # graph-safe drafter: backbone (+ the greedy Markov heads) on persistent buffers
        self._round_inputs()
        h, base = self.drafter.draft_logits(self.dstate, self.pending, self.anchor_pos, self.gamma)
        if self.do_sample:
            return h, base  # the sampling heads run eagerly on these
        self._set_window(self.drafter.markov_draft(h, base, self.pending, confidence=self._cut))
        return None

    def _extend(self) -> None:  # reads the verify step's hidden states (its static outputs once it is a graph)
        hid = self.verify_step.out[1] if self.verify_step.graph is not None else self.box["hid"]
        self.drafter.extend_at(self.dstate, hid, self.ext_pos, self.ext_mask, self.wstart)

    def _whole_round(self):
        self._draft()
        self.box["logits"], self.box["hid"] = self._verify()
        return self._post()

    def _undo_verify_capture(self) -> None:  # the aborted capture pass ran the Python side of begin/commit
        self.cache.seen_tokens = self.box["start"]
        for _, st in self.rb.kda:
            st.end_window()

    def _split_round(self):
        """The round as separate steps: (host read of the acceptance, graphed, hidden states)."""
        call, box = self.call, self.box
        if self.graph_draft:
            hb = self.draft_step()
            if self.do_sample:
                prop = self.drafter.markov_draft(hb[0], hb[1], self.pending, call.cfg, call.gen, self._cut)
                self._set_window(prop)
                box["q"] = prop.probs
        else:
            self._round_inputs()
            prop = self.drafter.propose(self.dstate, self.pending, self.anchor_pos, self.gamma, call.cfg, call.gen)
            self._set_window(prop)
            box["q"] = prop.probs
        logits, hid = self.verify_step()
        box["logits"], box["hid"] = logits, hid
        self.cache.seen_tokens = box["start"] + self.T
        # the later steps read the verify step's outputs: they are captured only once those are a graph's
        # static outputs (else a capture would keep one round's tensors)
        graphed = self.verify_step.graph is not None
        return (self.post_step() if graphed else self._post()).tolist(), graphed, hid

    # -- one call ------------------------------------------------------------------------------------------------
    def reset(self, T0: int, n_new: int, pad: int) -> None:
        """Empty the cache, the drafter's state and the round buffers for a call (no reallocation)."""
        if n_new > self.capacity:
            raise ValueError(f"max_new_tokens={n_new} exceeds the session's capacity {self.capacity}")
        cache, dstate = self.cache, self.dstate
        cache.set_static(False)
        for _, st in self.rb.kda:
            st.end_window()
        cache.reset()
        if self.graph_draft:
            dstate.reset()  # the captured steps point at its tensors
        else:  # a drafter's own state: made anew
            self.dstate = self.drafter.new_state(self.B, self.capacity)
        self.out.fill_(pad)
        for t in (self.n_out, self.finished, self.counters, self.pos_tried, self.pos_acc):
            t.zero_()
        self.t0.fill_(T0)
        self.limit.fill_(n_new)

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cfg, n_new: int, streamer, stats,
            gen, pad: int, pipe: LogitsPipeline, prefill: Callable) -> torch.Tensor:
        """Generate ``n_new`` tokens for ``input_ids`` [B, T0] (the prompt rows) with the session's round;
        ``prefill(model, drafter, dstate, cache, input_ids, attention_mask, taps, pipe, gen)`` gives the first
        token. Returns the new tokens [B, n_new] (rows that finished padded with ``pad``) and how many of their
        columns went to ``streamer``; counters land in ``stats``."""
        B, T0 = input_ids.shape
        self.calls += 1
        self.call = _Call(cfg, pipe, gen, n_new)
        self.reset(T0, n_new, pad)
        cache, box, finished, n_out = self.cache, self.box, self.finished, self.n_out
        streamed = 0

        def stream() -> None:
            nonlocal streamed
            if streamer is None or bool(finished.all()):
                return
            ready = int(torch.where(finished, torch.full_like(n_out, n_new), n_out).min())
            for c in range(streamed, ready):
                streamer.put(self.out[:, c].cpu())
            streamed = max(streamed, ready)

        self.pending.copy_(prefill(self.model, self.drafter, self.dstate, cache, input_ids, attention_mask,
                                   self.taps, pipe, gen))
        emit(self.out, n_out, finished, self.pending[:, None], torch.ones(B, dtype=torch.long, device=self.dev),
             self.eos, self.limit)
        stream()
        cache.set_static(True)
        rounds = 0
        done = bool(finished.all())
        while not done:
            start = box["start"] = cache.seen_tokens
            if self.round_step is not None:  # one replay, one host read
                vals, graphed = self.round_step().tolist(), self.round_step.graph is not None
            else:
                vals, graphed, hid = self._split_round()
            acc, fin = vals[:B], vals[B:2 * B]
            if vals[2 * B]:
                raise FloatingPointError(f"speculative decoding: the target's logits contain NaN or Inf in verify "
                                         f"round {rounds} (0-based)")
            cache.seen_tokens = start + max(1, max(acc))
            for a in [] if self.fused else sorted(set(acc) - {0}):
                if a not in self.commit_steps:
                    self.commit_steps[a] = GraphStep(
                        self.rb.static_commit_fn(a, self.T, self.kacc, lambda: box["refs"]), f"commit[{a}]",
                        self.graphs)
                step = self.commit_steps[a]
                step() if graphed else step.fn()
            if self.graph_draft:
                if not self.one_step:
                    self.extend_step() if graphed else self._extend()
                self.dstate.length = cache.seen_tokens
            else:
                self.drafter.extend(self.dstate, hid, self.ext_pos, self.ext_mask, start=start)
            rounds += 1
            done = all(fin)
            stream()
        cache.set_static(False)
        steps = ([self.round_step] if self.round_step is not None
                 else [self.draft_step, self.verify_step, self.post_step, self.extend_step,
                       *self.commit_steps.values()])
        stats.graphs = {s.name: s.graph is not None for s in steps if s.capture}
        reasons = [stats.fallback] if stats.fallback else []  # set before the round (e.g. eager backend)
        reasons += [s.fallback_reason for s in steps if s.fallback_reason]
        stats.fallback = "; ".join(reasons) if reasons else None
        c = self.counters.tolist()
        stats.rounds, stats.row_rounds, stats.drafted, stats.accepted = rounds, c[0], c[1], c[2]
        stats.emitted = int(n_out.sum()) - B
        stats.position_tried, stats.position_accepted = self.pos_tried.tolist(), self.pos_acc.tolist()
        stats.session_calls = self.calls
        self.call = None
        return self.out[:, :n_new].clone(), streamed
