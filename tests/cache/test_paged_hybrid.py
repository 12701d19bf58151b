"""Paged hybrid cache: pools, accounting, the batch view against the contiguous cache, in-pass checkpoints."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from k3nn import KimiK3, KimiK3Config
from k3nn.cache.hybrid import CacheFullError
from k3nn.cache.paged import HybridPools, pool_sizes_for_budget
from k3nn.cache.states import StatePool, latent_bytes_per_token, state_bytes_per_slot
from k3nn.engine.runner import ModelRunner, RowWork

CFG = KimiK3Config.tiny()


@pytest.fixture(scope="module")
def model():
    return KimiK3(CFG, dtype=torch.float64, seed=0).eval()


def ids_of(n, seed):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


# -- pools ------------------------------------------------------------------------------------------------
def test_state_pool_accounting_and_refcounts():
    pool = StatePool(CFG, 3, torch.bfloat16)
    H, D, W = CFG.kda_num_heads, CFG.kda_head_dim, CFG.short_conv_kernel_size
    per_layer = H * D * D * 4 + (W - 1) * 3 * H * D * 2
    assert pool.bytes_per_slot == per_layer * 2 == state_bytes_per_slot(CFG, torch.bfloat16)
    a = pool.allocate(2)
    pool.incref([a[0]])
    pool.free([a[0]])
    assert pool.refcount(a[0]) == 1 and pool.num_free == 1
    with pytest.raises(CacheFullError, match="KDA"):
        pool.allocate(2)
    pool.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a[0]])
    with pytest.raises(ValueError, match="outside"):
        pool.incref([7])


def test_state_pool_copy_is_simultaneous():
    pool = StatePool(CFG, 3, torch.float32)
    for j in range(len(pool.layer_ids)):
        pool.recurrent[j].copy_(torch.arange(3.0)[:, None, None, None].expand_as(pool.recurrent[j]))
    pool.copy_([0, 1], pool, [1, 0])  # swap
    assert pool.recurrent[0][:, 0, 0, 0].tolist() == [1.0, 0.0, 2.0]


def test_hybrid_pools_memory_from_config():
    pools = HybridPools(CFG, num_pages=5, max_running=2, num_snapshots=3, dtype=torch.bfloat16)
    assert pools.bytes_per_token == latent_bytes_per_token(CFG, torch.bfloat16)
    mem = pools.memory_bytes()
    assert mem["latent_pages"] == 5 * 64 * pools.bytes_per_token
    assert mem["snapshot_slots"] == 3 * state_bytes_per_slot(CFG, torch.bfloat16)
    pages, snaps = pool_sizes_for_budget(CFG, 1 << 20, 2, dtype=torch.bfloat16)
    slot, page = state_bytes_per_slot(CFG, torch.bfloat16), 64 * latent_bytes_per_token(CFG, torch.bfloat16)
    assert 2 * slot + snaps * slot + pages * page <= 1 << 20
    assert (1 << 20) - (2 * slot + snaps * slot + pages * page) < page
    with pytest.raises(ValueError, match="running"):
        pool_sizes_for_budget(CFG, 10, 2)


class Row:
    """The request fields the runner reads: running slot, pages, cached count."""

    def __init__(self, row, blocks, num_computed=0):
        self.row, self.blocks, self.num_computed, self.synced_blocks = row, list(blocks), num_computed, 0


def forward(model, pools, rows, tokens, snapshots=None):
    """One runner forward over ``rows`` feeding ``tokens[b]``: every column's logits [B, T, V]."""
    runner = getattr(pools, "_runner", None) or ModelRunner(model, pools, max_rows=pools.running.num_slots,
                                                            cuda_graphs=False)
    pools._runner = runner
    work = [RowWork(r, list(t), snapshots=list((snapshots or {}).get(b, []))) for b, (r, t) in
            enumerate(zip(rows, tokens))]
    with torch.no_grad():
        out = runner.forward(work, all_columns=True)
    for r, t in zip(rows, tokens):
        r.num_computed += len(t)
    return out.columns


def test_rows_need_pages(model):
    pools = HybridPools(CFG, num_pages=4, max_running=2, num_snapshots=1, dtype=torch.float64)
    r = Row(0, pools.allocator.allocate(1))
    with pytest.raises(ValueError, match="snapshot position"):
        forward(model, pools, [r], [ids_of(10, 0).tolist()], {0: [(11, 0)]})


