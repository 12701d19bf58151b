"""Request and server lifecycle: a client that goes away aborts its request and frees its row and pages; a request
that fails inside the engine gets an error chunk or a 500 alone; a step that raises fails only the requests in
flight; requests the engine can never admit fail instead of hanging; /health is 503 until the warmup finished; a
warmup that fails stops the server."""

import threading
import time

import httpx
import openai
import pytest

from k3nn.engine import Engine

from serve_helpers import LiveServer, engine_outputs, free_socket


@pytest.fixture(scope="module")
def server(model, tokenizer, chat_template):
    with LiveServer(model, tokenizer, chat_template=chat_template) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


LONG = dict(model="tiny", prompt="for i in range(10):", max_tokens=500, temperature=0,
            extra_body={"ignore_eos": True})


def test_disconnect_mid_stream_aborts_and_frees(server, client):
    before = server.outcomes()
    tokens_before = server.metrics()[("k3nn_generation_tokens_total", ())]
    stream = client.completions.create(stream=True, **LONG)
    got = [next(stream) for _ in range(3)]
    assert all(c.choices[0].text is not None for c in got)
    stream.close()  # the client goes away mid-stream
    assert server.wait_idle(timeout=30) == []
    after = server.outcomes()
    assert after["abort"] == before["abort"] + 1 and after["length"] == before["length"]
    assert server.metrics()[("k3nn_generation_tokens_total", ())] - tokens_before < 500  # it did not run on


def test_disconnect_while_waiting_for_a_non_streamed_answer(server):
    before = server.outcomes()["abort"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", timeout=0.5,
                   json={"prompt": "x", "max_tokens": 500, "temperature": 0, "ignore_eos": True})
    assert server.wait_idle(timeout=30) == []
    assert server.outcomes()["abort"] == before + 1


def test_disconnect_of_one_of_n_choices_aborts_all(server, client):
    stream = client.completions.create(stream=True, n=3, prompt=["a", "b"], **{k: v for k, v in LONG.items()
                                                                               if k != "prompt"})
    next(stream)
    stream.close()
    assert server.wait_idle(timeout=30) == []


class _Poisoned:
    """The test tokenizer, except that decoding three 7s in a row raises: a request whose prompt ends so fails in
    the engine's stop check (its detokenizer sees the prompt's last tokens), the others do not."""

    def __init__(self, tok):
        self.tok, self.vocab_size = tok, tok.vocab_size

    def encode(self, text):
        return self.tok.encode(text)

    def decode(self, ids):
        ids = [int(i) for i in ids]
        if any(ids[i:i + 3] == [7, 7, 7] for i in range(len(ids))):
            raise RuntimeError("poisoned detokenization")
        return self.tok.decode(ids)


def test_a_request_failing_in_the_engine_fails_alone(model, tokenizer):
    good = tokenizer.encode("def add(a, b):")
    ((ref, _),) = engine_outputs(model, tokenizer, [good], max_new_tokens=20, ignore_eos=True)
    with LiveServer(model, _Poisoned(tokenizer), warmup_batch_sizes=(1,)) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
        result = {}

        def healthy():
            r = c.completions.create(model="tiny", prompt=good, max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
            result["ids"] = r.choices[0].model_extra["token_ids"]

        t = threading.Thread(target=healthy)
        t.start()
        with pytest.raises(openai.APIError) as ei:  # streamed: an error chunk
            for _ in c.completions.create(model="tiny", prompt=[5, 7, 7, 7], max_tokens=5, stream=True):
                pass
        assert "failed in the engine" in str(ei.value) and "poisoned" in str(ei.value)
        with pytest.raises(openai.InternalServerError) as ei:  # not streamed: a 500
            c.completions.create(model="tiny", prompt=[5, 7, 7, 7], max_tokens=5)
        assert ei.value.status_code == 500 and "poisoned" in ei.value.message
        t.join(60)
        assert result["ids"] == ref
        assert s.outcomes()["error"] == 2
        assert s.wait_idle() == []


class _Flaky(Engine):
    """An engine whose next step() raises once ``fail_next`` is set."""

    fail_next = False

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("step exploded")
        return super().step()


def test_a_step_that_raises_fails_the_requests_in_flight_and_the_server_goes_on(model, tokenizer):
    with LiveServer(model, tokenizer, engine_cls=_Flaky, warmup_batch_sizes=(1,)) as s:
        s.engine.fail_next = True
        r = httpx.post(s.base_url + "/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 500 and "step exploded" in r.json()["error"]["message"]
        r = httpx.post(s.base_url + "/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert s.wait_idle() == []


def test_a_request_that_can_never_be_admitted_fails_instead_of_hanging(model, tokenizer):
    with LiveServer(model, tokenizer, max_num_seqs=1, warmup_batch_sizes=(1,)) as s:
        # a prefill-only request (P/D export) holds the only row until released
        def hold(e):
            return e.add_request(list(range(10, 30)), max_new_tokens=1, prefill_only=True)

        rid = s.run(s.aengine.call(hold))
        deadline = time.monotonic() + 20
        while s.run(s.aengine.call(lambda e: e.requests[rid].status.value)) != "prefilled":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(s.base_url + "/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 500 and "cannot admit" in r.json()["error"]["message"]

        def release(e):
            e.release(rid)
            del e.requests[rid]

        s.run(s.aengine.call(release))
        assert httpx.post(s.base_url + "/completions", json={"prompt": "hi", "max_tokens": 3},
                          timeout=60).status_code == 200
        assert s.wait_idle() == []


class _Gated(Engine):
    gate = threading.Event()

    def warmup(self, *args, **kwargs):
        assert self.gate.wait(60)
        return super().warmup(*args, **kwargs)


def test_health_is_503_until_the_warmup_finished(model, tokenizer):
    with LiveServer(model, tokenizer, engine_cls=_Gated, warmup_batch_sizes=(1,), wait=False) as s:
        r = httpx.get(s.url + "/health", timeout=60)
        assert r.status_code == 503 and "warming up" in r.json()["error"]["message"]
        r = httpx.post(s.base_url + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(s.url + "/metrics", timeout=60).status_code == 200
        _Gated.gate.set()
        s.wait_ready()
        assert httpx.post(s.base_url + "/completions", json={"prompt": "hi", "max_tokens": 2},
                          timeout=60).status_code == 200


class _Broken(Engine):
    def warmup(self, *args, **kwargs):
        raise RuntimeError("no kernels today")


def test_a_failed_warmup_stops_the_server(model, tokenizer):
    from k3nn.engine import EngineConfig
    from k3nn.serve import AsyncEngine, OpenAIServer, run_server

    engine = _Broken(model, EngineConfig(max_num_seqs=1, num_pages=8))
    server = OpenAIServer(AsyncEngine(engine), tokenizer, served_model_names=["tiny"], max_model_len=256)
    sock = free_socket()
    rc = {}
    t = threading.Thread(target=lambda: rc.setdefault("rc", run_server(server, sock=sock, log_level="critical")))
    t.start()
    t.join(60)
    sock.close()
    assert not t.is_alive() and rc["rc"] == 1
    assert isinstance(server.engine.error, RuntimeError) and not server.engine.running
