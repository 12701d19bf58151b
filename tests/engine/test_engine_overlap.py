"""Asynchronous decoding (``EngineConfig.async_scheduling``, ``engine/overlap.py``): a pure decode step is launched
before the previous one's tokens are read, fed those tokens on the device. The tokens equal the synchronous
engine's and generate()'s; requests that stop at an eos while the next step is in flight, aborts and the prefix
cache stay correct."""

import pytest
import torch

from k3nn.engine.overlap import OverlapSteps
from k3nn.engine import RequestStatus
from k3nn.engine.speculative import DSparkEngineDrafter
from k3nn.layers.dspark import DSparkConfig, DSparkDrafter

from engine_helpers import CFG, model, rand_ids, reference  # noqa: F401 - fixture
from test_engine_sampling import _engine
from test_engine_spec import GAMMA


def _run(e, prompts, news, **params):
    ids = [e.add_request(p, max_new_tokens=n, **params) for p, n in zip(prompts, news)]
    streamed = {i: [] for i in ids}
    while e.has_unfinished():
        for o in e.step():
            streamed[o.request_id] += o.new_token_ids
    assert all(streamed[i] == e.requests[i].output for i in ids)  # every token reached the caller once
    return [e.requests[i].output for i in ids]


@pytest.fixture
def lookaheads(monkeypatch):
    """The lookahead launches (steps fed the previous step's tokens on the device)."""
    seen = []
    launch = OverlapSteps._launch_deferred

    def counted(engine, batch, feed=None, **kw):
        if feed is not None:
            seen.append(len(batch))
        return launch(engine, batch, feed, **kw)

    monkeypatch.setattr(OverlapSteps, "_launch_deferred", counted)
    return seen


def test_async_decoding_equals_generate(model, lookaheads):
    prompts = [rand_ids(13 + 6 * i, 500 + i) for i in range(3)]
    news = [9, 4, 12]
    e = _engine(model, cuda_graphs="static", async_scheduling=True)
    assert _run(e, prompts, news) == [reference(model, p, n) for p, n in zip(prompts, news)]
    assert lookaheads and max(lookaheads) == 3  # steps launched before the previous step's tokens were read
    assert e._ahead is None and not e.running
    # seeded sampling with penalties draws on the device from per-row seeds: the same tokens as without overlap
    kw = dict(do_sample=True, temperature=0.9, top_k=30, repetition_penalty=1.3, seed=11)
    sync = _engine(model, cuda_graphs="static")
    assert _run(e, prompts, news, **kw) == _run(sync, prompts, news, **kw)
    with pytest.raises(TypeError, match="async_scheduling"):
        _engine(model, async_scheduling=1)


def test_a_stop_while_the_next_step_is_in_flight(model, lookaheads):
    """A request that ends at an eos had its next token computed already: the token is dropped and the prefix
    cache indexes only what the request kept (a follow-up turn over prompt + answer equals uncached
    generation)."""
    prompt = rand_ids(52, 510)
    full = reference(model, prompt, 30)
    eos = next(t for i, t in enumerate(full) if full.index(t) == i >= 14)  # prompt + answer cross a page (64)
    cut = full[:full.index(eos) + 1]
    other = rand_ids(22, 511)
    e = _engine(model, cuda_graphs="static", async_scheduling=True)
    outs = _run(e, [prompt, other], [30, 30], eos_token_id=eos)
    sync = _engine(model, cuda_graphs="static")
    assert outs == _run(sync, [prompt, other], [30, 30], eos_token_id=eos)
    assert outs[0] == cut and lookaheads and len(prompt) + len(cut) > 64
    turn = prompt + cut + rand_ids(9, 512)
    hits = [x.metrics()["cache_hits"] for x in (e, sync)]
    assert _run(e, [turn], [6]) == _run(sync, [turn], [6]) == [reference(model, turn, 6)]
    # the answer's page and decode state were kept as without overlap: the follow-up turn hits the same way
    gained = [x.metrics()["cache_hits"] - h for x, h in zip((e, sync), hits)]
    assert gained[0] == gained[1] > 0
    # an abort while a step is in flight: the other request goes on unchanged
    e2 = _engine(model, cuda_graphs="static", async_scheduling=True)
    a = e2.add_request(prompt, max_new_tokens=20)
    b = e2.add_request(other, max_new_tokens=20)
    for _ in range(4):
        e2.step()
    assert e2._ahead is not None
    e2.abort(a)
    while e2.has_unfinished():
        e2.step()
    assert e2.requests[b].output == reference(model, other, 20)
    assert e2.requests[a].status == RequestStatus.ABORTED


def test_steps_that_are_not_pure_decodes_run_as_before(model, lookaheads):
    """A request arriving while decodes are in flight is scheduled after the deferred step is read (no lookahead
    while anything waits), and runs to the same tokens."""
    e = _engine(model, cuda_graphs="static", async_scheduling=True)
    p, q = rand_ids(17, 520), rand_ids(29, 521)
    a = e.add_request(p, max_new_tokens=10)
    for _ in range(3):
        e.step()
    b = e.add_request(q, max_new_tokens=7)
    while e.has_unfinished():
        e.step()
    assert e.requests[a].output == reference(model, p, 10)
    assert e.requests[b].output == reference(model, q, 7)
    assert lookaheads  # steps ran ahead (the first request alone, then both)


class _BigramRounds(DSparkEngineDrafter):
    """A DSpark engine drafter whose greedy rounds draft from a bigram table on the device (each draft: the token
    that followed the previous one in the reference continuations), so rounds accept 0 to all of their drafts."""

    def __init__(self, model, next_of):
        cfg = DSparkConfig.for_target(model.config, num_layers=1, num_heads=2, block_size=GAMMA)
        super().__init__(DSparkDrafter(cfg, model, dtype=torch.float64), 64, 64, "cpu")
        self.next_of = next_of

    def step_drafts(self, tables, cached, anchor, n, L):
        out, t = [], anchor
        for _ in range(n):
            t = self.next_of[t]
            out.append(t)
        return torch.stack(out, 1)


