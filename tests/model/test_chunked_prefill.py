"""Chunked prefill: a long forward with a cache, run as chunks, equals the one-shot forward; bounded memory."""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from k3nn import KimiK3, KimiK3Config

CFG = {
    "k3_tiny": KimiK3Config.tiny(),
    "kl_tiny": KimiK3Config.tiny(kda_gate="softplus", use_full_rank_gate=False, q_lora_rank=None,
                                 mla_use_nope=False, mla_use_output_gate=False, use_attn_res=False,
                                 moe_kind="standard", routed_expert_hidden_size=None, hidden_act="silu"),
}
_MODELS: dict = {}


def model(name):
    if name not in _MODELS:
        _MODELS[name] = KimiK3(CFG[name], dtype=torch.float64, seed=0).eval()
    return _MODELS[name]


@given(name=st.sampled_from(sorted(CFG)), T=st.integers(2, 150), chunk=st.integers(1, 80), ctx=st.integers(0, 70),
       pad=st.integers(0, 5), keep=st.sampled_from([0, 1, 3]), seed=st.integers(0, 2**31 - 1))
def test_chunked_prefill_equals_one_shot(name, T, chunk, ctx, pad, keep, seed):
    """Chunk sizes that cut KDA chunks (64) and MLA pages (64) anywhere, after cached context, with left padding,
    hidden-state taps and KDA checkpoint export; fp64."""
    note(f"{name} T={T} chunk={chunk} ctx={ctx} pad={pad} keep={keep}")
    m = model(name)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, m.config.vocab_size, (2, ctx + T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :min(pad, ctx + T - 1)] = 0
    taps = [0, 2]
    ckpt = [[0, T // 2, T], [T, 1]]
    outs = []
    with torch.no_grad():
        for c in (10 ** 6, chunk):
            cache = m.new_cache(2, ctx + T + 1)
            if ctx:
                m(ids[:, :ctx], cache=cache, attention_mask=mask[:, :ctx])
            o = m(ids[:, ctx:], cache=cache, attention_mask=mask[:, ctx:], logits_to_keep=keep,
                  output_hidden_layers=taps, checkpoint_positions=ckpt, prefill_chunk_size=c)
            nxt = m(ids[:, -1:], cache=cache).logits  # the cache continues identically
            kda = [st.checkpoints for i, st in enumerate(cache.layers) if not m.config.is_mla_layer(i)]
            outs.append((o.logits, o.hidden_states, kda, nxt))
    (la, ha, ka, na), (lb, hb, kb, nb) = outs
    tol = dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lb, la, **tol)
    for x, y in zip(hb, ha):
        torch.testing.assert_close(x, y, **tol)
    for x, y in zip(kb, ka):
        torch.testing.assert_close(x, y, **tol)
    torch.testing.assert_close(nb, na, **tol)


def test_generate_chunked_prefill_same_tokens_and_bad_arguments():
    m = model("k3_tiny")
    ids = torch.randint(0, m.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(3))
    ref = m.generate(ids, max_new_tokens=6)
    assert torch.equal(m.generate(ids, max_new_tokens=6, prefill_chunk_size=16), ref)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="prefill_chunk_size"):
            m.generate(ids, max_new_tokens=2, prefill_chunk_size=bad)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        m(ids, cache=m.new_cache(2, 80), prefill_chunk_size=0)


def test_prompt_longer_than_max_position_embeddings_is_an_error():
    m = KimiK3(KimiK3Config.tiny(max_position_embeddings=40), dtype=torch.float64, seed=0).eval()
    ids = torch.randint(0, 256, (1, 41))
    with pytest.raises(ValueError, match=r"41 tokens.*max_position_embeddings = 40"):
        m.generate(ids, max_new_tokens=1)
    with pytest.raises(ValueError, match=r"max_new_tokens 5 = 45 exceeds the model's max_position_embeddings = 40"):
        m.generate(ids[:, :40], max_new_tokens=5)
    with pytest.raises(ValueError, match=r"41 tokens reaches position 41, past the model's max_position_embeddings"):
        m(ids)
    cache = m.new_cache(1, 64)
    m(ids[:, :30], cache=cache)
    with pytest.raises(ValueError, match=r"11 new tokens after 30 cached reaches position 41"):
        m(ids[:, 30:], cache=cache)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_long_prefill_never_allocates_quadratic_memory():
    """A 6K-token prefill of a tiny model in chunks of 256: no tensor anywhere near T² elements (the old masked
    attention built a [B, 1, T, L] mask and a [B, H, T, L] score matrix)."""
    m = KimiK3(KimiK3Config.tiny(max_position_embeddings=8192), dtype=torch.float32, seed=0).eval()
    T = 6144
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(4))
    spy = _LargestTensor()
    with torch.no_grad(), spy:
        out = m(ids, cache=m.new_cache(1, T), logits_to_keep=1, prefill_chunk_size=256)
    assert torch.isfinite(out.logits).all()
    H = m.config.num_attention_heads
    assert spy.numel <= H * 256 * T, f"largest tensor {spy.numel} elements (T² = {T * T})"
