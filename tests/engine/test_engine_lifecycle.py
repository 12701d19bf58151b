"""Engine request lifecycle under bad input and failures: validation in add_request (nothing queued on error),
a failure inside step() fails only its request (or its forward's requests), generate() checks every prompt first,
idempotent abort, stall detection, fresh randomness for unseeded sampling, generate()'s default eos."""

import random

import numpy as np
import pytest
import torch

from k3nn.cache.hybrid import CacheFullError
from k3nn.engine import (Engine, EngineConfig, EngineStalledError, RequestFailedError, RequestStatus,
                         SamplingParams)
from k3nn.generation import GenerationConfig

from engine_helpers import CFG, model, rand_ids, reference  # noqa: F401  (model is a fixture)


def engine(model, cls=Engine, **kw):
    base = dict(max_num_seqs=4, num_pages=24, num_snapshots=4, max_num_batched_tokens=4096)
    base.update(kw)
    return cls(model, EngineConfig(**base))


def assert_no_leaks(e):
    """Nothing live: only the prefix index holds pages and snapshot slots, no row has an owner."""
    assert not e.has_unfinished() and not e.waiting
    assert all(o is None for o in e.row_owner)
    live = [r for r in e.requests.values() if r.status in (RequestStatus.RUNNING, RequestStatus.PREFILLED)]
    assert not live and not e.running
    for r in e.requests.values():
        assert r.row is None and not r.blocks and r.decode_snap is None
    alloc = e.pools.allocator
    if e.prefix is None:
        assert alloc.num_free == alloc.num_blocks and e.pools.snapshots.num_free == e.pools.snapshots.num_slots
        return
    e.prefix.check_invariants()
    refs: dict[int, int] = {}
    for x in e.prefix.entries.values():
        refs[x.page] = refs.get(x.page, 0) + 1
    assert all(alloc.refcount(b) == c for b, c in refs.items())
    assert alloc.num_free == alloc.num_blocks - len(refs)
    snaps = sum(x.snapshot is not None for x in e.prefix.entries.values())
    assert e.pools.snapshots.num_free == e.pools.snapshots.num_slots - snaps


