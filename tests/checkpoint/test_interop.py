"""transformers interop of configs and checkpoints: every config form, strict types, loading kwargs, both directions."""

import json

import pytest
import torch

from k3nn import KimiK3, KimiK3Config

transformers = pytest.importorskip("transformers", reason="transformers is in the parity extra")


def _hf_model(**over):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2,
              layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3)
    kw.update(over)
    torch.manual_seed(0)
    hf = KimiLinearForCausalLM(KimiLinearConfig(**kw)).eval()
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return hf


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_transformers_flat_linear_dims_load_and_match(tmp_path):
    """transformers 5.x writes linear_num_heads / linear_head_dim flat (no linear_attn_config)."""
    hf = _hf_model(linear_num_heads=4, linear_head_dim=24, linear_conv_kernel_dim=3)
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "linear_attn_config" not in raw and raw["linear_num_heads"] == 4
    m = KimiK3.from_pretrained(tmp_path)
    assert (m.config.kda_num_heads, m.config.kda_head_dim, m.config.short_conv_kernel_size) == (4, 24, 3)
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _rel(m(ids).logits, hf(ids).logits) < 1e-4
    g = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(m.generate(ids, max_new_tokens=8, eos_token_id=[]), g)


def test_default_save_of_a_kimi_linear_model_loads_in_transformers(tmp_path):
    from transformers import KimiLinearForCausalLM

    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    m = KimiK3.from_pretrained(tmp_path / "hf")
    m.save_pretrained(tmp_path / "k3")  # default: the layout transformers loads
    back = KimiLinearForCausalLM.from_pretrained(tmp_path / "k3").eval()
    ids = torch.randint(0, 128, (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _rel(back(ids).logits, hf(ids).logits) < 1e-6
    # the stacked k3nn layout stays available and says so in its config
    m.save_pretrained(tmp_path / "native", format="k3nn")
    cfg = json.loads((tmp_path / "native" / "config.json").read_text())
    assert cfg["k3nn_layout"] == "k3nn" and cfg["architectures"] == ["KimiK3ForCausalLM"]
    assert KimiK3.from_pretrained(tmp_path / "native").load_format == "k3nn"
    # a K3 model is not a transformers model: its default stays k3nn
    KimiK3(KimiK3Config.tiny(), seed=0).save_pretrained(tmp_path / "k3")
    assert json.loads((tmp_path / "k3" / "config.json").read_text())["k3nn_layout"] == "k3nn"


@pytest.mark.parametrize("key,value,match", [
    ("hidden_size", "64", r"hidden_size must be an integer, got '64'"),
    ("rms_norm_eps", "1e-5", r"rms_norm_eps must be a number"),
    ("tie_word_embeddings", "no", r"tie_word_embeddings must be true or false"),
    ("mla_use_nope", 1, r"mla_use_nope must be true or false"),
])
def test_config_types_are_checked_and_errors_name_the_file(tmp_path, key, value, match):
    KimiK3(KimiK3Config.tiny(), seed=0).save_pretrained(tmp_path)
    p = tmp_path / "config.json"
    d = json.loads(p.read_text())
    d[key] = value
    p.write_text(json.dumps(d))
    with pytest.raises(TypeError, match=match) as e:
        KimiK3.from_pretrained(tmp_path)
    assert str(p) in str(e.value)


def test_unknown_config_keys_are_warned_about_with_a_suggestion():
    d = KimiK3Config.tiny().to_dict()
    d["num_expert_per_token"] = 3
    with pytest.warns(UserWarning, match=r"'num_expert_per_token' \(did you mean 'num_experts_per_token'\?\)"):
        cfg = KimiK3Config.from_dict(d)
    assert cfg.extra == {"num_expert_per_token": 3}


def test_from_pretrained_accepts_transformers_loading_kwargs(tmp_path):
    m = KimiK3(KimiK3Config.tiny(), seed=0, dtype=torch.bfloat16)
    m.save_pretrained(tmp_path)
    assert KimiK3.from_pretrained(tmp_path).dtype == torch.bfloat16  # the checkpoint's dtype by default
    assert KimiK3.from_pretrained(tmp_path, dtype="auto").dtype == torch.bfloat16
    assert KimiK3.from_pretrained(tmp_path, dtype="float32").dtype == torch.float32
    assert KimiK3.from_pretrained(tmp_path, torch_dtype="torch.float16").dtype == torch.float16
    assert KimiK3.from_pretrained(tmp_path, torch_dtype=torch.float32, device_map="cpu").device.type == "cpu"
    assert KimiK3.from_pretrained(tmp_path, device_map={"": "cpu"}).device.type == "cpu"
    if not torch.cuda.is_available():
        assert KimiK3.from_pretrained(tmp_path, device_map="auto").device.type == "cpu"
    with pytest.raises(ValueError, match="apply_tensor_parallel"):
        KimiK3.from_pretrained(tmp_path, device_map={"model.embed_tokens": "cpu", "lm_head": "cuda:1"})
    with pytest.raises(ValueError, match="dtype must be"):
        KimiK3.from_pretrained(tmp_path, dtype="bfloat17")
    with pytest.raises(ValueError, match="not both"):
        KimiK3.from_pretrained(tmp_path, dtype=torch.float32, torch_dtype=torch.float16)


def test_float64_end_to_end(tmp_path):
    m = KimiK3(KimiK3Config.tiny(), seed=0)
    m.save_pretrained(tmp_path)
    m64 = KimiK3.from_pretrained(tmp_path, dtype=torch.float64)
    assert {p.dtype for p in m64.parameters()} == {torch.float64}
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = m64(ids).logits
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.float(), m(ids).logits, rtol=1e-4, atol=1e-4)
    assert m64.generate(ids, max_new_tokens=3).shape == (2, 12)
