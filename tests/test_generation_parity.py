"""generate() against transformers' own generate() on the same weights (CPU, fp32): tokens, processed scores
(``output_scores``) and raw logits (``output_logits``) for every GenerationMixin argument k3nn implements.

Sampling draws from different RNGs in the two libraries, so the sampled cases compare the processed scores with
both samplers replaced by an argmax of the same distribution (``argmax_sampling``): the scores at every step are
then those of the same prefix. The real samplers are compared at step 0, where the prefix is the prompt.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import k3nn.generation
import k3nn.logits
from k3nn import GenerationConfig, KimiK3, KimiK3Config

transformers = pytest.importorskip("transformers")

T = 7  # prompt length
EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(0)
    cfg = KimiLinearConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS,
        linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "head_dim": 16, "num_heads": 2,
                            "short_conv_kernel_size": 4})
    hf = KimiLinearForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("kimi_linear")
    hf.save_pretrained(d)
    m = KimiK3.from_pretrained(d, backend="eager")
    ids = torch.randint(3, 128, (2, T), generator=torch.Generator().manual_seed(1))  # no pad / bos / eos ids
    return hf, m, ids


@pytest.fixture(scope="module")
def greedy(pair):
    """k3nn's plain greedy continuation [2, 8] without eos (the reference the cases below must change)."""
    _, m, ids = pair
    return m.generate(ids, max_new_tokens=8, eos_token_id=[])[:, T:]


@pytest.fixture
def argmax_sampling(monkeypatch):
    """Both libraries pick the argmax of the distribution they would sample from."""
    monkeypatch.setattr(torch, "multinomial", lambda p, num_samples=1, **kw: p.argmax(-1, keepdim=True))
    monkeypatch.setattr(k3nn.logits, "sample_from_scores", lambda s, generator=None: s.argmax(-1))


def run_both(hf, m, ids, hf_extra=None, k3_extra=None, **kw):
    out = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
    a = hf.generate(ids, **out, **kw, **(hf_extra or {}))
    b = m.generate(ids, **out, **kw, **(k3_extra or {}))
    return a, b


def assert_same(a, b, tokens=True):
    if tokens:
        assert torch.equal(a.sequences, b.sequences), (a.sequences, b.sequences)
    assert len(a.scores) == len(b.scores) == len(a.logits) == len(b.logits)
    for x, y in zip(a.scores, b.scores):
        assert y.dtype == torch.float32 and y.shape == x.shape
        assert torch.equal(torch.isinf(x), torch.isinf(y))  # the same tokens masked
        fin = torch.isfinite(x)
        torch.testing.assert_close(y[fin], x[fin], rtol=1e-5, atol=1e-5)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


# -- lengths and special tokens ----------------------------------------------------------------------------------
def test_greedy_tokens_scores_and_logits(pair):
    hf, m, ids = pair
    a, b = run_both(hf, m, ids, max_new_tokens=8)
    assert_same(a, b)
    new = b.sequences[:, T:]
    assert (new == EOS).any(), "the case should exercise eos (and pad after it)"


def test_eos_and_pad_from_the_model_config(pair, monkeypatch):
    """No generation_config.json: the model config's eos / pad ids apply, as in transformers."""
    hf, m, ids = pair
    monkeypatch.setattr(m, "generation_config", None)
    assert m.config.eos_token_id == EOS and m.config.pad_token_id == PAD
    out = m.generate(ids, max_new_tokens=8)
    assert torch.equal(out, hf.generate(ids, max_new_tokens=8))
    for row in out[:, T:].tolist():  # after eos: pad
        if EOS in row:
            assert set(row[row.index(EOS) + 1:]) <= {PAD}


def test_max_length_and_max_new_tokens(pair, monkeypatch):
    hf, m, ids = pair
    a = m.generate(ids, max_length=11, eos_token_id=[])
    assert a.shape[1] == 11 and torch.equal(a, hf.generate(ids, max_length=11, eos_token_id=[]))
    assert m.generate(ids, max_length=11, max_new_tokens=2, eos_token_id=[]).shape[1] == T + 2  # explicit wins
    assert k3nn.generation.DEFAULT_MAX_NEW_TOKENS == 64  # when neither is given (transformers: max_length 20)
    monkeypatch.setattr(k3nn.generation, "DEFAULT_MAX_NEW_TOKENS", 3)
    assert m.generate(ids, eos_token_id=[]).shape[1] == T + 3
    with pytest.raises(ValueError, match="max_length"):
        m.generate(ids, max_length=T)


