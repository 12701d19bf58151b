"""The one-launch MoE alignment (``moe_align_triton``, interpreted on CPU) equals the torch alignment exactly —
block experts, used rows and every sorted id, pairs of an expert in flat order — on hypothesis-drawn routings,
decode sizes of K3 included; ``align_for`` takes it up to ``ONE_LAUNCH_PAIRS`` pairs once its self-check passed."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3nn.kernels.moe import align


@settings(deadline=None, max_examples=25)
@given(n=st.integers(1, 20), e=st.integers(1, 300), k=st.integers(1, 16), bm=st.sampled_from([1, 2, 4, 8, 16]),
       skew=st.booleans(), seed=st.integers(0, 2 ** 31 - 1))
def test_one_launch_equals_torch_alignment(n, e, k, bm, skew, seed):
    k = min(k, e)
    g = torch.Generator().manual_seed(seed)
    if skew:  # a few hot experts
        hot = torch.randperm(e, generator=g)[:k]
        ids = torch.stack([hot[torch.randperm(k, generator=g)] for _ in range(n)])
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    a, b = align.moe_align(ids, e, bm), align.moe_align_triton(ids, e, bm)
    assert torch.equal(a.sorted_ids, b.sorted_ids)
    assert torch.equal(a.expert_ids, b.expert_ids) and torch.equal(a.num_rows, b.num_rows)


def test_k3_decode_sizes_and_align_for():
    g = torch.Generator().manual_seed(0)
    for tokens, e in ((1, 128), (16, 128), (4, 896)):
        ids = torch.stack([torch.randperm(e, generator=g)[:16] for _ in range(tokens)])
        assert align._same_alignment(align.moe_align(ids, e, 8), align.moe_align_triton(ids, e, 8))
    assert align.one_launch_ok("cpu")
    ids = torch.stack([torch.randperm(128, generator=g)[:16] for _ in range(2)])
    assert align._same_alignment(align.align_for(ids, 128, 8), align.moe_align(ids, 128, 8))


@settings(deadline=None, max_examples=8)
@given(n=st.integers(1, 90), e=st.sampled_from([1, 5, 33, 130]), k=st.integers(1, 8),
       bm=st.sampled_from([4, 16, 64]), skew=st.booleans(), seed=st.integers(0, 2 ** 31 - 1))
def test_chunked_equals_torch_alignment(n, e, k, bm, skew, seed):
    """The three-launch alignment of prefill-sized batches (chunks made small here so several programs, their
    offsets tile and the blocks' experts split across programs are exercised) == moe_align exactly."""
    k = min(k, e)
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(e, generator=g)[:k] if skew else None
    ids = torch.stack([pool[torch.randperm(k, generator=g)] if skew else torch.randperm(e, generator=g)[:k]
                       for _ in range(n)])
    saved = align.CHUNK_PAIRS, align.CHUNK_TILE, align.BLOCK_TILE, align.SCATTER_PAIRS
    # small chunks and tiles: several programs, offsets carried across chunk tiles, blocks in several tiles, a
    # chunk ranked by four scatter programs
    align.CHUNK_PAIRS, align.CHUNK_TILE, align.BLOCK_TILE, align.SCATTER_PAIRS = 128, 2, 2, 32
    try:
        a, b = align.moe_align(ids, e, bm), align.moe_align_chunked(ids, e, bm)
    finally:
        align.CHUNK_PAIRS, align.CHUNK_TILE, align.BLOCK_TILE, align.SCATTER_PAIRS = saved
    assert torch.equal(a.sorted_ids, b.sorted_ids)
    assert torch.equal(a.expert_ids, b.expert_ids) and torch.equal(a.num_rows, b.num_rows)


def test_chunked_self_check_and_limits():
    assert align.chunked_ok("cpu")
    too_many = torch.zeros(align.CHUNK_PAIRS * align.MAX_CHUNKS + 1, 1, dtype=torch.long)
    import pytest

    with pytest.raises(ValueError, match="exceed"):
        align.moe_align_chunked(too_many, 4, 16)
