"""The P/D manifest digest: what it covers, and that chunked / threaded / strided hashing changes nothing."""

import pytest
import torch
from hypothesis import given, strategies as st

import k3nn.engine.transfer as transfer
from k3nn.engine.transfer import state_digest

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]


def tensors(seed, shapes, dtype):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g, dtype=torch.float64) * 100).to(dtype) for s in shapes]


@given(seed=st.integers(0, 2**16), shapes=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=3), min_size=1,
                                                   max_size=4), dtype=st.sampled_from(DTYPES))
def test_chunked_threaded_and_strided_hashing_agree(seed, shapes, dtype):
    ts = tensors(seed, shapes, dtype)
    names = [f"t{i}" for i in range(len(ts))]
    want = state_digest([1, 2, 3], 2, names, ts)
    assert set(want["parts"]) == {"prompt", *names}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transfer, "_HASH_CHUNK_BYTES", 1)  # one element per chunk
        mp.setattr(transfer, "_PARALLEL_HASH_BYTES", 0)  # the thread pool
        assert state_digest([1, 2, 3], 2, names, ts) == want
    strided = [torch.cat([t, t], dim=-1)[..., : t.shape[-1]] for t in ts]  # same values, not contiguous
    assert state_digest([1, 2, 3], 2, names, strided) == want


def test_every_covered_field_changes_the_digest():
    ts = tensors(0, [[2, 3], [4]], torch.float32)
    base = state_digest([5, 6, 7], 2, ["a", "b"], ts)
    assert state_digest([5, 6, 8], 2, ["a", "b"], ts)["parts"]["prompt"] != base["parts"]["prompt"]
    assert state_digest([5, 6, 7], 1, ["a", "b"], ts)["parts"]["prompt"] != base["parts"]["prompt"]
    renamed = state_digest([5, 6, 7], 2, ["a", "c"], ts)["parts"]
    assert renamed["a"] == base["parts"]["a"] and renamed["c"] != base["parts"]["b"]
    reshaped = state_digest([5, 6, 7], 2, ["a", "b"], [ts[0].reshape(3, 2), ts[1]])  # same bytes, other shape
    assert reshaped["parts"]["a"] != base["parts"]["a"] and reshaped["parts"]["b"] == base["parts"]["b"]
    recast = state_digest([5, 6, 7], 2, ["a", "b"], [ts[0].view(torch.int32), ts[1]])  # same bytes, other dtype
    assert recast["parts"]["a"] != base["parts"]["a"]
    flipped = ts[1].clone()
    flipped.view(torch.uint8)[0] ^= 1
    other = state_digest([5, 6, 7], 2, ["a", "b"], [ts[0], flipped])
    assert other["parts"]["b"] != base["parts"]["b"] and other["value"] != base["value"]
    assert base["algorithm"] == "sha256" and len(base["value"]) == 64


def test_state_digest_arguments():
    with pytest.raises(ValueError, match="2 names for 1 tensors"):
        state_digest([1], 0, ["a", "b"], [torch.zeros(1)])