# -- processors (greedy) ------------------------------------------------------------------------------------------
def _cases(g):
    from transformers import LogitsProcessorList, StoppingCriteriaList, SuppressTokensLogitsProcessor

    tok = int(g[1, 2])

    class StopOn:
        def __call__(self, input_ids, scores, **kw):
            return input_ids[:, -1] == tok

    return {
        "repetition_penalty": dict(repetition_penalty=1.3),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=1),
        "bad_words_ids": dict(bad_words_ids=[[int(g[0, 1])], [int(g[1, 0]), int(g[1, 1])], [EOS]]),
        "min_new_tokens": dict(min_new_tokens=5),
        "min_length": dict(min_length=T + 5),
        "logits_processor": dict(logits_processor=LogitsProcessorList([SuppressTokensLogitsProcessor(
            [int(g[0, 0]), int(g[1, 3])])])),
        "stopping_criteria": dict(stopping_criteria=StoppingCriteriaList([StopOn()])),
        "generation_config": dict(generation_config=transformers.GenerationConfig(
            max_new_tokens=6, repetition_penalty=1.2, no_repeat_ngram_size=1)),
    }


@pytest.mark.parametrize("case", ["repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_new_tokens",
                                  "min_length", "logits_processor", "stopping_criteria", "generation_config"])
def test_processor_matches_transformers(pair, greedy, case):
    hf, m, ids = pair
    kw = _cases(greedy)[case]
    if "generation_config" not in kw:
        kw = dict(max_new_tokens=6, **kw)
    a, b = run_both(hf, m, ids, **kw)
    assert_same(a, b)
    new = b.sequences[:, T:]
    assert not torch.equal(new, greedy[:, :new.shape[1]]), "the argument changed nothing"


def test_left_padding_with_repetition_penalty(pair):
    """The prompt's left padding is left out of the penalty; a mask inferred from leading pad ids works too."""
    hf, m, ids = pair
    ids = ids.clone()
    ids[0, :2] = PAD
    mask = (ids != PAD).long()
    a, b = run_both(hf, m, ids, hf_extra=dict(attention_mask=mask), k3_extra=dict(attention_mask=mask),
                    max_new_tokens=6, repetition_penalty=1.5)
    assert_same(a, b)
    assert torch.equal(m.generate(ids, max_new_tokens=6, repetition_penalty=1.5), a.sequences)


def test_stop_strings(pair, greedy):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    hf, m, ids = pair
    letters = "abcdefghijkl"
    pairs = ["".join(p) for p in itertools.product(letters, repeat=2)][:116]
    vocab = list(letters) + pairs  # 128 tokens of 1-2 characters
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[(p[0], p[1]) for p in pairs]))
    tk.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk)
    g = greedy[1].tolist()
    overhang = vocab[g[0]][-1] + vocab[g[1]][0]  # ends inside the second new token
    spanning = vocab[g[1]][-1] + vocab[g[2]] + vocab[g[3]][:1]
    for stops in (overhang, [spanning, "lkj"]):
        a, b = run_both(hf, m, ids, max_new_tokens=6, stop_strings=stops, tokenizer=tokenizer)
        assert_same(a, b)
        assert b.sequences.shape[1] < T + 6 or (b.sequences[1, T + 4:] == PAD).all()
    with pytest.raises(ValueError, match="tokenizer"):
        m.generate(ids, max_new_tokens=2, stop_strings="ab")


# -- sampling ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    dict(),  # transformers' default top_k=50
    dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
    dict(typical_p=0.8, repetition_penalty=1.2),
], ids=["default_top_k", "temperature_top_k_top_p_min_p", "typical_p"])
def test_sampling_scores_match_transformers(pair, argmax_sampling, kw):
    hf, m, ids = pair
    a, b = run_both(hf, m, ids, max_new_tokens=5, do_sample=True, **kw)
    assert_same(a, b)
    if not kw:
        assert (torch.isfinite(b.scores[0]).sum(-1) == 50).all()


