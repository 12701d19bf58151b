"""transformers' Auto classes on k3nn checkpoints, without remote code; the import-order hook; the transformers-format
refusal."""

import json
import os
import subprocess
import sys

import pytest
import torch

from k3nn import KimiK3, KimiK3Config

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from k3nn.hf import KimiK3PretrainedConfig  # noqa: E402


def _ids(vocab, shape=(2, 13), seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_autoconfig_reads_a_k3_checkpoint(k3_dir, k3):
    cfg = AutoConfig.from_pretrained(k3_dir)
    assert isinstance(cfg, KimiK3PretrainedConfig) and cfg.model_type == "kimi_k3"
    raw = json.loads((k3_dir / "config.json").read_text())
    assert cfg.hidden_size == raw["hidden_size"] and cfg.linear_attn_config == raw["linear_attn_config"]
    assert cfg.to_k3nn() == KimiK3Config.from_json_file(k3_dir / "config.json") == k3.config
    assert KimiK3PretrainedConfig.from_k3nn(k3.config).to_k3nn() == k3.config


def test_automodel_returns_k3nn_model_with_the_same_logits(k3_dir, k3, vocab):
    m = AutoModelForCausalLM.from_pretrained(k3_dir)
    assert type(m) is KimiK3 and m.name_or_path == str(k3_dir)
    ids = _ids(vocab)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, k3(ids).logits)
    # transformers' loading keywords: dtype names, device_map, trust_remote_code, low_cpu_mem_usage
    m16 = AutoModelForCausalLM.from_pretrained(k3_dir, dtype=torch.bfloat16, device_map="cpu", trust_remote_code=False,
                                               low_cpu_mem_usage=True)
    assert m16.dtype == torch.bfloat16 and m16.device.type == "cpu"
    assert AutoModelForCausalLM.from_pretrained(k3_dir, torch_dtype="float64").dtype == torch.float64
    # the generation defaults of the checkpoint reach generate() (eos from the config)
    assert m.generation_config.eos_token_id == k3.config.eos_token_id


@pytest.mark.parametrize("kw,err,match", [
    (dict(attn_implementation="sdpa"), ValueError, "attn_implementation='sdpa'.*backend="),
    (dict(use_safetensors=False), ValueError, "use_safetensors=False.*only safetensors"),
    (dict(device_map="auto", max_memory={0: "1GB"}), ValueError, "max_memory"),
    (dict(no_such_flag=1), TypeError, "no_such_flag"),
])
def test_automodel_refuses_what_it_cannot_honour(k3_dir, kw, err, match):
    with pytest.raises(err, match=match):
        AutoModelForCausalLM.from_pretrained(k3_dir, **kw)


def test_from_config_builds_a_random_k3nn_model(k3):
    hf_cfg = KimiK3PretrainedConfig.from_k3nn(k3.config)
    m = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float64)
    assert type(m) is KimiK3 and m.dtype == torch.float64 and m.config == k3.config


def test_kimi_linear_checkpoint_through_the_auto_classes(kl_dir, vocab):
    """transformers owns model_type kimi_linear: by default its Auto classes keep returning its own model, and k3nn
    loads the same checkpoint (also from the config AutoConfig returns) with the same logits."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = AutoConfig.from_pretrained(kl_dir)
    assert isinstance(cfg, KimiLinearConfig)
    hf = AutoModelForCausalLM.from_pretrained(kl_dir).eval()
    assert isinstance(hf, KimiLinearForCausalLM)
    m = KimiK3.from_pretrained(kl_dir, config=cfg)
    assert m.config == KimiK3.from_pretrained(kl_dir).config
    ids = _ids(vocab, (1, 17))
    with torch.no_grad():
        a, b = m(ids).logits, hf(ids).logits
    assert ((a - b).norm() / b.norm()).item() < 1e-5


_ORDER_SCRIPT = """
import importlib.resources, sys, torch
import k3nn
assert "transformers" not in sys.modules, "import k3nn imported transformers"
from transformers import AutoConfig, AutoModelForCausalLM
import transformers.models.auto as auto
assert type(auto.__spec__.loader).__module__ != "k3nn.hf", auto.__spec__.loader
assert importlib.resources.files("transformers.models.auto").joinpath("__init__.py").is_file()
assert not any(type(f).__module__ == "k3nn.hf" for f in sys.meta_path), "the hook stayed installed"
k3_dir, kl_dir = sys.argv[1:3]
assert type(AutoConfig.from_pretrained(k3_dir)).__name__ == "KimiK3PretrainedConfig"
assert type(AutoModelForCausalLM.from_pretrained(k3_dir)) is k3nn.KimiK3
k3nn.register_transformers(kimi_linear=True)
m = AutoModelForCausalLM.from_pretrained(kl_dir)
assert type(m) is k3nn.KimiK3, type(m)
ids = torch.arange(1, 12)[None]
with torch.no_grad():
    assert torch.equal(m(ids).logits, k3nn.KimiK3.from_pretrained(kl_dir)(ids).logits)
print("ok")
"""


def test_import_k3nn_first_then_transformers(k3_dir, kl_dir):
    """In a fresh process: ``import k3nn`` does not import transformers; importing transformers' Auto classes later
    registers k3nn (the hook leaves no trace on the module and removes itself); ``kimi_linear=True`` opts in to
    k3nn's model for Kimi Linear checkpoints."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _ORDER_SCRIPT, str(k3_dir), str(kl_dir)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_import_k3nn_after_transformers_registers_at_once(monkeypatch):
    """With the Auto classes already imported, ``import k3nn`` registers on the spot and installs no hook."""
    import k3nn.hf as hf

    calls = []
    monkeypatch.setattr(hf, "_register_after_import", lambda: calls.append(1))
    before = list(sys.meta_path)
    hf._install()
    assert calls == [1] and sys.meta_path == before


def test_transformers_format_of_a_k3_model_is_refused_by_name(tmp_path, k3):
    with pytest.raises(ValueError) as e:
        k3.save_pretrained(tmp_path / "tf", format="transformers")
    msg = str(e.value)
    for what in ("AttnRes is on", "moe_kind is 'latent'", "MLA output gate", "format='k3nn'"):
        assert what in msg
    assert not (tmp_path / "tf").exists()
    # a Kimi Linear model still saves in transformers' layout (tests/checkpoint/test_interop.py loads it back)
    kl = KimiK3(KimiK3Config.kimi_linear_48b(vocab_size=64, hidden_size=32, num_hidden_layers=2, mla_layers=[1],
                                             kda_num_heads=2, kda_head_dim=16, num_attention_heads=2, kv_lora_rank=16,
                                             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                             intermediate_size=32, num_experts=4, num_experts_per_token=2,
                                             moe_intermediate_size=16, bos_token_id=0, eos_token_id=1), seed=0)
    kl.save_pretrained(tmp_path / "kl", format="transformers")
    assert json.loads((tmp_path / "kl" / "config.json").read_text())["model_type"] == "kimi_linear"
