"""Prefill/decode disaggregation: export (N−1 state + pages + manifest, pinned), import, torch.distributed."""

import gc
import math
import os
import tempfile
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine_helpers import reference
from k3nn import KimiK3, KimiK3Config
from k3nn.engine.transfer import (RequestState, acknowledge, config_fingerprint, expire_leases, export_request_state,
                                 import_request_state, leases, recv_request_state, send_request_state)
from k3nn.engine import Engine, EngineConfig, RequestStatus, SamplingParams

CFG = KimiK3Config.tiny()
PROMPT = torch.randint(0, CFG.vocab_size, (150,), generator=torch.Generator().manual_seed(5)).tolist()
SHORT = PROMPT[:70]  # 69 computed tokens: cheap to prefill for the lease tests
NEW = 4


def make_model():
    return KimiK3(CFG, dtype=torch.float64, seed=0).eval()


def make_engine(model, **kw):
    return Engine(model, EngineConfig(**{**dict(max_num_seqs=2, num_pages=12, num_snapshots=4), **kw}))


def prefill(engine, prompt=PROMPT):
    rid = engine.add_request(prompt, prefill_only=True)
    while engine.requests[rid].status != RequestStatus.PREFILLED:
        engine.step()
    return rid


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def expected(model):
    return reference(model, PROMPT, NEW)  # memoised across the engine test modules


def test_export_import_round_trip(model, expected):
    P = make_engine(model)
    rid = prefill(P)
    assert P.requests[rid].num_computed == len(PROMPT) - 1  # N−1: the decoder recomputes the last token
    state = export_request_state(P, rid)
    m = state.manifest
    assert m["num_tokens"] == 149 and m["mla"]["num_pages"] == 3 and m["kda"]["recurrent_layout"] == "HKV"
    assert m["config_fingerprint"] == config_fingerprint(CFG)
    assert [e["name"] for e in m["tensors"]][:2] == ["mla.1.pages", "mla.3.pages"]
    assert all(list(t.shape) == e["shape"] for t, e in zip(state.tensors, m["tensors"]))
    assert not state.tensors[0][-1, 149 - 128:].any()  # the partial last page ships no stale rows
    # pinned until released: the pages and the row stay allocated
    held = P.requests[rid].blocks
    assert all(P.pools.allocator.refcount(b) >= 1 for b in held) and P.requests[rid].row is not None
    D = make_engine(model)
    did = import_request_state(D, state, SamplingParams(max_new_tokens=NEW))
    list(D.stream())
    assert D.requests[did].output == expected
    assert D.requests[did].num_forwards == 1  # the last prompt token ran as one decode row
    assert state.lease.release() is True
    assert state.lease.release() is False  # idempotent
    assert P.requests[rid].status == RequestStatus.FINISHED and P.requests[rid].row is None
    assert P.pools.allocator.num_free == 12 - len(P.prefix.entries)


def test_import_rejects_mismatched_state(model):
    P = make_engine(model)
    state = export_request_state(P, prefill(P))
    other = KimiK3(KimiK3Config.tiny(kda_num_heads=4), dtype=torch.float64, seed=0)
    with pytest.raises(ValueError, match="fingerprint"):
        import_request_state(make_engine(other), state)
    bad = RequestState(dict(state.manifest), state.tensors[:-1])
    with pytest.raises(ValueError, match="tensors"):
        import_request_state(make_engine(model), bad)
    bad = RequestState({**state.manifest, "version": 99}, state.tensors)
    with pytest.raises(ValueError, match="version"):
        import_request_state(make_engine(model), bad)
    rid = P.add_request(PROMPT, max_new_tokens=2)
    with pytest.raises(ValueError, match="prefill_only"):
        export_request_state(P, rid)
    with pytest.raises(ValueError, match="not prefilled"):
        P.release(rid)
    state.lease.release()


