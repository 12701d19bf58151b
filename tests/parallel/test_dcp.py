"""Decode context parallelism: sharded latent cache + exact LSE merge == unsharded decode."""

import contextlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, note
from hypothesis import strategies as st

from k3nn import backend
from k3nn.cache.pages import PagedLatentCache
from k3nn.config import KimiK3Config
from k3nn.kernels.mla.api import merge_attn_states
from k3nn.kernels.mla.reference import mla_decode_reference
from k3nn.layers.mla import MultiHeadLatentAttention
from k3nn.ops import mla_decode
from k3nn.cache.pages import gather_latents
from k3nn.kernels.mla.merge import merge_scale
from k3nn.parallel.dcp import (DCPContext, _cat_last, dcp_attention, dcp_gather_context, dcp_local_lens,
                               dcp_mla_decode_layer, dcp_visible_lens, dcp_write_latents)

from conftest import poison


def build(seed, lens, W, I, bs, r, dr):
    """The same latents written into an unsharded cache and into the W rank-local caches."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    c, kr = torch.randn(B, max(lens), r, generator=g), torch.randn(B, max(lens), dr, generator=g)
    caches = []
    for world, rank in [(1, 0)] + [(W, k) for k in range(W)]:
        cache = PagedLatentCache(1, 64, r, dr, block_size=bs, dtype=torch.float32, world_size=world, rank=rank,
                                 interleave=I if world > 1 else 1)
        for b in range(B):
            cache.add(b)
        pos = cache.extend(list(range(B)), lens)
        cache.write(0, list(range(B)), pos, c, kr)
        caches.append(cache)
    return caches[0], caches[1:]


@pytest.mark.parametrize("name", ["eager", "triton"])
@given(W=st.integers(1, 4), I=st.sampled_from([1, 2, 4]), Tq=st.integers(1, 3),
       lens=st.lists(st.integers(3, 90), min_size=1, max_size=3), H=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_sharded_partials_merge_to_unsharded(name, W, I, Tq, lens, H, seed):
    note(f"W={W} I={I} Tq={Tq} lens={lens} H={H}")
    bs, r, dr = 8, 16, 8
    full, shards = build(seed, lens, W, I, bs, r, dr)
    ids = list(range(len(lens)))
    g = torch.Generator().manual_seed(seed + 1)
    q_lat, q_rope = torch.randn(len(lens), Tq, H, r, generator=g), torch.randn(len(lens), Tq, H, dr, generator=g)
    sl = full.seq_lens(ids)
    o_ref, lse_ref = mla_decode_reference(q_lat, q_rope, full.pools[0], full.block_table(ids), sl, 0.3)
    outs, lses = [], []
    for k, cache in enumerate(shards):
        ctx = DCPContext(W, k, I)
        with backend(name):
            o, lse = mla_decode(q_lat, q_rope, cache.pools[0], cache.block_table(ids), cache.local_seq_lens(ids), 0.3,
                                visible_lens=dcp_visible_lens(sl, Tq, ctx), num_splits=2)
        outs.append(o)
        lses.append(lse)
    o, lse = merge_attn_states(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5)


@given(W=st.integers(2, 4), I=st.sampled_from([1, 2]), Tq=st.integers(1, 2),
       lens=st.lists(st.integers(2, 40), min_size=1, max_size=2), seed=st.integers(0, 2**31 - 1))
def test_sharded_flow_with_empty_shards(W, I, Tq, lens, seed):
    """The sharded-heads flow of dcp_attention emulated in one process with the fused kernels: per rank
    dcp_local_lens + decode of all heads, gathered LSEs, merge_scale into head groups, the reduce-scatter as a
    sum. Short requests leave whole ranks (or some queries of a rank) without a visible key."""
    lens = [n if i else 1 + n % 3 for i, n in enumerate(lens)]  # the first request has 1-3 tokens
    lens = [max(n, Tq) for n in lens]
    note(f"W={W} I={I} Tq={Tq} lens={lens}")
    bs, r, dr, H = 8, 16, 8, 2 * W
    full, shards = build(seed, lens, W, I, bs, r, dr)
    ids = list(range(len(lens)))
    g = torch.Generator().manual_seed(seed + 1)
    q_lat, q_rope = torch.randn(len(lens), Tq, H, r, generator=g), torch.randn(len(lens), Tq, H, dr, generator=g)
    sl = full.seq_lens(ids)
    o_ref, lse_ref = mla_decode_reference(q_lat, q_rope, full.pools[0], full.block_table(ids), sl, 0.3)
    with backend("triton"):
        partials = []
        for k, cache in enumerate(shards):
            local, vis = dcp_local_lens(sl, Tq, DCPContext(W, k, I))
            partials.append(mla_decode(q_lat, q_rope, cache.pools[0], cache.block_table(ids), local, 0.3,
                                       visible_lens=vis, out_dtype=torch.float32))
        lses = torch.stack([p[1] for p in partials])
        merged = [merge_scale(lses, partials[k][0], k, W, k) for k in range(W)]
    o = sum(m[0] for m in merged)  # [W, B, Tq, H/W, r]: rank k keeps o[k]
    Hl = H // W
    for k in range(W):
        torch.testing.assert_close(o[k], o_ref[:, :, k * Hl:(k + 1) * Hl], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(merged[k][1], lse_ref[:, :, k * Hl:(k + 1) * Hl], atol=2e-5, rtol=2e-5)


def test_errors():
    with pytest.raises(ValueError, match="rank 2 must be in"):
        DCPContext(2, 2)
    with pytest.raises(ValueError, match="interleave"):
        DCPContext(2, 0, interleave=0)
    cache = PagedLatentCache(1, 4, 16, 8, block_size=8, world_size=2, rank=1)
    with pytest.raises(ValueError, match="built for world_size=2, rank=1"):
        DCPContext(2, 0).check_cache(cache)
    q = torch.zeros(1, 1, 2, 16)
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed"):
        dcp_attention(q, q[..., :8], cache.pools[0], torch.zeros(1, 1, dtype=torch.int32),
                      torch.tensor([1], dtype=torch.int32), 0.1, DCPContext(2, 1))
    with pytest.raises(ValueError, match="heads must be"):
        dcp_attention(q, q[..., :8], cache.pools[0], torch.zeros(1, 1, dtype=torch.int32),
                      torch.tensor([1], dtype=torch.int32), 0.1, DCPContext(1, 0), heads="tp")
    layer = MultiHeadLatentAttention(KimiK3Config.tiny(num_attention_heads=3))
    cache3 = PagedLatentCache(1, 8, layer.kv_lora_rank, layer.dr, block_size=8, world_size=2, rank=0)
    cache3.add(0)
    pos = cache3.extend([0], 1)
    with pytest.raises(ValueError, match="3 heads cannot be sharded over 2 ranks"):
        dcp_mla_decode_layer(layer, torch.zeros(1, 1, layer.o_proj.out_features), cache3, 0, [0], pos,
                             DCPContext(2, 0), heads="sharded")


@contextlib.contextmanager
def no_host_reads():
    """Any read of a tensor value on the host (what a CUDA graph capture cannot contain) raises."""
    names = ["item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy"]
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def boom(n):
        def f(self, *a, **k):
            raise AssertionError(f"host read of a tensor value: Tensor.{n}")
        return f

    try:
        for n in names:
            setattr(torch.Tensor, n, boom(n))
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def test_single_rank_out_and_no_host_reads():
    """W = 1: dcp_attention is mla_decode with the local lengths; check=False reads nothing on the host."""
    full, _ = build(2, [19, 40], 1, 1, 8, 16, 8)
    ids = [0, 1]
    q = torch.randn(2, 2, 3, 24, generator=torch.Generator().manual_seed(4))
    sl = full.seq_lens(ids)
    o_ref, lse_ref = mla_decode_reference(q[..., :16], q[..., 16:], full.pools[0], full.block_table(ids), sl, 0.3)
    out = (poison(2, 2, 3, 16), poison(2, 2, 3))
    with backend("triton"), no_host_reads():
        o, lse = dcp_attention(q[..., :16], q[..., 16:], full.pools[0], full.block_table(ids), sl, 0.3,
                               DCPContext(1, 0), check=False, out=out)
    assert o is out[0] and lse is out[1]
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5)


def test_cat_last():
    q = torch.randn(2, 1, 3, 24)
    assert _cat_last(q[..., :16], q[..., 16:]).data_ptr() == q.data_ptr()
    a, b = torch.randn(2, 1, 3, 16), torch.randn(2, 1, 3, 8)
    assert torch.equal(_cat_last(a, b), torch.cat([a, b], -1))
    assert torch.equal(_cat_last(q[:, :, 1:, :16], q[:, :, 1:, 16:]), q[:, :, 1:])


# -- two processes over gloo -----------------------------------------------------------------------------------

def _worker(rank, world, init_file, results):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        errs = {}
        # kernel-level: sharded heads (ag + rs) and replicated queries
        for I in (1, 2):
            full, shards = build(5, [41, 7, 66], world, I, 8, 16, 8)
            ids = [0, 1, 2]
            g = torch.Generator().manual_seed(9)
            H, Tq = 4, 2
            q_lat, q_rope = torch.randn(3, Tq, H, 16, generator=g), torch.randn(3, Tq, H, 8, generator=g)
            sl = full.seq_lens(ids)
            o_ref, lse_ref = mla_decode_reference(q_lat, q_rope, full.pools[0], full.block_table(ids), sl, 0.25)
            ctx = DCPContext.from_group(interleave=I)
            cache = shards[rank]
            hs = slice(rank * H // world, (rank + 1) * H // world)
            o, lse = dcp_attention(q_lat[:, :, hs], q_rope[:, :, hs], cache.pools[0], cache.block_table(ids), sl, 0.25,
                                   ctx, heads="sharded")
            errs[f"sharded I={I}"] = max((o - o_ref[:, :, hs]).abs().max().item(),
                                         (lse - lse_ref[:, :, hs]).abs().max().item())
            # the fused (interpreted Triton) merge, into preallocated outputs, without host reads
            q = torch.cat([q_lat[:, :, hs], q_rope[:, :, hs]], -1)
            out = (poison(3, Tq, H // world, 16), poison(3, Tq, H // world))
            with backend("triton"), no_host_reads():
                o, lse = dcp_attention(q[..., :16], q[..., 16:], cache.pools[0], cache.block_table(ids), sl, 0.25,
                                       ctx, heads="sharded", check=False, out=out)
            errs[f"sharded fused I={I}"] = max((o - o_ref[:, :, hs]).abs().max().item(),
                                               (lse - lse_ref[:, :, hs]).abs().max().item(),
                                               float(o is not out[0] or lse is not out[1]))
            with backend("triton"):
                o, lse = dcp_attention(q_lat, q_rope, cache.pools[0], cache.block_table(ids), sl, 0.25, ctx,
                                       heads="replicated")
            errs[f"replicated I={I}"] = max((o - o_ref).abs().max().item(), (lse - lse_ref).abs().max().item())
            o, lse = dcp_attention(q_lat, q_rope, cache.pools[0], cache.block_table(ids), sl, 0.25, ctx,
                                   heads="replicated")  # eager merge
            errs[f"replicated eager I={I}"] = max((o - o_ref).abs().max().item(), (lse - lse_ref).abs().max().item())
            # the gathered context equals the unsharded cache's rows (within each request's length)
            gpool, gtab, glen = dcp_gather_context(cache, 0, ids, ctx, block_size=16)
            want = gather_latents(full.pools[0], full.block_table(ids), int(sl.max()))
            got = gather_latents(gpool, gtab, int(sl.max()))
            keep = torch.arange(int(sl.max()))[None, :] < sl[:, None]
            errs[f"gather I={I}"] = float(not (torch.equal(got[keep], want[keep]) and torch.equal(glen, sl)))
        # layer-level decode (verify window of 2) vs the unsharded layer forward
        cfg = KimiK3Config.tiny(num_attention_heads=4)
        torch.manual_seed(0)
        layer = MultiHeadLatentAttention(cfg)
        lens, T = [13, 30], 2
        x = torch.randn(2, max(lens) + T, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            ref = torch.stack([layer(x[b:b + 1, : lens[b] + T])[0, lens[b]:] for b in range(2)])
            ctx = DCPContext.from_group(interleave=2)
            cache = PagedLatentCache(1, 8, cfg.kv_lora_rank, cfg.qk_rope_head_dim, block_size=4, dtype=torch.float32,
                                     world_size=world, rank=rank, interleave=2)
            cache.add("a")
            cache.add("b")
            pos = cache.extend(["a", "b"], lens)
            dcp_write_latents(layer, x[:, : max(lens)], cache, 0, ["a", "b"], pos, ctx)
            pos = cache.extend(["a", "b"], T)
            xn = torch.stack([x[b, lens[b]: lens[b] + T] for b in range(2)])
            for heads in ("auto", "sharded"):  # auto = replicated (1 collective); sharded: 4 collectives
                y = dcp_mla_decode_layer(layer, xn, cache, 0, ["a", "b"], pos, ctx, heads=heads)
                errs[f"layer {heads}"] = (y - ref).abs().max().item()
        try:
            dcp_attention(q_lat, q_rope, shards[rank].pools[0], shards[rank].block_table(ids), sl, 0.25,
                          DCPContext(world + 1, rank))
        except ValueError as e:
            errs["world size mismatch"] = 0.0 if "process group has 2 ranks" in str(e) else 1.0
        results[rank] = errs
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_rank_gloo_matches_one_rank():
    world = 2
    with tempfile.TemporaryDirectory() as d:
        mgr = mp.get_context("spawn").Manager()
        results = mgr.dict()
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), results), nprocs=world, join=True)
        res = dict(results)
        mgr.shutdown()
    assert sorted(res) == [0, 1]
    for rank, errs in res.items():
        assert len(errs) == 13, errs
        for k, e in errs.items():
            assert e < 1e-4, (rank, k, e)
