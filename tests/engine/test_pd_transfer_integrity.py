"""P/D import trusts nothing: every corruption of a shipped state is rejected before the receiving engine allocates
anything, and a failed Engine.adopt leaves nothing behind."""

import copy
import json

import pytest
import torch
from hypothesis import given, strategies as st

from engine_helpers import model, rand_ids, reference  # noqa: F401  (model is a fixture)
from k3nn.cache.hybrid import CacheFullError
from k3nn.cache.prefix import block_hashes
from k3nn.engine.transfer import RequestState, export_request_state, import_request_state, state_digest
from k3nn.engine import Engine, EngineConfig, RequestStatus, SamplingParams

PROMPT = rand_ids(150, 5)  # 149 computed tokens: 3 pages, the last one partial
NEW = 4


def make_engine(model, **kw):
    return Engine(model, EngineConfig(**{**dict(max_num_seqs=2, num_pages=12, num_snapshots=4), **kw}))


def prefill(engine, prompt):
    rid = engine.add_request(prompt, prefill_only=True)
    while engine.requests[rid].status != RequestStatus.PREFILLED:
        engine.step()
    return rid


def snapshot(engine):
    """Everything an import could take or poison: free pages / slots, row owners, requests, the prefix index."""
    pc = engine.prefix
    return {"free_pages": engine.pools.allocator.num_free, "free_slots": engine.pools.snapshots.num_free,
            "rows": [None if o is None else o.request_id for o in engine.row_owner],
            "requests": {k: r.status for k, r in engine.requests.items()}, "running": len(engine.running),
            "prefix_stats": pc.stats(), "prefix": {k: (e.page, e.snapshot) for k, e in pc.entries.items()}}


@pytest.fixture(scope="module")
def exported(model):
    P = make_engine(model)
    state = export_request_state(P, prefill(P, PROMPT))
    yield state
    state.lease.release()


class Decoder(tuple):
    def __repr__(self):  # hypothesis prints the arguments of a failing example
        return "Decoder(engine, snapshot)"


@pytest.fixture(scope="module")
def decoder(model):
    """A decode engine whose prefix index already holds a page (what a poisoned import would corrupt)."""
    D = make_engine(model)
    D.generate([rand_ids(70, 9)], max_new_tokens=1)
    assert D.prefix.entries
    return Decoder((D, snapshot(D)))


def clone(state):
    return RequestState(copy.deepcopy(state.manifest), [t.clone() for t in state.tensors])


def redigest(s):
    """What a sender that hashed after the damage ships: only the structural checks can catch it."""
    m = s.manifest
    m["digest"] = state_digest(m["prompt"], m["num_tokens"], [e["name"] for e in m["tensors"]], s.tensors)
    return s


def entry(s, name):
    return next(i for i, e in enumerate(s.manifest["tensors"]) if e["name"] == name)


def set_num_tokens(d):
    def f(s):
        s.manifest["num_tokens"] += d
        return redigest(s)
    return f


def alter_prompt(pos, rehash=False):
    def f(s):
        s.manifest["prompt"][pos] = (s.manifest["prompt"][pos] + 1) % 1000
        return redigest(s) if rehash else s
    return f


def drop_tensor(s):
    del s.tensors[0]
    return s


def drop_page(consistent):
    def f(s):
        i = entry(s, "mla.1.pages")
        s.tensors[i] = s.tensors[i][:2].clone()
        if consistent:  # a sender that truncated everything coherently: the page count is what gives it away
            for e in s.manifest["tensors"]:
                if e["name"].startswith("mla."):
                    e["shape"][0] = 2
            s.tensors = [t[:2].clone() if n["name"].startswith("mla.") else t
                         for t, n in zip(s.tensors, s.manifest["tensors"])]
            s.manifest["mla"]["num_pages"] = 2
            redigest(s)
        return s
    return f


def wrong_recurrent(consistent):
    def f(s):
        i = entry(s, "kda.0.recurrent")
        s.tensors[i] = s.tensors[i][..., :-1].contiguous()
        if consistent:
            s.manifest["tensors"][i]["shape"] = list(s.tensors[i].shape)
            redigest(s)
        return s
    return f


