"""k3nn.logits' request-side additions: frequency / presence penalties, the count-based path (TokenCounts,
apply_counts) and LogitsPipeline.for_request, against plain-PyTorch references and a hand-computed vLLM example."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3nn.logits import (FrequencyPenalty, LogitsPipeline, MinNewTokens, PresencePenalty, RepetitionPenalty,
                         Temperature, TokenCounts, TopK, TopP)


def ref_penalties(scores, ids, prompt_length, rep=1.0, freq=0.0, pres=0.0):
    """vLLM's penalties one row and one token at a time: repetition over prompt + output, frequency and presence
    over the output."""
    out = scores.clone()
    N, V = scores.shape
    for n in range(N):
        seq = ids[n].tolist()
        gen = seq[prompt_length:]
        for v in range(V):
            s = out[n, v].item()
            if v in seq:
                s = s / rep if s > 0 else s * rep
            c = gen.count(v)
            s = s - freq * c - pres * (c > 0)
            out[n, v] = s
    return out


cases = st.fixed_dictionaries(dict(
    N=st.integers(1, 3), V=st.integers(3, 40), P=st.integers(0, 6), G=st.integers(0, 8), seed=st.integers(0, 2**16),
    rep=st.sampled_from([1.0, 0.5, 1.3, 2.0]), freq=st.sampled_from([0.0, -1.5, 0.4, 2.0]),
    pres=st.sampled_from([0.0, -0.7, 1.0, 2.0])))


def draw(c):
    g = torch.Generator().manual_seed(c["seed"])
    ids = torch.randint(0, c["V"], (c["N"], c["P"] + c["G"]), generator=g)
    scores = torch.randn(c["N"], c["V"], generator=g) * 3
    return ids, scores


@given(cases)
def test_each_penalty_matches_the_reference(c):
    ids, scores = draw(c)
    P = c["P"]
    for proc, kw in [(RepetitionPenalty(c["rep"]), dict(rep=c["rep"])),
                     (FrequencyPenalty(c["freq"], P), dict(freq=c["freq"])),
                     (PresencePenalty(c["pres"], P), dict(pres=c["pres"]))]:
        want = ref_penalties(scores, ids, P, **kw)
        torch.testing.assert_close(proc(ids, scores), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(proc.apply_counts(scores, TokenCounts.from_ids(ids, P, c["V"])), want,
                                   rtol=1e-6, atol=1e-6)


@given(cases)
def test_token_counts_match_the_reference(c):
    ids, _ = draw(c)
    tc = TokenCounts.from_ids(ids, c["P"], c["V"])
    for n in range(c["N"]):
        seq = ids[n].tolist()
        assert tc.output[n].tolist() == [float(seq[c["P"]:].count(v)) for v in range(c["V"])]
        assert tc.seen[n].tolist() == [v in seq for v in range(c["V"])]
    assert tc.length == ids.shape[1]


@given(cases, st.booleans(), st.integers(0, 5))
def test_for_request_runs_the_same_from_ids_and_from_counts(c, sample, min_tokens):
    ids, scores = draw(c)
    P, V = c["P"], c["V"]
    params = SimpleNamespace(repetition_penalty=c["rep"], frequency_penalty=c["freq"], presence_penalty=c["pres"],
                             min_tokens=min_tokens, stop_token_ids=[V - 1], do_sample=sample, temperature=0.7,
                             top_k=min(5, V), top_p=0.9)
    pipe = LogitsPipeline.for_request(params, prompt_length=P, vocab_size=V, eos_ids=[0])
    a = pipe(ids, scores)
    b = pipe.apply_counts(scores, TokenCounts.from_ids(ids, P, V))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the reference: penalties, then the stop-token block, then the warpers
    want = ref_penalties(scores, ids, P, c["rep"], c["freq"], c["pres"])
    if c["G"] < min_tokens:
        want[:, [0, V - 1]] = -float("inf")
    if sample:
        want = TopP(0.9).apply(TopK(min(5, V)).apply(want / 0.7))
    torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-5)


def test_vllm_penalties_by_hand():
    # prompt [0, 1], output [3, 3, 2]; repetition 2 over prompt + output, frequency 0.25 and presence 0.5 over
    # the output: 2 → 2/2 = 1; −1 → −1·2 = −2; 0.5 → 0.25 − 0.25·1 − 0.5 = −0.5; 3 → 1.5 − 0.25·2 − 0.5 = 0.5;
    # token 4 (unseen) keeps 0
    scores = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    ids = torch.tensor([[0, 1, 3, 3, 2]])
    params = SimpleNamespace(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    pipe = LogitsPipeline.for_request(params, prompt_length=2, vocab_size=5)
    assert [type(p) for p in pipe] == [RepetitionPenalty, FrequencyPenalty, PresencePenalty]
    assert pipe(ids, scores).tolist() == [[1.0, -2.0, -0.5, 0.5, 0.0]]


def test_for_request_parts_and_neutral_values():
    V = 10
    pipe = LogitsPipeline.for_request(SimpleNamespace(), prompt_length=3, vocab_size=V, eos_ids=[2])
    assert len(pipe) == 0 and not pipe.do_sample and not pipe.reads_counts
    # min_tokens blocks eos and the stop ids; under ignore_eos only the stop ids
    p = SimpleNamespace(min_tokens=2, stop_token_ids=[7], ignore_eos=False)
    (m,) = LogitsPipeline.for_request(p, prompt_length=3, vocab_size=V, eos_ids=[2]).processors
    assert isinstance(m, MinNewTokens) and m.eos_token_id == [2, 7] and m.prompt_length == 3
    p.ignore_eos = True
    (m,) = LogitsPipeline.for_request(p, prompt_length=3, vocab_size=V, eos_ids=[2]).processors
    assert m.eos_token_id == [7]
    # greedy keeps the penalties and drops the warpers; sampling adds them after
    p = SimpleNamespace(repetition_penalty=1.2, do_sample=False, temperature=0.5, top_k=3)
    assert [type(q) for q in LogitsPipeline.for_request(p, prompt_length=0, vocab_size=V)] == [RepetitionPenalty]
    p.do_sample = True
    pipe = LogitsPipeline.for_request(p, prompt_length=0, vocab_size=V)
    assert [type(q) for q in pipe] == [RepetitionPenalty, Temperature, TopK] and pipe.do_sample


def test_count_path_refuses_processors_of_the_ids_and_windows_refuse_penalties():
    from k3nn.logits import NoRepeatNGram

    tc = TokenCounts(None, None, 4)
    with pytest.raises(NotImplementedError, match="no_repeat_ngram_size=2"):
        LogitsPipeline([NoRepeatNGram(2)]).apply_counts(torch.zeros(1, 4), tc)
    with pytest.raises(NotImplementedError, match="FrequencyPenalty"):
        LogitsPipeline([FrequencyPenalty(0.5)]).check_history_free("the speculative path")


@pytest.mark.parametrize("cls,name", [(FrequencyPenalty, "frequency_penalty"), (PresencePenalty, "presence_penalty")])
def test_penalty_errors_name_the_argument(cls, name):
    for bad in (float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match=name):
            cls(bad)