def test_lease_expires_on_the_clock_and_frees_the_request(model):
    P = make_engine(model)
    rid = prefill(P, SHORT)
    state = export_request_state(P, rid, lease_timeout_s=30.0)
    lease = state.lease
    t0 = lease.expires_at - 30.0
    assert leases(P) == {rid: lease} and not lease.expired and not lease.is_expired(now=t0 + 29.9)
    assert expire_leases(P, now=t0 + 29.9) == [] and P.requests[rid].status == RequestStatus.PREFILLED
    lease.renew(60.0, now=t0 + 10)  # the decoder asked for more time
    assert lease.expires_at == t0 + 70
    assert expire_leases(P, now=t0 + 31) == [] and P.requests[rid].row is not None
    assert lease.is_expired(now=t0 + 70)
    assert expire_leases(P, now=t0 + 70) == [rid]
    assert P.requests[rid].status == RequestStatus.FINISHED and P.row_owner == [None, None]
    assert P.pools.allocator.num_free == 12 - len(P.prefix.entries)
    assert lease.released and lease.expired and lease.end_reason == "expired"
    assert lease.release() is False and expire_leases(P, now=t0 + 1e6) == [] and leases(P) == {}
    with pytest.raises(ValueError, match="already ended"):
        lease.renew(10.0)
    with pytest.raises(ValueError, match="expired at"):  # past its deadline, not yet collected
        late = export_request_state(P, prefill(P, SHORT), lease_timeout_s=1.0).lease
        late.renew(10.0, now=late.expires_at + 1)
    assert late.release() is True


def test_release_after_abort_is_a_noop(model):
    P = make_engine(model)
    rid = prefill(P, SHORT)
    state = export_request_state(P, rid)
    assert P.abort(rid)
    assert state.lease.release() is False  # used to raise: the request is no longer prefilled
    assert state.lease.released and state.lease.end_reason == "gone" and not state.lease.expired
    assert leases(P) == {}
    rid = prefill(P, SHORT)  # aborted while live: the next expiry pass drops the lease without listing it
    lease = export_request_state(P, rid, lease_timeout_s=None).lease
    assert lease.expires_at is None and expire_leases(P, now=math.inf) == []  # never expires
    assert P.abort(rid) and expire_leases(P) == [] and leases(P) == {} and lease.end_reason == "gone"
    assert lease.release() is False and P.pools.allocator.num_free == 12 - len(P.prefix.entries)


def test_lease_arguments_and_one_live_lease_per_request(model):
    P = make_engine(model)
    rid = prefill(P, SHORT)
    for bad, exc in [(0, ValueError), (-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError),
                     ("5", TypeError), (True, TypeError)]:
        with pytest.raises(exc, match="lease_timeout_s"):
            export_request_state(P, rid, lease_timeout_s=bad)
    assert leases(P) == {}
    state = export_request_state(P, rid)
    assert state.lease.expires_at == pytest.approx(time.monotonic() + 600.0, abs=60)
    with pytest.raises(ValueError, match="live lease"):
        export_request_state(P, rid)
    with pytest.raises(ValueError, match="timeout_s"):
        state.lease.renew(0)
    with state.lease:
        pass
    assert state.lease.end_reason == "released" and P.requests[rid].status == RequestStatus.FINISHED
    with pytest.raises(ValueError, match="prefilled"):
        export_request_state(P, rid)


def test_a_dropped_engine_is_not_kept_alive_by_its_leases(model):
    P = make_engine(model)
    state = export_request_state(P, prefill(P, SHORT))
    ref = weakref.ref(P)
    del P
    gc.collect()
    assert ref() is None  # the lease registry holds engines weakly, leases hold them weakly
    assert state.lease.engine is None and state.lease.release() is False and state.lease.end_reason == "gone"


def _pd_worker(rank, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        model = make_model()
        eng = make_engine(model)
        if rank == 0:  # prefill side: compute N−1, send, wait for the ack, release the pin
            state = export_request_state(eng, prefill(eng))
            send_request_state(state, dst=1)
            results[0] = (state.lease.released, eng.pools.allocator.num_free, len(eng.prefix.entries))
        else:  # decode side
            state = recv_request_state(src=0)
            rid = import_request_state(eng, state, SamplingParams(max_new_tokens=NEW))
            acknowledge(0)
            list(eng.stream())
            results[1] = eng.requests[rid].output
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_process_gloo_transfer_continues_like_one_process(expected):
    with tempfile.TemporaryDirectory() as d:
        mgr = mp.get_context("spawn").Manager()
        results = mgr.dict()
        mp.spawn(_pd_worker, args=(os.path.join(d, "init"), results), nprocs=2, join=True)
        released, free, entries = results[0]
        assert released and free == 12 - entries
        assert results[1] == expected