def test_async_rounds_equal_the_synchronous_engine(model, lookaheads):
    """Greedy speculative rounds launched before the last round's acceptance is read (staged at its least, the
    accepted count added on the device) give the synchronous engine's tokens and generate()'s, with windows that
    accept none to all of their drafts, a stop inside a window, rows of different draft budgets and decode-state
    retention across page boundaries."""
    prompts = [rand_ids(43 + 9 * i, 530 + i) for i in range(3)]
    news = [41, 17, 30]
    refs = [reference(model, p, n) for p, n in zip(prompts, news)]
    next_of = torch.randint(0, CFG.vocab_size, (CFG.vocab_size,), generator=torch.Generator().manual_seed(3))
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        seq = p[-1:] + ref
        for k, (a, b) in enumerate(zip(seq, seq[1:])):
            if (k + i) % 7:  # every seventh draft wrong
                next_of[a] = b
    eos = refs[2][19]
    turn = prompts[0] + refs[0] + rand_ids(7, 539)  # a follow-up turn over prompt + answer (past a page)
    outs, rounds, gained = {}, {}, {}
    for mode in (False, True):
        e = _engine(model, _BigramRounds(model, next_of), cuda_graphs="static", num_speculative_tokens=GAMMA,
                    async_scheduling=mode)
        outs[mode] = _run(e, prompts, news) + _run(e, prompts[2:], [30], eos_token_id=eos)
        m = e.metrics()
        rounds[mode] = (m["spec_rounds"], m["spec_accepted"])
        hits = m["cache_hits"]
        outs[mode].append(_run(e, [turn], [5])[0])
        gained[mode] = e.metrics()["cache_hits"] - hits
    assert outs[True] == outs[False]
    assert outs[True][:3] == refs and outs[True][3] == refs[2][:refs[2].index(eos) + 1]
    assert outs[True][4] == reference(model, turn, 5)
    assert lookaheads and rounds[True][1] > rounds[True][0]  # rounds launched ahead; most drafts accepted
    # the answers' pages and decode states were indexed as without overlap: the follow-up turn hits the same way
    assert gained[True] == gained[False] > 0


@pytest.mark.parametrize("asynchronous", [False, True])
def test_rounds_keep_the_decode_state_of_the_page_boundaries_they_cross(model, asynchronous):
    """Decode-state retention with speculation: a verify round moves a request's length by 1 + its accepted
    drafts, so it steps over most page boundaries; its commit exports the KDA state at the boundary it crosses.
    A follow-up turn over prompt + answer then reuses as much of the prefix cache as after plain decoding (prompt
    lengths whose rounds never land on the boundary itself)."""
    for L in (40, 44):
        p = rand_ids(L, 530)
        ref = reference(model, p, 41)
        next_of = torch.randint(0, CFG.vocab_size, (CFG.vocab_size,), generator=torch.Generator().manual_seed(3))
        seq = p[-1:] + ref
        for k, (a, b) in enumerate(zip(seq, seq[1:])):
            if k % 7:  # every seventh draft wrong
                next_of[a] = b
        turn = p + ref + rand_ids(7, 539)
        computed = {}
        for name, drafter in (("plain", None), ("spec", _BigramRounds(model, next_of))):
            e = _engine(model, drafter, cuda_graphs="static", num_speculative_tokens=GAMMA if drafter else None,
                        async_scheduling=asynchronous)
            assert _run(e, [p], [41]) == [ref]
            before = e.metrics()["computed_prompt_tokens"]
            assert _run(e, [turn], [5]) == [reference(model, turn, 5)]
            computed[name] = e.metrics()["computed_prompt_tokens"] - before
            # no slot leaked: every snapshot slot in use is one the prefix index holds
            held = sum(x.snapshot is not None for x in e.prefix.entries.values())
            assert e.pools.snapshots.num_free + held == e.pools.snapshots.num_slots
        assert computed["spec"] == computed["plain"] <= len(turn) - 64, (L, computed)  # the answer's page hit


def test_boundary_export_copies_only_the_exporting_rows(model, monkeypatch):
    """ModelRunner._export_states copies a fixed number of states (the planner's cap) whatever the batch: the
    exporting rows' running states land in their slots, every other snapshot slot keeps its content, with and
    without rows exporting."""
    import k3nn.engine.runner as runner_mod

    monkeypatch.setattr(runner_mod, "MAX_BOUNDARY_EXPORTS", 2)
    e = _engine(model, cuda_graphs="static")
    run, pool = e.pools.running, e.pools.snapshots
    g = torch.Generator().manual_seed(0)
    for t in run.recurrent + run.conv + pool.recurrent + pool.conv:
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    before = [t.clone() for t in pool.recurrent + pool.conv]
    slots = torch.tensor([0, 1, 2, 3])
    e.runner._export_states(torch.zeros(4, dtype=torch.bool), slots, torch.full((4,), -1))
    assert all(torch.equal(a, b) for a, b in zip(before, pool.recurrent + pool.conv))  # nothing exported
    export = torch.tensor([False, True, False, True])
    e.runner._export_states(export, slots, torch.tensor([-1, 5, 2, 7]))
    for a, b, src in zip(before, pool.recurrent + pool.conv, run.recurrent + run.conv):
        assert torch.equal(b[5], src[1]) and torch.equal(b[7], src[3])
        others = [i for i in range(b.shape[0]) if i not in (5, 7)]
        assert torch.equal(b[others], a[others])
