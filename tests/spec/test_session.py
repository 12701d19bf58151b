"""The speculative session: generate(drafter=) keeps the graph-safe round (cache, buffers, graphs) across calls."""

from __future__ import annotations

import torch

from k3nn.spec import SpecOptions, clear_sessions
from k3nn.spec import session as S

from .helpers import structured_target
from .test_generate import GAMMA, _dspark, _emulate_capture, _stats_tuple


def _prompt(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 255, (batch, n), generator=torch.Generator().manual_seed(seed))


def _fresh(target, drafter, ids, **kw):
    """The same call on a session made for it alone (the reference)."""
    clear_sessions(drafter)
    out = target.generate(ids, drafter=drafter, num_assistant_tokens=GAMMA, **kw)
    assert drafter.last_stats.session_calls == 1
    return out, drafter.last_stats


def test_capacity_bucket_holds_the_call():
    for T0, n, B in [(1, 1, 1), (7, 12, 2), (300, 700, 4), (2048, 256, 1)]:
        cap = S.capacity_bucket(T0, n, B, GAMMA)
        T = GAMMA + 1
        assert cap >= T0 + min(B, T) * n + (B + 2) * (T + 1) and cap >= S.MIN_CAPACITY
        assert cap & (cap - 1) == 0  # a power of two: nearby lengths share a session


def test_calls_of_one_bucket_share_a_session_and_match_fresh_ones():
    """Prompts of different lengths and budgets in one capacity bucket run on one session (its state emptied
    between calls) and give what a session made for each call gives, which is plain greedy decoding."""
    target = structured_target()
    drafter = _dspark(target)
    drafter.spec_options = SpecOptions(cuda_graph="static")
    calls = [(_prompt(7, 1), 12), (_prompt(4, 2), 9), (_prompt(7, 1), 12), (_prompt(9, 3), 15)]
    refs = [_fresh(target, drafter, ids, max_new_tokens=n) for ids, n in calls]
    clear_sessions(drafter)
    for i, ((ids, n), (ref, ref_stats)) in enumerate(zip(calls, refs)):
        out = target.generate(ids, drafter=drafter, num_assistant_tokens=GAMMA, max_new_tokens=n)
        st = drafter.last_stats
        assert st.session_calls == i + 1, st
        assert torch.equal(out, ref) and _stats_tuple(st) == _stats_tuple(ref_stats)
        assert torch.equal(out, target.generate(ids, max_new_tokens=n))


def test_eos_batch_and_bucket_are_part_of_the_key():
    target = structured_target()
    drafter = _dspark(target)
    drafter.spec_options = SpecOptions(cuda_graph="static")
    ids = _prompt(6, 4, batch=2)
    ref = target.generate(ids, max_new_tokens=10)
    eos = int(ref[0, 8])  # a token row 0 emits: the eos call stops there
    kw = dict(drafter=drafter, num_assistant_tokens=GAMMA)
    target.generate(ids, max_new_tokens=10, **kw)
    out = target.generate(ids, max_new_tokens=10, eos_token_id=eos, **kw)
    assert drafter.last_stats.session_calls == 1  # another eos set: another session
    assert torch.equal(out, target.generate(ids, max_new_tokens=10, eos_token_id=eos))
    target.generate(ids[:1], max_new_tokens=10, **kw)
    assert drafter.last_stats.session_calls == 1  # another batch size
    target.generate(ids, max_new_tokens=S.MIN_CAPACITY, **kw)
    assert drafter.last_stats.session_calls == 1  # another capacity bucket
    assert len(S._sessions[drafter]) == S.MAX_SESSIONS  # the least recently used ones were dropped
    target.generate(ids, max_new_tokens=10, **kw)
    assert drafter.last_stats.session_calls == 1  # (it was dropped)
    target.generate(ids, max_new_tokens=10, **kw)
    assert drafter.last_stats.session_calls == 2
    clear_sessions(drafter)
    assert drafter not in S._sessions


def test_processors_and_new_weights_get_a_session_of_their_own():
    """Logits processors' parameters would be baked into captured steps: such calls are not kept. Weights that
    moved (reassigned parameters) retire the sessions that point at the old ones."""
    target = structured_target()
    drafter = _dspark(target)
    drafter.spec_options = SpecOptions(cuda_graph="static")
    ids = _prompt(6, 5)
    kw = dict(drafter=drafter, num_assistant_tokens=GAMMA, max_new_tokens=10)
    for _ in range(2):
        out = target.generate(ids, bad_words_ids=[[7]], **kw)
        assert drafter.last_stats.session_calls == 1
    assert torch.equal(out, target.generate(ids, bad_words_ids=[[7]], max_new_tokens=10))
    target.generate(ids, **kw)
    target.generate(ids, **kw)
    assert drafter.last_stats.session_calls == 2
    with torch.no_grad():
        target.lm_head.weight = torch.nn.Parameter(target.lm_head.weight * 1.5)
    out = target.generate(ids, **kw)
    assert drafter.last_stats.session_calls == 1
    assert torch.equal(out, target.generate(ids, max_new_tokens=10))


def test_a_kept_graph_round_replays_from_the_first_round_of_the_next_call(monkeypatch):
    """Emulated capture: the first call warms up and captures the round; the next calls (other prompt lengths
    and budgets) replay it from their first round, with the tokens and statistics of the static round."""
    _emulate_capture(monkeypatch)
    target = structured_target()
    drafter = _dspark(target)
    calls = [(_prompt(7, 1), 12), (_prompt(5, 6), 14), (_prompt(8, 7), 9)]
    drafter.spec_options = SpecOptions(cuda_graph="static")
    refs = [_fresh(target, drafter, ids, max_new_tokens=n) for ids, n in calls]
    drafter.spec_options = SpecOptions(cuda_graph=True)
    clear_sessions(drafter)
    first = None
    for i, ((ids, n), (ref, ref_stats)) in enumerate(zip(calls, refs)):
        out = target.generate(ids, drafter=drafter, num_assistant_tokens=GAMMA, max_new_tokens=n)
        st = drafter.last_stats
        assert torch.equal(out, ref) and _stats_tuple(st) == _stats_tuple(ref_stats)
        assert st.mode == "graph" and st.graphs == {"round": True} and st.session_calls == i + 1, st
        (session,) = S._sessions[drafter].values()
        first = first or session
        # one session; its round was captured in the first call, so every later round is a replay
        assert session is first and session.round_step.graph is not None
        assert session.round_step.calls == sum(r[1].rounds for r in refs[:i + 1])
