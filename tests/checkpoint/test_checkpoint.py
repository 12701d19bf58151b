"""save_pretrained / from_pretrained round trips, strictness, hub resolution, Kimi Linear parity."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3nn import KimiK3, KimiK3Config
from k3nn.checkpoint import CheckpointError


@pytest.fixture(scope="module")
def model():
    return KimiK3(KimiK3Config.tiny(), seed=3).eval()


@pytest.mark.parametrize("fmt", ["k3nn", "moonshot", "transformers"])
def test_save_load_round_trip_exact(model, tmp_path, fmt):
    if fmt == "transformers":  # transformers' layout only for a model transformers' KimiLinearForCausalLM represents
        with pytest.raises(ValueError, match="transformers has no class for this model"):
            model.save_pretrained(tmp_path, format=fmt)
        model = KimiK3(KimiK3Config.tiny(model_type="kimi_linear", use_attn_res=False, moe_kind="standard",
                                         kda_gate="softplus", use_full_rank_gate=False, mla_use_output_gate=False,
                                         hidden_act="silu", routed_expert_hidden_size=None), seed=3).eval()
    model.save_pretrained(tmp_path, max_shard_size="200KB", format=fmt)
    assert (tmp_path / "model.safetensors.index.json").exists(), "expected several shards"
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    m2 = KimiK3.from_pretrained(tmp_path)
    assert m2.load_format == fmt
    sd1, sd2 = model.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, m2(ids).logits)


def test_mxfp4_round_trip(tmp_path):
    m = KimiK3(KimiK3Config.tiny(mxfp4_experts=True), seed=1).eval()
    m.save_pretrained(tmp_path, format="moonshot")
    keys = load_file(tmp_path / "model.safetensors").keys()
    assert "model.layers.1.block_sparse_moe.experts.3.w1.weight_packed" in keys
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight_scale" in keys
    m2 = KimiK3.from_pretrained(tmp_path)
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k


def test_config_round_trip_and_1_based_layer_lists(tmp_path):
    for cfg in (KimiK3Config.tiny(), KimiK3Config.small(), KimiK3Config.kimi_linear_48b(), KimiK3Config.k3()):
        d = cfg.to_dict()
        assert 0 not in d["linear_attn_config"]["full_attn_layers"] + d["linear_attn_config"]["kda_layers"]
        back = KimiK3Config.from_dict(json.loads(json.dumps(d)))
        assert back.to_dict() == d
        assert back.mla_layers == cfg.mla_layers
    kl = KimiK3Config.kimi_linear_48b().to_dict()["linear_attn_config"]
    assert kl["full_attn_layers"] == [4, 8, 12, 16, 20, 24, 27]
    assert kl["kda_layers"][:4] == [1, 2, 3, 5]


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="num_experts_per_token"):
        KimiK3Config.tiny(num_experts_per_token=99)
    with pytest.raises(ValueError, match="mla_layers"):
        KimiK3Config.tiny(mla_layers=[7])
    with pytest.raises(ValueError, match="partition"):
        KimiK3Config.from_dict({"num_hidden_layers": 3, "linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [2, 3]}})
    with pytest.raises(ValueError, match="model_type"):
        KimiK3Config.from_dict({"model_type": "llama"})


def _resave(path, fn):
    f = path / "model.safetensors"
    sd = load_file(f)
    fn(sd)
    save_file(sd, f)


def test_strict_loading_names_the_problem(model, tmp_path):
    model.save_pretrained(tmp_path)
    _resave(tmp_path, lambda sd: sd.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors.*model\.norm\.weight"):
        KimiK3.from_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    _resave(tmp_path, lambda sd: sd.__setitem__("model.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*model\.extra\.weight"):
        KimiK3.from_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    _resave(tmp_path, lambda sd: sd.__setitem__("model.norm.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"mis-shaped.*model\.norm\.weight"):
        KimiK3.from_pretrained(tmp_path)


def test_truncated_and_pickle_checkpoints_are_refused(model, tmp_path):
    model.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated|corrupt|cannot read"):
        KimiK3.from_pretrained(tmp_path)
    f.unlink()
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors only"):
        KimiK3.from_pretrained(tmp_path)


def test_hub_offline_missing_repo_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(CheckpointError, match="local hub cache"):
        KimiK3.from_pretrained("k3nn-test/absent", local_files_only=True, cache_dir=str(tmp_path))


def test_hub_cache_snapshot_loads_offline(model, tmp_path):
    # a hand-made hub cache entry, as huggingface_hub lays it out
    repo = tmp_path / "models--k3nn-test--tiny"
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    model.save_pretrained(snap)
    m2 = KimiK3.from_pretrained("k3nn-test/tiny", cache_dir=str(tmp_path), local_files_only=True)
    assert torch.equal(m2.lm_head.weight, model.lm_head.weight)


def test_kimi_linear_parity_with_transformers(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(0)
    cfg = KimiLinearConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "head_dim": 16, "num_heads": 2,
                            "short_conv_kernel_size": 4})
    hf = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial router bias, so routing uses it
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    m = KimiK3.from_pretrained(tmp_path)
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = hf(ids).logits, m(ids).logits
    assert ((a - b).norm() / a.norm()).item() < 1e-4
    g_hf = hf.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(g_hf, m.generate(ids, max_new_tokens=10))
