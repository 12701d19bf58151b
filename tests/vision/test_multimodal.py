"""KimiK3ForConditionalGeneration: parity with transformers' Kimi K2.5, checkpoints in both directions, generate() with
images, the text-only load of a multimodal checkpoint, and a KDA-hybrid text model beside the vision tower."""

import json
import logging

import pytest
import torch

from k3nn import KimiK3, KimiK3Config, KimiK3ForConditionalGeneration, MultimodalConfig, VisionConfig
from k3nn.checkpoint import CheckpointError

from . import processor_fixture as pf
from .helpers import hf_k25, rel

transformers = pytest.importorskip("transformers", reason="transformers is in the parity extra")


@pytest.fixture(scope="module")
def hf():
    return hf_k25()


@pytest.fixture(scope="module")
def inputs():
    return pf.load()


@pytest.fixture(scope="module", params=[True, False], ids=["transformers-default-save", "transformers-runtime-names"])
def loaded(request, hf, tmp_path_factory):
    """transformers' model saved in one of its two layouts, loaded by k3nn."""
    d = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(d, save_original_format=request.param)
    return d, KimiK3ForConditionalGeneration.from_pretrained(d)


def test_processor_outputs_are_still_what_the_fixture_stores():
    """Where torchvision is installed, transformers' processor gives exactly the stored tensors."""
    try:
        proc = pf.processor()
    except ImportError as e:
        pytest.skip(f"transformers' Kimi K2.5 image processor needs torchvision: {e}")
    live, stored = pf.run_processor(proc), pf.load()
    for case in pf.CASES:
        for k in pf.KEYS:
            assert torch.equal(live[case][k], stored[case][k]), (case, k)


@pytest.mark.parametrize("case", list(pf.CASES))
def test_vision_features_projector_and_logits_match_transformers(hf, loaded, inputs, case):
    d, m = loaded
    x = inputs[case]
    px, grid = x["pixel_values"], x["image_grid_thw"]
    with torch.no_grad():
        ref_tower = hf.model.vision_tower(px, grid_thw=grid)
        assert rel(m.vision_tower.patch_features(px, grid), ref_tower.last_hidden_state) < 1e-4
        assert rel(m.vision_tower(px, grid), ref_tower.pooler_output) < 1e-4
        ref_feats = hf.model.get_image_features(px, grid).pooler_output
        mine = m.get_image_features(px, grid)
        assert [f.shape for f in mine] == [f.shape for f in ref_feats]
        assert rel(torch.cat(mine), torch.cat(ref_feats)) < 1e-4
        ref = hf(**x).logits
        out = m(**x).logits
    keep = x["attention_mask"].bool()
    assert rel(out[keep], ref[keep]) < 1e-4


@pytest.mark.parametrize("case", list(pf.CASES))
def test_greedy_tokens_match_transformers(hf, loaded, inputs, case):
    _, m = loaded
    x = inputs[case]
    ref = hf.generate(**x, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=pf.PAD_ID)
    out = m.generate(**x, max_new_tokens=10, eos_token_id=[])
    assert torch.equal(out, ref)
    assert len(set(out[:, -10:].flatten().tolist())) > 3  # the tiny model does not collapse onto one token


def test_image_tokens_take_one_cache_position_each(loaded, inputs):
    """Prefill of a prompt with images, then decode: the cache holds one position per token (image tokens too),
    and every step equals the full forward over the longer sequence."""
    _, m = loaded
    x = inputs["one"]
    T = x["input_ids"].shape[1]
    with torch.no_grad():
        cache = m.new_cache(1, T + 4)
        logits = m(**x, cache=cache).logits
        assert cache.get_seq_length() == T
        ids = x["input_ids"]
        for _ in range(3):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            logits = m(nxt, cache=cache).logits
            ids = torch.cat([ids, nxt], 1)
            full = m(ids, x["pixel_values"], x["image_grid_thw"]).logits
            assert rel(logits[:, -1], full[:, -1]) < 1e-5
        assert cache.get_seq_length() == T + 3


