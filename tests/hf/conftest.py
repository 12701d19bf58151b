"""Fixtures of the Hugging Face ecosystem tests: the demo's tokenizer trained on a slice of the demo corpus, a tiny
K3 checkpoint and a tiny Kimi Linear checkpoint (written by transformers) with that tokenizer beside them."""

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra: pip install 'k3nn[hf]'")
pytest.importorskip("tokenizers", reason="the hf extra: pip install 'k3nn[hf]'")

from k3nn import KimiK3, KimiK3Config  # noqa: E402
from k3nn.demo import EOS, load_corpus, train_tokenizer  # noqa: E402


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """Tiny models: one torch thread is as fast as two, and much faster when the cores are shared (two threads then
    wait on each other at every small op). Restored for the tests after these."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def eager_kernels(request, monkeypatch):
    """These tests are about the integration, not the kernels (tested against eager elsewhere): on CPU the eager
    backend runs them in a fraction of the time the Triton interpreter takes. The environment reaches pipeline
    threads and subprocesses too. GPU tests keep the default backend (the real kernels)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("K3NN_BACKEND", "eager")


@pytest.fixture(scope="session")
def corpus():
    """A few files of the demo corpus (the Python standard library), as (name, text) pairs."""
    return load_corpus(0.03, 0.01)


@pytest.fixture(scope="session")
def tok(corpus):
    """The demo's byte-level BPE (``<|endoftext|>`` id 0, ``<|mask|>`` id 1), trained here on the corpus slice."""
    return train_tokenizer([t for _, t in corpus.train], 320)


@pytest.fixture(scope="session")
def vocab(tok):
    return tok.get_vocab_size()


@pytest.fixture(scope="session")
def k3_dir(tmp_path_factory, tok, vocab):
    """A tiny K3 (every K3 feature: AttnRes, LatentMoE, gated MLA, SiTU) saved with its tokenizer."""
    d = tmp_path_factory.mktemp("k3")
    cfg = KimiK3Config.tiny(vocab_size=vocab, eos_token_id=tok.token_to_id(EOS))
    KimiK3(cfg, seed=0).save_pretrained(d, tokenizer=tok)
    return d


@pytest.fixture(scope="session")
def k3(k3_dir):
    return KimiK3.from_pretrained(k3_dir)


@pytest.fixture(scope="session")
def kl_dir(tmp_path_factory, tok, vocab):
    """A tiny Kimi Linear written by transformers' KimiLinearForCausalLM, with the tokenizer beside it."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from k3nn.tokenizer import save_tokenizer

    eos = tok.token_to_id(EOS)
    cfg = KimiLinearConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        linear_num_heads=2, linear_head_dim=16, pad_token_id=eos, bos_token_id=eos, eos_token_id=eos,
        layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3)
    torch.manual_seed(0)
    hf = KimiLinearForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("kimi_linear")
    hf.save_pretrained(d)
    save_tokenizer(tok, d, eos_token=EOS)
    return d


@pytest.fixture(scope="session")
def hf_tok(k3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(k3_dir)
