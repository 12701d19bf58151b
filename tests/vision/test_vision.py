"""k3nn.vision: varlen attention, 2D rotary, patch merge, the tower and projector against transformers' Kimi K2.5 on
random grids, configs in both spellings, and bad inputs (each a ValueError naming the argument)."""

import json

import pytest
import torch
from hypothesis import given, strategies as st

from k3nn import KimiK3, KimiK3Config, KimiK3ForConditionalGeneration, MultimodalConfig, VisionConfig
from k3nn.vision import (MoonViT, PatchMergerProjector, apply_rope_2d, cu_seqlens_from_grid, patch_merge,
                         rope_2d_angles, varlen_attention)

from . import processor_fixture as pf
from .helpers import VISION, hf_k25, rel

grids = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 4).map(lambda x: 2 * x),
                           st.integers(1, 4).map(lambda x: 2 * x)), min_size=1, max_size=4)


def _padded_attention(q, k, v, cu):
    """Reference: every image padded to the longest, key padding masked (what varlen avoids)."""
    bounds = cu.tolist()
    n = max(b - a for a, b in zip(bounds, bounds[1:]))
    out = torch.zeros_like(v)
    for a, b in zip(bounds, bounds[1:]):
        if b == a:
            continue
        pad = lambda t: torch.cat([t[a:b], t.new_zeros(n - (b - a), *t.shape[1:])])  # noqa: E731
        s = torch.einsum("ihd,jhd->hij", pad(q), pad(k)) * q.shape[-1] ** -0.5
        s[..., b - a:] = float("-inf")
        out[a:b] = torch.einsum("hij,jhd->ihd", s.softmax(-1), pad(v))[: b - a]
    return out


@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=5), heads=st.integers(1, 3),
       dim=st.sampled_from([8, 16]), seed=st.integers(0, 2**16))
def test_varlen_attention_matches_the_padded_reference(lengths, heads, dim, seed):
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths)
    q, k, v = (torch.randn(L, heads, dim, generator=g) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ref = _padded_attention(q, k, v, cu)
    for backend in ("eager", "sdpa"):
        out = varlen_attention(q, k, v, cu, backend=backend)
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), backend


def test_varlen_attention_rejects_bad_cu_seqlens():
    q = torch.randn(10, 2, 8)
    for cu, match in ([torch.tensor([0, 4, 9]), "end at the token count 10"], [torch.tensor([1, 10]), "start at 0"],
                      [torch.tensor([0, 6, 4, 10]), "not decrease"], [torch.tensor([0.0, 10.0]), "integers"]):
        with pytest.raises(ValueError, match=match):
            varlen_attention(q, q, q, cu)
    with pytest.raises(ValueError, match="backend"):
        varlen_attention(q, q, q, torch.tensor([0, 10]), backend="cudnn")