# -- the batch view against the contiguous cache -------------------------------------------------------
@settings(max_examples=5)
@given(st.lists(st.tuples(st.integers(1, 70), st.integers(1, 70)), min_size=1, max_size=2), st.integers(0, 1))
def test_right_padded_chunks_equal_full_forward(model, chunks, row0):
    """Two requests fed chunks of different lengths in shared forwards (right padding, states taken from
    in-pass checkpoints or the fused op's per-row counts) produce the logits of one full forward each; the rows
    live on any slots (no contiguity needed)."""
    lens = [sum(c[b] for c in chunks) for b in range(2)]
    seqs = [ids_of(n, 10 + b) for b, n in enumerate(lens)]
    with torch.no_grad():
        ref = [model(s[None]).logits[0] for s in seqs]
    pools = HybridPools(CFG, num_pages=8, max_running=3, num_snapshots=1, dtype=torch.float64)
    slots = [2, 0] if row0 else [0, 2]
    pools.running.zero_(slots)
    rows = [Row(slots[b], pools.allocator.allocate(pools.pages_for(n))) for b, n in enumerate(lens)]
    done = [0, 0]
    for c in chunks:
        out = forward(model, pools, rows, [seqs[b][done[b]:done[b] + c[b]].tolist() for b in range(2)])
        for b in range(2):
            torch.testing.assert_close(out[b, :c[b]], ref[b][done[b]:done[b] + c[b]], rtol=1e-9, atol=1e-9)
        done = [d + n for d, n in zip(done, c)]


def test_checkpoint_export_equals_separate_prefills(model):
    """Snapshots exported inside one prefill pass == final states of separate prefills of each prefix
    (recurrent and conv), for every KDA layer."""
    seq = ids_of(200, 3)
    positions = [1, 2, 64, 130, 200]
    pools = HybridPools(CFG, num_pages=4, max_running=1, num_snapshots=len(positions), dtype=torch.float64)
    slots = pools.snapshots.allocate(len(positions))
    pools.running.zero_([0])
    forward(model, pools, [Row(0, pools.allocator.allocate(4))], [seq.tolist()], {0: list(zip(positions, slots))})
    with torch.no_grad():
        for p, s in zip(positions, slots):
            ref = model.new_cache(1, p)
            model(seq[None, :p], cache=ref, checkpoint_positions=[[p]])  # (keeps 1-2 token prefills off the fused decode path)
            kda = [st for st in ref.layers if hasattr(st, "recurrent")]
            for j, st_ in enumerate(kda):
                # fp64; deeper layers see attention over 200 vs p keys, so rounding differs at ~1e-11
                torch.testing.assert_close(pools.snapshots.recurrent[j][s], st_.recurrent[0], rtol=1e-6, atol=1e-9)
                torch.testing.assert_close(pools.snapshots.conv[j][s], st_.conv[0], rtol=1e-6, atol=1e-9)


def test_prefill_equals_prefill_then_decodes(model):
    """prefill(T) == prefill(T-k) + k one-token steps (logits and final KDA state)."""
    T, k = 150, 5
    seq = ids_of(T, 4).tolist()
    pools = HybridPools(CFG, num_pages=6, max_running=2, num_snapshots=1, dtype=torch.float64)
    a, b = Row(0, pools.allocator.allocate(3)), Row(1, pools.allocator.allocate(3))
    pools.running.zero_([0, 1])
    full = forward(model, pools, [a], [seq])[0]
    outs = [forward(model, pools, [b], [seq[:T - k]])[0]]
    for t in range(T - k, T):
        outs.append(forward(model, pools, [b], [seq[t:t + 1]])[0])
    torch.testing.assert_close(torch.cat(outs), full, rtol=1e-9, atol=1e-9)
    for j in range(len(pools.running.layer_ids)):
        torch.testing.assert_close(pools.running.recurrent[j][1], pools.running.recurrent[j][0], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(pools.running.conv[j][1], pools.running.conv[j][0], rtol=1e-9, atol=1e-12)


def test_padding_tokens_write_the_trash_page(model):
    """A right-padded row's padding columns write their latents to the trash page, never to a real one."""
    pools = HybridPools(CFG, num_pages=2, max_running=2, num_snapshots=1, dtype=torch.float64)
    pools.running.zero_([0, 1])
    a, b = Row(0, pools.allocator.allocate(1)), Row(1, pools.allocator.allocate(1))
    before = [p[:2].clone() for p in pools.pages]
    forward(model, pools, [a, b], [ids_of(20, 1).tolist(), ids_of(3, 2).tolist()])
    for p, p0 in zip(pools.pages, before):
        assert torch.equal(p[1, 3:], p0[1, 3:])  # row b's page: only its 3 tokens written
        assert p.shape[0] == 3 and pools.trash_row == 2 * 64
