"""Run a batch of prompts through the continuous-batching Engine, with a progress bar and metrics.

    python examples/engine_batch.py                       # tiny random model on CPU, 16 prompts
    python examples/engine_batch.py --config small --device cuda --num-prompts 64 --prompt-len 2048

Prompts share a few "system prompt" prefixes, so the prefix cache gets hits (hybrid: latent pages + KDA
snapshots); the run prints TTFT, TPOT, throughput and the cache hit rate.
"""

from __future__ import annotations

import argparse
import random

import torch
from tqdm.auto import tqdm

from k3nn import KimiK3, KimiK3Config
from k3nn.cli import add_threads_argument
from k3nn.engine import Engine, EngineConfig, SamplingParams
from k3nn.utils import configure_threads


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=160, help="system prefix length (a user suffix follows)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--budget", default="adaptive", choices=["adaptive", "fixed"])
    ap.add_argument("--retention", default="marconi", help="marconi | replay | interval:N | none")
    ap.add_argument("--sample", action="store_true", help="sample (temperature 0.8, top-k 50) instead of greedy")
    add_threads_argument(ap)
    a = ap.parse_args(argv)
    configure_threads(a.threads)  # an entry point sets threads; the library itself never does

    cfg = getattr(KimiK3Config, a.config)()
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    model = KimiK3(cfg, dtype=dtype, seed=0).to(a.device).eval()
    rng = random.Random(0)
    systems = [[rng.randrange(cfg.vocab_size) for _ in range(a.prompt_len)] for _ in range(3)]
    prompts = [rng.choice(systems) + [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, 64))]
               for _ in range(a.num_prompts)]
    per_req = -(-(a.prompt_len + 64 + a.max_new_tokens) // 64)
    engine = Engine(model, EngineConfig(max_num_seqs=a.max_num_seqs, num_pages=per_req * (a.max_num_seqs + 8),
                                        num_snapshots=16, budget=a.budget, retention=a.retention))
    params = SamplingParams(max_new_tokens=a.max_new_tokens, do_sample=a.sample, temperature=0.8, top_k=50, seed=0)
    ids = [engine.add_request(p, params) for p in prompts]
    with tqdm(total=len(ids), unit="req", desc="engine") as bar:
        for out in engine.stream():
            if out.finished:
                bar.update(1)
    m = engine.metrics()
    print(f"first output: {engine.requests[ids[0]].output}")
    print(f"TTFT mean {m['ttft_mean_s'] * 1e3:.1f} ms (p95 {m['ttft_p95_s'] * 1e3:.1f}), TPOT {m['tpot_mean_s'] * 1e3:.1f} ms, "
          f"{m['throughput_tok_s']:.1f} tok/s, cache hit rate {m['cache_hit_rate']:.1%} "
          f"({m['computed_prompt_tokens']} of {m['prompt_tokens']} prompt tokens computed), {m['forwards']} forwards")
    return m


if __name__ == "__main__":
    main()