def test_num_return_sequences(pair, argmax_sampling):
    hf, m, ids = pair
    a, b = run_both(hf, m, ids, max_new_tokens=4, do_sample=True, num_return_sequences=2, no_repeat_ngram_size=2)
    assert_same(a, b)
    assert b.sequences.shape[0] == 4 and torch.equal(b.sequences[:, :T], ids.repeat_interleave(2, 0))
    with pytest.raises(ValueError, match="num_return_sequences"):
        m.generate(ids, max_new_tokens=2, num_return_sequences=2)


def test_real_samplers_agree_on_the_first_step_and_seeds_repeat(pair):
    hf, m, ids = pair
    kw = dict(max_new_tokens=1, do_sample=True, temperature=0.8, top_p=0.9)
    a, b = run_both(hf, m, ids, **kw)
    assert_same(a, b, tokens=False)
    s1 = m.generate(ids, max_new_tokens=3, do_sample=True, seed=3, num_return_sequences=2)
    s2 = m.generate(ids, max_new_tokens=3, do_sample=True, seed=3, num_return_sequences=2)
    assert torch.equal(s1, s2)
    assert torch.isfinite(b.scores[0]).gather(1, b.sequences[:, T:T + 1]).all()  # sampled inside the nucleus


# -- speculative path --------------------------------------------------------------------------------------------
def test_speculative_greedy_applies_the_same_processors(pair, greedy):
    from k3nn.layers.dspark import DSparkConfig, DSparkDrafter
    from k3nn.spec import SpecOptions

    hf, m, ids = pair
    d = DSparkDrafter(DSparkConfig.for_target(m.config, num_layers=1, num_heads=2, block_size=3, markov_rank=8), m)
    kw = dict(max_new_tokens=6, min_new_tokens=5, bad_words_ids=[[int(greedy[0, 1])]])
    ref = hf.generate(ids, **kw)
    for mode in (False, "static"):
        d.spec_options = SpecOptions(cuda_graph=mode)
        assert torch.equal(m.generate(ids, drafter=d, **kw), ref), mode
    d.spec_options = None
    for bad in (dict(repetition_penalty=1.2), dict(no_repeat_ngram_size=2), dict(bad_words_ids=[[5, 6]]),
                dict(stop_strings="ab", tokenizer=object()), dict(output_scores=True, return_dict_in_generate=True)):
        with pytest.raises((NotImplementedError, ValueError)):
            m.generate(ids, max_new_tokens=3, drafter=d, **bad)


# -- argument handling, errors -----------------------------------------------------------------------------------
def test_generation_config_forms_and_errors(pair):
    hf, m, ids = pair
    ref = m.generate(ids, max_new_tokens=3, repetition_penalty=1.3)
    assert torch.equal(m.generate(ids, generation_config=transformers.GenerationConfig(
        max_new_tokens=3, repetition_penalty=1.3)), ref)
    assert torch.equal(m.generate(ids, generation_config=dict(max_new_tokens=3, repetition_penalty=1.3)), ref)
    assert torch.equal(m.generate(ids, generation_config=GenerationConfig(max_new_tokens=3),
                                  repetition_penalty=1.3), ref)
    assert torch.equal(m.generate(ids, max_new_tokens=3, repetition_penalty=1.3, use_cache=False), ref)
    with pytest.raises(ValueError, match="suppress_tokens"):
        m.generate(ids, generation_config=transformers.GenerationConfig(max_new_tokens=2, suppress_tokens=[3]))
    with pytest.raises(TypeError, match="unknown generation argument"):
        m.generate(ids, max_new_tokens=2, foo=1)
    with pytest.raises(NotImplementedError, match="num_return_sequences"):
        m.generate(ids, max_new_tokens=2, num_beams=4)


@pytest.fixture(scope="module")
def tiny():
    return KimiK3(KimiK3Config.tiny(), backend="eager", seed=0).eval()


@pytest.mark.parametrize("do_sample", [False, True])
def test_nonfinite_logits_raise_naming_the_step(tiny, do_sample):
    calls = {"n": 0}

    def poison(mod, args, out):
        calls["n"] += 1
        return out.fill_(float("nan")) if calls["n"] == 4 else out  # call 1 = prefill = step 0

    h = tiny.lm_head.register_forward_hook(poison)
    try:
        with pytest.raises(FloatingPointError, match="step 3"):
            tiny.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=do_sample, seed=0)
    finally:
        h.remove()