def flip_byte(name, offset=37):
    def f(s):
        i = entry(s, name)
        s.tensors[i].view(-1).view(torch.uint8)[offset] ^= 0x10
        return s
    return f


def wrong_dtype(s):
    i = entry(s, "kda.0.recurrent")
    s.tensors[i] = s.tensors[i].float()  # the fp64 model keeps an fp64 recurrent state
    return s


def declared_dtype(s):
    s.manifest["tensors"][entry(s, "kda.2.conv")]["dtype"] = "float16"
    return redigest(s)


def set_field(path, value, rehash=False):
    def f(s):
        d = s.manifest
        *head, last = path.split(".")
        for k in head:
            d = d[k]
        if value is None:
            del d[last]
        else:
            d[last] = value
        return redigest(s) if rehash else s
    return f


def rename(s):
    s.manifest["tensors"][entry(s, "kda.2.conv")]["name"] = "kda.2.conv_state"
    return s


CORRUPTIONS = {
    "num_tokens-1": (set_num_tokens(-1), "num_tokens 148"),
    "num_tokens+1": (set_num_tokens(+1), "num_tokens 150"),
    "prompt token, stale block_hashes": (alter_prompt(3, rehash=True), "block_hashes"),
    "prompt token in the partial block": (alter_prompt(140), "digest mismatch: the prompt ids"),
    "block_hashes truncated": (set_field("block_hashes", [], rehash=True), "block_hashes"),
    "prompt token out of vocab": (set_field("prompt", [10**6] + PROMPT[1:]), "token ids"),
    "lost tensor": (drop_tensor, "lost"),
    "dropped page": (drop_page(consistent=False), "mla.1.pages: shape"),
    "dropped page, coherent manifest": (drop_page(consistent=True), "num_pages 2"),
    "recurrent shape": (wrong_recurrent(consistent=False), "kda.0.recurrent: shape"),
    "recurrent shape, coherent manifest": (wrong_recurrent(consistent=True), "kda.0.recurrent: manifest shape"),
    "flipped byte in pages": (flip_byte("mla.3.pages"), "digest mismatch: tensor 'mla.3.pages'"),
    "flipped byte in conv": (flip_byte("kda.2.conv", 5), "digest mismatch: tensor 'kda.2.conv'"),
    "tensor dtype": (wrong_dtype, "kda.0.recurrent: dtype float32 != manifest float64"),
    "declared dtype": (declared_dtype, "manifest dtype 'float16'"),
    "fingerprint": (set_field("config_fingerprint", "0" * 64), "fingerprint"),
    "digest value": (set_field("digest.value", "0" * 64), "digest value"),
    "no digest": (set_field("digest", None), "missing field 'digest'"),
    "renamed tensor": (rename, "expected 'kda.2.conv'"),
    "layer list": (set_field("kda.layers", [0]), "layer lists"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupted_state_is_rejected_before_anything_is_allocated(decoder, exported, case):
    D, before = decoder
    corrupt, match = CORRUPTIONS[case]
    bad = corrupt(clone(exported))
    with pytest.raises(ValueError, match=match):
        import_request_state(D, bad, SamplingParams(max_new_tokens=NEW))
    assert snapshot(D) == before


@given(which=st.integers(0, 5), frac=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_flipped_bit_is_caught_and_named(decoder, exported, which, frac, bit):
    D, before = decoder
    bad = clone(exported)
    name = bad.manifest["tensors"][which]["name"]
    raw = bad.tensors[which].view(-1).view(torch.uint8)
    raw[int(frac * raw.numel())] ^= 1 << bit
    with pytest.raises(ValueError, match=f"digest mismatch: tensor '{name}'"):
        import_request_state(D, bad)
    assert snapshot(D) == before


def test_good_import_after_rejections_decodes_like_generate(decoder, exported, model):
    D, before = decoder
    assert snapshot(D) == before  # after every rejection above
    wire = RequestState(json.loads(json.dumps(exported.manifest)), [t.clone() for t in exported.tensors])
    did = import_request_state(D, wire, SamplingParams(max_new_tokens=NEW))
    list(D.stream())
    assert D.requests[did].output == reference(model, PROMPT, NEW)
    assert D.requests[did].num_forwards == 1
    D.prefix.check_invariants()


def test_adopt_without_a_free_row_leaks_nothing(model, exported):
    D = make_engine(model, max_num_seqs=1)
    prefill(D, rand_ids(20, 3))  # a prefilled request holds the only row
    before = snapshot(D)
    with pytest.raises(CacheFullError, match="rows"):
        import_request_state(D, clone(exported))
    assert snapshot(D) == before


def test_adopt_failing_after_taking_pages_is_undone(model, exported, monkeypatch):
    D = make_engine(model)
    before = snapshot(D)
    real = D.pools.allocator.allocate

    def allocate_then_fail(n=1):
        real(n)
        raise RuntimeError("device lost")

    monkeypatch.setattr(D.pools.allocator, "allocate", allocate_then_fail)
    with pytest.raises(RuntimeError, match="device lost") as info:
        import_request_state(D, clone(exported))
    assert snapshot(D) == before
    assert any("leaked page" in n for n in getattr(info.value, "__notes__", []))


def test_adopt_failing_after_registering_is_undone(model, exported, monkeypatch):
    D = make_engine(model)
    before = snapshot(D)
    real = D.adopt

    def adopt_then_fail(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("late failure")

    monkeypatch.setattr(D, "adopt", adopt_then_fail)
    with pytest.raises(RuntimeError, match="late failure") as info:
        import_request_state(D, clone(exported), request_id="pd-1")
    assert snapshot(D) == before
    assert any("half-imported request 'pd-1'" in n for n in info.value.__notes__)
    monkeypatch.undo()
    assert import_request_state(D, clone(exported), request_id="pd-1") == "pd-1"  # the id is free again
    assert D.requests["pd-1"].status == RequestStatus.RUNNING
    D.abort("pd-1")


@pytest.mark.parametrize("n", [1, 65])  # nothing computed (no pages); 64 computed (the last page full)
def test_edge_lengths_round_trip(model, n):
    prompt = rand_ids(n, 11)
    P, D = make_engine(model, enable_prefix_caching=False), make_engine(model)  # the sender never hashed
    state = export_request_state(P, prefill(P, prompt))
    assert state.manifest["mla"]["num_pages"] == -(-(n - 1) // 64)
    assert state.manifest["block_hashes"] == [k.hex() for k in D.prefix.hashes(prompt)]
    did = import_request_state(D, state, SamplingParams(max_new_tokens=2))
    assert state.lease.release() is True
    list(D.stream())
    assert D.requests[did].output == reference(model, prompt, 2)


def test_a_sender_with_another_page_size_is_repaged(exported, model):
    """A 32-token-page sender: the checks use its unit (pages, hashes), the import re-lays the tokens out."""
    s = clone(exported)
    m, n, bs = s.manifest, s.manifest["num_tokens"], 32
    for i, e in enumerate(m["tensors"]):
        if e["name"].startswith("mla."):
            flat = s.tensors[i].reshape(-1, s.tensors[i].shape[-1])[:n]
            s.tensors[i] = torch.cat([flat, flat.new_zeros(-n % bs, flat.shape[-1])]).view(-1, bs, flat.shape[-1])
            e["shape"] = list(s.tensors[i].shape)
    m["mla"].update(block_size=bs, num_pages=-(-n // bs))
    with pytest.raises(ValueError, match="block_hashes"):  # still hashed in 64-token blocks
        import_request_state(make_engine(model), redigest(clone(s)))
    m["block_hashes"] = [k.hex() for k in block_hashes(m["prompt"], bs)]
    D = make_engine(model)
    did = import_request_state(D, redigest(s), SamplingParams(max_new_tokens=NEW))
    list(D.stream())
    assert D.requests[did].output == reference(model, PROMPT, NEW)
