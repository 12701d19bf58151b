"""serve: load on ``k3nn serve`` over HTTP, as ``vllm bench serve`` puts it on a vLLM server, next to the same
workload run in-process through the Engine.

Workload: ``--num-prompts`` requests of random token ids to ``/v1/completions`` (streamed, greedy, ``ignore_eos`` so
every request produces exactly its output length), ``--input-len`` / ``--output-len`` tokens each, or lengths drawn
uniformly from ``[len·(1−r), len·(1+r)]`` with ``--range-ratio r``. Arrivals: all at once (``--request-rate inf``),
or a Poisson process of ``--request-rate`` requests/s (gamma-distributed gaps with ``--burstiness`` ≠ 1), at most
``--max-concurrency`` in flight (one run per value given).

Per run: TTFT, TPOT ((latency − TTFT) / (tokens − 1)), ITL (gaps between streamed chunks; a speculative verify
window arrives as one chunk) and end-to-end latency — mean, p50, p99 in ms — request throughput (req/s) and output
throughput (tok/s). ``--in-process`` runs the same workload (same arrivals and concurrency cap) through an
``Engine`` in this process, so the HTTP overhead is a ratio: the row's ``speedup`` is HTTP output tok/s / in-process
output tok/s (goal ≥ 0.95 at concurrency 16).

Where the server comes from:

* ``--base-url http://127.0.0.1:8000``: a server already running (any machine: no GPU needed here);
* ``--launch demo``: ``k3nn serve`` on the demo checkpoint (``--model-path``, default ``~/.cache/k3nn/demo/model``:
  ``k3nn demo`` writes it) in a child process on a free port, stopped with SIGTERM afterwards;
* ``--launch tiny|small|k3_slice``: the seeded random-weight model of :mod:`bench.models` served by a child
  process (``--serve-preset``, byte-level tokenizer).

Results go to ``bench/results/serve-<date>.json``: one row per (model, concurrency) with ``k3nn_ms`` = milliseconds
per output token at the HTTP throughput, ``anchor_ms`` the same for the in-process Engine, and both summaries.

    k3nn bench serve --launch demo --model-path runs/demo/model --in-process --max-concurrency 1 16
    k3nn bench serve --launch k3_slice --in-process --max-concurrency 16 --input-len 1024 --output-len 128
    python -m bench.serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8   (client only)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RequestSpec", "RequestResult", "make_workload", "arrival_offsets", "run_load", "run_in_process",
           "summarize", "launch_server", "main"]

SUITE = "serve"


@dataclass
class RequestSpec:
    prompt: list[int]
    output_len: int


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0  # since the run started
    error: str | None = None
    token_ids: list[int] | None = None


def make_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                  vocab_size: int = 256, seed: int = 0) -> list[RequestSpec]:
    """Random-token prompts (ids in [0, vocab_size)) with fixed lengths, or lengths uniform in
    [len·(1 − range_ratio), len·(1 + range_ratio)] (each at least 1)."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be >= 1")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def length(n: int) -> int:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.randint(lo, hi)

    return [RequestSpec([rng.randrange(vocab_size) for _ in range(length(input_len))], length(output_len))
            for _ in range(num_prompts)]


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Start offsets (s) of ``n`` requests: all 0 for an infinite rate, else cumulative gamma-distributed gaps with
    mean 1/rate and shape ``burstiness`` (1: a Poisson process; < 1 burstier, > 1 more regular)."""
    if math.isinf(request_rate):
        return [0.0] * n
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError("request_rate and burstiness must be > 0")
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
    return out


async def _sse_lines(resp):
    """The lines of a Server-Sent Events body, split at LF only (a server may send raw UTF-8, whose line separators
    such as U+2028 are no SSE line ends)."""
    buf = b""
    async for part in resp.aiter_bytes():
        buf += part
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if buf:
        yield buf


async def _one(client, url: str, payload: dict, spec: RequestSpec, t_run: float, headers: dict) -> RequestResult:
    res = RequestResult(False, len(spec.prompt), start=time.perf_counter() - t_run)
    t0 = time.perf_counter()
    last = None
    ids: list[int] = []
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in _sse_lines(resp):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip().decode()
                if data == "[DONE]":
                    res.ok = res.error is None
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", str(chunk["error"]))
                    continue
                now = time.perf_counter()
                for ch in chunk.get("choices") or ():
                    if ch.get("text") or ch.get("token_ids"):
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        ids += ch.get("token_ids") or []
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - t0
    res.token_ids = ids
    if res.ok and res.output_tokens == 0:
        res.output_tokens = len(ids)
    return res


async def run_load(base_url: str, workload: list[RequestSpec], *, model: str | None = None,
                   request_rate: float = math.inf, burstiness: float = 1.0, max_concurrency: int | None = None,
                   api_key: str | None = None, seed: int = 0, timeout: float = 3600.0
                   ) -> tuple[list[RequestResult], float]:
    """Send ``workload`` to ``base_url``'s ``/v1/completions`` (streamed, greedy, eos ignored, token ids returned);
    returns the per-request results (in workload order) and the run's wall seconds."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    offsets = arrival_offsets(len(workload), request_rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(workload), max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t_run = time.perf_counter()

        async def go(i: int, spec: RequestSpec) -> RequestResult:
            delay = offsets[i] - (time.perf_counter() - t_run)
            if delay > 0:
                await asyncio.sleep(delay)
            payload = {"prompt": spec.prompt, "max_tokens": spec.output_len, "temperature": 0.0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
            if model is not None:
                payload["model"] = model
            if sem is None:
                return await _one(client, url, payload, spec, t_run, headers)
            async with sem:
                return await _one(client, url, payload, spec, t_run, headers)

        results = await asyncio.gather(*(go(i, s) for i, s in enumerate(workload)))
        return list(results), time.perf_counter() - t_run


def run_in_process(engine, workload: list[RequestSpec], *, request_rate: float = math.inf, burstiness: float = 1.0,
                   max_concurrency: int | None = None, seed: int = 0) -> tuple[list[RequestResult], float]:
    """The same workload through ``engine`` (``add_request`` at each arrival while fewer than ``max_concurrency``
    are in flight, then ``step()``), timed as the HTTP client times it: TTFT from the add to the first step output
    with tokens, ITL between outputs. Returns (results, wall seconds)."""
    import torch

    from k3nn.engine import SamplingParams

    dev = engine.pools.device
    offsets = arrival_offsets(len(workload), request_rate, burstiness, seed)
    results = [RequestResult(False, len(s.prompt)) for s in workload]
    t_add: dict[str, float] = {}
    last: dict[str, float] = {}
    index: dict[str, int] = {}
    nxt = 0
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t_run = time.perf_counter()
    while nxt < len(workload) or engine.has_unfinished():
        now = time.perf_counter() - t_run
        while nxt < len(workload) and offsets[nxt] <= now and (not max_concurrency or len(t_add) < max_concurrency):
            spec = workload[nxt]
            rid = engine.add_request(spec.prompt, SamplingParams(max_new_tokens=spec.output_len, ignore_eos=True))
            t_add[rid], index[rid] = time.perf_counter(), nxt
            results[nxt].start = t_add[rid] - t_run
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, offsets[nxt] - (time.perf_counter() - t_run)))
            continue
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            i = index.get(out.request_id)
            if i is None:
                continue
            r = results[i]
            if out.new_token_ids:
                if out.request_id not in last:
                    r.ttft = now - t_add[out.request_id]
                else:
                    r.itl.append(now - last[out.request_id])
                last[out.request_id] = now
                r.output_tokens += len(out.new_token_ids)
            if out.finished:
                r.ok = out.finish_reason in ("stop", "length")
                r.error = out.error
                r.latency = now - t_add.pop(out.request_id)
    return results, time.perf_counter() - t_run


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    s = sorted(xs)

    def pct(q):  # linear interpolation (numpy's default)
        k = (len(s) - 1) * q
        f = math.floor(k)
        return s[f] + (s[min(f + 1, len(s) - 1)] - s[f]) * (k - f)

    return {"mean": round(sum(s) / len(s) * 1e3, 3), "p50": round(pct(0.5) * 1e3, 3), "p99": round(pct(0.99) * 1e3, 3)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """vllm-bench-serve-style metrics of one run (times in ms)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(duration, 3),
            "input_tokens": sum(r.prompt_len for r in ok), "output_tokens": out_tokens,
            "request_throughput": round(len(ok) / duration, 3) if duration > 0 else 0.0,
            "output_tok_s": round(out_tokens / duration, 2) if duration > 0 else 0.0,
            "total_tok_s": round((out_tokens + sum(r.prompt_len for r in ok)) / duration, 2) if duration > 0
            else 0.0,
            "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
            "itl_ms": _stats([x for r in ok for x in r.itl]), "e2el_ms": _stats([r.latency for r in ok]),
            "errors": sorted({r.error for r in results if r.error})[:5]}


def _print(label: str, s: dict) -> None:
    print(f"{label}: {s['completed']} ok / {s['failed']} failed in {s['duration_s']:.2f} s | "
          f"{s['request_throughput']:.2f} req/s | {s['output_tok_s']:.1f} output tok/s | "
          + " | ".join(f"{k.removesuffix('_ms').upper()} mean {s[k]['mean']:.2f} p50 {s[k]['p50']:.2f} "
                       f"p99 {s[k]['p99']:.2f} ms" for k in ("ttft_ms", "tpot_ms", "itl_ms")), flush=True)
    for e in s["errors"]:
        print(f"  error: {e}", flush=True)


# -- the server ------------------------------------------------------------------------------------------------------
def _pages(max_seqs: int, input_len: int, output_len: int, range_ratio: float) -> int:
    longest = int((input_len + output_len) * (1 + range_ratio)) + 1
    return max_seqs * -(-longest // 64) * 2 + 16


class _Child:
    """A server child process whose stderr is echoed and searched for the URL it serves at."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        print("launching:", " ".join(cmd), flush=True)
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        self.url: str | None = None
        self._found = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            sys.stderr.write("  [server] " + line)
            m = re.search(r"at (http://[\w.:\[\]-]+):(\d+)/v1", line)
            if m and self.url is None:
                self.url = f"{m.group(1)}:{m.group(2)}"
                self._found.set()
        self._found.set()

    def wait_ready(self, timeout: float) -> str:
        import httpx

        t0 = time.monotonic()
        if not self._found.wait(timeout) or self.url is None:
            raise RuntimeError(f"the server did not start (exit status {self.proc.poll()})")
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready (GET /health) within {timeout:.0f} s")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode


def launch_server(kind: str, *, model_path: str | None, max_num_seqs: int, num_pages: int, device: str | None,
                  dtype: str | None, drafter_path: str | None = None, threads: int | None = None) -> _Child:
    """Start ``k3nn serve`` on the demo checkpoint (``kind="demo"``, with its drafter when ``drafter_path`` is given)
    or a random-weight preset in a child process on a free port of 127.0.0.1."""
    common = ["--port", "0", "--max-num-seqs", str(max_num_seqs), "--num-pages", str(num_pages), "--no-access-log"]
    common += (["--device", device] if device else []) + (["--dtype", dtype] if dtype else [])
    common += ["--threads", str(threads)] if threads else []
    env = dict(os.environ)
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root)] + ([env["PYTHONPATH"]] if env.get(
        "PYTHONPATH") else []))
    if kind == "demo":
        drafter = ["--drafter", str(drafter_path)] if drafter_path else []
        return _Child([sys.executable, "-m", "k3nn", "serve", "--model", str(model_path), "--offline",
                       "--served-model-name", "demo"] + drafter + common, env)
    return _Child([sys.executable, "-m", "bench.serve", "--serve-preset", kind] + common, env)


