"""k3nn serve through the official openai client: completions and chat, streamed and not, n, stop, logprobs, seed,
usage, echo, token prompts, batches, vLLM's extra sampling fields, /v1/models and /metrics. Greedy output over HTTP
equals Engine.generate() and model.generate() on the same prompts."""

import math

import openai
import pytest
import torch

from k3nn.engine import Engine, EngineConfig

from serve_helpers import ENGINE_DEFAULTS, LiveServer, engine_outputs

PROMPTS = ["def add(a, b):", "Hello world", "for i in range(3):"]


@pytest.fixture(scope="module")
def server(model, tokenizer, chat_template):
    with LiveServer(model, tokenizer, chat_template=chat_template) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def extra(obj, name):
    """A field outside OpenAI's schema (vLLM's token_ids, stop_reason, ...)."""
    return (obj.model_extra or {}).get(name)


def test_greedy_completions_equal_engine_and_model_generate(client, model, tokenizer):
    ids = [tokenizer.encode(p) for p in PROMPTS]
    refs = engine_outputs(model, tokenizer, ids, max_new_tokens=10)
    generated = Engine(model, EngineConfig(**ENGINE_DEFAULTS)).generate(ids, max_new_tokens=10)
    for p, pids, (ref_ids, ref_text), gen in zip(PROMPTS, ids, refs, generated):
        r = client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0,
                                      extra_body={"return_token_ids": True})
        ch = r.choices[0]
        direct = model.generate(torch.tensor([pids]), max_new_tokens=10, do_sample=False)[0, len(pids):].tolist()
        assert extra(ch, "token_ids") == ref_ids == gen == direct
        assert extra(ch, "prompt_token_ids") == pids
        assert ch.text == ref_text and ch.index == 0
        assert ch.finish_reason == ("stop" if len(ref_ids) < 10 else "length")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(pids), len(ref_ids))
        assert r.usage.total_tokens == len(pids) + len(ref_ids)
        assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    # the same prompts as one batch request: one choice per prompt, in order
    r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=10, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [extra(c, "token_ids") for c in r.choices] == [x for x, _ in refs]
    assert r.usage.prompt_tokens == sum(map(len, ids))


def test_token_prompts_and_n_per_prompt(client, model, tokenizer):
    prompts = [[5, 6, 7, 8], [40, 41]]
    refs = engine_outputs(model, tokenizer, prompts, max_new_tokens=6)
    r = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=6, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert extra(r.choices[0], "token_ids") == refs[0][0]
    r = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=6, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt p, sample k → p · n + k
    assert [extra(c, "token_ids") for c in r.choices] == [refs[0][0]] * 2 + [refs[1][0]] * 2
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 2 * (len(refs[0][0]) + len(refs[1][0]))


def test_streaming_completion_one_chunk_per_step(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in body) == full.choices[0].text
    # plain decoding: every engine step adds one token, and every step is one chunk
    assert [len(extra(c.choices[0], "token_ids")) for c in body] == [1] * full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + [full.choices[0].finish_reason]
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "text_completion"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # without stream_options: no usage chunk
    plain = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                           stream=True))
    assert all(c.choices for c in plain)


def test_chat_renders_the_template_and_matches_the_engine(client, model, tokenizer, chat_template):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add two numbers"}]
    text = chat_template.render(messages, add_generation_prompt=True)
    assert text == "# system: be brief\n# user: add two numbers\n# assistant:\n"
    ids = tokenizer.encode(text)
    ((ref_ids, ref_text),) = engine_outputs(model, tokenizer, [ids], max_new_tokens=8)
    r = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.message.content == ref_text
    assert extra(ch, "token_ids") == ref_ids and extra(r, "prompt_token_ids") == ids
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref_ids))
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    # max_tokens is the older name of the same limit; text parts are joined
    r2 = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
        messages[0], {"role": "user", "content": [{"type": "text", "text": "add two numbers"}]}])
    assert r2.choices[0].message.content == ref_text
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ch.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref_ids)


def test_chat_without_max_tokens_runs_to_the_context_limit(client, chat_template, tokenizer):
    n = 300  # a long message leaves a few tokens of room under the server's max_model_len (1024)
    while len(tokenizer.encode(chat_template.render([{"role": "user", "content": "a, " * n}]))) < 1016:
        n += 1
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a, " * n}],
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens <= 8
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 1024


