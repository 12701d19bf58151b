"""Property tests of the eager layers (shapes and seeds drawn by hypothesis, fp64 math)."""

import torch
from hypothesis import given, note
from hypothesis import strategies as st

from k3nn import KimiK3Config, ops
from k3nn.cache import HybridCache
from k3nn.layers.kda import KimiDeltaAttention
from k3nn.layers.mla import MultiHeadLatentAttention, _mask, absorbed_attention, decompressed_attention
from k3nn.layers.moe import MoE, route

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _init(mod, seed):
    g = _gen(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.3)
    return mod


@given(T=st.integers(1, 12), split=st.integers(0, 12), B=st.integers(1, 3), H=st.integers(1, 3),
       D=st.sampled_from([4, 8]), gate=st.sampled_from(["softplus", "lower_bound"]), seed=st.integers(0, 2**16))
def test_kda_layer_state_passing(T, split, B, H, D, gate, seed):
    """f(x) == f(x[:s]) then f(x[s:] | state), for both gates and any split (incl. single tokens)."""
    split = min(split, T)
    note(dict(T=T, split=split, B=B, H=H, D=D, gate=gate))
    cfg = KimiK3Config.tiny(kda_num_heads=H, kda_head_dim=D, kda_gate=gate)
    layer = _init(KimiDeltaAttention(cfg).to(F64), seed)
    x = torch.randn(B, T, cfg.hidden_size, generator=_gen(seed + 1), dtype=F64)
    full = layer(x)
    cache = HybridCache(KimiK3Config.tiny(kda_num_heads=H, kda_head_dim=D, num_hidden_layers=1, mla_layers=[]),
                        B, T, dtype=F64)
    st_ = cache.layers[0]
    parts = [layer(x[:, :split], st_)] if split else []
    for t in range(split, T):
        parts.append(layer(x[:, t:t + 1], st_))
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)


@given(L=st.integers(1, 20), T=st.integers(1, 4), H=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_mla_absorbed_equals_decompressed(L, T, H, seed):
    cfg = KimiK3Config.tiny(num_attention_heads=H)
    layer = _init(MultiHeadLatentAttention(cfg).to(F64), seed)
    g = _gen(seed + 1)
    x = torch.randn(2, T, cfg.hidden_size, generator=g, dtype=F64)
    c = torch.randn(2, L + T, cfg.kv_lora_rank, generator=g, dtype=F64)
    kr = torch.randn(2, L + T, cfg.qk_rope_head_dim, generator=g, dtype=F64)
    key_mask = torch.rand(2, L + T, generator=g) > 0.3
    q_pos = (L + torch.arange(T)).expand(2, T)
    mask = _mask(q_pos, L + T, key_mask)
    q_nope, q_rope = layer.queries(x, None)
    w_uk, w_uv = layer.w_uk_uv()
    o_lat, lse = absorbed_attention(torch.einsum("bthd,hdr->bthr", q_nope, w_uk), q_rope, c, kr, mask, layer.scale)
    absorbed = torch.einsum("bthr,hvr->bthv", o_lat, w_uv)
    k = torch.cat([torch.einsum("blr,hdr->blhd", c, w_uk), kr[:, :, None].expand(-1, -1, H, -1)], -1)
    v = torch.einsum("blr,hvr->blhv", c, w_uv)
    plain = decompressed_attention(torch.cat([q_nope, q_rope], -1), k, v, mask, layer.scale)
    torch.testing.assert_close(absorbed, plain, rtol=1e-10, atol=1e-10)
    assert torch.isfinite(lse).all()


@given(N=st.integers(1, 9), E=st.integers(2, 8), k=st.integers(1, 8), latent=st.booleans(), seed=st.integers(0, 2**16))
def test_moe_is_token_permutation_equivariant(N, E, k, latent, seed):
    k = min(k, E)
    cfg = KimiK3Config.tiny(num_experts=E, num_experts_per_token=k,
                            moe_kind="latent" if latent else "standard",
                            routed_expert_hidden_size=32 if latent else None)
    moe = _init(MoE(cfg).to(F64), seed)
    x = torch.randn(N, cfg.hidden_size, generator=_gen(seed + 1), dtype=F64)
    perm = torch.randperm(N, generator=_gen(seed + 2))
    torch.testing.assert_close(moe(x)[perm], moe(x[perm]), rtol=1e-10, atol=1e-10)


@given(N=st.integers(1, 6), E=st.integers(2, 16), k=st.integers(1, 16), groups=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**16))
def test_router_weights(N, E, k, groups, seed):
    k = min(k, E)
    E = max(E - E % groups, groups)
    k = min(k, E // groups)  # group-limited routing can only pick from the kept group
    g = _gen(seed)
    logits, bias = torch.randn(N, E, generator=g), torch.randn(E, generator=g)
    ids, w = route(logits, bias, k, True, 2.5, num_group=groups, topk_group=1 if groups > 1 else 1)
    assert ids.shape == (N, k) and (ids.sort(-1).values.diff(dim=-1) != 0).all()  # distinct experts
    raw = logits.sigmoid().gather(1, ids)
    if k > 1:  # renormalised over the chosen experts (Kimi's gate leaves a single expert's score raw)
        torch.testing.assert_close(w.sum(-1), torch.full((N,), 2.5), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w, raw / raw.sum(-1, keepdim=True) * 2.5)
    else:
        torch.testing.assert_close(w, raw * 2.5)
    if groups == 1:  # selection uses the biased scores
        choice = logits.sigmoid() + bias
        assert torch.equal(ids.sort(-1).values, choice.topk(k, -1).indices.sort(-1).values)


@given(S=st.integers(1, 9), d=st.sampled_from([4, 16, 33]), seed=st.integers(0, 2**16))
def test_attnres_mix_is_a_convex_combination(S, d, seed):
    g = _gen(seed)
    src = [torch.randn(3, d, generator=g, dtype=F64) * (i + 1) for i in range(S)]
    qw, nw = torch.randn(d, generator=g, dtype=F64), torch.rand(d, generator=g, dtype=F64)
    out = ops.attnres_mix(src, qw, nw, 1e-5)
    V = torch.stack(src)
    K = V / torch.sqrt(V.pow(2).mean(-1, keepdim=True) + 1e-5)
    p = (K * (qw * nw)).sum(-1).softmax(0)
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(0), torch.ones(3, dtype=F64))
    torch.testing.assert_close(out, (p[..., None] * V).sum(0))
    # a single source is returned unchanged
    torch.testing.assert_close(ops.attnres_mix(src[:1], qw, nw, 1e-5), src[0])
