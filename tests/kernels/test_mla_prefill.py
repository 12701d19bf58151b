"""mla_prefill (decompressed, chunked over paged context) vs the layer's eager decompressed_attention."""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from k3nn.cache.pages import PagedLatentCache
from k3nn.kernels.mla.api import merge_attn_states
from k3nn.kernels.mla.prefill import attention_with_lse, mla_prefill
from k3nn.layers.mla import _mask, decompressed_attention

H, DN, DR, DV, R = 3, 8, 4, 8, 16


def decompress(c, kr, w_uk, w_uv):
    k = torch.cat([torch.einsum("blr,hdr->blhd", c, w_uk), kr[:, :, None].expand(-1, -1, H, -1)], -1)
    return k, torch.einsum("blr,hvr->blhv", c, w_uv)


@given(ctx=st.lists(st.integers(0, 90), min_size=1, max_size=3), T=st.integers(1, 12),
       chunk=st.sampled_from([7, 32, 4096]), q_chunk=st.sampled_from([5, 1024]), seed=st.integers(0, 2**31 - 1))
def test_chunked_prefill_matches_full_attention(ctx, T, chunk, q_chunk, seed):
    note(f"ctx={ctx} T={T} chunk={chunk} q_chunk={q_chunk}")
    g = torch.Generator().manual_seed(seed)
    B = len(ctx)
    w_uk, w_uv = torch.randn(H, DN, R, generator=g) / 3, torch.randn(H, DV, R, generator=g) / 3
    L = max(ctx) + T
    c, kr = torch.randn(B, L, R, generator=g), torch.randn(B, L, DR, generator=g)
    q = torch.randn(B, T, H, DN + DR, generator=g)
    cache = PagedLatentCache(1, 40, R, DR, block_size=8, dtype=torch.float32)
    ids = list(range(B))
    for i in ids:
        cache.add(i)
    pos = cache.extend(ids, ctx)
    cache.write(0, ids, pos, c[:, :pos.shape[1]], kr[:, :pos.shape[1]])
    # the new tokens of row b are c[b, ctx[b]:ctx[b]+T]
    cn = torch.stack([c[b, ctx[b]:ctx[b] + T] for b in ids])
    krn = torch.stack([kr[b, ctx[b]:ctx[b] + T] for b in ids])
    k, v = decompress(cn, krn, w_uk, w_uv)
    scale = (DN + DR) ** -0.5
    o, lse = mla_prefill(q, k, v, scale, kv_pool=cache.pools[0], block_table=cache.block_table(ids),
                         context_lens=torch.tensor(ctx), w_uk=w_uk, w_uv=w_uv, chunk_size=chunk, q_chunk=q_chunk,
                         return_lse=True)
    for b in ids:
        n = ctx[b] + T
        kf, vf = decompress(c[b:b + 1, :n], kr[b:b + 1, :n], w_uk, w_uv)
        ref = decompressed_attention(q[b:b + 1], kf, vf, _mask((ctx[b] + torch.arange(T))[None], n, None), scale)
        torch.testing.assert_close(o[b:b + 1], ref, atol=2e-5, rtol=2e-5)
    assert torch.isfinite(lse).all()


def test_prefill_without_context_and_errors():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 9, H, 12, generator=g), torch.randn(2, 9, H, 12, generator=g)
    v = torch.randn(2, 9, H, DV, generator=g)
    ref = decompressed_attention(q, k, v, _mask(torch.arange(9).expand(2, 9), 9, None), 0.3)
    torch.testing.assert_close(mla_prefill(q, k, v, 0.3, q_chunk=4), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs kv_pool, block_table"):
        mla_prefill(q, k, v, 0.3, kv_pool=torch.zeros(2, 8, 16))
    with pytest.raises(ValueError, match="q and k must both be"):
        mla_prefill(q, k[:, :3], v, 0.3)


def test_merge_attn_states_exact_and_guards():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 10, 1, 4, generator=g)
    v = torch.randn(1, 10, 1, 3, generator=g)
    full, lse_full = attention_with_lse(q, k, v, 0.5)
    a, la = attention_with_lse(q, k[:, :4], v[:, :4], 0.5)
    b, lb = attention_with_lse(q, k[:, 4:], v[:, 4:], 0.5)
    nan_part = torch.full_like(a, float("nan"))  # an empty shard with garbage output
    o, lse = merge_attn_states(torch.stack([a, b, nan_part]),
                               torch.stack([la, lb, torch.full_like(la, float("-inf"))]))
    torch.testing.assert_close(o, full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, lse_full, atol=1e-6, rtol=1e-6)
    o, lse = merge_attn_states(torch.stack([nan_part, nan_part]), torch.full((2,) + la.shape, float("-inf")))
    assert (o == 0).all() and torch.isneginf(lse).all()
