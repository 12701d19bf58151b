"""Serving with a DSpark drafter: greedy output over HTTP equals plain greedy decoding whatever the drafts, a
verify window's tokens arrive as one SSE chunk, requests may turn speculation off, and /metrics reports acceptance."""

import openai
import pytest
import torch

from k3nn.layers.dspark import DSparkConfig, DSparkDrafter
from k3nn.spec import SpecOptions

from serve_helpers import LiveServer, engine_outputs

GAMMA = 3


@pytest.fixture(scope="module")
def drafter(model):
    cfg = DSparkConfig.for_target(model.config, num_layers=1, num_heads=2, block_size=GAMMA)
    return DSparkDrafter(cfg, model, dtype=torch.float64).eval()


def _token_counts(client, prompt, n):
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    return [len(c.choices[0].model_extra["token_ids"]) for c in chunks]


def test_greedy_speculative_serving_equals_plain_greedy(model, tokenizer, drafter):
    prompts = [tokenizer.encode(p) for p in ("def add(a, b):", "Hello world")]
    refs = engine_outputs(model, tokenizer, prompts, max_new_tokens=10, ignore_eos=True)
    with LiveServer(model, tokenizer, drafter=drafter, warmup_batch_sizes=(1,)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
        r = client.completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert [c.model_extra["token_ids"] for c in r.choices] == [ids for ids, _ in refs]
        assert [c.text for c in r.choices] == [text for _, text in refs]
        assert sum(_token_counts(client, prompts[0], 10)) == 10
        plain = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=6, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True, "num_speculative_tokens": 0})
        assert sum(1 for _ in plain) == 6  # speculation off for this request: one token per step
        m = s.metrics()
        assert m[("k3nn_spec_decode_num_draft_tokens_total", ())] > 0
        assert 1.0 <= m[("k3nn_spec_decode_acceptance_length", ())] <= GAMMA + 1
        assert s.wait_idle() == []


def test_a_verify_window_is_one_chunk(model, tokenizer, drafter):
    # synthetic acceptance: every window keeps the same number of tokens (the machinery, not the output)
    with LiveServer(model, tokenizer, drafter=drafter, warmup_batch_sizes=(1,),
                    spec=SpecOptions(synthetic_acceptance_length=3)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
        counts = _token_counts(client, tokenizer.encode("Hello world"), 12)
        assert sum(counts) == 12 and counts[0] == 1  # the prefill's token, then one chunk per verify window
        window = counts[1]
        assert window > 1 and counts[1:-1] == [window] * (len(counts) - 2) and 1 <= counts[-1] <= window
        assert s.wait_idle() == []
