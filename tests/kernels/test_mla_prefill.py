"""mla_attention (causal prefill attention on decompressed K/V: eager reference and Triton kernel) and mla_prefill
(chunked over paged context) vs the layer's eager masked decompressed_attention."""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from k3nn.cache.pages import PagedLatentCache
from k3nn.kernels.mla.api import merge_attn_states
from k3nn import backend, ops
from k3nn.kernels.mla import prefill
from k3nn.kernels.mla.prefill import attention_with_lse, mla_attention_reference, mla_prefill
from k3nn.kernels.mla.triton_prefill import mla_attention_triton
from k3nn.layers.mla import _mask, decompressed_attention
from conftest import poison

H, DN, DR, DV, R = 3, 8, 4, 8, 16


def decompress(c, kr, w_uk, w_uv):
    k = torch.cat([torch.einsum("blr,hdr->blhd", c, w_uk), kr[:, :, None].expand(-1, -1, H, -1)], -1)
    return k, torch.einsum("blr,hvr->blhv", c, w_uv)


@given(ctx=st.lists(st.integers(0, 90), min_size=1, max_size=3), T=st.integers(1, 12),
       chunk=st.sampled_from([7, 32, 4096]), seed=st.integers(0, 2**31 - 1))
def test_chunked_prefill_matches_full_attention(ctx, T, chunk, seed):
    note(f"ctx={ctx} T={T} chunk={chunk}")
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
                         context_lens=torch.tensor(ctx), w_uk=w_uk, w_uv=w_uv, chunk_size=chunk, return_lse=True)
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
    torch.testing.assert_close(mla_prefill(q, k, v, 0.3), ref, atol=1e-5, rtol=1e-5)
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


# -- mla_attention ------------------------------------------------------------------------------------------------

def _qkv(g, B, T, L, H, dn, dr, dv, dtype=torch.float32):
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return (r(B, T, H, dn), r(B, T, H, dr) if dr else None, r(B, L, H, dn), r(B, L, dr) if dr else None,
            r(B, L, H, dv))


def _masked_reference(qn, qr, kn, kr, v, scale, q_start, key_mask):
    """The layer's eager masked form over [B, 1, T, L] (the definition the kernels must match)."""
    B, T, H, _ = qn.shape
    L = kn.shape[1]
    q = qn if qr is None else torch.cat([qn, qr], -1)
    k = kn if kr is None else torch.cat([kn, kr[:, :, None].expand(-1, -1, H, -1)], -1)
    qs = torch.as_tensor(q_start).reshape(-1, 1).expand(B, 1)
    return decompressed_attention(q, k, v, _mask(qs + torch.arange(T), L, key_mask), scale)


@given(B=st.integers(1, 2), T=st.integers(1, 40), ctx=st.integers(0, 40), H=st.integers(1, 2),
       dims=st.sampled_from([(16, 8, 16), (12, 0, 20), (32, 16, 16), (24, 8, 8)]), masked=st.booleans(),
       per_row=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_triton_attention_matches_masked_reference(B, T, ctx, H, dims, masked, per_row, seed):
    """Query offsets (chunked prefill / prefix hits), key masks (left padding, holes), T = 1.., head dims that are
    not powers of two and no rope part; the Triton kernel under the interpreter in fp32."""
    dn, dr, dv = dims
    note(f"B={B} T={T} ctx={ctx} H={H} dims={dims} masked={masked} per_row={per_row}")
    g = torch.Generator().manual_seed(seed)
    L = ctx + T
    qn, qr, kn, kr, v = _qkv(g, B, T, L, H, dn, dr, dv)
    key_mask = (torch.rand(B, L, generator=g) > 0.3) if masked else None
    q_start = torch.tensor([ctx] * B) if per_row else None
    scale = (dn + dr) ** -0.5
    ref = _masked_reference(qn, qr, kn, kr, v, scale, ctx, key_mask)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefill, "Q_BLOCK", 7)  # several query blocks
        o_ref, lse_ref = mla_attention_reference(qn, qr, kn, kr, v, scale, q_start=q_start, key_mask=key_mask,
                                                 return_lse=True)
    torch.testing.assert_close(o_ref, ref, atol=1e-5, rtol=1e-5)
    o, lse = poison(B, T, H, dv), poison(B, T, H)
    mla_attention_triton(qn, qr, kn, kr, v, scale, q_start=q_start, key_mask=key_mask, return_lse=True, out=(o, lse))
    torch.testing.assert_close(o, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, lse_ref.float(), atol=2e-5, rtol=2e-5)


@given(lens=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=4),
       seed=st.integers(0, 2**31 - 1))