def _serve_preset(argv: list[str]) -> int:
    """The child process of ``--launch PRESET``: a seeded random-weight model served by k3nn serve."""
    ap = argparse.ArgumentParser(prog="python -m bench.serve --serve-preset")
    ap.add_argument("--serve-preset", required=True, choices=["tiny", "small", "k3_slice"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=512)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--no-access-log", action="store_true")
    ap.add_argument("--threads", default="auto")
    a = ap.parse_args(argv)
    import logging

    import torch

    from k3nn.engine import Engine, EngineConfig
    from k3nn.serve import AsyncEngine, OpenAIServer, run_server
    from k3nn.serve.cli import _bind
    from k3nn.tokenizer import ByteTokenizer

    from bench.models import bench_model

    from k3nn.utils import configure_threads

    configure_threads(a.threads)
    logging.basicConfig(level=logging.WARNING, format="[%(name)s] %(message)s")
    logging.getLogger("k3nn.serve").setLevel(logging.INFO)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sock = _bind("127.0.0.1", a.port)
    cfg, model = bench_model(a.serve_preset, device, a.dtype)
    tok = ByteTokenizer(cfg.vocab_size)
    engine = Engine(model, EngineConfig(max_num_seqs=a.max_num_seqs, num_pages=a.num_pages), tokenizer=tok)
    max_len = min(cfg.max_position_embeddings, a.num_pages * engine.pools.block_size)
    server = OpenAIServer(AsyncEngine(engine), tok, served_model_names=[a.serve_preset], max_model_len=max_len)
    host, port = sock.getsockname()[:2]
    logging.getLogger("k3nn.serve").info("serving %s at http://%s:%d/v1", a.serve_preset, host, port)
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn handles them, then re-raises them here: exit 0
        signal.signal(sig, lambda *_: None)
    return run_server(server, sock=sock, access_log=not a.no_access_log, log_level="warning")


def _in_process_engine(kind: str, model_path: str | None, max_num_seqs: int, num_pages: int, device: str | None,
                       dtype: str | None, drafter_path: str | None = None):
    import torch

    from k3nn import KimiK3
    from k3nn.engine import Engine, EngineConfig
    from k3nn.tokenizer import ByteTokenizer, load_tokenizer

    from bench.models import bench_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    drafter = None
    if kind == "demo":
        dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        model = KimiK3.from_pretrained(model_path, dtype=dt, device=device).eval()
        tok = load_tokenizer(model_path, model.config.vocab_size)
        if drafter_path:
            from k3nn.layers.dspark import DSparkDrafter

            drafter = DSparkDrafter.from_pretrained(drafter_path, target=model, device=device, dtype=dt).eval()
    else:
        cfg, model = bench_model(kind, device, dtype)
        tok = ByteTokenizer(cfg.vocab_size)
    engine = Engine(model, EngineConfig(max_num_seqs=max_num_seqs, num_pages=num_pages), drafter=drafter,
                    tokenizer=tok)
    w = engine.warmup()
    print(f"in-process engine warmed up in {w:.1f} s", flush=True)
    return engine


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--serve-preset" in argv:
        sys.exit(_serve_preset(argv))
    ap = argparse.ArgumentParser(prog="k3nn bench serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--base-url", help="a running server (client only), e.g. http://127.0.0.1:8000")
    src.add_argument("--launch", choices=["demo", "tiny", "small", "k3_slice"],
                     help="start k3nn serve in a child process on this model, then measure")
    ap.add_argument("--model-path", default=None, help="--launch demo: the checkpoint (default: k3nn demo's)")
    ap.add_argument("--drafter-path", default=None,
                    help="--launch demo: serve (and run in-process) with this DSpark drafter (e.g. k3nn demo's)")
    ap.add_argument("--model", default=None, help="the model name sent with each request (default: the server's)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0, help="random lengths in [len(1-r), len(1+r)]")
    ap.add_argument("--vocab-size", type=int, default=None, help="prompt ids are drawn below this (default: the "
                    "launched model's vocabulary, else 256)")
    ap.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    ap.add_argument("--max-concurrency", type=int, nargs="+", default=[16],
                    help="requests in flight at most; one run per value (default 16)")
    ap.add_argument("--in-process", action="store_true",
                    help="with --launch: also run the workload through an Engine in this process (the ratio)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu by default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", default="auto",
                    help="torch CPU threads of the launched server and of the in-process run (the same number for "
                         "both; default auto: resolved once here)")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the launched server")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    if a.in_process and not a.launch:
        ap.error("--in-process needs --launch (the in-process run loads the same model here)")
    if a.drafter_path and a.launch != "demo":
        ap.error("--drafter-path goes with --launch demo")
    if a.launch == "demo" and a.model_path is None:
        from k3nn.demo import default_out_dir

        a.model_path = str(default_out_dir() / "model")
    if a.launch == "demo" and not (Path(a.model_path) / "config.json").is_file():
        ap.error(f"--launch demo: no checkpoint at {a.model_path}; run 'k3nn demo' (or pass --model-path DIR)")
    if any(c < 1 for c in a.max_concurrency) or a.num_prompts < 1:
        ap.error("--max-concurrency and --num-prompts must be >= 1")
    vocab = a.vocab_size
    if vocab is None and a.launch:
        if a.launch == "demo":
            vocab = json.loads((Path(a.model_path) / "config.json").read_text())["vocab_size"]
        else:
            from k3nn.config import KimiK3Config

            vocab = getattr(KimiK3Config, a.launch)().vocab_size
    workload = make_workload(a.num_prompts, a.input_len, a.output_len, a.range_ratio, vocab or 256, a.seed)
    from k3nn.utils import configure_threads

    threads = configure_threads(a.threads)  # this process's (the in-process run) and the launched server's
    max_seqs = max(a.max_concurrency)
    pages = _pages(max_seqs, a.input_len, a.output_len, a.range_ratio)
    label = a.launch or a.base_url
    runs: dict[int, dict] = {}
    child = None
    try:
        if a.launch:
            child = launch_server(a.launch, model_path=a.model_path, max_num_seqs=max_seqs, num_pages=pages,
                                  device=a.device, dtype=a.dtype, drafter_path=a.drafter_path, threads=threads)
            base_url = child.wait_ready(a.startup_timeout)
        else:
            base_url = a.base_url
        for c in a.max_concurrency:
            results, dur = asyncio.run(run_load(base_url, workload, model=a.model, request_rate=a.request_rate,
                                                burstiness=a.burstiness, max_concurrency=c, api_key=a.api_key,
                                                seed=a.seed))
            runs[c] = {"http": summarize(results, dur)}
            _print(f"{label} HTTP c={c}", runs[c]["http"])
    finally:
        if child is not None:
            rc = child.stop()
            print(f"server stopped (exit status {rc})", flush=True)
    if a.in_process:
        engine = _in_process_engine(a.launch, a.model_path, max_seqs, pages, a.device, a.dtype, a.drafter_path)
        for c in a.max_concurrency:
            results, dur = run_in_process(engine, workload, request_rate=a.request_rate, burstiness=a.burstiness,
                                          max_concurrency=c, seed=a.seed)
            runs[c]["in_process"] = summarize(results, dur)
            _print(f"{label} in-process c={c}", runs[c]["in_process"])
    rows = []
    for c, r in runs.items():
        http = r["http"]
        row = {"case": f"{a.launch or 'server'}{'+drafter' if a.drafter_path else ''}_c{c}_in{a.input_len}"
                       f"_out{a.output_len}",
               "k3nn_ms": round(1e3 / http["output_tok_s"], 4) if http["output_tok_s"] else None,
               "concurrency": c, "http": http}
        if "in_process" in r and r["in_process"]["output_tok_s"]:
            row.update(anchor="in-process Engine (same workload)",
                       anchor_ms=round(1e3 / r["in_process"]["output_tok_s"], 4), in_process=r["in_process"],
                       http_vs_in_process=round(http["output_tok_s"] / r["in_process"]["output_tok_s"], 3))
            print(f"c={c}: HTTP / in-process output throughput = {row['http_vs_in_process']:.3f} (goal >= 0.95)")
        rows.append(row)
    meta = {"model": a.launch or a.base_url, "model_path": a.model_path, "drafter_path": a.drafter_path,
            "num_prompts": a.num_prompts,
            "input_len": a.input_len, "output_len": a.output_len, "range_ratio": a.range_ratio,
            "request_rate": a.request_rate if math.isfinite(a.request_rate) else "inf", "burstiness": a.burstiness,
            "max_num_seqs": max_seqs, "num_pages": pages, "dtype": a.dtype, "device": a.device, "cpu_threads": threads,
            "k3nn_ms": "milliseconds per output token at the run's output throughput (1000 / tok/s)",
            "targets": "HTTP serving >= 0.95x the in-process Engine output throughput at concurrency 16 (issue 35)"}
    if not a.no_write:
        from bench.common import write_results

        print(f"wrote {write_results(SUITE, rows, meta)}")
    return rows


if __name__ == "__main__":
    main()
