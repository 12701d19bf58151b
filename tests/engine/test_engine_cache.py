"""Engine + hybrid prefix cache: cache on == cache off, CoW, same-step rule, Marconi, eviction, budgets."""

import random

import pytest
import torch

from k3nn.cache.hybrid import CacheFullError
from k3nn.engine import Engine, EngineConfig, RequestStatus, SamplingParams

from engine_helpers import CFG, model, rand_ids, reference  # noqa: F401  (model is a fixture)


class RecordingEngine(Engine):
    """Records every forward: (rows, tokens per row, tokens already cached per row)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log = []

    def _forward(self, rows, *args):
        self.log.append(([w.req.row for w in rows], [w.num_new for w in rows], [w.req.num_computed for w in rows],
                         None))
        return super()._forward(rows, *args)


def engine(model, **kw):
    base = dict(max_num_seqs=4, num_pages=48, num_snapshots=8, max_num_batched_tokens=4096)
    base.update(kw)
    return RecordingEngine(model, EngineConfig(**base))


SHARED = rand_ids(150, 1)
PROMPTS = [SHARED + rand_ids(n, 10 + n) for n in (1, 50)] + [rand_ids(64, 2), rand_ids(3, 3)]


@pytest.mark.parametrize("mbt", [4096, 67])
def test_cache_on_equals_cache_off(model, mbt):
    """Same greedy tokens with prefix caching on (two rounds: fill, reuse) and off; a token budget that cuts
    prefills at an awkward offset (64 + 3)."""
    refs = [reference(model, p, 3) for p in PROMPTS]
    on = engine(model, max_num_batched_tokens=mbt)
    assert on.generate(PROMPTS, max_new_tokens=3) == refs
    assert on.generate(PROMPTS, max_new_tokens=3) == refs
    assert on.prefix.hits > 0 and on.metrics()["computed_prompt_tokens"] < on.metrics()["prompt_tokens"]
    off = engine(model, max_num_batched_tokens=mbt, enable_prefix_caching=False)
    assert off.generate(PROMPTS, max_new_tokens=3) == refs
    for rows, *_ in on.log + off.log:
        assert len(set(rows)) == len(rows)  # each request on its own running slot
    on.prefix.check_invariants()


def test_prompt_lengths_exact_multiples_of_the_block(model):
    prompts = [rand_ids(64 * k, 40 + k) for k in (1, 2, 3)]
    e = engine(model)
    first = e.generate(prompts, max_new_tokens=3)
    ids = [e.add_request(p, max_new_tokens=3) for p in prompts]
    list(e.stream())
    assert [e.requests[i].hit_len for i in ids] == [0, 64, 128]  # N−1 cap: never the whole prompt
    assert [e.requests[i].output for i in ids] == first == [reference(model, p, 3) for p in prompts]


def test_copy_on_write_keeps_the_shared_snapshot_intact(model):
    e = engine(model)
    base = SHARED[:140]
    e.generate([base], max_new_tokens=2)  # snapshot at the replay boundary 128
    entry = e.prefix.entries[e.prefix.hashes(base)[1]]
    before = [r[entry.snapshot].clone() for r in e.pools.snapshots.recurrent]
    a, b = base + rand_ids(30, 5), base + rand_ids(90, 6)
    ra, rb = e.add_request(a, max_new_tokens=4), e.add_request(b, max_new_tokens=4)
    list(e.stream())
    assert e.requests[ra].hit_len == e.requests[rb].hit_len == 128
    assert e.requests[ra].output == reference(model, a, 4) and e.requests[rb].output == reference(model, b, 4)
    for j, r in enumerate(e.pools.snapshots.recurrent):
        assert torch.equal(r[entry.snapshot], before[j])


def test_snapshots_of_this_step_are_invisible_until_committed(model):
    e = engine(model)
    p = SHARED + rand_ids(10, 7)
    r1, r2 = e.add_request(p, max_new_tokens=2), e.add_request(p, max_new_tokens=2)
    e.step()  # both admitted in the same step: neither may read the other's (unwritten) state
    assert e.requests[r1].hit_len == e.requests[r2].hit_len == 0
    list(e.stream())
    r3 = e.add_request(p, max_new_tokens=2)
    list(e.stream())
    assert e.requests[r3].hit_len == 128
    assert e.requests[r1].output == e.requests[r2].output == e.requests[r3].output == reference(model, p, 2)


@pytest.mark.parametrize("retention", ["marconi", "replay"])
def test_marconi_three_request_sequence(model, retention):
    """1st request caches only its replay boundary; the 2nd shares a 150-token prefix: its pages hit but no
    state exists there, so (Marconi) it exports a checkpoint at the junction 128; the 3rd hits at 128."""
    e = engine(model, retention=retention)
    ps = [SHARED + rand_ids(45 + 7 * i, 20 + i) for i in range(3)]  # replay boundaries at 192
    ids = []
    for p in ps:
        ids.append(e.add_request(p, max_new_tokens=2))
        list(e.stream())
    r1, r2, r3 = (e.requests[i] for i in ids)
    assert r1.hit_len == 0 and r2.hit_len == 0 and r2.kv_len == 128
    snaps = sorted(x.end for x in e.prefix.entries.values() if x.snapshot is not None)
    if retention == "marconi":
        assert r3.hit_len == 128 and 128 in snaps
    else:
        assert r3.hit_len == 0 and 128 not in snaps
    assert [r.output for r in (r1, r2, r3)] == [reference(model, p, 2) for p in ps]


@pytest.mark.parametrize("retain", [True, False])
def test_next_turn_reuses_the_answer(model, retain):
    """Decode-state retention: turn 2 = turn-1 prompt + answer + more resumes past the turn-1 prompt (from the
    state kept when decoding crossed 128), and generates what uncached generation does."""
    e = engine(model, retain_decode_state=retain)
    p1 = rand_ids(100, 50)
    r1 = e.add_request(p1, max_new_tokens=40)
    list(e.stream())
    p2 = p1 + e.requests[r1].output + rand_ids(10, 51)
    r2 = e.add_request(p2, max_new_tokens=3)
    list(e.stream())
    assert e.requests[r2].hit_len == (128 if retain else 64)
    assert e.requests[r2].output == reference(model, p2, 3)
    assert e.pools.snapshots.num_free == e.pools.snapshots.num_slots - sum(
        x.snapshot is not None for x in e.prefix.entries.values())  # no leaked private snapshot
    e.prefix.check_invariants()


def test_eviction_under_pressure_never_touches_running_requests(model):
    """A pool too small to keep every prefix: the index evicts (leaves first), running requests keep their
    pages and states, outputs stay exact."""
    prompts = [SHARED[:70 + 40 * (i % 2)] + rand_ids(30 + 11 * i, 60 + i) for i in range(6)]
    e = engine(model, num_pages=8, num_snapshots=2, max_num_seqs=3, eviction="marconi")
    assert e.generate(prompts, max_new_tokens=2) == [reference(model, p, 2) for p in prompts]
    st = e.prefix.stats()
    assert st["evicted_pages"] > 0 and st["evicted_snapshots"] > 0
    e.prefix.check_invariants()
    # everything finished: only the index holds pages
    assert e.pools.allocator.num_free == 8 - len(e.prefix.entries)


def test_request_past_the_model_context_is_rejected(model):
    """Prompt + max_new_tokens beyond max_position_embeddings: a ValueError naming both, nothing queued."""
    e = engine(model, num_pages=512)
    ctx = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_position_embeddings"):
        e.add_request(rand_ids(ctx - 4, 0), max_new_tokens=5)
    assert not e.waiting and not e.requests
    rid = e.add_request(rand_ids(ctx - 4, 0), max_new_tokens=4)  # exactly the context: accepted
    assert e.requests[rid].params.max_new_tokens == 4


def test_request_that_can_never_fit_is_rejected(model):
    e = engine(model, num_pages=2)
    with pytest.raises(CacheFullError, match="num_pages"):
        e.add_request(rand_ids(100, 0), max_new_tokens=40)
    with pytest.raises(ValueError, match="empty"):
        e.add_request([])
    with pytest.raises(ValueError, match="vocab_size"):
        e.add_request([CFG.vocab_size])
    with pytest.raises(ValueError, match="max_new_tokens"):
        e.add_request([1, 2], max_new_tokens=0)


def test_adaptive_budget_does_not_split_a_lone_prompt(model):
    p = rand_ids(300, 8)
    kw = dict(max_num_batched_tokens=512, max_num_seqs=4, reserve_per_seq=64)
    fixed = engine(model, budget="fixed", **kw)  # 512 − 4·64 = 256 prefill tokens per step
    adaptive = engine(model, budget="adaptive", **kw)  # 512 − (running decodes)·64
    rf = fixed.add_request(p, max_new_tokens=2)
    ra = adaptive.add_request(p, max_new_tokens=2)
    list(fixed.stream()), list(adaptive.stream())
    assert fixed.requests[rf].num_forwards == 2 and adaptive.requests[ra].num_forwards == 1
    assert [n for _, n, _, _ in fixed.log[:2]] == [[256], [44]]  # split on a 64-token boundary
    assert fixed.requests[rf].output == adaptive.requests[ra].output == reference(model, p, 2)
    assert adaptive.prefill_budget(2) == 512 - 128 and fixed.prefill_budget(2) == 256


def test_decodes_first_and_mixed_steps_use_contiguous_rows(model):
    e = engine(model, max_num_batched_tokens=100, max_num_seqs=3)
    a, b, c = rand_ids(40, 30), rand_ids(200, 31), rand_ids(90, 32)
    ra = e.add_request(a, max_new_tokens=6)
    e.step()
    rb, rc = e.add_request(b, max_new_tokens=3), e.add_request(c, max_new_tokens=3)
    while e.has_unfinished():
        before = len(e.log)
        e.step()
        step = e.log[before:]
        decode_rows = [rows for rows, n, _, _ in step if max(n) == 1]
        if len(step) == 2:  # mixed step: the decode batch runs first, on rows [0, D)
            assert decode_rows and decode_rows[0][0] == 0 and step[1][0][0] == len(step[0][0])
        for rows, n, _, _ in step:
            assert sum(x for x in n if x > 1) <= 100  # the prefill budget of this step
    assert [e.requests[r].output for r in (ra, rb, rc)] == [reference(model, a, 6), reference(model, b, 3),
                                                            reference(model, c, 3)]


def test_short_prefill_chunks_share_the_decode_forward(model):
    e = engine(model, mixed_forward_max_tokens=64)
    a, b = rand_ids(30, 33), rand_ids(40, 34)
    ra = e.add_request(a, max_new_tokens=4)
    e.step()
    rb = e.add_request(b, max_new_tokens=2)
    e.step()
    rows, n, cached, _ = e.log[-1]
    assert len(e.log) == 2 and n == [1, 40] and sorted(rows) == [0, 1] and cached == [30, 0]
    list(e.stream())
    assert e.requests[ra].output == reference(model, a, 4) and e.requests[rb].output == reference(model, b, 2)


def test_sampling_with_seed_is_reproducible_with_cache(model):
    p = SHARED + rand_ids(40, 9)
    sp = SamplingParams(max_new_tokens=5, do_sample=True, temperature=0.8, top_k=20, seed=3)
    on = engine(model)
    on.generate([SHARED + rand_ids(20, 11)], max_new_tokens=1)  # leaves a snapshot at 128
    a = on.requests[on.add_request(p, sp)]
    list(on.stream())
    off = engine(model, enable_prefix_caching=False)
    b = off.requests[off.add_request(p, sp)]
    list(off.stream())
    assert a.hit_len == 128 and a.output == b.output


def test_stream_abort_and_metrics(model):
    e = engine(model)
    r1 = e.add_request(rand_ids(50, 12), max_new_tokens=5, eos_token_id=[])
    r2 = e.add_request(rand_ids(80, 13), max_new_tokens=3)
    seen = {}
    for out in e.stream():
        seen.setdefault(out.request_id, []).extend(out.new_token_ids)
        if len(seen.get(r1, [])) == 2 and e.requests[r1].status == RequestStatus.RUNNING:
            e.abort(r1)
    assert e.requests[r1].status == RequestStatus.ABORTED and len(seen[r1]) == 2
    assert seen[r2] == e.requests[r2].output and len(seen[r2]) == 3
    m = e.metrics()
    assert m["ttft_mean_s"] > 0 and m["tpot_mean_s"] > 0 and m["generated_tokens"] == 5
    assert 0 <= m["cache_hit_rate"] <= 1 and m["throughput_tok_s"] > 0
    assert e.pools.running.num_slots == 4 and all(o is None for o in e.row_owner)


def test_long_random_workload_equals_uncached_generation(model):
    """Many requests with shared prefixes arriving over time, small pools (eviction), chunked prefills:
    every output equals uncached generation."""
    rng = random.Random(0)
    systems = [rand_ids(n, 100 + n) for n in (70, 130)]
    prompts, lens = [], []
    for i in range(10):
        s = rng.choice(systems)
        prompts.append(s[:rng.choice([len(s), 64, len(s) - 1])] + rand_ids(rng.randint(1, 60), 200 + i))
        lens.append(rng.randint(1, 3))
    e = engine(model, num_pages=12, num_snapshots=3, max_num_seqs=3, max_num_batched_tokens=180,
               retention=rng.choice(["marconi", "interval:64"]))
    pending = list(range(len(prompts)))
    ids = {}
    while pending or e.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i = pending.pop(0)
                ids[i] = e.add_request(prompts[i], max_new_tokens=lens[i],
                                       boundaries=[len(prompts[i]) // 2] if i % 3 == 0 else ())
        e.step()
    for i, rid in ids.items():
        assert e.requests[rid].output == reference(model, prompts[i], lens[i]), f"request {i}"
    assert e.prefix.hits > 0
    e.prefix.check_invariants()


def test_engine_batch_example_runs(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "engine_batch.py"
    spec = importlib.util.spec_from_file_location("engine_batch_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m = mod.main(["--num-prompts", "5", "--max-new-tokens", "2", "--prompt-len", "64", "--max-num-seqs", "2"])
    assert m["finished"] == 5 and m["generated_tokens"] == 10
    assert "cache hit rate" in capsys.readouterr().out