def test_triton_attention_varlen(lens, seed):
    """Packed sequences (empty ones included), each with its own cached context before its queries."""
    note(f"(queries, context) per sequence: {lens}")
    g = torch.Generator().manual_seed(seed)
    tq = [t for t, _ in lens]
    tk = [t + c for t, c in lens]
    cu = torch.tensor([0] + tq).cumsum(0)
    cuk = torch.tensor([0] + tk).cumsum(0)
    H, dn, dr, dv = 2, 16, 8, 16
    qn, qr, kn, kr, v = _qkv(g, 1, int(cu[-1]), int(cuk[-1]), H, dn, dr, dv)
    o, lse = poison(1, int(cu[-1]), H, dv), poison(1, int(cu[-1]), H)
    mla_attention_triton(qn, qr, kn, kr, v, 0.25, cu_seqlens=cu, cu_seqlens_k=cuk, return_lse=True, out=(o, lse))
    for i, (t, c) in enumerate(lens):
        a, b, ka, kb = int(cu[i]), int(cu[i + 1]), int(cuk[i]), int(cuk[i + 1])
        if t == 0:
            continue
        ref = _masked_reference(qn[:, a:b], qr[:, a:b], kn[:, ka:kb], kr[:, ka:kb], v[:, ka:kb], 0.25, c, None)
        torch.testing.assert_close(o[:, a:b], ref, atol=2e-5, rtol=2e-5)
    ro, rl = mla_attention_reference(qn, qr, kn, kr, v, 0.25, cu_seqlens=cu, cu_seqlens_k=cuk, return_lse=True)
    torch.testing.assert_close(o, ro, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, rl, atol=2e-5, rtol=2e-5)


def test_triton_attention_edge_cases():
    g = torch.Generator().manual_seed(3)
    qn, qr, kn, kr, v = _qkv(g, 1, 5, 5, 1, 16, 8, 16)
    # every key masked: each query still sees itself (the layer's rule for padded queries)
    none = torch.zeros(1, 5, dtype=torch.bool)
    o, lse = mla_attention_triton(qn, qr, kn, kr, v, 0.5, key_mask=none, return_lse=True)
    torch.testing.assert_close(o, v, atol=1e-6, rtol=1e-6)
    # a sequence with fewer keys than queries: its first queries see nothing (o = 0, lse = -inf)
    cu, cuk = torch.tensor([0, 5]), torch.tensor([0, 3])
    o, lse = mla_attention_triton(qn, qr, kn[:, :3], kr[:, :3], v[:, :3], 0.5, cu_seqlens=cu, cu_seqlens_k=cuk,
                                  return_lse=True)
    assert (o[:, :2] == 0).all() and torch.isneginf(lse[:, :2]).all() and torch.isfinite(lse[:, 2:]).all()
    # q_start past the keys: all visible
    o = mla_attention_triton(qn, qr, kn, kr, v, 0.5, q_start=99)
    ref = _masked_reference(qn, qr, kn, kr, v, 0.5, 99, None)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


def test_mla_attention_op_dispatch_and_errors():
    g = torch.Generator().manual_seed(4)
    qn, qr, kn, kr, v = _qkv(g, 2, 6, 9, 2, 16, 8, 16, dtype=torch.float64)
    ref = _masked_reference(qn, qr, kn, kr, v, 0.3, 3, None)
    torch.testing.assert_close(ops.mla_attention(qn, qr, kn, kr, v, 0.3), ref)  # fp64: the eager path
    with backend("triton"):
        o = ops.mla_attention(qn.float(), qr.float(), kn.float(), kr.float(), v.float(), 0.3)
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="k_rope must be"):
        ops.mla_attention(qn, qr, kn, kr[:, :, :4], v, 0.3)
    with pytest.raises(ValueError, match="q_rope and k_rope come together"):
        ops.mla_attention(qn, qr, kn, None, v, 0.3)
    with pytest.raises(TypeError, match="share a dtype"):
        ops.mla_attention(qn, qr, kn.float(), kr, v, 0.3)
    with pytest.raises(ValueError, match="key_mask must be"):
        ops.mla_attention(qn, qr, kn, kr, v, 0.3, key_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        ops.mla_attention(qn[:1], qr[:1], kn[:1, :6], kr[:1, :6], v[:1, :6], 0.3, cu_seqlens=torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="B=1"):
        ops.mla_attention(qn, qr, kn, kr, v, 0.3, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="scale must be"):
        ops.mla_attention(qn, qr, kn, kr, v, -1.0)
    with pytest.raises(ValueError, match="q_start tensor must be"):
        ops.mla_attention(qn, qr, kn, kr, v, 0.3, q_start=torch.tensor([1]))
    with backend("triton"), pytest.raises(Exception, match="dtype torch.float64"):
        ops.mla_attention(qn, qr, kn, kr, v, 0.3)


def test_eager_attention_trains():
    """The eager path is the training path: gradients flow (the Triton kernel is forward-only and refuses)."""
    g = torch.Generator().manual_seed(5)
    qn, qr, kn, kr, v = (t.requires_grad_() for t in _qkv(g, 1, 4, 4, 1, 8, 4, 8))
    ops.mla_attention(qn, qr, kn, kr, v, 0.3).sum().backward()
    assert qn.grad is not None and kr.grad is not None and torch.isfinite(v.grad).all()
