"""mla_decode: every backend vs the eager paged reference, the layer's absorbed and decompressed attention."""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from k3nn import backend
from k3nn.kernels.registry import BackendUnavailableError, tuning
from k3nn.layers.mla import _mask, absorbed_attention, decompressed_attention
from k3nn.ops import mla_decode

from conftest import poison

BACKENDS = ["eager", "triton"]


def make_case(seed, lens, Tq, H, r, dr, bs, dtype=torch.float32, extra_blocks=2):
    """Random paged cache: blocks shuffled over the pool, unused rows and blocks NaN-poisoned, unused
    block-table entries pointing far past the pool (a kernel must never read them)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    nblk = [-(-n // bs) for n in lens]
    width = max(nblk) + 1
    nb = sum(nblk) + extra_blocks
    pool = torch.full((nb, bs, r + dr), float("nan"), dtype=dtype)
    perm = torch.randperm(nb, generator=g).tolist()
    table = torch.full((B, width), nb + 10_000, dtype=torch.int32)
    c = torch.randn(B, max(lens), r, generator=g)
    kr = torch.randn(B, max(lens), dr, generator=g)
    for b, n in enumerate(lens):
        ids = [perm.pop() for _ in range(nblk[b])]
        table[b, : nblk[b]] = torch.tensor(ids, dtype=torch.int32)
        for j in range(n):
            pool[ids[j // bs], j % bs] = torch.cat([c[b, j], kr[b, j]]).to(dtype)
    q_lat = torch.randn(B, Tq, H, r, generator=g).to(dtype)
    q_rope = torch.randn(B, Tq, H, dr, generator=g).to(dtype)
    return q_lat, q_rope, pool, table, torch.tensor(lens, dtype=torch.int32), c.to(dtype), kr.to(dtype)


def run(name, *args, **kw):
    B, Tq, H, r = args[0].shape
    out = (poison(B, Tq, H, r, dtype=kw.get("out_dtype") or args[0].dtype), poison(B, Tq, H))
    with backend(name):
        o, lse = mla_decode(*args, out=out, **kw)
    assert o is out[0] and lse is out[1]
    return o, lse


def check_vs_layer(o, lse, q_lat, q_rope, c, kr, lens, scale, atol):
    """Per request, the layer's absorbed_attention on the contiguous cache (query t at seq_len - Tq + t)."""
    Tq = q_lat.shape[1]
    for b, n in enumerate(lens):
        q_pos = (n - Tq + torch.arange(Tq))[None]
        mask = _mask(q_pos, n, None)
        o_ref, lse_ref = absorbed_attention(q_lat[b:b + 1], q_rope[b:b + 1], c[b:b + 1, :n], kr[b:b + 1, :n],
                                            mask, scale)
        torch.testing.assert_close(o[b:b + 1].float(), o_ref, atol=atol, rtol=atol)
        torch.testing.assert_close(lse[b:b + 1], lse_ref, atol=atol, rtol=atol)


@pytest.mark.parametrize("name", BACKENDS)
@given(data=st.data())
def test_matches_layer_absorbed(name, data):
    bs = data.draw(st.sampled_from([16, 64]), label="block_size")
    Tq = data.draw(st.integers(1, 3), label="Tq")
    B = data.draw(st.integers(1, 3), label="B")
    lens = data.draw(st.lists(st.integers(Tq, 150), min_size=B, max_size=B), label="lens")
    H = data.draw(st.integers(1, 6), label="H")
    r = data.draw(st.sampled_from([16, 32, 24]), label="r")
    dr = data.draw(st.sampled_from([0, 8, 16]), label="dr")
    splits = data.draw(st.sampled_from([None, 1, 2, 5]), label="num_splits")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    note(f"bs={bs} lens={lens} Tq={Tq} H={H} r={r} dr={dr} splits={splits}")
    q_lat, q_rope, pool, table, sl, c, kr = make_case(seed, lens, Tq, H, r, dr, bs)
    scale = (r + dr) ** -0.5 * 1.7
    o, lse = run(name, q_lat, q_rope, pool, table, sl, scale, num_splits=splits)
    check_vs_layer(o, lse, q_lat, q_rope, c, kr, lens, scale, atol=2e-5)


