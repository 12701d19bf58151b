"""The ``k3nn serve`` command: its help, one-line errors for bad flags (exit 2), and a real server process that
loads a checkpoint, chats with its template, and on SIGTERM lets the request in flight finish, then exits 0."""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from k3nn import cli

from serve_helpers import free_socket


def run(capsys, *argv):
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 2
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_help(capsys):
    rc, out, _ = run(capsys, "serve", "--help")
    assert rc == 0
    for flag in ("--model", "--drafter", "--host", "--port", "--max-num-seqs", "--num-pages", "--cache-memory",
                 "--served-model-name", "--api-key", "--dtype", "--device", "--chat-template", "--shutdown-timeout"):
        assert flag in out
    rc, out, _ = run(capsys, "--help")
    assert "serve" in out


def test_bad_flags_are_one_line_errors(capsys, checkpoint):
    busy = free_socket()
    busy.listen()
    cases = [
        (["--port", "70000"], "--port"),
        (["--cache-memory", "lots"], "--cache-memory"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--num-speculative-tokens", "2"], "--drafter"),
        (["--dtype", "bogus"], "--dtype"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
        (["--port", str(busy.getsockname()[1])], "cannot listen"),
        (["--max-model-len", "100000000", "--port", "0"], "--max-model-len"),
    ]
    try:
        for extra, text in cases:
            rc, _, err = run(capsys, "serve", "--model", str(checkpoint), *extra)
            assert rc == 2, (extra, err)
            lines = [ln for ln in err.splitlines() if "error" in ln]
            assert lines and lines[-1].startswith("k3nn serve: error:") and text in lines[-1], (extra, err)
    finally:
        busy.close()
    rc, _, err = run(capsys, "serve", "--model", str(checkpoint), "--num-pages", "4", "--cache-memory", "1GiB")
    assert rc == 2 and "not allowed with" in err
    rc, _, err = run(capsys, "serve", "--model", str(checkpoint.parent / "nowhere"), "--offline", "--port", "0")
    assert rc == 2 and err.strip().splitlines()[-1].startswith("k3nn serve: error:")


def test_parse_bytes():
    from k3nn.serve.cli import parse_bytes

    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("1e9") == 10**9 and parse_bytes("1024") == 1024 and parse_bytes("2k") == 2000
    for bad in ("", "GiB", "-5", "0", "1.5XB"):
        with pytest.raises(ValueError, match="--cache-memory"):
            parse_bytes(bad)


def test_server_process_drains_on_sigterm(checkpoint):
    env = {**os.environ, "K3NN_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "k3nn", "serve", "--model", str(checkpoint), "--port", "0", "--max-num-seqs", "2",
         "--num-pages", "32", "--served-model-name", "tiny", "--shutdown-timeout", "60", "--offline"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    log = []

    def read():
        for line in proc.stderr:
            log.append(line)
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
            url = m.group(1) if m else None
        while httpx.get(url + "/health", timeout=60).status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(log)
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "add"}],
                                              max_tokens=3, temperature=0)
        assert chat.usage.completion_tokens == 3 and chat.usage.prompt_tokens > 3  # the checkpoint's template
        stream = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=40, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        chunks = [next(stream)]
        proc.send_signal(signal.SIGTERM)  # the request in flight may finish
        chunks += list(stream)
        assert sum(len(c.choices[0].model_extra["token_ids"]) for c in chunks) == 40
        assert chunks[-1].choices[0].finish_reason == "length"
        assert proc.wait(60) == 0, "".join(log)
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=10)
        text = "".join(log)
        assert "engine warmup" in text and "chat template from" in text and "k3nn serve stopped" in text
        assert "Traceback" not in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
