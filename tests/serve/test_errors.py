"""Bad input gets OpenAI's error JSON — HTTP 400 naming the parameter, 401 for a wrong API key — and nothing is
queued for it; a checkpoint without a chat template says so."""

import httpx
import openai
import pytest

from serve_helpers import LiveServer


@pytest.fixture(scope="module")
def server(model, tokenizer, chat_template):
    # max_model_len above what 8 pages hold: the Engine's own capacity check (add_request) is reached too
    with LiveServer(model, tokenizer, chat_template=chat_template, max_model_len=2048, num_pages=8) as s:
        yield s


def post(server, path, body, **kw):
    kw.setdefault("timeout", 60)
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, **kw)
    return httpx.post(server.url + path, json=body, **kw)


def error(r, status=400):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    return e


OK = {"prompt": "Hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_COMPLETIONS = [  # (body changes, param the error must name, text the message must contain)
    ({"model": "gpt-4"}, "model", "does not exist"),
    ({"prompt": [7] * 3000}, "prompt", "maximum context length"),
    ({"prompt": [7] * 2040, "max_tokens": 20}, "max_tokens", "maximum context length"),
    ({"max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": 2.5}, "max_tokens", "integer"),
    ({"n": 17}, "n", "less than or equal to 16"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"temperature": -0.5}, "temperature", "greater than or equal to 0"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"seed": "abc"}, "seed", "integer"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"stop": [1, 2]}, "stop", "string"),
    ({"stop": ""}, "stop", "empty"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [1, "a"]}, "prompt", "mixed"),
    ({"prompt": [[1, 2], []]}, "prompt[1]", "empty"),
    ({"prompt": [1, 320]}, "prompt", "vocabulary"),
    ({"prompt": [1, -2]}, "prompt", "vocabulary"),
    ({"prompt": [1, True]}, "prompt", "mixed"),
    ({"prompt": None}, "prompt", "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt", "dict"),
    ({"foo": 1}, "foo", "not supported"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"logit_bias": {"5": 10}}, "logit_bias", "not supported"),
    ({"best_of": 3}, "best_of", "best_of"),
    ({"echo": True, "logprobs": 1}, "echo", "prompt's log-probabilities"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x", "not supported"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "max_tokens"),
    ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
    ({"top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"stop_token_ids": [400]}, None, "stop_token_ids"),
    ({"num_speculative_tokens": 2}, "num_speculative_tokens", "drafter"),
    ({"prompt": [[1, 2], [7] * 600], "max_tokens": 8}, "max_tokens", "latent pages"),  # the Engine's check
]


@pytest.mark.parametrize("change,param,text", BAD_COMPLETIONS, ids=lambda x: str(x)[:40])
def test_bad_completion_requests(server, change, param, text):
    e = error(post(server, "/v1/completions", {**OK, **change}))
    assert e["type"] == "invalid_request_error"
    if param is not None:
        assert e["param"] == param, e
    assert text in e["message"], e


BAD_CHATS = [
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": "hi"}, "messages", "non-empty"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "one of"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "text parts"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     "not supported"),
    ({"tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs", "less than or equal to 20"),
    ({"max_completion_tokens": 5000}, "max_completion_tokens", "maximum context length"),
    ({"max_tokens": -3}, "max_tokens", "greater than or equal to 1"),
    ({"n": 40}, "n", "less than or equal to 16"),
    ({"model": "nope"}, "model", "does not exist"),
    ({"chat_template_kwargs": {"messages": []}}, "messages", "chat_template_kwargs"),
]


@pytest.mark.parametrize("change,param,text", BAD_CHATS, ids=lambda x: str(x)[:40])
def test_bad_chat_requests(server, change, param, text):
    e = error(post(server, "/v1/chat/completions", {**CHAT, **change}))
    assert e["param"] == param, e
    assert text in e["message"], e


@pytest.mark.parametrize("body", [b"{bad", b"[1, 2]", b"", b'{"prompt": NaN}', "{\"prompt\": \"\xe9\"".encode()])
def test_malformed_json(server, body):
    e = error(post(server, "/v1/completions", body))
    assert e["code"] == "invalid_json" and "JSON" in e["message"]


def test_the_openai_client_raises_bad_request(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    assert ei.value.status_code == 400 and ei.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "hi"}])
    assert ei.value.param == "model" and ei.value.code == "model_not_found"


def test_unknown_route_and_method(server):
    e = error(httpx.get(server.url + "/v1/nothing", timeout=60), 404)
    assert e["type"] == "not_found_error"
    error(httpx.get(server.url + "/v1/completions", timeout=60), 405)


def test_nothing_is_queued_for_bad_input(server):
    """After every rejected request (including a batch whose second prompt the Engine refused after the first was
    added), the engine holds nothing, and the rejections were counted."""
    before = server.outcomes()["rejected"]
    for change, _, _ in BAD_COMPLETIONS[:5] + BAD_COMPLETIONS[-3:]:
        post(server, "/v1/completions", {**OK, **change})
    assert server.outcomes()["rejected"] == before + 8
    assert server.wait_idle() == []
    stats = server.run(server.aengine.call(lambda e: (len(e.requests), len(e.waiting), len(e.running))))
    assert stats == (0, 0, 0)
    r = post(server, "/v1/completions", OK)  # and it still serves
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_chat_without_a_template_is_a_400_that_says_so(model, tokenizer):
    with LiveServer(model, tokenizer, chat_template=None, warmup_batch_sizes=(1,)) as s:
        e = error(post(s, "/v1/chat/completions", CHAT))
        assert e["param"] == "messages" and e["code"] == "chat_template_missing"
        assert "no chat template" in e["message"]
        assert post(s, "/v1/completions", OK).status_code == 200


def test_api_key(model, tokenizer, chat_template):
    with LiveServer(model, tokenizer, chat_template=chat_template, api_key="s3cret", warmup_batch_sizes=(1,)) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            for path, body in (("/v1/completions", OK), ("/v1/chat/completions", CHAT)):
                e = error(httpx.post(s.url + path, json=body, headers=headers, timeout=60), 401)
                assert e["code"] == "invalid_api_key"
            error(httpx.get(s.url + "/v1/models", headers=headers, timeout=60), 401)
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.post(s.url + "/v1/completions", json=OK, headers=good, timeout=60).status_code == 200
        assert httpx.get(s.url + "/v1/models", headers=good, timeout=60).status_code == 200
        assert httpx.get(s.url + "/health", timeout=60).status_code == 200  # health and metrics stay open
        assert httpx.get(s.url + "/metrics", timeout=60).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base_url, api_key="nope", max_retries=0).completions.create(
                model="tiny", prompt="hi", max_tokens=1)
        r = openai.OpenAI(base_url=s.base_url, api_key="s3cret", max_retries=0).completions.create(
            model="tiny", prompt="hi", max_tokens=1)
        assert r.usage.completion_tokens == 1
        assert s.wait_idle() == []
