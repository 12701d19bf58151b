"""Which Engine steps run from CUDA graphs: for a checkpoint (and its drafter), with decode-state retention on and
off and with asynchronous scheduling on and off, warm the Engine up, run one batch of held-out prompts twice and
print the tok/s per user, the graph keys captured at warm-up and after, and every key whose capture failed (those
steps run eagerly, with the same tokens). Exits with status 1 when a capture failed.

    python -m bench.gpu.engine_captures --model DIR [--drafter DIR] [--conc 1] [--new 128]

A capture that fails is also logged by ``k3nn.runtime.graphs``; this prints those warnings.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch


def main(argv=None) -> int:
    from k3nn.engine import Engine, EngineConfig
    from k3nn.model import KimiK3

    from bench.serving import _heldout_prompts, _prompts, engine_batch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--conc", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    dev = torch.device("cuda")
    model = KimiK3.from_pretrained(args.model, dtype=torch.bfloat16, device="cuda").eval()
    drafter = None
    if args.drafter:
        from k3nn.layers.dspark import DSparkDrafter

        drafter = DSparkDrafter.from_pretrained(args.drafter, model, device=dev, dtype=torch.bfloat16).eval()
    V = model.config.vocab_size
    prompts = _heldout_prompts(args.model, V, args.conc, args.prompt) or _prompts(V, args.conc, args.prompt, seed=11)
    failed_any = False
    for retain in (True, False):
        for asynchronous in (True, False):
            pages = args.conc * (-(-(args.prompt + args.new + 16) // 64)) + 16
            cfg = EngineConfig(max_num_seqs=args.conc, num_pages=pages, num_snapshots=max(4, args.conc),
                               max_num_batched_tokens=8192, async_scheduling=asynchronous,
                               retain_decode_state=retain)
            engine = Engine(model, cfg, drafter=drafter)
            t0 = time.perf_counter()
            engine.warmup(prompt_len=args.prompt, batch_sizes=[args.conc])
            warm_s = time.perf_counter() - t0
            graphs = engine.runner.graphs
            at_warmup = set(graphs.graphs)
            runs = [engine_batch(engine, prompts, args.new, dev) for _ in range(2)]
            print(f"retain_decode_state={retain} async_scheduling={asynchronous}: warm-up {warm_s:.1f} s, "
                  f"tok/s per user {[round(r['per_user_tok_s']) for r in runs]}, "
                  f"acceptance {runs[-1]['acceptance_length']}")
            print("  captured at warm-up:", sorted(map(str, at_warmup)))
            print("  captured later:", sorted(map(str, set(graphs.graphs) - at_warmup)))
            print("  failed:", {str(k): v.splitlines()[0] for k, v in graphs.failed.items()})
            failed_any |= bool(graphs.failed)
            del engine
            torch.cuda.empty_cache()
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
