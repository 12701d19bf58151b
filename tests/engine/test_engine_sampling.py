"""SamplingParams through the engine: penalties, stop strings, n samples, logprobs, ignore_eos — with and without
speculation, against generate() and the model's own logits."""

import pytest
import torch

from engine_helpers import CFG, model, rand_ids, reference  # noqa: F401 - fixture
from test_engine_spec import GAMMA, OracleDrafter

from k3nn.engine import Engine, EngineConfig, SamplingParams


class LetterTokenizer:
    """Token i decodes to one letter (so any substring of an output's text is a stop string candidate)."""

    def decode(self, ids):
        return "".join(chr(65 + int(i) % 26) for i in ids)


def _engine(model, drafter=None, **kw):
    cfg = dict(max_num_seqs=4, num_pages=64, num_snapshots=8, max_num_batched_tokens=256)
    cfg.update({k: kw.pop(k) for k in list(kw) if k in EngineConfig.__dataclass_fields__})
    return Engine(model, EngineConfig(**cfg), drafter=drafter, **kw)


@pytest.mark.parametrize("spec", [False, True])
def test_repetition_penalty_equals_generate(model, spec):
    prompts = [rand_ids(18 + 5 * i, 70 + i) for i in range(3)]
    n = 12
    refs = {tuple(p): reference(model, p, n, repetition_penalty=1.8) for p in prompts}
    plain = {tuple(p): reference(model, p, n) for p in prompts}  # drafts from the unpenalised continuation
    assert refs != plain
    e = _engine(model, OracleDrafter(plain, GAMMA) if spec else None, num_speculative_tokens=GAMMA if spec else None)
    assert e.generate(prompts, max_new_tokens=n, repetition_penalty=1.8) == [refs[tuple(p)] for p in prompts]
    if spec:
        assert e.metrics()["spec_rounds"] > 0


@pytest.mark.parametrize("spec", [False, True])
def test_stop_string_ends_the_output(model, spec):
    p = rand_ids(25, 80)
    n = 16
    ref = reference(model, p, n)
    tok = LetterTokenizer()
    stop = tok.decode(ref[6:8])
    first = tok.decode(ref).index(stop)  # the stop string's first occurrence
    end = next(k for k in range(1, n + 1) if stop in tok.decode(ref[:k]))  # tokens up to the one completing it
    e = _engine(model, OracleDrafter({tuple(p): ref}, GAMMA) if spec else None, tokenizer=tok,
                num_speculative_tokens=GAMMA if spec else None)
    rid = e.add_request(p, max_new_tokens=n, stop=stop)
    outs = list(e.stream())
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == stop
    assert e.requests[rid].output == ref[:end]
    assert last.text == tok.decode(ref)[:first]
    assert sum(len(o.new_token_ids) for o in outs) == end


def test_stop_strings_need_the_engine_tokenizer(model):
    with pytest.raises(ValueError, match="stop"):
        _engine(model).add_request([1, 2, 3], stop="AB")


def test_n_samples_are_the_seeded_children(model):
    p = rand_ids(14, 81)
    e = _engine(model, max_num_seqs=8)
    outs = e.generate([p], n=3, max_new_tokens=6, do_sample=True, seed=11)
    assert len(outs) == 1 and len(outs[0]) == 3
    singles = [_engine(model).generate([p], max_new_tokens=6, do_sample=True, seed=11 + i)[0] for i in range(3)]
    assert outs[0] == singles
    rid = e.add_request(p, SamplingParams(n=2, max_new_tokens=3, do_sample=True))
    assert e.parents[rid] == [f"{rid}/0", f"{rid}/1"]
    assert e.abort(rid) and all(e.requests[c].finish_reason == "abort" for c in e.parents[rid])


@pytest.mark.parametrize("spec", [False, True])
def test_logprobs_are_the_raw_model_distribution(model, spec):
    p = rand_ids(20, 82)
    n = 9
    ref = reference(model, p, n)
    e = _engine(model, OracleDrafter({tuple(p): ref}, 2) if spec else None,
                num_speculative_tokens=GAMMA if spec else None)
    e.add_request(p, max_new_tokens=n, logprobs=3)
    outs = list(e.stream())
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    assert [lp.token_id for lp in lps] == ref
    with torch.no_grad():
        logits = model(torch.tensor([p + ref])).logits[0, len(p) - 1:-1].double().log_softmax(-1)
    for k, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(float(logits[k, ref[k]]), abs=1e-5)
        assert lp.rank == 1  # greedy: the most likely token
        top = logits[k].topk(3)
        assert list(lp.top) == top.indices.tolist()
        assert list(lp.top.values()) == pytest.approx(top.values.tolist(), abs=1e-5)


def test_ignore_eos_and_min_tokens(model):
    p = rand_ids(22, 83)
    ref = reference(model, p, 10)
    eos = ref[2]
    e = _engine(model)
    a = e.add_request(p, max_new_tokens=10, eos_token_id=eos)
    b = e.add_request(p, max_new_tokens=10, eos_token_id=eos, ignore_eos=True)
    list(e.stream())
    assert e.requests[a].output == ref[:ref.index(eos) + 1]
    assert e.requests[b].finish_reason == "length" and e.requests[b].output == ref  # eos passed through
    c = e.add_request(p, max_new_tokens=10, eos_token_id=eos, min_tokens=4)
    list(e.stream())
    out = e.requests[c].output
    assert out[:2] == ref[:2] and out[2] != eos and eos not in out[:4]  # eos blocked for the first 4 tokens


def test_n_samples_share_the_prompt_through_the_prefix_cache(model):
    p = rand_ids(150, 84)
    e = _engine(model, max_num_seqs=8)
    outs = e.generate([p], n=4, max_new_tokens=5, do_sample=True, seed=3)[0]
    assert e.metrics()["cache_hits"] >= 3 and e.metrics()["computed_prompt_tokens"] < 2 * len(p)
    assert outs == [_engine(model).generate([p], max_new_tokens=5, do_sample=True, seed=3 + i)[0] for i in range(4)]
