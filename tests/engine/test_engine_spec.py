"""Speculative decoding and preemption inside the engine: greedy output equal to generate() whatever the drafts,
sampled output with the target's distribution, no leaked pages, preempted requests resume identically."""

import pytest
import torch

from k3nn.engine import Engine, EngineConfig, RequestStatus
from k3nn.layers.dspark import DraftProposal, DSparkConfig, DSparkDrafter
from k3nn.spec import SpecOptions

from engine_helpers import CFG, model, rand_ids, reference  # noqa: F401 - fixture

GAMMA = 4


class OracleDrafter:
    """Proposes the target's own greedy continuation of each known prompt, wrong at draft ``wrong`` (0-based) of
    every window: a correct engine then accepts exactly min(wrong, n) drafts per window."""

    target_layers: list[int] = []

    def __init__(self, refs: dict[tuple, list[int]], wrong: int):
        self.refs, self.wrong = refs, wrong
        self.windows: list[int] = []

    def write(self, taps, positions, slots):
        pass

    def propose(self, rows, n):
        toks = []
        for r in rows:
            prompt = next(p for p in self.refs if tuple(r.tokens[:len(p)]) == p)
            done = len(r.tokens) - len(prompt)
            ref = self.refs[prompt] + [0] * (n + 1)
            d = ref[done:done + n]
            if self.wrong < n:
                d[self.wrong] = (d[self.wrong] + 1) % CFG.vocab_size
            toks.append(d)
            self.windows.append(n)
        return DraftProposal(torch.tensor(toks), None, None)


def _engine(model, drafter=None, **kw):
    cfg = dict(max_num_seqs=4, num_pages=64, num_snapshots=8, max_num_batched_tokens=256)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg), drafter=drafter)


def _leak_free(e):
    assert not e.running and not e.waiting
    alloc = e.pools.allocator
    cached = {x.page for x in e.prefix.entries.values()} if e.prefix is not None else set()
    assert alloc.num_free == alloc.num_blocks - len(cached)
    assert all(o is None for o in e.row_owner)


@pytest.mark.parametrize("wrong", [0, 2, GAMMA])
def test_greedy_equals_generate_for_every_acceptance(model, wrong):
    prompts = [rand_ids(20 + 9 * i, 40 + i) for i in range(5)]
    n = 13
    refs = {tuple(p): reference(model, p, n) for p in prompts}
    d = OracleDrafter(refs, wrong)
    e = _engine(model, d, num_speculative_tokens=GAMMA)
    assert e.generate(prompts, max_new_tokens=n) == [refs[tuple(p)] for p in prompts]
    reqs = list(e.requests.values())
    assert sum(r.spec_rounds for r in reqs) == e.metrics()["spec_rounds"] > 0
    assert sum(r.spec_accepted for r in reqs) == sum(min(wrong, w) for w in d.windows)
    m = e.metrics()
    if wrong == GAMMA:
        assert m["spec_accepted"] == m["spec_drafted"]
    if wrong == 0:
        assert m["spec_accepted"] == 0
    assert m["spec_acceptance_length"] == pytest.approx((m["spec_accepted"] + m["spec_rounds"]) / m["spec_rounds"])
    _leak_free(e)


def test_acceptance_counts_follow_the_drafts(model):
    p = rand_ids(33, 7)
    n = 15
    d = OracleDrafter({tuple(p): reference(model, p, n)}, 2)
    e = _engine(model, d, num_speculative_tokens=GAMMA)
    e.generate([p], max_new_tokens=n)
    r = next(iter(e.requests.values()))
    assert r.spec_drafted == sum(d.windows) and r.spec_accepted == sum(min(2, w) for w in d.windows)
    assert len(r.output) == n


