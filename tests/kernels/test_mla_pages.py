"""Paged latent cache: allocator, slot mapping (plain and DCP-interleaved), writes and reads."""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from k3nn.cache.pages import (BlockAllocator, CacheFullError, PagedLatentCache, gather_latents, local_seq_lens,
                              owner_rank, slot_mapping)


def test_allocator_refcounts_and_full():
    a = BlockAllocator(4)
    x = a.allocate(3)
    assert len(set(x)) == 3 and a.num_free == 1
    with pytest.raises(CacheFullError, match="need 2 free block"):
        a.allocate(2)
    assert a.num_free == 1  # a failed allocation takes nothing
    a.incref(x[:1])
    a.free(x)
    assert a.refcount(x[0]) == 1 and a.num_free == 3
    a.free(x[:1])
    assert a.num_free == 4
    with pytest.raises(ValueError, match="not allocated"):
        a.free(x[:1])
    with pytest.raises(ValueError, match="outside the pool"):
        a.incref([9])
    with pytest.raises(ValueError):
        BlockAllocator(0)


def test_cache_roundtrip_and_errors():
    g = torch.Generator().manual_seed(0)
    cache = PagedLatentCache(2, 5, 8, 4, block_size=4, dtype=torch.float32)
    cache.add("a")
    cache.add("b")
    pos = cache.extend(["a", "b"], [6, 3])
    assert pos.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, -1, -1, -1]]
    c, kr = torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 4, generator=g)
    cache.write(1, ["a", "b"], pos, c, kr)
    got = gather_latents(cache.pools[1], cache.block_table(["a", "b"]), 6)
    torch.testing.assert_close(got[0], torch.cat([c[0], kr[0]], -1))
    torch.testing.assert_close(got[1, :3], torch.cat([c[1, :3], kr[1, :3]], -1))
    assert (cache.pools[0] == 0).all()  # other layer untouched
    assert cache.seq_lens(["a", "b"]).tolist() == [6, 3] and cache.block_table(["a"]).dtype == torch.int32
    free = cache.allocator.num_free
    with pytest.raises(CacheFullError, match="cache full"):
        cache.extend(["a", "b"], [8, 8])
    assert cache.allocator.num_free == free and cache.seq_len("a") == 6  # all or nothing
    with pytest.raises(ValueError, match="already in the cache"):
        cache.add("a")
    with pytest.raises(KeyError, match="not in the cache"):
        cache.extend(["zz"], 1)
    cache.release("a")
    assert cache.allocator.num_free == free + 2
    with pytest.raises(ValueError, match="table has 1 columns"):
        slot_mapping(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([[4]]), block_size=4)
    with pytest.raises(ValueError, match="interleave"):
        PagedLatentCache(1, 4, 8, 4, block_size=4, world_size=2, interleave=3)
    with pytest.raises(ValueError, match="rank"):
        PagedLatentCache(1, 4, 8, 4, block_size=4, world_size=2, rank=2)


@given(W=st.integers(1, 4), I=st.sampled_from([1, 2, 4]), n=st.integers(0, 200), seed=st.integers(0, 99))
def test_dcp_slots_partition_the_sequence(W, I, n, seed):
    """Every position has exactly one owner; each rank's slots are exactly its local rows 0..len_r-1 in order."""
    note(f"W={W} I={I} n={n}")
    bs = 8
    nblocks = -(-max(n, 1) // (bs * W))
    table = torch.randperm(nblocks + 3, generator=torch.Generator().manual_seed(seed))[:nblocks].int()[None]
    pos = torch.arange(n)[None]
    owners = torch.zeros(n, dtype=torch.long)
    for r in range(W):
        s = slot_mapping(table, pos, bs, W, r, I)[0]
        own = s >= 0
        owners += own.long()
        assert torch.equal(own, owner_rank(pos[0], W, I) == r)
        L = int(local_seq_lens(torch.tensor(n), W, r, I))
        assert int(own.sum()) == L
        # rank-local index of an owned position = its row in an ordinary paged cache with this table
        blk, row = s[own] // bs, s[own] % bs
        local = torch.tensor([table[0].tolist().index(b) for b in blk.tolist()], dtype=torch.long) * bs + row
        assert local.tolist() == list(range(L))
        # causal bound of a query at position q is local_seq_lens(q + 1)
        if n:
            q = torch.arange(n)
            assert torch.equal(local_seq_lens(q + 1, W, r, I), torch.cumsum(own.long(), 0))
    assert bool((owners == 1).all())
