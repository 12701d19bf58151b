"""Adaptive vs fixed scheduled-token budget: TTFT at concurrency 1–4.

``c`` requests (``--prompt-len`` tokens each, distinct, ``--new-tokens`` generated) arrive together. Both
engines have ``max_num_batched_tokens`` = 8192 and reserve ``--reserve`` tokens per decoding sequence (a
speculative window, as with DSpark):

* ``fixed``: the prefill budget reserves room for ``max_num_seqs`` decodes whether or not they run
  (8192 − 8·768 = 2048 by default: an 8K prompt takes four forwards even when it is alone);
* ``adaptive``: only the sequences actually decoding are reserved for (8192 at concurrency 1).

Reported per concurrency: mean TTFT (add → first token), the forwards a request needed before its first
token, and mean TPOT. ``python -m bench.budget``; ``--config tiny --device cpu`` is a smoke test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3nn.engine import Engine, EngineConfig

from bench.models import bench_model

__all__ = ["main", "run_batch"]


def run_batch(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    if engine.pools.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    ids = [engine.add_request(p, max_new_tokens=new_tokens) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    reqs = [engine.requests[i] for i in ids]
    ttft = [(r.first_token_time - r.arrival_time) * 1e3 for r in reqs]
    tpot = [(r.finish_time - r.first_token_time) * 1e3 / (len(r.output) - 1) for r in reqs if len(r.output) > 1]
    return {"ttft_ms": statistics.mean(ttft), "ttft_max_ms": max(ttft),
            "forwards_to_first_token": statistics.mean(r.num_forwards for r in reqs),
            "tpot_ms": statistics.mean(tpot) if tpot else 0.0, "wall_ms": wall * 1e3}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="k3nn bench budget", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="small", choices=["tiny", "small", "k3_slice"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-seqs", type=int, default=8)
    ap.add_argument("--reserve", type=int, default=768)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=120.0, help="skip the remaining concurrencies after this")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cfg, model = bench_model(a.config, device, a.dtype)
    gen = torch.Generator().manual_seed(0)

    def prompts(c: int) -> list[list[int]]:
        return [torch.randint(0, cfg.vocab_size, (a.prompt_len,), generator=gen).tolist() for _ in range(c)]

    pages = max(a.concurrency) * (-(-(a.prompt_len + a.new_tokens) // 64)) + 8
    base = dict(max_num_seqs=a.max_seqs, num_pages=pages, num_snapshots=4, enable_prefix_caching=False,
                max_num_batched_tokens=a.max_batched_tokens, reserve_per_seq=a.reserve, min_prefill_tokens=64)
    engines = {mode: Engine(model, EngineConfig(**base, budget=mode)) for mode in ("fixed", "adaptive")}
    rows = []
    t_start = time.perf_counter()
    for c in a.concurrency:
        if time.perf_counter() - t_start > a.max_seconds:
            print(f"time budget spent: concurrency {c} and above skipped")
            break
        res = {}
        for mode, e in engines.items():
            run_batch(e, prompts(c), a.new_tokens)  # unmeasured: this concurrency's chunk shapes compile here
            runs = [run_batch(e, prompts(c), a.new_tokens) for _ in range(a.reps)]
            res[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        f, ad = res["fixed"], res["adaptive"]
        rows.append({"case": f"ttft_c{c}_{a.prompt_len}", "k3nn_ms": round(ad["ttft_ms"], 3), "anchor": "fixed",
                     "anchor_ms": round(f["ttft_ms"], 3),
                     "ttft_change_pct": round(100 * (ad["ttft_ms"] / f["ttft_ms"] - 1), 2),
                     "forwards_to_first_token": {"adaptive": ad["forwards_to_first_token"],
                                                 "fixed": f["forwards_to_first_token"]},
                     "tpot_ms": {"adaptive": round(ad["tpot_ms"], 3), "fixed": round(f["tpot_ms"], 3)},
                     "prefill_budget_tokens": {"adaptive_idle": engines["adaptive"].prefill_budget(0),
                                               "fixed": engines["fixed"].prefill_budget(0)}})
    meta = {"model": a.config, "dtype": str(model.dtype).removeprefix("torch."), "device": str(device),
            "max_num_batched_tokens": a.max_batched_tokens, "max_num_seqs": a.max_seqs,
            "reserve_per_seq": a.reserve, "new_tokens": a.new_tokens, "reps": a.reps,
            "targets": "adaptive TTFT better than fixed, goal -50% (docs/perf.md)"}
    if not a.no_write:
        from bench.common import write_results

        print(f"wrote {write_results('budget', rows, meta)}")
    for r in rows:
        print(r)
    return rows


if __name__ == "__main__":
    main()