def test_per_request_draft_count_and_eos_inside_the_window(model):
    prompts = [rand_ids(25, 50 + i) for i in range(3)]
    n = 12
    refs = {tuple(p): reference(model, p, n) for p in prompts}
    e = _engine(model, OracleDrafter(refs, GAMMA), num_speculative_tokens=GAMMA)
    eos = refs[tuple(prompts[0])][5]  # a token inside a fully accepted window
    ids = [e.add_request(prompts[0], max_new_tokens=n, eos_token_id=eos),
           e.add_request(prompts[1], max_new_tokens=n, num_speculative_tokens=0),
           e.add_request(prompts[2], max_new_tokens=n, num_speculative_tokens=1)]
    list(e.stream())
    out0 = e.requests[ids[0]].output
    assert out0 == refs[tuple(prompts[0])][:out0.index(eos) + 1] and e.requests[ids[0]].finish_reason == "stop"
    assert e.requests[ids[1]].output == refs[tuple(prompts[1])] and e.requests[ids[1]].spec_rounds == 0
    r2 = e.requests[ids[2]]
    assert r2.output == refs[tuple(prompts[2])] and r2.spec_drafted == r2.spec_rounds
    _leak_free(e)


@pytest.fixture(scope="module")
def dspark(model):
    c = DSparkConfig.for_target(model.config, num_layers=1, num_heads=2, block_size=GAMMA)
    return DSparkDrafter(c, model, dtype=torch.float64)


def test_dspark_drafter_with_shared_prefixes_eviction_and_preemption(model, dspark):
    """A real (untrained) DSpark drafter: any acceptance; shared prefixes (prefix hits carry the drafter's
    context), a pool small enough to evict and preempt; output equals the non-speculative engine and
    generate(). Its greedy drafts reach the verify step on the device."""
    base = rand_ids(140, 3)
    prompts = [base[:50 + 25 * i] + rand_ids(5 + i, 60 + i) for i in range(4)] + [rand_ids(30, 90)]
    n = 24
    spec = _engine(model, dspark, max_num_seqs=3, num_pages=5, num_snapshots=3, max_num_batched_tokens=96)
    fed = []  # greedy DSpark drafts stay on the device and are copied into the verify step's inputs there
    feed = spec.runner._feed_device_drafts
    spec.runner._feed_device_drafts = lambda rows, B, T: (fed.append(sum(w.device_drafts is not None for w in rows)),
                                                          feed(rows, B, T))
    assert spec.generate(prompts, max_new_tokens=n) == [reference(model, p, n) for p in prompts]
    m = spec.metrics()
    assert m["spec_rounds"] > 0 and m["cache_hits"] > 0 and sum(fed) > 0
    _leak_free(spec)


@pytest.mark.parametrize("drafts", [False, True])
def test_preemption_by_recompute_resumes_identically(model, dspark, drafts):
    """Two requests that each fit the pool alone but not together once they have decoded: the newer one is
    preempted (pages freed, re-queued), recomputed and resumed with the same tokens."""
    prompts = [rand_ids(60, 21), rand_ids(61, 22)]
    n = 68
    e = _engine(model, dspark if drafts else None, max_num_seqs=2, num_pages=3, num_snapshots=2)
    assert e.generate(prompts, max_new_tokens=n) == [reference(model, p, n) for p in prompts]
    m = e.metrics()
    assert m["preemptions"] > 0 and m["recomputed_tokens"] > 0
    assert sum(r.num_preemptions for r in e.requests.values()) == m["preemptions"]
    _leak_free(e)


def test_small_requests_pass_a_large_one_that_does_not_fit_yet(model):
    big = rand_ids(450, 11)  # 8 pages with its answer: the whole pool
    small = [rand_ids(20, 12 + i) for i in range(4)]
    e = _engine(model, max_num_seqs=4, num_pages=8, num_snapshots=2, enable_prefix_caching=False)
    first = e.add_request(small[0], max_new_tokens=20)  # holds a page while it decodes
    e.step()
    b = e.add_request(big, max_new_tokens=10)
    rest = [e.add_request(p, max_new_tokens=10) for p in small[1:]]
    e.step()
    assert e.requests[b].status == RequestStatus.WAITING
    assert all(e.requests[r].status == RequestStatus.RUNNING for r in rest)  # admitted past the big one
    list(e.stream())
    assert e.requests[b].output == reference(model, big, 10)
    assert e.requests[first].output == reference(model, small[0], 20)
    for r, p in zip(rest, small[1:]):
        assert e.requests[r].output == reference(model, p, 10)
    _leak_free(e)


