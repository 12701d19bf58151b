"""A serving workload on the CPU: hundreds of requests with shared prefixes through an engine whose pool is small
enough to evict prefix entries and preempt running requests, with aborts and a DSpark drafter on part of the
requests. Every request that finishes equals uncached generate(); nothing leaks."""

import random

import torch

from engine_helpers import CFG, model, rand_ids, reference  # noqa: F401 - fixture

from k3nn.engine import Engine, EngineConfig, RequestStatus
from k3nn.layers.dspark import DSparkConfig, DSparkDrafter


def test_random_workload_equals_generate(model):
    rng = random.Random(0)
    bases = [rand_ids(160, 300 + i) for i in range(3)]
    work = []
    for i in range(200):
        base = bases[rng.randrange(3)]
        prompt = base[:rng.randrange(1, 160)] + rand_ids(rng.randrange(0, 12), 400 + i)
        work.append((prompt, rng.choice([rng.randrange(1, 9), rng.randrange(1, 9), rng.randrange(20, 45)]), rng.choice([0, 0, 3])))
    drafter = DSparkDrafter(DSparkConfig.for_target(CFG, num_layers=1, num_heads=2, block_size=3), model,
                            dtype=torch.float64)
    e = Engine(model, EngineConfig(max_num_seqs=6, num_pages=10, num_snapshots=4, max_num_batched_tokens=128,
                                   mixed_forward_max_tokens=24), drafter=drafter)
    ids, aborted, pending = [], set(), list(work)
    while pending or e.has_unfinished():
        for _ in range(rng.randrange(0, 6)):  # arrivals between steps
            if pending:
                p, n, k = pending.pop(0)
                ids.append((e.add_request(p, max_new_tokens=n, num_speculative_tokens=k), p, n))
        if rng.random() < 0.04:
            live = [i for i, _, _ in ids if e.requests[i].status in (RequestStatus.WAITING, RequestStatus.RUNNING)]
            if live:
                victim = rng.choice(live)
                e.abort(victim)
                aborted.add(victim)
        e.step()
    m = e.metrics()
    assert m["requests"] == 200 and m["failed"] == 0
    assert m["preemptions"] > 0 and m["spec_rounds"] > 0 and m["cache_hits"] > 0
    assert aborted and m["aborted"] == len(aborted)
    for rid, p, n in ids:
        r = e.requests[rid]
        if rid in aborted:
            assert r.status == RequestStatus.ABORTED
            continue
        assert r.status == RequestStatus.FINISHED and r.output == reference(model, p, n), rid
    e.prefix.check_invariants()
    cached = {x.page for x in e.prefix.entries.values()}
    assert e.pools.allocator.num_free == e.pools.allocator.num_blocks - len(cached)
    assert all(o is None for o in e.row_owner) and not e.running and not e.waiting
