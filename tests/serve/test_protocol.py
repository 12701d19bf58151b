"""The request schemas and their mapping onto the Engine's SamplingParams."""

import pytest

from k3nn.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, error_param, parse_json,
                                 parse_request, sampling_params)


def comp(**kw):
    return parse_request(CompletionRequest, {"prompt": "x", **kw})


def test_openai_defaults_and_greedy():
    p = sampling_params(comp(), 16, None)
    assert p.do_sample and p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0 and p.n == 1  # OpenAI: T=1
    g = sampling_params(comp(temperature=0, top_p=0.5, top_k=4), 8, None)
    assert not g.do_sample and g.max_new_tokens == 8  # temperature 0 is greedy (vLLM)
    s = sampling_params(comp(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05, seed=-1, n=3, stop="\n"), 4, 2)
    assert (s.do_sample, s.temperature, s.top_p, s.top_k, s.min_p, s.n) == (True, 0.7, 0.9, 0, 0.05, 3)
    assert s.seed == 2**64 - 1 and s.stop == ["\n"] and s.logprobs == 2
    e = sampling_params(comp(presence_penalty=1, frequency_penalty=-1, repetition_penalty=1.2, ignore_eos=True,
                             min_tokens=2, stop_token_ids=[3], include_stop_str_in_output=True), 4, None)
    assert (e.presence_penalty, e.frequency_penalty, e.repetition_penalty) == (1.0, -1.0, 1.2)
    assert e.ignore_eos and e.min_tokens == 2 and e.stop_token_ids == [3] and e.include_stop_str_in_output
    for p in (s, e, g):
        p.validate(None if not p.stop else type("T", (), {"decode": lambda self, ids: ""})())


def test_nulls_are_defaults():
    r = parse_request(CompletionRequest, {"prompt": "x", "max_tokens": None, "temperature": None, "stop": None,
                                          "seed": None, "logprobs": None, "stream_options": None, "user": "u1",
                                          "best_of": 1, "logit_bias": {}})
    assert r.max_tokens is None and r.n == 1


def test_chat_request_fields():
    r = parse_request(ChatCompletionRequest, {"messages": [], "logprobs": True, "top_logprobs": 3,
                                              "max_completion_tokens": 5, "stream": True,
                                              "stream_options": {"include_usage": True},
                                              "chat_template_kwargs": {"x": 1}, "add_generation_prompt": False})
    assert r.top_logprobs == 3 and r.stream_options.include_usage and not r.add_generation_prompt
    with pytest.raises(APIError) as ei:
        parse_request(ChatCompletionRequest, {"messages": [], "echo": True})
    assert ei.value.param == "echo" and ei.value.code == "unsupported_parameter"
    with pytest.raises(APIError) as ei:
        parse_request(ChatCompletionRequest, {})
    assert ei.value.param == "messages" and "required" in ei.value.message


def test_error_body_shape():
    e = APIError("bad", param="n", code="invalid_value")
    assert e.body() == {"error": {"message": "bad", "type": "invalid_request_error", "param": "n",
                                  "code": "invalid_value"}} and e.status == 400
    with pytest.raises(APIError, match="not valid JSON"):
        parse_json(b"\xff")


@pytest.mark.parametrize("message,names,param", [
    ("max_new_tokens must be >= 1, got 0", {}, "max_tokens"),
    ("max_new_tokens must be >= 1, got 0", {"max_tokens_param": "max_completion_tokens"}, "max_completion_tokens"),
    ("prompt has token ids outside [0, vocab_size=320): [400]", {"prompt_param": "messages"}, "messages"),
    ("logprobs must be <= vocab_size=320, got 400", {"logprobs_param": "top_logprobs"}, "top_logprobs"),
    ("num_speculative_tokens > 0 needs an engine with a drafter", {}, "num_speculative_tokens"),
    ("request 'x' needs 9 latent pages", {}, "max_tokens"),
    ("stop_token_ids has ids outside [0, vocab_size=320): [400]", {}, "stop_token_ids"),
    ("something else entirely", {}, None),
])
def test_error_param(message, names, param):
    assert error_param(message, **names) == param