@pytest.mark.parametrize("fmt", ["moonshot", "transformers"])
def test_save_load_both_layouts_exact_and_transformers_reads_them(hf, loaded, inputs, tmp_path, fmt):
    from transformers import Kimi_K25ForConditionalGeneration

    _, m = loaded
    m.save_pretrained(tmp_path, format=fmt)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert ("media_placeholder_token_id" in cfg) == (fmt == "moonshot")
    m2 = KimiK3ForConditionalGeneration.from_pretrained(tmp_path)
    assert m2.config.config_form == fmt
    sd, sd2 = m.state_dict(), m2.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    if fmt == "transformers":
        back = Kimi_K25ForConditionalGeneration.from_pretrained(tmp_path).eval()
        x = inputs["batch"]
        with torch.no_grad():
            assert rel(back(**x).logits, hf(**x).logits) < 1e-6


def test_tied_embeddings_round_trip(tmp_path, inputs):
    from transformers import Kimi_K25ForConditionalGeneration

    hf = hf_k25(seed=3, tie=True)
    hf.save_pretrained(tmp_path / "hf")
    m = KimiK3ForConditionalGeneration.from_pretrained(tmp_path / "hf")
    assert m.language_model.lm_head.weight is m.language_model.model.embed_tokens.weight
    x = inputs["one"]
    with torch.no_grad():
        assert rel(m(**x).logits, hf(**x).logits) < 1e-4
    m.save_pretrained(tmp_path / "k3", format="transformers")
    back = Kimi_K25ForConditionalGeneration.from_pretrained(tmp_path / "k3").eval()
    with torch.no_grad():
        assert rel(back(**x).logits, hf(**x).logits) < 1e-6


def test_text_only_load_of_a_multimodal_checkpoint(hf, loaded, caplog):
    d, _ = loaded
    with pytest.raises(CheckpointError, match="multimodal checkpoint.*language_model_only=True"):
        KimiK3.from_pretrained(d)
    with caplog.at_level(logging.WARNING, logger="k3nn.checkpoint.io"):
        t = KimiK3.from_pretrained(d, language_model_only=True)
    assert "skipped its 35 vision tower / projector tensors" in caplog.text or \
        "skipped its 43 vision tower / projector tensors" in caplog.text
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert rel(t(ids).logits, hf(input_ids=ids).logits) < 1e-4


def test_strict_loading_names_missing_and_unexpected_tensors(tmp_path, loaded):
    from safetensors.torch import load_file, save_file

    d, m = loaded
    m.save_pretrained(tmp_path, format="moonshot")
    f = next(tmp_path.glob("*.safetensors"))
    sd = load_file(str(f))
    sd.pop("vision_tower.encoder.blocks.1.wqkv.bias")
    sd["vision_tower.encoder.blocks.9.wo.weight"] = torch.zeros(2)
    save_file(sd, str(f))
    with pytest.raises(CheckpointError, match=r"missing.*blocks\.1\.wqkv\.bias(.|\n)*unexpected.*blocks\.9\.wo"):
        KimiK3ForConditionalGeneration.from_pretrained(tmp_path)


def test_text_only_checkpoint_is_refused_by_the_multimodal_class(tmp_path):
    KimiK3(KimiK3Config.tiny()).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="text-only checkpoint.*KimiK3.from_pretrained"):
        KimiK3ForConditionalGeneration.from_pretrained(tmp_path)


# -- a K3 text model (KDA + MLA hybrid, AttnRes, LatentMoE) beside the vision tower -------------------------------

def _hybrid(vision: VisionConfig | None = None, seed: int = 0):
    text = KimiK3Config.tiny()
    vision = vision or VisionConfig.tiny(text_hidden_size=text.hidden_size)
    cfg = MultimodalConfig(text, vision, image_token_id=pf.IMAGE_TOKEN_ID, video_token_id=pf.VIDEO_TOKEN_ID)
    return KimiK3ForConditionalGeneration(cfg, seed=seed).eval()


