"""SamplingParams' vLLM fields and k3nn.engine.sampling.RequestSampler: validation, penalties from incremental
counts, min_tokens, stop ids and stop strings (byte and word toy tokenizers), logprobs, seeds, verify windows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3nn.engine.request import RequestOutput, SamplingParams, TokenLogprobs
from k3nn.engine.sampling import IncrementalDetokenizer, RequestSampler
from k3nn.logits import LogitsPipeline
from k3nn.tokenizer import ByteTokenizer

EOS = 256
BYTES = ByteTokenizer(260)  # ids 256.. are specials (decoded as nothing)


class WordTokenizer:
    """Token i decodes to WORDS[i] (multi-character tokens, so a stop string can end inside one)."""

    WORDS = ["ab", "cX", "Yd", "e", " ", "XY", "<eos>"]

    def decode(self, ids):
        return "".join(self.WORDS[i] for i in ids if i != 6)


def sampler(prompt=(1, 2, 3), V=260, eos=(EOS,), generator=None, tokenizer=None, **kw):
    return RequestSampler(SamplingParams(**kw), list(prompt), vocab_size=V, eos_ids=list(eos), generator=generator,
                          tokenizer=tokenizer)


def feed(s, tokens):
    """Append tokens one by one, calling check_stop after each; returns (output, result, texts)."""
    out, texts = [], []
    for t in tokens:
        out.append(t)
        r = s.check_stop(out)
        texts.append(s.text)
        if r[0]:
            return out, r, texts
    return out, (False, None, 0), texts


# -- validation ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,exc", [
    ("n", 0, ValueError), ("n", 1.0, TypeError), ("stop", 3, TypeError), ("stop", ["a", 1], TypeError),
    ("stop", "", ValueError), ("stop_token_ids", 5, TypeError), ("stop_token_ids", [-1], ValueError),
    ("stop_token_ids", ["a"], TypeError), ("ignore_eos", 1, TypeError), ("min_tokens", -1, ValueError),
    ("min_tokens", 1.5, TypeError), ("min_tokens", 65, ValueError), ("repetition_penalty", 0.0, ValueError),
    ("repetition_penalty", "2", TypeError), ("repetition_penalty", float("nan"), ValueError),
    ("presence_penalty", 2.5, ValueError), ("presence_penalty", None, TypeError),
    ("frequency_penalty", -2.01, ValueError), ("frequency_penalty", float("inf"), ValueError),
    ("logprobs", -1, ValueError), ("logprobs", 2.0, TypeError), ("logprobs", True, TypeError),
    ("include_stop_str_in_output", "yes", TypeError), ("max_new_tokens", 0, ValueError),
])
def test_validation_errors_name_the_field(field, value, exc):
    p = SamplingParams(**{field: value})
    with pytest.raises(exc, match=field):
        p.validate(BYTES)


def test_valid_params_and_defaults():
    p = SamplingParams(n=3, stop=["a", "bc"], stop_token_ids=[4], ignore_eos=True, min_tokens=64,
                       repetition_penalty=1.5, presence_penalty=-2, frequency_penalty=2, logprobs=0,
                       include_stop_str_in_output=True)
    p.validate(BYTES)
    d = SamplingParams()
    assert (d.n, d.stop, d.stop_token_ids, d.ignore_eos, d.min_tokens, d.repetition_penalty, d.presence_penalty,
            d.frequency_penalty, d.logprobs, d.include_stop_str_in_output) == (1, None, None, False, 0, 1.0, 0.0, 0.0,
                                                                               None, False)
    assert SamplingParams(stop="x").stop_strings == ["x"] and d.stop_strings == []


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="x").validate()
    with pytest.raises(ValueError, match="stop"):
        sampler(stop=["x"])
    sampler(stop=["x"], tokenizer=BYTES)  # fine with one


def test_sampler_checks_against_the_vocabulary():
    with pytest.raises(ValueError, match="stop_token_ids"):
        sampler(V=10, stop_token_ids=[10])
    with pytest.raises(ValueError, match="logprobs"):
        sampler(V=10, logprobs=11)
    with pytest.raises(TypeError, match="params"):
        RequestSampler({"n": 1}, [1], vocab_size=10)
    s = sampler(V=10, repetition_penalty=1.5)
    with pytest.raises(ValueError, match="logits"):
        s.choose(torch.zeros(11), [])


def test_child_seeds_for_n_samples():
    p = SamplingParams(n=3, seed=2**64 - 2, do_sample=True, stop=["a"])
    kids = [p.child(i) for i in range(3)]
    assert [k.seed for k in kids] == [2**64 - 2, 2**64 - 1, 0] and all(k.n == 1 for k in kids)
    assert kids[0].stop is not p.stop and kids[0].stop == p.stop
    assert SamplingParams(n=2).child(1).seed is None
    with pytest.raises(ValueError, match="index"):
        p.child(3)


# -- penalties and the pipeline ------------------------------------------------------------------------------------
params_st = st.fixed_dictionaries(dict(
    repetition_penalty=st.sampled_from([1.0, 0.7, 1.8]), presence_penalty=st.sampled_from([0.0, 1.5, -0.5]),
    frequency_penalty=st.sampled_from([0.0, 0.6, -2.0]), min_tokens=st.integers(0, 4), do_sample=st.booleans(),
    temperature=st.sampled_from([0.6, 1.0]), top_k=st.sampled_from([0, 4]), top_p=st.sampled_from([1.0, 0.8])))


@given(params_st, st.integers(3, 48), st.integers(0, 6), st.integers(1, 7), st.integers(0, 2**16))
def test_incremental_scores_equal_the_pipeline_on_the_ids(kw, V, P, G, seed):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V, (P,), generator=g).tolist()
    output = torch.randint(0, V, (G,), generator=g).tolist()
    logits = torch.randn(G + 1, V, generator=g) * 2
    s = sampler(prompt, V=V, eos=[0], stop_token_ids=[V - 1], max_new_tokens=16, **kw)
    ref = LogitsPipeline.for_request(s.params, prompt_length=P, vocab_size=V, eos_ids=[0])
    for i in range(G + 1):  # grows one token at a time: the counts are updated, not rebuilt
        ids = torch.tensor([prompt + output[:i]])
        torch.testing.assert_close(s.scores(logits[i], output[:i]), ref(ids, logits[i:i + 1]), rtol=1e-5, atol=1e-5)
    # a rewritten output is recounted
    other = output[:-1] + [(output[-1] + 1) % V]
    torch.testing.assert_close(s.scores(logits[0], other), ref(torch.tensor([prompt + other]), logits[:1]),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.scores(logits[0], output[:1]), ref(torch.tensor([prompt + output[:1]]), logits[:1]),
                               rtol=1e-5, atol=1e-5)


@given(params_st, st.integers(3, 48), st.integers(0, 5), st.integers(1, 5), st.booleans(), st.integers(0, 2**16))
def test_window_rows_see_the_drafts_as_history(kw, V, G, D, as_tensor, seed):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V, (3,), generator=g).tolist()
    output = torch.randint(0, V, (G,), generator=g).tolist()
    drafts = torch.randint(0, V, (D,), generator=g).tolist()
    logits = torch.randn(D + 1, V, generator=g)
    s = sampler(prompt, V=V, eos=[1], stop_token_ids=[2], max_new_tokens=16, **kw)
    ref = sampler(prompt, V=V, eos=[1], stop_token_ids=[2], max_new_tokens=16, **kw)
    w = s.window_scores(logits, output, torch.tensor(drafts) if as_tensor else drafts)
    assert w.shape == (D + 1, V)
    for j in range(D + 1):
        torch.testing.assert_close(w[j:j + 1], ref.scores(logits[j], output + drafts[:j]), rtol=1e-5, atol=1e-5)
    # fewer rows than drafts + 1 is fine; more is not
    torch.testing.assert_close(s.window_scores(logits[:1], output, drafts), w[:1])
    with pytest.raises(ValueError, match="drafts"):
        s.window_scores(logits, output, drafts[:-1])


def test_sampler_penalties_by_hand():
    # vLLM's semantics (tests/test_logits_request.py works the numbers out): prompt [0, 1], output [3, 3, 2]
    # appended at once (the counts of a repeated token add up)
    s = sampler((0, 1), V=5, eos=(), repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    assert s.scores(logits, [3, 3, 2]).tolist() == [[1.0, -2.0, -0.5, 0.5, 0.0]]
    assert s.scores(logits, [3, 3, 2, 3]).tolist() == [[1.0, -2.0, -0.5, 0.25, 0.0]]


def test_greedy_applies_the_penalties():
    V = 8
    logits = torch.tensor([0.0, 5.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    s = sampler((), V=V, eos=(), repetition_penalty=2.0)
    assert not s.plain_greedy
    assert s.choose(logits, []) == (1, None)
    assert s.choose(logits, [1]) == (2, None)  # 5 / 2 < 4
    s = sampler((), V=V, eos=(), frequency_penalty=0.6)
    assert s.choose(logits, [1]) == (1, None) and s.choose(logits, [1, 1]) == (2, None)  # 5 − 1.2 < 4
    s = sampler((), V=V, eos=(), presence_penalty=1.5)
    assert s.choose(logits[None], [1]) == (2, None)
    assert sampler((), V=V).plain_greedy and not sampler((), V=V, logprobs=1).plain_greedy


# -- min_tokens and stop ids ----------------------------------------------------------------------------------------
def test_min_tokens_blocks_eos_and_stop_ids():
    V = 12
    logits = torch.zeros(V)
    logits[[3, 7]] = torch.tensor([9.0, 8.0])  # eos 3, then stop id 7, are the favourites
    s = sampler((), V=V, eos=[3], stop_token_ids=[7], min_tokens=2)
    assert s.choose(logits, [])[0] not in (3, 7)
    assert s.choose(logits, [5])[0] not in (3, 7)
    assert s.choose(logits, [5, 5])[0] == 3
    # sampling: the blocked tokens are never drawn
    g = torch.Generator().manual_seed(0)
    s = sampler((), V=V, eos=[3], stop_token_ids=[7], min_tokens=3, do_sample=True, generator=g)
    assert all(s.choose(logits, [0] * k)[0] not in (3, 7) for k in range(3) for _ in range(20))
    # ignore_eos: eos is an ordinary token, neither blocked nor stopping; stop ids still are
    s = sampler((), V=V, eos=[3], stop_token_ids=[7], min_tokens=2, ignore_eos=True)
    assert s.choose(logits, [])[0] == 3
    out, r, _ = feed(s, [3, 3, 3, 7, 3])
    assert r == (True, "stop", 0) and s.stop_reason == 7 and out == [3, 3, 3, 7]


def test_stop_ids_eos_and_length():
    s = sampler(eos=[EOS], stop_token_ids=[9], max_new_tokens=5)
    assert feed(s, [1, 2, EOS])[1] == (True, "stop", 0) and s.stop_reason is None
    s = sampler(eos=[EOS], stop_token_ids=[9], max_new_tokens=5)
    assert feed(s, [1, 9])[1] == (True, "stop", 0) and s.stop_reason == 9
    s = sampler(eos=[EOS], max_new_tokens=3)
    assert feed(s, [1, 2, 3])[1] == (True, "length", 0) and s.stop_reason is None
    s = sampler(eos=[EOS], max_new_tokens=3)
    assert feed(s, [1, 2, EOS])[1] == (True, "stop", 0)  # a stop at the last token is a stop
    # several tokens at once (a verify window): the first stop wins, the rest is trimmed; the end is final
    s = sampler(eos=[EOS], stop_token_ids=[9], min_tokens=2, max_new_tokens=10)
    out = [9, 4, 9, EOS, 5]
    assert s.check_stop(out) == (True, "stop", 2) and s.stop_reason == 9  # the 9 at index 0 is inside min_tokens
    assert s.check_stop(out[:3]) == (True, "stop", 0) and s.finished
    s = sampler(eos=[EOS], max_new_tokens=4)
    assert s.check_stop([1, 2, 3, 4, 5, 6]) == (True, "length", 2)
    # min_tokens holds eos back from stopping when it was forced in
    s = sampler(eos=[EOS], min_tokens=2)
    assert feed(s, [EOS, EOS, EOS])[1] == (True, "stop", 0) and s.check_stop([EOS] * 3) == (True, "stop", 0)
    s = sampler(eos=[EOS], min_tokens=2)
    assert s.check_stop([EOS, EOS]) == (False, None, 0)


# -- stop strings ---------------------------------------------------------------------------------------------------
def test_stop_string_with_bytes():
    s = sampler(eos=[EOS], stop=["lo w", "zzz"], tokenizer=BYTES, max_new_tokens=30)
    out, r, texts = feed(s, list(b"hello world"))
    assert r == (True, "stop", 0) and s.stop_reason == "lo w"
    assert out == list(b"hello w")  # the ids keep the token that completed the stop string
    assert s.text == "hel"
    assert all(len(t) <= max(0, i + 1 - 3) for i, t in enumerate(texts[:-1]))  # 3 = len("lo w") − 1 held back
    s = sampler(eos=[EOS], stop=["lo w"], tokenizer=BYTES, include_stop_str_in_output=True)
    out, r, _ = feed(s, list(b"hello world"))
    assert s.text == "hello w" and out == list(b"hello w")
    # appended at once: trimmed after the completing token
    s = sampler(eos=[EOS], stop=["o w"], tokenizer=BYTES)
    assert s.check_stop(list(b"hello world")) == (True, "stop", 4) and s.text == "hell"


def test_stop_string_inside_a_token_and_earliest_wins():
    tok = WordTokenizer()  # "ab" "cX" "Yd" "e" " " "XY" "<eos>"
    s = sampler(eos=[6], V=7, stop=["XY"], tokenizer=tok)
    out, r, _ = feed(s, [0, 1, 2, 3])
    assert r == (True, "stop", 0) and out == [0, 1, 2] and s.text == "abc"
    s = sampler(eos=[6], V=7, stop=["XY"], tokenizer=tok, include_stop_str_in_output=True)
    assert feed(s, [0, 1, 2, 3])[0] == [0, 1, 2] and s.text == "abcXY"  # the rest of "Yd" is cut
    s = sampler(eos=[6], V=7, stop=["d", "bc"], tokenizer=tok)
    assert s.check_stop([0, 1, 2]) == (True, "stop", 1) and s.stop_reason == "bc" and s.text == "a"
    # not looked for before min_tokens: "XY" completed by the second token does not count, the later one does
    s = sampler(eos=[6], V=7, stop=["XY"], tokenizer=tok, min_tokens=3)
    out, r, _ = feed(s, [1, 2, 3, 5, 4])
    assert out == [1, 2, 3, 5] and s.text == "cXYde"


def test_text_with_eos_multibyte_and_prompt_context():
    s = sampler(eos=[EOS], tokenizer=BYTES)
    e = list("é€".encode())  # 2 + 3 bytes
    out, r, texts = feed(s, e + [EOS])
    assert texts[:5] == ["", "é", "é", "é", "é€"] and s.text == "é€" and out == e + [EOS]
    s = sampler(eos=[EOS], tokenizer=BYTES, stop_token_ids=[257], include_stop_str_in_output=True)
    assert feed(s, [104, 257])[1] == (True, "stop", 0) and s.text == "h"  # specials decode to nothing here
    # an incomplete UTF-8 tail is flushed at the end
    s = sampler(eos=[EOS], tokenizer=BYTES, max_new_tokens=2)
    assert feed(s, [104, 0xC3])[1] == (True, "length", 0) and s.text == "h\ufffd"
    # the prompt's tail is decoding context only
    d = IncrementalDetokenizer(BYTES, list("a é".encode())[:-1])  # the prompt ends inside "é"
    assert d.push(0xA9) == 1 and d.text == "é"
    assert sampler().text is None


# -- logprobs and seeds ---------------------------------------------------------------------------------------------
@given(st.integers(2, 64), st.integers(0, 6), st.booleans(), st.integers(0, 2**16))
def test_logprobs_are_the_raw_log_softmax(V, k, sample, seed):
    k = min(k, V)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, generator=g) * 3
    s = sampler((0, 1), V=V, eos=(), logprobs=k, do_sample=sample, temperature=0.5, top_k=2, repetition_penalty=1.7,
                presence_penalty=1.0, generator=torch.Generator().manual_seed(seed))
    tok, lp = s.choose(logits.to(torch.bfloat16), [1, 1])
    raw = torch.log_softmax(logits.to(torch.bfloat16).float(), -1)
    assert isinstance(lp, TokenLogprobs) and lp.token_id == tok
    assert lp.logprob == pytest.approx(raw[tok].item(), abs=1e-6)
    assert lp.rank == int((raw > raw[tok]).sum()) + 1
    vals = list(lp.top.values())
    assert len(lp.top) == k and vals == sorted(vals, reverse=True)
    assert vals == pytest.approx(torch.topk(raw, k).values.tolist(), abs=1e-6)
    assert all(raw[i].item() == pytest.approx(v, abs=1e-6) for i, v in lp.top.items())
    # several rows at once (accepted tokens of a window)
    rows = torch.randn(3, V, generator=g)
    lps = s.logprobs_of(rows, [0, V - 1, 1])
    assert [x.token_id for x in lps] == [0, V - 1, 1]
    assert [x.logprob for x in lps] == pytest.approx(torch.log_softmax(rows, -1)[[0, 1, 2], [0, V - 1, 1]].tolist(),
                                                     abs=1e-6)


def test_no_logprobs_unless_asked():
    s = sampler(V=10)
    assert s.choose(torch.randn(10), [])[1] is None
    with pytest.raises(ValueError, match="logprobs"):
        s.logprobs_of(torch.randn(1, 10), [0])
    assert sampler(V=10, logprobs=0).choose(torch.randn(10), [])[1].top == {}


def test_seeds_reproduce_and_differ():
    V = 50
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0))

    def run(seed):
        s = sampler((), V=V, eos=(), do_sample=True, seed=seed, repetition_penalty=1.3, top_p=0.95,
                    generator=torch.Generator().manual_seed(seed))
        out = []
        for _ in range(24):
            out.append(s.choose(logits, out)[0])
        return out

    assert run(3) == run(3) and run(3) != run(4)


def test_request_output_fields():
    lp = TokenLogprobs(5, -0.5, 1, {5: -0.5})
    o = RequestOutput("r", [5], True, "stop", [5], None, "x", [lp], "ab")
    assert (o.stop_reason, o.logprobs, o.text) == ("x", [lp], "ab")
    assert RequestOutput("r", [], False).logprobs is None
