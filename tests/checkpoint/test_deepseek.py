"""The text model of Kimi K2.5 (DeepSeek-V3: every layer MLA with RoPE, grouped noaux_tc MoE) as a KimiK3: transformers'
``DeepseekV3ForCausalLM`` checkpoints load and match, interleaved rope rows are permuted exactly, and the save reads
back in transformers."""

import json

import pytest
import torch

from k3nn import KimiK3, KimiK3Config

transformers = pytest.importorskip("transformers", reason="transformers is in the parity extra")

TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
            q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
            num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, rope_parameters={"rope_theta": 500.0, "rope_type": "default"})


def _hf(**over):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**{**TEXT, **over})).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return hf


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_v3_checkpoint_matches_and_round_trips(tmp_path, interleave):
    from transformers import DeepseekV3ForCausalLM

    hf = _hf(rope_interleave=interleave)
    hf.save_pretrained(tmp_path / "hf")
    m = KimiK3.from_pretrained(tmp_path / "hf")
    c = m.config
    assert (c.model_type, c.mla_layers, c.mla_use_nope, c.rope_interleave, c.rope_theta, c.num_expert_group) == \
        ("deepseek_v3", [0, 1, 2], False, interleave, 500.0, 4)
    ids = torch.randint(3, 128, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _rel(m(ids).logits, hf(ids).logits) < 1e-4
    g = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(m.generate(ids, max_new_tokens=8, eos_token_id=[]), g)
    for fmt in ("transformers", "deepseek"):
        m.save_pretrained(tmp_path / fmt, format=fmt)
        cfg = json.loads((tmp_path / fmt / "config.json").read_text())
        assert cfg["rope_interleave"] is interleave and cfg["n_routed_experts"] == 8
        back = DeepseekV3ForCausalLM.from_pretrained(tmp_path / fmt).eval()
        assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), hf.state_dict().values()))
        with torch.no_grad():  # same weights; transformers' fused experts round differently by their memory layout
            assert _rel(back(ids).logits, hf(ids).logits) < 1e-6
        again = KimiK3.from_pretrained(tmp_path / fmt)
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), m.state_dict().values()))


def test_deepseek_configs_refuse_what_k3nn_cannot_run():
    base = {**TEXT, "model_type": "deepseek_v3"}
    with pytest.raises(ValueError, match="rope scaling 'yarn'.*positions would be wrong"):
        KimiK3Config.from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 32.0}})
    with pytest.raises(ValueError, match="attention_bias"):
        KimiK3Config.from_dict({**base, "attention_bias": True})
    with pytest.raises(ValueError, match="DeepSeek-V3 architecture, but not every layer is MLA"):
        KimiK3Config.tiny(model_type="deepseek_v3")
    moonshot = {k: v for k, v in base.items() if k != "rope_parameters"}  # Moonshot's spelling: rope_theta
    kimi_k2 = KimiK3Config.from_dict({**moonshot, "model_type": "kimi_k2", "rope_theta": 50000.0, "rope_scaling": None})
    assert kimi_k2.model_type == "kimi_k2" and kimi_k2.rope_theta == 50000.0 and kimi_k2.rms_norm_eps == 1e-6