@pytest.mark.parametrize("vision", ["k25", "k3"])
def test_kda_hybrid_with_images_generates_and_caches_consistently(inputs, tmp_path, vision):
    v = VisionConfig.tiny(text_hidden_size=64) if vision == "k25" else VisionConfig.kimi_k3(
        patch_size=4, pos_emb_height=8, pos_emb_width=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        qkv_hidden_size=48, intermediate_size=64, text_hidden_size=64)
    m = _hybrid(v, seed=1)
    x = inputs["batch"]
    B, T = x["input_ids"].shape
    out = m.generate(**x, max_new_tokens=6, eos_token_id=[])
    assert out.shape == (B, T + 6)
    # greedy tokens == the argmax of the full forward over the grown sequence (the cache holds T + n positions)
    with torch.no_grad():
        ids, mask = x["input_ids"], x["attention_mask"]
        for i in range(6):
            logits = m(ids, x["pixel_values"], x["image_grid_thw"], attention_mask=mask).logits[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            assert torch.equal(nxt[:, 0], out[:, T + i])
            ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    # images change the output; the Moonshot layout round-trips exactly
    with torch.no_grad():
        a = m(**x).logits
        b = m(**{**x, "pixel_values": x["pixel_values"] + 1}).logits
    assert rel(a, b) > 1e-3
    m.save_pretrained(tmp_path)
    m2 = KimiK3ForConditionalGeneration.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(m2(**x).logits, a)
    if vision == "k3":
        keys = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"] \
            if (tmp_path / "model.safetensors.index.json").exists() else None
        from safetensors import safe_open

        names = set(keys) if keys else set(safe_open(str(tmp_path / "model.safetensors"), "pt").keys())
        assert "mm_projector.post_norm.weight" in names and "vision_tower.encoder.blocks.0.wqkv.bias" not in names
        assert any(k.startswith("language_model.model.layers.1.block_sparse_moe.experts.0.w1") for k in names)
        with pytest.raises(ValueError, match="transformers"):
            m.save_pretrained(tmp_path / "tf", format="transformers")


def test_chunked_prefill_with_images_gives_the_same_tokens(inputs):
    m = _hybrid(seed=2)
    x = inputs["one"]  # 16 tokens, 12 of them the image's: chunks of 6 split the image's tokens
    a = m.generate(**x, max_new_tokens=4, eos_token_id=[])
    b = m.generate(**x, max_new_tokens=4, eos_token_id=[], prefill_chunk_size=6)
    assert torch.equal(a, b)


def test_an_image_and_a_video_clip_in_one_prompt_match_transformers(hf, loaded):
    """A 2-frame clip (temporal embedding, attention across its frames, frames averaged) at the video tokens beside an
    image at the image tokens."""
    _, m = loaded
    g = torch.Generator().manual_seed(7)
    img_grid, vid_grid = torch.tensor([[1, 4, 6]]), torch.tensor([[2, 6, 4]])
    img = torch.randn(24, 3, 4, 4, generator=g)
    vid = torch.randn(48, 3, 4, 4, generator=g)
    ids = torch.tensor([[5, 6] + [pf.IMAGE_TOKEN_ID] * 6 + [7] + [pf.VIDEO_TOKEN_ID] * 6 + [8, 9]])
    kw = dict(pixel_values=img, image_grid_thw=img_grid, pixel_values_videos=vid, video_grid_thw=vid_grid)
    with torch.no_grad():
        ref = hf(input_ids=ids, **kw).logits
        assert rel(m(ids, **kw).logits, ref) < 1e-4
    out = m.generate(ids, **kw, max_new_tokens=5, eos_token_id=[])
    assert torch.equal(out, hf.generate(input_ids=ids, **kw, max_new_tokens=5, do_sample=False, eos_token_id=None,
                                        pad_token_id=pf.PAD_ID))
    with pytest.raises(ValueError, match=r"6 video tokens.*1 videos of \[12\] tokens.*more videos"):
        m(ids, **{**kw, "video_grid_thw": torch.tensor([[1, 6, 8]])})
