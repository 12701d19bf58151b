"""k3nn.vision.layout: the per-batch index tensors against the per-image references they replace (the learned grid
resampled by ``F.interpolate``, the sin/cos frame rows, the rotary angles, the merge), a mixed batch of images and
clips giving what each entry gives alone (K2.5 and K3 towers, every CPU backend), and the forward's op count not
growing with the number of images."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.profiler import ProfilerActivity, profile

from k3nn.vision import MoonViT, VisionConfig, rope_2d_angles
from k3nn.vision.layout import GridLayout, interpolation_taps, merge_index, merge_patches, position_taps

from .helpers import rel

MIXED = [(1, 28, 28), (1, 14, 20), (1, 32, 18), (1, 8, 8), (2, 6, 10), (1, 14, 20), (3, 4, 4), (1, 2, 2)]


def _tower(cfg: VisionConfig, seed: int = 0) -> MoonViT:
    m = MoonViT(cfg).eval()
    m.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # non-trivial norms and biases, so every parameter matters
        g = torch.Generator().manual_seed(seed + 1)
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return m


#: the tiny K2.5 tower (bicubic, 8×8 grid) and a tiny K3-like one (bilinear 6×10 grid, attention wider than D, RMSNorm)
TOWERS = {"k25": VisionConfig.tiny(),
          "k3": VisionConfig.tiny(qkv_hidden_size=48, norm_type="rmsnorm", norm_eps=None, attn_bias=False,
                                  mlp_bias=False, patch_embed_bias=False, pos_emb_interpolation="bilinear",
                                  projector_type="patchmergerv2", pos_emb_height=6, pos_emb_width=10)}


def _reference_pos(emb, x, grid):
    """The per-image loop: the resampled grid of each image (+ the frame's sin/cos row in a clip)."""
    parts = []
    for t, h, w in grid.tolist():
        p = emb.grid(h, w)
        if t > 1:
            p = (p[None] + emb.time_weight[:t, None].to(p.dtype)).flatten(0, 1)
        parts.append(p)
    return x + torch.cat(parts).to(x.dtype)


@settings(max_examples=60, deadline=None)
@given(src=st.integers(1, 12), dst=st.integers(1, 40), mode=st.sampled_from(["bicubic", "bilinear"]),
       seed=st.integers(0, 2**16))
def test_interpolation_taps_reproduce_f_interpolate(src, dst, mode, seed):
    x = torch.randn(3, src, generator=torch.Generator().manual_seed(seed))
    index, weight = interpolation_taps(src, dst, mode)
    ref = F.interpolate(x[None, :, None], size=(1, dst), mode=mode, align_corners=False)[0, :, 0]  # [3, 1, src] → dst
    out = (x[:, index] * weight).sum(-1)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(grid=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 12).map(lambda v: 2 * v),
                               st.integers(1, 12).map(lambda v: 2 * v)), min_size=1, max_size=5),
       tower=st.sampled_from(list(TOWERS)), seed=st.integers(0, 2**16))