@given(grid=grids, seed=st.integers(0, 2**16))
def test_rope_2d_rotates_by_relative_grid_offsets(grid, seed):
    """|RoPE(x)| = |x|, and q·k after rotation depends only on the offset between the two patches."""
    g = torch.Generator().manual_seed(seed)
    grid_t = torch.tensor(grid)
    ang = rope_2d_angles(grid_t, 16)
    L = int(grid_t.prod(-1).sum())
    assert ang.shape == (L, 8)
    x = torch.randn(L, 2, 16, generator=g)
    assert torch.allclose(apply_rope_2d(x, ang).norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    t, h, w = grid[0]
    q, k = torch.randn(1, 1, 16, generator=g), torch.randn(1, 1, 16, generator=g)
    a = rope_2d_angles(torch.tensor([[1, h, w]]), 16)
    shift = lambda r, c: a[r * w + c][None]  # noqa: E731
    s1 = (apply_rope_2d(q, shift(h - 1, w - 1)) * apply_rope_2d(k, shift(h - 1, 0))).sum()
    s2 = (apply_rope_2d(q, shift(0, w - 1)) * apply_rope_2d(k, shift(0, 0))).sum()
    assert torch.allclose(s1, s2, atol=1e-4)


@given(grid=grids, seed=st.integers(0, 2**16))
def test_patch_merge_groups_blocks_and_averages_frames(grid, seed):
    grid_t = torch.tensor(grid)
    D = 3
    x = torch.randn(int(grid_t.prod(-1).sum()), D, generator=torch.Generator().manual_seed(seed))
    out = patch_merge(x, grid_t, (2, 2))
    rows, a = [], 0
    for t, h, w in grid:
        frames = x[a:a + t * h * w].view(t, h, w, D)
        a += t * h * w
        for r in range(0, h, 2):
            for c in range(0, w, 2):
                rows.append(frames[:, r:r + 2, c:c + 2].reshape(t, 4, D).mean(0))
    assert torch.allclose(out, torch.stack(rows), atol=1e-6)


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers", reason="transformers is in the parity extra")
    return hf_k25(seed=5)


@pytest.fixture(scope="module")
def k3nn_model(hf, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(d)
    return KimiK3ForConditionalGeneration.from_pretrained(d)


@given(grid=grids, seed=st.integers(0, 2**16))
def test_tower_and_projector_match_transformers_on_random_grids(hf, k3nn_model, grid, seed):
    """Images and clips (t > 1: temporal embedding, clip-level attention, frame averaging) of any even size, the
    learned 8×8 grid resampled bicubically."""
    grid_t = torch.tensor(grid)
    px = torch.randn(int(grid_t.prod(-1).sum()), 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = hf.model.vision_tower(px, grid_thw=grid_t)
        feats = torch.cat(hf.model.get_image_features(px, grid_t).pooler_output)
        m = k3nn_model
        assert rel(m.vision_tower.patch_features(px, grid_t), ref.last_hidden_state) < 1e-4
        assert rel(m.vision_tower(px, grid_t), ref.pooler_output) < 1e-4
        assert rel(m.image_features(px, grid_t), feats) < 1e-4


def test_eager_and_sdpa_towers_agree(k3nn_model):
    x = pf.load()["batch"]
    tower = k3nn_model.vision_tower
    with torch.no_grad():
        a = tower(x["pixel_values"], x["image_grid_thw"])
        tower.attn_backend = "eager"
        try:
            b = tower(x["pixel_values"], x["image_grid_thw"])
        finally:
            tower.attn_backend = "auto"
    assert rel(a, b) < 1e-6


def test_vision_configs_read_both_spellings():
    moon = {"vt_hidden_size": 32, "vt_intermediate_size": 64, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 2,
            "qkv_hidden_size": 48, "patch_size": 4, "init_pos_emb_height": 8, "init_pos_emb_width": 8,
            "init_pos_emb_time": 4, "merge_kernel_size": [2, 2], "mm_hidden_size": 32, "text_hidden_size": 64,
            "projector_ln_eps": 1e-5, "pos_emb_interpolation_mode": "bilinear", "merge_type": "sd2_tpool",
            "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm", "attn_bias": False, "linear_bias": False,
            "patch_embed_proj_bias": False, "mlp_type": "mlp2", "pos_emb_type": "divided_fixed"}
    v = VisionConfig.from_dict(moon)
    assert (v.attn_width, v.head_dim, v.norm_type, v.norm_eps, v.projector_type) == (48, 24, "rmsnorm", None,
                                                                                       "patchmergerv2")
    assert VisionConfig.from_dict(v.to_dict("moonshot")) == v
    with pytest.raises(ValueError, match="transformers"):
        v.to_dict("transformers")
    with pytest.raises(ValueError, match="merge_type"):
        VisionConfig.from_dict({**moon, "merge_type": "sd2"})
    t = VisionConfig.from_dict(dict(VISION, model_type="kimi_k25_vision"), text_hidden_size=64)
    assert t == VisionConfig.tiny()
    assert VisionConfig.from_dict(t.to_dict("transformers"), text_hidden_size=64) == t


def test_k3_multimodal_config_reads_the_text_wrapper():
    text = KimiK3Config.tiny().to_dict()
    d = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "bos_token_id": 1,
         "eos_token_id": 2, "media_placeholder_token_id": 250, "text_config": text,
         "vision_config": VisionConfig.kimi_k3(text_hidden_size=64).to_dict("moonshot")}
    cfg = MultimodalConfig.from_dict(json.loads(json.dumps(d)))
    assert cfg.text_config.eos_token_id == 2 and cfg.image_token_id == 250
    assert cfg.vision_config == VisionConfig.kimi_k3(text_hidden_size=64)
    assert MultimodalConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="DeepSeek-V3"):
        cfg.to_dict("transformers")
    with pytest.raises(ValueError, match="text_hidden_size"):
        MultimodalConfig(KimiK3Config.tiny(), VisionConfig.tiny(text_hidden_size=32))


# -- bad input ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return KimiK3ForConditionalGeneration(MultimodalConfig.tiny(), seed=0).eval()


def test_grid_that_disagrees_with_the_pixels_is_refused(tiny):
    x = pf.load()["one"]
    ids, px, grid = x["input_ids"], x["pixel_values"], x["image_grid_thw"]
    cases = [
        (dict(pixel_values=px[:-4]), "image_grid_thw describes 48 patches.*pixel_values holds 44"),
        (dict(image_grid_thw=torch.tensor([[1, 6, 6]])), "image_grid_thw describes 36 patches"),
        (dict(image_grid_thw=torch.tensor([[1, 3, 16]])), r"image_grid_thw\[0\].*multiples of the merge kernel"),
        (dict(image_grid_thw=torch.tensor([[1, 6, 8, 1]])), "image_grid_thw must be an integer tensor"),
        (dict(image_grid_thw=grid.float()), "image_grid_thw must be an integer tensor"),
        (dict(image_grid_thw=torch.tensor([[5, 6, 8]])), "pos_emb_time"),
        (dict(pixel_values=px.flatten(1)), r"pixel_values must be patches \[num_patches, 3, 4, 4\]"),
        (dict(pixel_values=px.long()), "pixel_values must be a floating-point tensor"),
        (dict(image_grid_thw=None), "pixel_values was given without image_grid_thw"),
        (dict(pixel_values=None), "image_grid_thw was given without pixel_values"),
    ]
    for over, match in cases:
        kw = dict(pixel_values=px, image_grid_thw=grid)
        kw.update(over)
        with pytest.raises(ValueError, match=match):
            tiny(ids, **kw)
        with pytest.raises(ValueError, match=match):
            tiny.generate(ids, **kw, max_new_tokens=2)


def test_more_or_fewer_images_than_image_tokens_is_refused(tiny):
    one, batch = pf.load()["one"], pf.load()["batch"]
    ids, px, grid = one["input_ids"], one["pixel_values"], one["image_grid_thw"]
    with pytest.raises(ValueError, match=r"input_ids has 12 image tokens.*2 images of \[12, 12\] tokens = 24 "
                                         r"\(more images than image tokens"):
        tiny(ids, torch.cat([px, px]), torch.cat([grid, grid]))
    ids, px, grid = batch["input_ids"], batch["pixel_values"], batch["image_grid_thw"]
    assert (ids == pf.IMAGE_TOKEN_ID).sum() == 37  # images of 10, 1, 12, 4 and 10 tokens
    n_last = int(grid[-1].prod())
    with pytest.raises(ValueError, match=r"37 image tokens.*4 images of \[10, 1, 12, 4\] tokens = 27 \(fewer images"):
        tiny(ids, px[:-n_last], grid[:-1])
    with pytest.raises(ValueError, match=r"37 image tokens.*0 images.*fewer images"):
        tiny(ids)
    with pytest.raises(ValueError, match=r"fewer images"):
        tiny.generate(ids, max_new_tokens=2)
    # the same 37 tokens, but the first two images swapped: image 0's tokens would straddle rows 0 and 1
    swapped = torch.cat([grid[1:2], grid[:1], grid[2:]])
    with pytest.raises(ValueError, match=r"row 0: its image tokens end inside one image's tokens"):
        tiny(ids, torch.cat([px[40:44], px[:40], px[44:]]), swapped)


def test_images_on_a_text_only_model_are_refused(tiny):
    x = pf.load()["one"]
    ids, px, grid = x["input_ids"], x["pixel_values"], x["image_grid_thw"]
    text = KimiK3(KimiK3Config.tiny())
    for call in (text, text.generate):
        with pytest.raises(ValueError, match="pixel_values: KimiK3 is a text-only model"):
            call(ids, pixel_values=px, image_grid_thw=grid)
    with pytest.raises(ValueError, match="image_grid_thw: KimiK3 is a text-only model"):
        text(ids, image_grid_thw=grid)
    wrapper = KimiK3ForConditionalGeneration(MultimodalConfig(KimiK3Config.tiny(), None, image_token_id=250))
    with pytest.raises(ValueError, match="pixel_values: this model has no vision tower"):
        wrapper(ids, px, grid)
    with pytest.raises(ValueError, match="pixel_values: this model has no vision tower"):
        wrapper.generate(ids, px, grid, max_new_tokens=1)


def test_k3_tower_shapes_and_parameter_names():
    """MoonViT-V2 as Kimi K3's checkpoint names it: attention 1536 wide over 12 heads of 128 beside a 1024 residual,
    no biases, RMSNorm; the projector's RMSNorm after the MLP (built on the meta device: no allocation)."""
    with torch.device("meta"):
        v = VisionConfig.kimi_k3()
        tower, proj = MoonViT(v), PatchMergerProjector(v)
    names = {k: tuple(p.shape) for k, p in {**{f"vision_tower.{k}": p for k, p in tower.state_dict().items()},
                                            **{f"mm_projector.{k}": p for k, p in proj.state_dict().items()}}.items()}
    assert names["vision_tower.encoder.blocks.0.wqkv.weight"] == (4608, 1024)
    assert names["vision_tower.encoder.blocks.0.wo.weight"] == (1024, 1536)
    assert names["vision_tower.encoder.blocks.0.mlp.fc0.weight"] == (4096, 1024)
    assert names["vision_tower.patch_embed.pos_emb.weight"] == (64, 64, 1024)
    assert names["vision_tower.patch_embed.proj.weight"] == (1024, 3, 14, 14)
    assert names["mm_projector.proj.0.weight"] == (4096, 4096)
    assert names["mm_projector.proj.2.weight"] == (7168, 4096)
    assert names["mm_projector.post_norm.weight"] == (7168,)
    assert not any(k.endswith(".bias") for k in names)
    assert len([k for k in names if ".blocks." in k]) == 27 * 6


def test_cu_seqlens_are_per_image_or_clip():
    assert cu_seqlens_from_grid(torch.tensor([[1, 2, 4], [3, 2, 2], [1, 4, 4]])).tolist() == [0, 8, 20, 36]