def test_sampled_speculation_keeps_the_target_distribution(model, dspark):
    """The first two sampled tokens after one prompt (the second one verified by rejection sampling against the
    drafter's distribution) against the exact target joint distribution p(t1) p(t2 | t1): total variation
    within the sampling noise of N independent requests."""
    prompt = rand_ids(12, 5)
    N, temp = 300, 0.35
    e = _engine(model, dspark, max_num_seqs=64, num_pages=128, num_speculative_tokens=1)
    outs = e.generate([prompt] * N, max_new_tokens=3, do_sample=True, temperature=temp)
    m = e.metrics()
    assert m["spec_rounds"] >= N and 0 < m["spec_accepted"] < m["spec_drafted"]
    with torch.no_grad():
        p1 = (model(torch.tensor([prompt])).logits[0, -1].float() / temp).softmax(-1)
        firsts = sorted(set(range(CFG.vocab_size)))
        p2 = (model(torch.tensor([prompt + [t] for t in firsts])).logits[:, -1].float() / temp).softmax(-1)
    exact = (p1[:, None] * p2).flatten()  # [V·V] joint of (t1, t2)
    counts = torch.zeros_like(exact)
    for o in outs:
        counts[o[0] * CFG.vocab_size + o[1]] += 1
    tv = 0.5 * float((counts / N - exact).abs().sum())
    noise = 0.5 * float((2 * exact * (1 - exact) / (torch.pi * N)).sqrt().sum())  # E[TV] of an exact sampler
    assert tv < 1.3 * noise + 0.02, (tv, noise)


def test_drafter_failure_falls_back_to_plain_decoding(model, caplog):
    class Broken(OracleDrafter):
        def propose(self, rows, n):
            raise RuntimeError("drafter down")

    p = rand_ids(21, 8)
    e = _engine(model, Broken({}, 0), num_speculative_tokens=GAMMA)
    assert e.generate([p], max_new_tokens=6) == [reference(model, p, 6)]
    assert "drafter down" in caplog.text and e.metrics()["spec_rounds"] == 0


def test_speculation_arguments_are_checked(model):
    e = _engine(model)
    with pytest.raises(ValueError, match="drafter"):
        e.add_request([1, 2, 3], num_speculative_tokens=2)
    with pytest.raises(TypeError, match="num_speculative_tokens"):
        _engine(model, OracleDrafter({}, 0)).add_request([1, 2], num_speculative_tokens=1.5)
    with pytest.raises(ValueError, match="replay"):
        _engine(model, spec=SpecOptions(rollback="slots"))
    with pytest.raises(TypeError, match="propose"):
        _engine(model, object())


def test_context_tokens_view_reads_like_the_list():
    """The view of prompt + output (+ drafts) indexes, slices and iterates like the concatenated list."""
    from k3nn.engine.request import ContextTokens

    for parts in (([1, 2, 3], [4, 5]), ([], [7]), ([8, 9], []), ([], []), ([1, 2], [3], [4, 5, 6]), ([], [], [9])):
        v, ref = ContextTokens(*parts), [t for p in parts for t in p]
        assert len(v) == len(ref) and list(v) == ref
        for i in range(-len(ref), len(ref)):
            assert v[i] == ref[i]
        for sl in (slice(None), slice(1, None), slice(None, -1), slice(-3, None), slice(0, 10), slice(None, None, 2),
                   slice(2, 1), slice(-1, None, -1)):
            assert v[sl] == ref[sl]
        with pytest.raises(IndexError):
            v[len(ref)]
