"""``k3nn bench serve``'s load client against a live CPU server, the same workload in-process, arrivals, and the
result file."""

import asyncio
import json
import math

import pytest

from k3nn.engine import Engine, EngineConfig

from serve_helpers import ENGINE_DEFAULTS, VOCAB, LiveServer


@pytest.fixture(scope="module")
def server(model, tokenizer):
    with LiveServer(model, tokenizer) as s:
        yield s


def test_workload_and_arrivals():
    from bench.serve import arrival_offsets, make_workload

    wl = make_workload(50, 20, 10, range_ratio=0.5, vocab_size=VOCAB, seed=1)
    assert all(10 <= len(w.prompt) <= 30 and 5 <= w.output_len <= 15 for w in wl)
    assert all(0 <= t < VOCAB for w in wl for t in w.prompt)
    assert {len(w.prompt) for w in wl} != {20}  # random lengths
    fixed = make_workload(5, 7, 3, vocab_size=VOCAB)
    assert [(len(w.prompt), w.output_len) for w in fixed] == [(7, 3)] * 5
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    t = arrival_offsets(4000, 20.0, seed=3)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.1)  # Poisson: mean gap 1/rate
    var = sum((g - 0.05) ** 2 for g in gaps) / len(gaps)
    assert var == pytest.approx(0.05 ** 2, rel=0.2)  # exponential gaps: variance = mean²
    regular = arrival_offsets(4000, 20.0, burstiness=50.0, seed=3)
    rgaps = [b - a for a, b in zip(regular, regular[1:])]
    assert sum((g - 0.05) ** 2 for g in rgaps) / len(rgaps) < var / 10
    with pytest.raises(ValueError):
        make_workload(0, 5, 5)


def test_load_client_and_in_process_run(server, model, tokenizer):
    from bench.serve import make_workload, run_in_process, run_load, summarize

    wl = make_workload(8, 12, 5, range_ratio=0.5, vocab_size=VOCAB, seed=0)
    results, duration = asyncio.run(run_load(server.url, wl, max_concurrency=4, request_rate=40.0))
    ref = Engine(model, EngineConfig(**ENGINE_DEFAULTS)).generate([w.prompt for w in wl], max_new_tokens=15,
                                                                  ignore_eos=True)
    for w, r, g in zip(wl, results, ref):
        assert r.ok and r.error is None
        assert r.output_tokens == w.output_len and r.token_ids == g[:w.output_len]
        assert r.prompt_len == len(w.prompt) and 0 < r.ttft <= r.latency
        assert len(r.itl) == w.output_len - 1  # plain decoding: one chunk per token
    s = summarize(results, duration)
    assert s["completed"] == 8 and s["failed"] == 0 and s["output_tokens"] == sum(w.output_len for w in wl)
    assert s["output_tok_s"] > 0 and s["request_throughput"] > 0
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(s[k]) == {"mean", "p50", "p99"} and s[k]["p99"] >= s[k]["p50"] > 0
    engine = Engine(model, EngineConfig(**ENGINE_DEFAULTS), tokenizer=tokenizer)
    local, dur = run_in_process(engine, wl, max_concurrency=4)
    assert [r.output_tokens for r in local] == [w.output_len for w in wl] and all(r.ok for r in local)
    assert summarize(local, dur)["completed"] == 8
    bad, _ = asyncio.run(run_load(server.url, wl[:1], model="nope"))
    assert not bad[0].ok and "HTTP 400" in bad[0].error
    assert summarize(bad, 1.0)["failed"] == 1


def test_the_suite_writes_a_result_file(server, tmp_path, monkeypatch, capsys):
    from k3nn import cli

    monkeypatch.setenv("K3NN_RESULTS_DIR", str(tmp_path))
    rc = cli.main(["bench", "serve", "--allow-cpu", "--base-url", server.url, "--num-prompts", "6",
                   "--input-len", "8", "--output-len", "3", "--max-concurrency", "1", "3",
                   "--vocab-size", str(VOCAB)])
    assert rc == 0
    (path,) = tmp_path.glob("serve-*.json")
    data = json.loads(path.read_text())
    assert [r["concurrency"] for r in data["rows"]] == [1, 3]
    for row in data["rows"]:
        assert row["case"].startswith("server_c") and row["k3nn_ms"] > 0
        assert row["http"]["completed"] == 6 and row["http"]["output_tokens"] == 18
    assert data["meta"]["num_prompts"] == 6 and "TTFT" in capsys.readouterr().out
