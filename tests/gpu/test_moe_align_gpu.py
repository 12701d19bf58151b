"""GPU: the one-launch MoE alignment passes its self-check on this device (``align_for`` takes it at decode sizes)
and equals the torch alignment exactly on random routings of K3's decode sizes, also replayed from a CUDA graph."""

import pytest
import torch

from k3nn.kernels.moe import align

pytestmark = pytest.mark.gpu


def _ids(tokens, e, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).cuda()


def test_self_check_passes():
    assert align.one_launch_ok("cuda")


@pytest.mark.parametrize("tokens,e,bm", [(1, 128, 8), (4, 128, 8), (16, 128, 8), (16, 896, 8), (32, 128, 16),
                                         (3, 9, 4), (16, 128, 2)])
def test_equals_torch_alignment(tokens, e, bm):
    for seed in range(3):
        ids = _ids(tokens, e, 16 if e >= 16 else 4, seed)
        a, b = align.moe_align(ids, e, bm), align.moe_align_triton(ids, e, bm)
        assert torch.equal(a.sorted_ids, b.sorted_ids) and torch.equal(a.expert_ids, b.expert_ids)
        assert torch.equal(a.num_rows, b.num_rows)


def test_graph_replay():
    ids = _ids(16, 128, 16, 0)
    align.moe_align_triton(ids, 128, 8)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = align.moe_align_triton(ids, 128, 8)
    ids.copy_(_ids(16, 128, 16, 1))
    g.replay()
    ref = align.moe_align(ids, 128, 8)
    assert torch.equal(out.sorted_ids, ref.sorted_ids) and torch.equal(out.expert_ids, ref.expert_ids)


def test_chunked_self_check_passes():
    assert align.chunked_ok("cuda")


@pytest.mark.parametrize("tokens,e,k,bm", [(64, 128, 16, 8), (512, 32, 8, 64), (2048, 256, 8, 128),
                                           (8192, 32, 8, 128), (700, 896, 16, 128)])
def test_chunked_equals_torch_alignment(tokens, e, k, bm):
    ids = _ids(tokens, e, k, tokens)
    a, b = align.moe_align(ids, e, bm), align.moe_align_chunked(ids, e, bm)
    assert torch.equal(a.sorted_ids, b.sorted_ids) and torch.equal(a.expert_ids, b.expert_ids)
    assert torch.equal(a.num_rows, b.num_rows)
    c = align.align_for(ids, e, bm)  # the kernel align_for takes at prefill sizes
    assert torch.equal(c.sorted_ids, a.sorted_ids)