@given(data=st.data())
def test_absorbed_equals_decompressed(data):
    """W_UV(Σ p c) with q_lat = W_UKᵀ q_nope is the decompressed MHA of the layer (the absorption identity)."""
    Tq = data.draw(st.integers(1, 3), label="Tq")
    n = data.draw(st.integers(Tq, 100), label="len")
    H, dn, dv, r, dr = 3, 8, 8, 16, 8
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    note(f"len={n} Tq={Tq}")
    g = torch.Generator().manual_seed(seed)
    _, q_rope, pool, table, sl, c, kr = make_case(seed, [n], Tq, H, r, dr, 16)
    q_nope = torch.randn(1, Tq, H, dn, generator=g)
    w_uk, w_uv = torch.randn(H, dn, r, generator=g) / 4, torch.randn(H, dv, r, generator=g) / 4
    scale = (dn + dr) ** -0.5
    q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)
    with backend("triton"):
        o_lat, _ = mla_decode(q_lat, q_rope, pool, table, sl, scale, num_splits=2)
    o = torch.einsum("bthr,hvr->bthv", o_lat, w_uv)
    k = torch.cat([torch.einsum("blr,hdr->blhd", c[:, :n], w_uk), kr[:, :n, None].expand(-1, -1, H, -1)], -1)
    v = torch.einsum("blr,hvr->blhv", c[:, :n], w_uv)
    mask = _mask((n - Tq + torch.arange(Tq))[None], n, None)
    ref = decompressed_attention(torch.cat([q_nope, q_rope], -1), k, v, mask, scale)
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", BACKENDS)
def test_visible_lens_and_empty_rows(name):
    """Explicit causal bounds (DCP shards): a query that sees no key gets o = 0, lse = -inf; a request with
    zero cached tokens is allowed."""
    q_lat, q_rope, pool, table, sl, c, kr = make_case(3, [40, 1, 70], 2, 3, 16, 8, 16)
    sl = torch.tensor([40, 0, 70], dtype=torch.int32)
    vis = torch.tensor([[0, 17], [0, 0], [69, 70]], dtype=torch.int32)
    o, lse = run(name, q_lat, q_rope, pool, table, sl, 0.2, visible_lens=vis, num_splits=3)
    assert torch.isneginf(lse[0, 0]).all() and torch.isneginf(lse[1]).all()
    assert (o[0, 0] == 0).all() and (o[1] == 0).all()
    for b, t, n in [(0, 1, 17), (2, 0, 69), (2, 1, 70)]:
        mask = torch.ones(1, 1, 1, n, dtype=torch.bool)
        o_ref, lse_ref = absorbed_attention(q_lat[b:b + 1, t:t + 1], q_rope[b:b + 1, t:t + 1], c[b:b + 1, :n],
                                            kr[b:b + 1, :n], mask, 0.2)
        torch.testing.assert_close(o[b, t], o_ref[0, 0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse[b, t], lse_ref[0, 0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("lens,bs,splits", [([64], 64, 1), ([128, 1], 64, 4), ([3, 3], 16, 8), ([65], 64, 2)])
def test_edges_fp16(name, lens, bs, splits):
    Tq = min(lens)
    q_lat, q_rope, pool, table, sl, c, kr = make_case(7, lens, Tq, 2, 32, 16, bs, dtype=torch.float16)
    o, lse = run(name, q_lat, q_rope, pool, table, sl, 0.15, num_splits=splits)
    assert o.dtype == torch.float16
    check_vs_layer(o, lse, q_lat.float(), q_rope.float(), c.float(), kr.float(), lens, 0.15, atol=2e-3)


def test_strided_queries_and_fp32_out():
    q_lat, q_rope, pool, table, sl, c, kr = make_case(11, [50, 20], 1, 4, 16, 8, 16, dtype=torch.float16)
    big = torch.cat([q_lat, q_rope], -1)  # q_lat / q_rope as strided views of one tensor
    with backend("triton"):
        o, lse = mla_decode(big[..., :16], big[..., 16:], pool, table, sl, 0.3, out_dtype=torch.float32)
    assert o.dtype == torch.float32
    with backend("eager"):
        o2, lse2 = mla_decode(q_lat, q_rope, pool, table, sl, 0.3, out_dtype=torch.float32)
    torch.testing.assert_close(o, o2, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, lse2, atol=2e-3, rtol=2e-3)


def test_bad_inputs():
    q_lat, q_rope, pool, table, sl, *_ = make_case(1, [40, 20], 1, 2, 16, 8, 16)
    with pytest.raises(ValueError, match="outside the pool"):
        mla_decode(q_lat, q_rope, pool, torch.full_like(table, pool.shape[0]), sl, 0.1)
    with pytest.raises(ValueError, match="exceeds what block_table covers"):
        mla_decode(q_lat, q_rope, pool, table[:, :1], sl, 0.1)
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        mla_decode(q_lat, q_rope, pool, table, -sl, 0.1)
    with pytest.raises(TypeError, match="share a dtype"):
        mla_decode(q_lat.half(), q_rope.half(), pool, table, sl, 0.1)
    with pytest.raises(TypeError, match="block_table must be int32 or int64"):
        mla_decode(q_lat, q_rope, pool, table.float(), sl, 0.1)
    with pytest.raises(ValueError, match="kv_pool must be"):
        mla_decode(q_lat, q_rope, pool[..., :-1], table, sl, 0.1)
    with pytest.raises(ValueError, match="q_rope must be"):
        mla_decode(q_lat, q_rope[:, :, :1], pool, table, sl, 0.1)
    with pytest.raises(ValueError, match="seq_lens must be"):
        mla_decode(q_lat, q_rope, pool, table, sl[:1], 0.1)
    with pytest.raises(ValueError, match="scale must be a positive"):
        mla_decode(q_lat, q_rope, pool, table, sl, 0.0)
    with pytest.raises(ValueError, match="visible_lens must lie"):
        mla_decode(q_lat, q_rope, pool, table, sl, 0.1, visible_lens=(sl + 1)[:, None])
    with pytest.raises(ValueError, match=r"seq_lens must be >= Tq"):
        mla_decode(q_lat.expand(2, 30, 2, 16), q_rope.expand(2, 30, 2, 8), pool, table, sl, 0.1)
    with pytest.raises(ValueError, match="out must be"):
        mla_decode(q_lat, q_rope, pool, table, sl, 0.1, out=(q_lat, sl))
    with backend("triton"), pytest.raises(BackendUnavailableError, match="bf16"):
        mla_decode(q_lat.bfloat16(), q_rope.bfloat16(), pool.bfloat16(), table, sl, 0.1)


@pytest.mark.parametrize("tile", [(16, 16, 4, 1, False), (16, 32, 4, 1, True), (16, 16, 4, 1, True),
                                  (16, 32, 4, 1, True, 2, True, True), (16, 16, 4, 1, False, 2, False, True),
                                  (16, 32, 4, 1, False, 1, True, False), (16, 16, 4, 1, False, 1, True, True, True),
                                  (16, 32, 4, 1, True, 1, False, False, True)])
@pytest.mark.parametrize("bs", [8, 64])
def test_tile_variants_and_growing_scores(monkeypatch, tile, bs):
    """Both rescaling schemes (eager and lazy, threshold 2^8), tiles spanning several pages, and scores whose
    running max grows by small and large steps across tiles; tensor-descriptor tiles (whole tiles through
    descriptors, the partial last one masked, NaN in the unused page rows) where a tile is one page's rows."""
    from k3nn.kernels.mla import triton_decode

    monkeypatch.setattr(triton_decode, "_INTERP_TILE", tile)
    lens = [150, 37]
    q_lat, q_rope, pool, table, sl, c, kr = make_case(5, lens, 2, 3, 16, 8, bs)
    ramp = torch.linspace(0.1, 3.0, max(lens))[None, :, None]  # later keys dominate more and more
    c, kr = c * ramp, kr * ramp
    for b, n in enumerate(lens):
        for j in range(n):
            pool[table[b, j // bs], j % bs] = torch.cat([c[b, j], kr[b, j]])
    o, lse = run("triton", q_lat, q_rope, pool, table, sl, 2.0, num_splits=2)
    check_vs_layer(o, lse, q_lat, q_rope, c, kr, lens, 2.0, atol=5e-5)


@pytest.mark.parametrize("dr,sv", [(0, 1), (16, 1), (16, 2)])
def test_tensor_descriptor_tiles(monkeypatch, dr, sv):
    """The tensor-descriptor path really runs (a spy on the descriptor builder; with the column split, one box
    per half) and matches the layer: lengths that end mid-tile, a request shorter than one tile, more splits than whole tiles, NaN past every sequence."""
    from k3nn.kernels.mla import triton_decode

    made = []
    build = triton_decode._tma_descriptors
    monkeypatch.setattr(triton_decode, "_tma_descriptors", lambda *a: made.append(build(*a)) or made[-1])
    monkeypatch.setattr(triton_decode, "_INTERP_TILE", (16, 16, 4, 1, True, sv, True, True, True))
    lens = [150, 9, 64]
    q_lat, q_rope, pool, table, sl, c, kr = make_case(11, lens, 1, 2, 32, dr, 64)
    for splits in (1, 4):
        o, lse = run("triton", q_lat, q_rope, pool, table, sl, 0.3, num_splits=splits)
        check_vs_layer(o, lse, q_lat, q_rope, c, kr, lens, 0.3, atol=3e-5)
    assert made and all(d is not None for d in made)


def test_tensor_descriptor_fallbacks():
    """Pools a descriptor box cannot tile go to the pointer path (None): tiles crossing pages, padded rope or
    latent blocks, pages not PAGE rows apart, a misaligned base; padded rows (a wider last dim) are fine."""
    from k3nn.kernels.mla.triton_decode import _tma_descriptors

    pool = torch.empty(3, 64, 48, dtype=torch.bfloat16)
    lat, rope = _tma_descriptors(pool, 32, 32, 16, 32, 16)
    assert lat.block_shape == [32, 32] and rope.block_shape == [32, 16] and lat.strides == [48, 1]
    assert _tma_descriptors(pool, 32, 32, 16, 32, 16, 2)[0].block_shape == [32, 16]  # one box per half
    wide = torch.empty(3, 64, 56, dtype=torch.bfloat16)[..., :48]  # rows 112 bytes apart
    assert _tma_descriptors(wide, 32, 32, 16, 32, 16)[0].strides == [56, 1]
    assert _tma_descriptors(pool, 128, 32, 16, 32, 16) is None  # a tile would cross pages
    assert _tma_descriptors(torch.empty(3, 64, 40, dtype=torch.bfloat16), 32, 32, 16, 32, 8) is None  # dr 8 < 16
    assert _tma_descriptors(torch.empty(3, 64, 56, dtype=torch.bfloat16), 32, 64, 16, 40, 16) is None  # r 40
    assert _tma_descriptors(torch.empty(64, 3, 48, dtype=torch.bfloat16).transpose(0, 1), 32, 32, 16, 32, 16) is None
    odd = torch.empty(3 * 64 * 48 + 1, dtype=torch.bfloat16)[1:].view(3, 64, 48)  # base 2 bytes off
    assert _tma_descriptors(odd, 32, 32, 16, 32, 16) is None


@given(data=st.data())
def test_plan_variants(data):
    """Every constexpr variant of a plan (column split, block ids read ahead, opaque scores, lazy or eager
    rescaling, tensor-descriptor tiles, key tiles within or across pages) against the eager reference, with verify windows and explicit
    visible lengths."""
    from k3nn.kernels.mla import triton_decode

    tile = (16, data.draw(st.sampled_from([16, 32]), label="BLOCK_N"), 4, 1, data.draw(st.booleans(), label="lazy"),
            data.draw(st.sampled_from([1, 2]), label="sv"), data.draw(st.booleans(), label="ahead"),
            data.draw(st.booleans(), label="opaque"), data.draw(st.booleans(), label="tma"))
    bs = data.draw(st.sampled_from([8, 16, 64]), label="block_size")
    Tq = data.draw(st.integers(1, 3), label="Tq")
    B = data.draw(st.integers(1, 2), label="B")
    lens = data.draw(st.lists(st.integers(Tq, 140), min_size=B, max_size=B), label="lens")
    H = data.draw(st.integers(1, 5), label="H")
    r = data.draw(st.sampled_from([16, 32, 24]), label="r")
    dr = data.draw(st.sampled_from([0, 8, 16]), label="dr")
    splits = data.draw(st.sampled_from([1, 2, 3]), label="num_splits")
    use_vis = data.draw(st.booleans(), label="visible_lens")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    note(f"tile={tile} bs={bs} lens={lens} Tq={Tq} H={H} r={r} dr={dr} splits={splits} vis={use_vis}")
    q_lat, q_rope, pool, table, sl, *_ = make_case(seed, lens, Tq, H, r, dr, bs)
    vis = None
    if use_vis:
        g = torch.Generator().manual_seed(seed + 1)
        vis = (torch.rand(B, Tq, generator=g) * (sl[:, None] + 1)).to(torch.int32).clamp_max(sl[:, None])
    scale = (r + dr) ** -0.5 * 1.7
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_decode, "_INTERP_TILE", tile)
        o, lse = run("triton", q_lat, q_rope, pool, table, sl, scale, visible_lens=vis, num_splits=splits)
    with backend("eager"):
        o_ref, lse_ref = mla_decode(q_lat, q_rope, pool, table, sl, scale, visible_lens=vis)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5)


def test_plans_and_split_counts(monkeypatch):
    """Host-side plan logic for a 132-SM GPU, without one: split counts that fill whole waves, candidate
    filtering by row count, plan tuples, the tile pinned through the tuning object."""
    from k3nn.kernels.mla import triton_decode as td

    monkeypatch.setattr(td, "_sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    assert td.wave_splits(64, 64, dev, 64) == 2  # 128 programs: one wave
    assert td.wave_splits(64, 64, dev, 32) == 1
    assert td.wave_splits(128, 64, dev, 64) == 1
    assert td.wave_splits(1, 64, dev, 64) == 132
    assert td.wave_splits(1, 96, dev, 32) == 44
    assert td.wave_splits(1, 64, dev, 64, split_v=2) == 66
    assert td.wave_splits(1, 16, dev, 16, waves=4.0) == td.MAX_SPLITS
    assert td.choose_num_splits(64, 64, dev, 32) == 3  # the default plan's count (about two waves)
    assert td.wave_splits(1, 64, torch.device("cpu"), 64) == 1
    p = td.make_plan((64, 32, 8, 4, True, 1, True, True), 2)
    assert p == td.Plan(64, 32, 8, 4, True, 1, True, True, splits=2) and p.tile == (64, 32, 8, 4, True, 1, True, True, False)
    assert p.short() == "64x32w8s4-LAO/S2"
    assert td.make_plan((32, 64, 4, 2, True), 3) == td.Plan(32, 64, 4, 2, True, 1, False, False, splits=3)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))  # Hopper: the wide tile
    assert td._default_plan(64, 64, dev) == td.Plan(64, 64, 8, 2, False, 1, True, True, True, splits=2)
    assert td._default_plan(64, 32, dev) == td.Plan(32, 64, 4, 2, True, 1, False, False, splits=5)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert td._default_plan(64, 64, dev) == td.Plan(32, 64, 4, 2, True, 1, False, False, splits=3)
    for M, rows in [(16, {16}), (64, {32, 64}), (96, {32, 64}), (128, {32, 64})]:
        cands = td._candidates(64, M, dev)
        assert {c.bh for c in cands} == rows, M
        assert len(cands) == len(set(cands))
        for c in cands:
            assert c.splits in {td.wave_splits(64, M, dev, c.bh, c.sv, w) for w in (1.0, 0.5, 0.25)} | {
                td.choose_num_splits(64, M, dev, c.bh, 2, c.sv)}
    # B=1: half- and quarter-wave split counts too, none above the block table's width
    assert {c.splits for c in td._candidates(1, 64, dev) if c.bh == 64} == {132, 128, 66, 33}
    assert max(c.splits for c in td._candidates(1, 64, dev, max_blocks=40)) == 40
    with tuning(mla_decode_tile=(64, 32, 8, 4, 1, 2, 1, 0)):
        assert td.pinned_tile() == (64, 32, 8, 4, True, 2, True, False)
    with tuning(mla_decode_tile=(64, 32, 8, 4, 0, 1, 1, 1, 1)):
        assert td.make_plan(td.pinned_tile(), 2).short() == "64x32w8s4-AOT/S2"
    assert td.pinned_tile() is None