GOOD = rand_ids(20, 1)
BAD_REQUESTS = [  # (prompt, kwargs, error type, text the message must contain)
    ([1.7, 2.2], {}, TypeError, "prompt"),
    ([1, True], {}, TypeError, "prompt"),
    (torch.tensor([1.0, 2.0]), {}, TypeError, "prompt"),
    ("hello", {}, TypeError, "prompt"),
    (5, {}, TypeError, "prompt"),
    ([], {}, ValueError, "empty"),
    ([1, CFG.vocab_size], {}, ValueError, "vocab_size"),
    ([-1, 2], {}, ValueError, "vocab_size"),
    (torch.tensor([[1, 2]]), {}, ValueError, "1-D"),
    (GOOD, dict(max_new_tokens=2.5), TypeError, "max_new_tokens"),
    (GOOD, dict(max_new_tokens=True), TypeError, "max_new_tokens"),
    (GOOD, dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (GOOD, dict(boundaries=[21]), ValueError, "boundaries"),
    (GOOD, dict(boundaries=[-1]), ValueError, "boundaries"),
    (GOOD, dict(boundaries=[10.0]), TypeError, "boundaries"),
    (GOOD, dict(boundaries=5), TypeError, "boundaries"),
    (GOOD, dict(do_sample="yes"), TypeError, "do_sample"),
    (GOOD, dict(do_sample=True, temperature=0.0), ValueError, "temperature"),
    (GOOD, dict(temperature=float("nan")), ValueError, "temperature"),
    (GOOD, dict(temperature="hot"), TypeError, "temperature"),
    (GOOD, dict(top_k=-1), ValueError, "top_k"),
    (GOOD, dict(top_k=1.5), TypeError, "top_k"),
    (GOOD, dict(top_p=0.0), ValueError, "top_p"),
    (GOOD, dict(top_p=1.5), ValueError, "top_p"),
    (GOOD, dict(seed=-1), ValueError, "seed"),
    (GOOD, dict(seed=1.0), TypeError, "seed"),
    (GOOD, dict(eos_token_id=1.5), TypeError, "eos_token_id"),
    (GOOD, dict(eos_token_id=[3, -2]), ValueError, "eos_token_id"),
    (GOOD, dict(request_id=7), TypeError, "request_id"),
    (GOOD, dict(prefill_only="no"), TypeError, "prefill_only"),
    (GOOD, dict(params=SamplingParams(), max_new_tokens=2), TypeError, "not both"),
    (GOOD, dict(params={"max_new_tokens": 2}), TypeError, "SamplingParams"),
    (GOOD, dict(nonsense=1), TypeError, "nonsense"),
    (GOOD, dict(max_new_tokens=3_000), CacheFullError, "num_pages"),
    (GOOD, dict(max_new_tokens=10_000), ValueError, "max_position_embeddings"),
]


@pytest.mark.parametrize("prompt,kw,err,text", BAD_REQUESTS)
def test_add_request_rejects_bad_input_and_queues_nothing(model, prompt, kw, err, text):
    e = engine(model)
    free = e.pools.allocator.num_free
    with pytest.raises(err, match=text):
        e.add_request(prompt, **kw)
    assert not e.requests and not e.waiting and e.pools.allocator.num_free == free
    assert e.metrics()["prompt_tokens"] == 0
    assert e.generate([GOOD], max_new_tokens=2) == [reference(model, GOOD, 2)]  # the engine still serves


def test_integer_like_inputs_are_accepted(model):
    e = engine(model)
    ids = [e.add_request(np.array(GOOD), max_new_tokens=np.int64(2), boundaries=[np.int32(10)]),
           e.add_request(torch.tensor(GOOD), max_new_tokens=2),
           e.add_request(tuple(GOOD), max_new_tokens=2, request_id="mine")]
    list(e.stream())
    assert [e.requests[i].output for i in ids] == [reference(model, GOOD, 2)] * 3
    with pytest.raises(ValueError, match="'mine'"):
        e.add_request(GOOD, request_id="mine")


def test_duplicate_and_mixed_generate_adds_nothing(model):
    e = engine(model)
    with pytest.raises(TypeError, match=r"prompts\[1\].*prompt"):
        e.generate([GOOD, [1.7, 2.2]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompts\[2\].*vocab_size"):
        e.generate([GOOD, GOOD, [CFG.vocab_size]], max_new_tokens=2)
    assert not e.requests and not e.waiting
    assert e.generate([GOOD], max_new_tokens=2) == [reference(model, GOOD, 2)]  # nothing left over
    assert len(e.requests) == 1


class PoisonEngine(Engine):
    """Fault injection: NaN logits for the requests in ``nan_ids``; a forward containing a request of
    ``crash_ids`` raises (once per request); the stop check of a request in ``commit_ids`` raises."""

    nan_ids: set = set()
    crash_ids: set = set()
    commit_ids: set = set()

    def _forward(self, rows, *args):
        hit = [w.req for w in rows if w.req.request_id in self.crash_ids]
        if hit:
            self.crash_ids = self.crash_ids - {r.request_id for r in hit}
            raise RuntimeError("injected forward failure")
        out = super()._forward(rows, *args)
        logits = out.logits.clone()  # an inference tensor
        for b, w in enumerate(rows):
            if w.req.request_id in self.nan_ids:
                logits[b] = float("nan")
        out.logits = logits
        return out

    def _retain_finished(self, r):
        if r.request_id in self.commit_ids:
            raise OSError("injected commit failure")
        return super()._retain_finished(r)


def _run(e):
    outs = {}
    for o in e.stream():
        outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.mark.parametrize("do_sample", [False, True])
def test_nan_logits_fail_only_that_request(model, do_sample):
    e = engine(model, PoisonEngine)
    prompts = [rand_ids(30 + 17 * i, 10 + i) for i in range(3)]
    a = e.add_request(prompts[0], max_new_tokens=3)
    bad = e.add_request(prompts[1], max_new_tokens=3, do_sample=do_sample, seed=1)
    c = e.add_request(prompts[2], max_new_tokens=3)
    e.nan_ids = {bad}
    outs = _run(e)
    r = e.requests[bad]
    assert r.status == RequestStatus.FAILED and r.finish_reason == "error" and "NaN" in r.error
    last = outs[bad][-1]
    assert last.finished and last.finish_reason == "error" and "NaN" in last.error
    assert e.requests[a].output == reference(model, prompts[0], 3)
    assert e.requests[c].output == reference(model, prompts[2], 3)
    m = e.metrics()
    assert m["failed"] == 1 and m["finished"] == 2
    assert_no_leaks(e)


def test_commit_failure_fails_only_that_request(model):
    e = engine(model, PoisonEngine)
    prompts = [rand_ids(70, 20), rand_ids(5, 21)]
    bad = e.add_request(prompts[0], max_new_tokens=2)
    ok = e.add_request(prompts[1], max_new_tokens=4)
    e.commit_ids = {bad}
    _run(e)
    assert e.requests[bad].status == RequestStatus.FAILED and "injected commit failure" in e.requests[bad].error
    assert e.requests[ok].output == reference(model, prompts[1], 4)
    assert_no_leaks(e)


def test_forward_failure_fails_its_batch_and_the_engine_goes_on(model):
    """A long prefill runs in its own forward (after the decodes): its crash fails the prefill batch only."""
    e = engine(model, PoisonEngine, mixed_forward_max_tokens=8)
    short = [rand_ids(3, 30), rand_ids(4, 31)]
    ids = [e.add_request(p, max_new_tokens=5) for p in short]
    e.step()
    e.step()  # both decoding now
    long_a = e.add_request(rand_ids(90, 32), max_new_tokens=2)
    long_b = e.add_request(rand_ids(100, 33), max_new_tokens=2)
    e.crash_ids = {long_a}
    outs = _run(e)
    for rid in (long_a, long_b):  # same prefill forward
        assert e.requests[rid].status == RequestStatus.FAILED and "forward" in e.requests[rid].error
        assert outs[rid][-1].finish_reason == "error"
    assert [e.requests[i].output for i in ids] == [reference(model, p, 5) for p in short]
    assert_no_leaks(e)
    p = rand_ids(90, 32)
    assert e.generate([p], max_new_tokens=2) == [reference(model, p, 2)]  # usable afterwards
    assert_no_leaks(e)


def test_generate_reports_failures_after_finishing_the_others(model):
    e = engine(model, PoisonEngine)
    prompts = [rand_ids(10, 40), rand_ids(12, 41)]
    e.nan_ids = {"req-1"}
    with pytest.raises(RequestFailedError, match="req-1.*NaN") as info:
        e.generate(prompts, max_new_tokens=3)
    assert set(info.value.failures) == {"req-1"}
    assert e.requests["req-0"].output == reference(model, prompts[0], 3)
    assert_no_leaks(e)


def test_abort_is_idempotent_and_names_unknown_ids(model):
    e = engine(model)
    done = e.add_request(GOOD, max_new_tokens=2)
    list(e.stream())
    assert e.abort(done) is False
    assert e.requests[done].status == RequestStatus.FINISHED and e.requests[done].finish_reason == "length"
    assert e.metrics()["finished"] == 1 and e.metrics()["aborted"] == 0
    with pytest.raises(KeyError, match="'no-such-id'"):
        e.abort("no-such-id")
    with pytest.raises(KeyError, match="'no-such-id'"):
        e.release("no-such-id")
    w = e.add_request(GOOD, max_new_tokens=2)
    assert e.abort(w) is True and e.abort(w) is False
    assert e.requests[w].status == RequestStatus.ABORTED and e.metrics()["aborted"] == 1
    assert_no_leaks(e)


def test_stream_raises_when_nothing_can_progress(model):
    """Prefilled requests (held for export) take every row: a new request can never be admitted until they are
    released; stream() says so instead of spinning, and generate() leaves none of its requests queued."""
    e = engine(model, max_num_seqs=1)
    held = e.add_request(rand_ids(40, 50), prefill_only=True)
    list(e.stream())
    assert e.requests[held].status == RequestStatus.PREFILLED
    waiting = e.add_request(GOOD, max_new_tokens=2)
    with pytest.raises(EngineStalledError, match="release"):
        list(e.stream())
    with pytest.raises(EngineStalledError, match="rows"):
        e.generate([GOOD], max_new_tokens=2)
    assert [r.request_id for r in e.waiting] == [waiting]  # generate() aborted its own request
    e.release(held)
    list(e.stream())
    assert e.requests[waiting].output == reference(model, GOOD, 2)
    assert_no_leaks(e)


def test_stream_raises_when_pages_are_held(model):
    e = engine(model, num_pages=4, max_num_seqs=2, enable_prefix_caching=False)
    held = e.add_request(rand_ids(150, 51), prefill_only=True)  # 3 of the 4 pages
    list(e.stream())
    e.add_request(rand_ids(100, 52), max_new_tokens=2)  # needs 2
    with pytest.raises(EngineStalledError, match="pages"):
        list(e.stream())
    e.release(held)
    list(e.stream())
    assert_no_leaks(e)


def test_unseeded_sampling_is_fresh_and_seeded_is_reproducible(model):
    p = rand_ids(10, 60)
    free = dict(max_new_tokens=8, do_sample=True, temperature=1.0)
    e1, e2 = engine(model), engine(model)
    a, b = e1.generate([p, p], **free)
    (c,) = e2.generate([p], **free)
    assert len({tuple(a), tuple(b), tuple(c)}) == 3  # 8 draws from 256 tokens: a collision is negligible
    seeded = dict(free, seed=123)
    assert e1.generate([p, p], **seeded) == e2.generate([p, p], **seeded)


def test_default_eos_is_generate_s(model):
    p = rand_ids(15, 70)
    ref = reference(model, p, 6)
    stop = ref[2]
    model.generation_config = GenerationConfig(eos_token_id=stop)  # generate() reads this before the config's
    try:
        expect = model.generate(torch.tensor([p]), max_new_tokens=6)[0, len(p):].tolist()
        out = engine(model).generate([p], max_new_tokens=6)[0]
    finally:
        del model.generation_config
    cut = ref.index(stop) + 1
    assert out == ref[:cut] == expect[:cut]
    assert engine(model).generate([p], max_new_tokens=6)[0] == ref  # tiny config: no eos


def test_random_workload_with_invalid_and_aborted_requests(model):
    """A few dozen requests over time, shared prefixes, small pools (eviction), some invalid (rejected, nothing
    queued), some aborted at random points: every other greedy output equals uncached generation, no leaks."""
    rng = random.Random(0)
    system = rand_ids(80, 80)
    e = engine(model, max_num_seqs=3, num_pages=10, num_snapshots=3, max_num_batched_tokens=150)
    pending = []
    for i in range(36):
        if i % 6 == 5:
            pending.append(("bad", rng.choice(BAD_REQUESTS)))
        else:
            base = system[:rng.choice([0, 64, 80])]
            pending.append(("ok", (base + rand_ids(rng.randint(1, 50), 300 + i), rng.randint(1, 3),
                                   rng.random() < 0.15)))
    valid, aborted = {}, set()
    steps = 0
    while pending or e.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if not pending:
                break
            kind, item = pending.pop(0)
            n_req, n_wait, free = len(e.requests), len(e.waiting), e.pools.allocator.num_free
            if kind == "bad":
                prompt, kw, err, _ = item
                with pytest.raises(err):
                    e.add_request(prompt, **kw)
                assert (len(e.requests), len(e.waiting), e.pools.allocator.num_free) == (n_req, n_wait, free)
            else:
                prompt, n, abort = item
                rid = e.add_request(prompt, max_new_tokens=n, boundaries=[len(prompt) // 2])
                valid[rid] = (prompt, n)
                if abort:
                    aborted.add(rid)
        for rid in list(aborted):
            if e.requests[rid].status not in (RequestStatus.ABORTED,) and rng.random() < 0.5:
                e.abort(rid)
                assert e.abort(rid) is False
        e.step()
        steps += 1
        assert steps < 2000
    for rid in aborted:
        assert e.abort(rid) is False
    for rid, (prompt, n) in valid.items():
        r = e.requests[rid]
        if r.status == RequestStatus.ABORTED:
            assert rid in aborted
            continue
        assert r.status == RequestStatus.FINISHED and r.output == reference(model, prompt, n), rid
    assert sum(e.requests[r].status == RequestStatus.ABORTED for r in aborted) > 0
    assert e.prefix.hits > 0
    assert_no_leaks(e)