def test_position_taps_equal_the_resampled_grid_per_image(grid, tower, seed):
    """Up- and down-sampling of the learned grid, bicubic (K2.5) and bilinear (K3, a 6×10 grid), clips included."""
    cfg = TOWERS[tower]
    emb = _tower(cfg, seed).patch_embed.pos_emb
    g = torch.tensor(grid)
    x = torch.randn(int(g.prod(-1).sum()), cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = emb(x, GridLayout.build(g, cfg))
        ref = _reference_pos(emb, x, g)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # fp32 sums of 16 taps in another order
    index, weight = position_taps(g, (cfg.pos_emb_height, cfg.pos_emb_width), cfg.pos_emb_interpolation)
    n = 16 if cfg.pos_emb_interpolation == "bicubic" else 4
    assert index.shape == weight.shape == (x.shape[0], n + (g[:, 0] > 1).any().item())
    torch.testing.assert_close(weight[:, :n].sum(-1), torch.ones(x.shape[0]))  # an interpolation's weights sum to 1


def test_position_taps_of_the_grid_size_itself_are_the_grid():
    cfg = TOWERS["k25"]
    emb = _tower(cfg).patch_embed.pos_emb
    x = torch.zeros(64, cfg.hidden_size)
    with torch.no_grad():
        assert torch.equal(emb(x, GridLayout.build(torch.tensor([[1, 8, 8]]), cfg)), emb.weight.flatten(0, 1))


def test_layout_rope_angles_and_segments_match_the_per_image_references():
    cfg = TOWERS["k3"]
    g = torch.tensor(MIXED)
    lay = GridLayout.build(g, cfg)
    ang = (lay.rope_pos[:, None, :] * lay.rope_freqs[:, None]).flatten(1)
    parts = []  # the per-grid construction: [col·f, row·f] per frequency, frames of a clip alike
    f = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 4, dtype=torch.float32) / cfg.head_dim)
    for t, h, w in MIXED:
        rows = torch.arange(h, dtype=torch.float32)[:, None, None].expand(h, w, 1)
        cols = torch.arange(w, dtype=torch.float32)[None, :, None].expand(h, w, 1)
        parts.append(torch.stack([cols * f, rows * f], -1).reshape(h * w, -1).repeat(t, 1))
    assert torch.equal(ang, torch.cat(parts)) and torch.equal(rope_2d_angles(g, cfg.head_dim, cfg.rope_theta), ang)
    sizes = [t * h * w for t, h, w in MIXED]
    assert list(lay.segments.bounds) == [0, *torch.tensor(sizes).cumsum(0).tolist()]
    assert lay.segments.cu_seqlens.dtype == torch.int32 and lay.segments.max_len == max(sizes)
    assert lay.has_clips and lay.merge_index.shape == (3, sum(h * w for _, h, w in MIXED))


def test_merge_of_images_only_is_one_gather():
    g = torch.tensor([[1, 4, 6], [1, 2, 2]])
    index, frames = merge_index(g, (2, 2))
    assert frames is None and index.shape == (1, 28)
    x = torch.arange(28.0)[:, None]
    out = merge_patches(x, index, frames, 4)
    # image 0 (4×6): block (0, 0) = patches 0, 1, 6, 7; image 1 follows
    assert out[0, :, 0].tolist() == [0, 1, 6, 7] and out[-1, :, 0].tolist() == [24, 25, 26, 27]


@pytest.mark.parametrize("tower", list(TOWERS))
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_a_mixed_batch_gives_what_each_image_gives_alone(tower, backend):
    """Images and clips of different sizes (one size twice) in one packed batch: the merged features and the patch
    features of each entry equal the entry's own forward."""
    cfg = TOWERS[tower]
    m = _tower(cfg)
    m.attn_backend = backend
    g = torch.tensor(MIXED)
    sizes = [t * h * w for t, h, w in MIXED]
    px = torch.randn(sum(sizes), 3, cfg.patch_size, cfg.patch_size, generator=torch.Generator().manual_seed(7))
    kh, kw = cfg.merge_kernel_size
    with torch.no_grad():
        merged, feats = m(px, g), m.patch_features(px, g)
        alone = [m(p, g[n:n + 1]) for n, p in enumerate(px.split(sizes))]
        alone_feats = [m.patch_features(p, g[n:n + 1]) for n, p in enumerate(px.split(sizes))]
    assert merged.shape == (sum(h * w for _, h, w in MIXED) // (kh * kw), kh * kw, cfg.hidden_size)
    for n, (a, b) in enumerate(zip(merged.split([h * w // (kh * kw) for _, h, w in MIXED]), alone)):
        assert rel(a, b) < 1e-5, n
    for n, (a, b) in enumerate(zip(feats.split(sizes), alone_feats)):
        assert rel(a, b) < 1e-5, n


def _top_level_ops(m, px, g) -> int:
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        m(px, g)
    return sum(e.cpu_parent is None for e in prof.events())


def test_the_forward_runs_the_same_ops_for_3_or_12_images():
    """Nothing in the forward loops over images: 12 images of 4 sizes (so as many distinct SDPA lengths) launch as
    many ops as 4 images of those sizes."""
    cfg = TOWERS["k25"]
    m = _tower(cfg)
    m.attn_backend = "sdpa"
    few = torch.tensor(MIXED[:4])
    many = torch.tensor(MIXED[:4] * 3)
    counts = []
    for g in (few, many):
        px = torch.randn(int(g.prod(-1).sum()), 3, cfg.patch_size, cfg.patch_size)
        m(px, g)  # warm the layout caches
        counts.append(_top_level_ops(m, px, g))
    assert counts[0] == counts[1]
