"""Load: 64 concurrent streaming clients with mixed prompt and output lengths, a tenth of them disconnecting early.
Every completed response equals its greedy reference, no request is lost or duplicated, and afterwards no page,
snapshot slot or row is held by anything but the prefix index."""

import asyncio
import json
import random

import httpx
import pytest

from k3nn.engine import Engine, EngineConfig

from serve_helpers import VOCAB, LiveServer

N = 64
ENGINE = dict(max_num_seqs=16, num_pages=160, num_snapshots=16)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    with LiveServer(model, tokenizer, warmup_batch_sizes=(1, 16), **ENGINE) as s:
        yield s


async def _client(url: str, payload: dict, drop_after: int | None) -> dict:
    """One streaming client; with ``drop_after`` it hangs up after that many tokens."""
    out = {"ids": [], "finish": [], "done": False, "usage": None, "response_ids": set(), "dropped": False}
    async with httpx.AsyncClient(timeout=120) as c:
        async with c.stream("POST", url, json=payload) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                out["response_ids"].add(chunk["id"])
                if chunk["choices"]:
                    ch = chunk["choices"][0]
                    out["ids"] += ch["token_ids"]
                    if ch["finish_reason"] is not None:
                        out["finish"].append(ch["finish_reason"])
                else:
                    out["usage"] = chunk["usage"]
                if drop_after is not None and len(out["ids"]) >= drop_after:
                    out["dropped"] = True
                    break  # leaving the block closes the connection mid-stream
    return out


def test_64_concurrent_streaming_clients(server, model):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 60))] for _ in range(N)]
    max_tokens = [rng.randint(1, 24) for _ in range(N)]
    drop = set(rng.sample(range(N), N // 10))
    for i in drop:
        max_tokens[i] = 24  # long enough to hang up in the middle
    ref = Engine(model, EngineConfig(**ENGINE)).generate(prompts, max_new_tokens=24)  # greedy prefixes
    before = server.outcomes()
    url = server.base_url + "/completions"

    async def run():
        return await asyncio.gather(*(
            _client(url, {"prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0, "stream": True,
                          "stream_options": {"include_usage": True}, "return_token_ids": True},
                    rng.randint(1, 6) if i in drop else None) for i in range(N)))

    results = asyncio.run(asyncio.wait_for(run(), timeout=180))
    seen = set()
    for i, r in enumerate(results):
        assert len(r["response_ids"]) == 1
        seen |= r["response_ids"]
        if i in drop:
            assert r["dropped"] and not r["done"]
            continue
        want = ref[i][:max_tokens[i]]
        assert r["done"] and r["ids"] == want, i
        assert r["finish"] == ["length" if len(want) == max_tokens[i] else "stop"]
        assert r["usage"] == {"prompt_tokens": len(prompts[i]), "completion_tokens": len(want),
                              "total_tokens": len(prompts[i]) + len(want)}
    assert len(seen) == N  # one response per request: nothing lost, nothing duplicated
    assert server.wait_idle(timeout=60) == []
    after = server.outcomes()
    finished = after["stop"] + after["length"] - before["stop"] - before["length"]
    assert finished == N - len(drop) and after["abort"] - before["abort"] == len(drop)
    assert after["error"] == before["error"] and after["rejected"] == before["rejected"]