def test_n_and_seed(client, model, tokenizer):
    kw = dict(model="tiny", prompt="Hello", max_tokens=8, temperature=1.0, n=2, seed=1234,
              extra_body={"return_token_ids": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    ids_a = [extra(c, "token_ids") for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same text
    assert ids_a == [extra(c, "token_ids") for c in b.choices]
    assert ids_a[0] != ids_a[1]  # the samples of one request differ (seeds seed + i)
    other = client.completions.create(**{**kw, "seed": 99})
    assert [extra(c, "token_ids") for c in other.choices] != ids_a
    assert a.usage.completion_tokens == sum(map(len, ids_a))
    # a seeded sample is the Engine's sample with that seed
    prompt = tokenizer.encode("Hello")
    ((ref, _),) = engine_outputs(model, tokenizer, [prompt], max_new_tokens=8, do_sample=True, temperature=1.0,
                                 seed=1234)
    one = client.completions.create(**{**kw, "n": 1})
    assert extra(one.choices[0], "token_ids") == ref == ids_a[0]
    chat = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                           max_tokens=6, seed=7) for _ in range(2)]
    assert [c.message.content for c in chat[0].choices] == [c.message.content for c in chat[1].choices]
    assert len(chat[0].choices) == 2


def _stop_case(client):
    """A prompt whose greedy text has a printable two-character string first seen past its start."""
    for p in PROMPTS + ["x = 1", "print(", "class A:"]:
        text = client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
        for i in range(1, len(text) - 1):
            s = text[i:i + 2]
            if s.isascii() and s.isprintable() and s.strip() and text.find(s) == i:
                return p, text, s, i
    pytest.fail("no greedy output with a usable stop string")


def test_stop_strings(client):
    p, text, s, i = _stop_case(client)
    r = client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0, stop=[s, "\x07never"])
    ch = r.choices[0]
    assert ch.text == text[:i] and ch.finish_reason == "stop" and extra(ch, "stop_reason") == s
    streamed = list(client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0, stop=s,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[:i]
    assert streamed[-1].choices[0].finish_reason == "stop"
    kept = client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0, stop=s,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:i + 2]


def test_completion_logprobs_are_the_models(client, model, tokenizer):
    ids = tokenizer.encode(PROMPTS[1])
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True})
    ch = r.choices[0]
    out = extra(ch, "token_ids")
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(out)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids + out])).logits[0].double(), -1)
    for j, t in enumerate(out):
        row = logp[len(ids) - 1 + j]
        assert lp.token_logprobs[j] == pytest.approx(row[t].item(), abs=1e-6)
        assert lp.token_logprobs[j] == pytest.approx(row.max().item(), abs=1e-6)  # greedy: the top token
        assert max(lp.top_logprobs[j].values()) == pytest.approx(row.max().item(), abs=1e-6)
        assert 1 <= len(lp.top_logprobs[j]) <= 4
        assert lp.tokens[j] == tokenizer.decode([t])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # streamed: each chunk's logprobs cover its tokens
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                            logprobs=2, stream=True))
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == pytest.approx(lp.token_logprobs)
    assert all(len(c.choices[0].logprobs.tokens) == 1 for c in chunks)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert e.bytes == list(e.token.encode()) and math.isfinite(e.logprob)
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                           temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices[0].logprobs is None


def test_echo(client):
    plain = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, temperature=0)
    r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == "Hello world" + plain.choices[0].text
    streamed = list(client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, temperature=0,
                                              echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    odd = "a\u2028b\x85c\u2029d é"  # Unicode line separators are no SSE line ends
    streamed = list(client.completions.create(model="tiny", prompt=odd, max_tokens=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed).startswith(odd)


def test_vllm_sampling_extras_reach_the_engine(client, model, tokenizer):
    ids = tokenizer.encode(PROMPTS[2])
    kw = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3, min_tokens=4)
    ((ref, _),) = engine_outputs(model, tokenizer, [ids], max_new_tokens=8, **kw)
    r = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                  presence_penalty=0.5, frequency_penalty=0.3,
                                  extra_body={"repetition_penalty": 1.3, "min_tokens": 4, "return_token_ids": True})
    assert extra(r.choices[0], "token_ids") == ref
    ((ref_k, _),) = engine_outputs(model, tokenizer, [ids], max_new_tokens=6, do_sample=True, top_k=3,
                                   top_p=0.9, min_p=0.2, seed=5, ignore_eos=True)
    r = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=6, temperature=1.0, top_p=0.9, seed=5,
                                  extra_body={"top_k": 3, "min_p": 0.2, "ignore_eos": True,
                                              "return_token_ids": True})
    assert extra(r.choices[0], "token_ids") == ref_k


def test_models_and_aliases(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert all(m.owned_by == "k3nn" and m.object == "model" for m in models.data)
    r = client.completions.create(model="tiny-alias", prompt="Hi", max_tokens=2)
    assert r.model == "tiny-alias"


def test_health_and_metrics(server, client):
    import httpx

    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    for _ in range(2):  # the second request hits the prefix cache
        client.completions.create(model="tiny", prompt="import os\nprint(os.getcwd())\n" * 6, max_tokens=2,
                                  temperature=0)
    m = server.metrics()
    assert m[("k3nn_requests_total", (("outcome", "length"),))] >= 2
    assert m[("k3nn_time_to_first_token_seconds_count", ())] >= 2
    assert m[("k3nn_e2e_request_latency_seconds_count", ())] >= 2
    assert m[("k3nn_generation_tokens_total", ())] >= 4 and m[("k3nn_prompt_tokens_total", ())] > 100
    assert m[("k3nn_num_requests_running", ())] == 0 and m[("k3nn_num_requests_waiting", ())] == 0
    assert m[("k3nn_prefix_cache_hit_rate", ())] > 0
    assert m[("k3nn_warmup_seconds", ())] > 0 and m[("k3nn_engine_steps_total", ())] > 0
    assert ("k3nn_num_preemptions_total", ()) in m
    assert server.wait_idle() == []
