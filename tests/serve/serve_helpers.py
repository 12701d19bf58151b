"""What the serve tests share: a tiny checkpoint (KimiK3Config.tiny, a byte-level BPE trained on a few lines, the
demo's chat template), a live server on 127.0.0.1 in a background thread, and uncached references."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import torch

from k3nn import KimiK3, KimiK3Config
from k3nn.engine import Engine, EngineConfig

VOCAB = 320
CFG = KimiK3Config.tiny(vocab_size=VOCAB, eos_token_id=0)  # id 0 is <|endoftext|>
TEXTS = ["def add(a, b):\n    return a + b\n", "Hello world, this is a tiny corpus for a tiny tokenizer.\n",
         "import os\nprint(os.getcwd())\n", "for i in range(10):\n    print(i * i)\n",
         "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"] * 4
ENGINE_DEFAULTS = dict(max_num_seqs=4, num_pages=96, num_snapshots=8, max_num_batched_tokens=2048)


def write_checkpoint(path) -> None:
    """config.json + safetensors (fp32), tokenizer.json, tokenizer_config.json with the demo's chat template."""
    from k3nn.demo import train_tokenizer, write_chat_template

    KimiK3(CFG, dtype=torch.float32, seed=0).save_pretrained(path)
    train_tokenizer(TEXTS, VOCAB, path / "tokenizer.json")
    write_chat_template(path)


def engine_outputs(model, tok, prompts, **sampling) -> list[tuple[list[int], str]]:
    """(token ids, text) per prompt from a fresh in-process Engine (add_request + stream)."""
    e = Engine(model, EngineConfig(**ENGINE_DEFAULTS), tokenizer=tok)
    ids = [e.add_request(p, **sampling) for p in prompts]
    final = {}
    for out in e.stream():
        if out.finished:
            final[out.request_id] = (out.output_token_ids, out.text)
    return [final[i] for i in ids]


def free_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


class LiveServer:
    """``k3nn serve``'s app over ``model`` on a free port of 127.0.0.1, uvicorn in a background thread; a context
    manager (stops the server and the engine thread on exit)."""

    def __init__(self, model, tokenizer, *, chat_template=None, api_key=None, max_model_len=1024, engine_cls=Engine,
                 warmup_batch_sizes=(1, 4), wait=True, drafter=None, **engine_kw):
        from k3nn.serve import AsyncEngine, OpenAIServer

        self.engine = engine_cls(model, EngineConfig(**{**ENGINE_DEFAULTS, **engine_kw}), tokenizer=tokenizer,
                                 drafter=drafter)
        self.aengine = AsyncEngine(self.engine, warmup_kwargs=dict(prompt_len=16,
                                                                   batch_sizes=list(warmup_batch_sizes)))
        self.server = OpenAIServer(self.aengine, tokenizer, served_model_names=["tiny", "tiny-alias"],
                                   max_model_len=max_model_len, chat_template=chat_template, api_key=api_key,
                                   root="/ckpt")
        self.wait = wait

    def __enter__(self) -> "LiveServer":
        import uvicorn

        self.sock = free_socket()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.base_url = self.url + "/v1"
        cfg = uvicorn.Config(self.server.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.uvicorn = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs=dict(sockets=[self.sock]), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uvicorn.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        if self.wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(self.url + "/health", timeout=60).status_code != 200:
            assert time.monotonic() < deadline, "the engine did not become ready"
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not stop"
        assert not self.aengine.running, "the engine thread did not stop"

    def run(self, coro, timeout: float = 30.0):
        """Run a coroutine on the server's event loop (e.g. ``self.aengine.leaks()``)."""
        return asyncio.run_coroutine_threadsafe(coro, self.aengine.loop).result(timeout)

    def wait_idle(self, timeout: float = 20.0) -> list[str]:
        """Wait until nothing leaks (every request ended and was cleaned up); returns the last leak report."""
        deadline = time.monotonic() + timeout
        while True:
            leaks = self.run(self.aengine.leaks())
            if not leaks or time.monotonic() > deadline:
                return leaks
            time.sleep(0.05)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """/metrics as {(sample name, sorted labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=60).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def outcomes(self) -> dict[str, float]:
        m = self.metrics()
        return {dict(k[1])["outcome"]: v for k, v in m.items() if k[0] == "k3nn_requests_total"}
