"""engine-spec: DSpark speculative decoding inside the Engine against the same engine without speculation.

Per concurrency C (1, 4, 16 by default), C prompts of ``--ctx`` random tokens, ``--new`` new tokens each (greedy,
eos ignored), run through two engines on the same model in the same process:

* ``plain``: ``Engine(model)`` — continuous batching, no drafter (the anchor);
* ``spec``: ``Engine(model, drafter=DSparkDrafter)`` with γ = 7 drafts per window. On random weights a drafter has
  no skill, so ``--accept A`` (default 6) runs synthetic acceptance: every window keeps exactly A drafts + the
  target's token (the machinery at a fixed acceptance; not the target's output). ``--drafter DIR`` with
  ``--model DIR`` (a trained pair, e.g. ``k3nn demo``'s) measures real acceptance instead.

Each engine is measured **cold** (its first batch in this process after construction: kernel compilation and
autotuning of new shapes included), then ``warmup()`` (reported as ``warmup_s``) and **warm** (median of
``--reps`` batches). Reported per row: per-user decode tok/s (mean over requests of tokens after the first /
(finish − first token)), total throughput (all new tokens / wall), TTFT p50, acceptance length, and
``speedup`` = spec / plain (per-user and total). Before timing, greedy spec with real verification
(no synthetic acceptance) is compared with the plain engine on the same prompts (agreeing tokens recorded; bf16
windows can flip near-ties).

    k3nn bench engine-spec [--config k3_slice] [--conc 1,4,16] [--ctx 128] [--new 128] [--accept 6]
    k3nn bench engine-spec --allow-cpu --config tiny --conc 1,2 --ctx 16 --new 12 --reps 1   (CPU smoke run)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3nn.config import KimiK3Config
from k3nn.engine import Engine, EngineConfig
from k3nn.layers.dspark import DSparkConfig, DSparkDrafter
from k3nn.spec import SpecOptions

from bench.common import print_table, sync, write_results

SUITE = "engine-spec"
GAMMA = 7


def _build(args, dev: torch.device, dtype: torch.dtype):
    if args.model:
        from k3nn.model import KimiK3

        model = KimiK3.from_pretrained(args.model, dtype=dtype, device=str(dev)).eval()
        drafter = DSparkDrafter.from_pretrained(args.drafter, model, device=dev, dtype=dtype).eval()
        return model, drafter
    cfg = getattr(KimiK3Config, args.config)()
    if dev.type == "cuda":
        from bench.models import build_model

        model = build_model(cfg, str(dev), dtype)
    else:
        from k3nn.model import KimiK3

        model = KimiK3(cfg, dtype=dtype, seed=0).eval()
    dcfg = DSparkConfig.for_target(cfg, num_layers=1, num_heads=max(1, cfg.hidden_size // 128), block_size=GAMMA,
                                   markov_rank=min(256, cfg.vocab_size))
    return model, DSparkDrafter(dcfg, model, device=dev, dtype=dtype).eval()


def _engine(model, drafter, args, synthetic: int | None) -> Engine:
    pages = args.max_seqs * (-(-(args.ctx + args.new + GAMMA + 1) // 64)) * 2 + 16
    cfg = EngineConfig(max_num_seqs=args.max_seqs, num_pages=pages, num_snapshots=max(4, args.max_seqs),
                       max_num_batched_tokens=max(4096, args.max_seqs * args.ctx),
                       spec=SpecOptions(synthetic_acceptance_length=synthetic))
    return Engine(model, cfg, drafter=drafter)


def _batch(engine: Engine, prompts: list[list[int]], new: int, dev) -> dict:
    """One batch to completion; per-user tok/s, total tok/s, TTFT p50, acceptance length."""
    sync(dev)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, max_new_tokens=new, ignore_eos=True) for p in prompts]
    list(engine.stream())
    sync(dev)
    wall = time.perf_counter() - t0
    reqs = [engine.requests[i] for i in ids]
    users = [(len(r.output) - 1) / (r.finish_time - r.first_token_time) for r in reqs
             if r.finish_time and r.finish_time > r.first_token_time]
    ttft = sorted(r.first_token_time - r.arrival_time for r in reqs)
    rounds = sum(r.spec_rounds for r in reqs)
    acc = (sum(r.spec_accepted for r in reqs) + rounds) / rounds if rounds else 0.0
    out = {"wall_s": wall, "per_user_tok_s": statistics.mean(users) if users else 0.0,
           "total_tok_s": sum(len(r.output) for r in reqs) / wall, "ttft_p50_s": ttft[len(ttft) // 2],
           "acceptance_length": acc, "outputs": [list(r.output) for r in reqs]}
    for i in ids:
        del engine.requests[i]
    return out


def _row(case: str, res: dict, anchor: dict | None) -> dict:
    row = {"case": case, "per_user_tok_s": round(res["per_user_tok_s"], 1), "total_tok_s": round(res["total_tok_s"], 1),
           "ttft_p50_ms": round(res["ttft_p50_s"] * 1e3, 1), "wall_ms": round(res["wall_s"] * 1e3, 1)}
    if res["acceptance_length"]:
        row["acceptance_length"] = round(res["acceptance_length"], 3)
    if anchor is not None:
        row["anchor"] = "the same engine without speculation"
        row["anchor_per_user_tok_s"] = round(anchor["per_user_tok_s"], 1)
        row["anchor_total_tok_s"] = round(anchor["total_tok_s"], 1)
        row["speedup"] = round(res["per_user_tok_s"] / max(anchor["per_user_tok_s"], 1e-9), 3)
        row["speedup_total"] = round(res["total_tok_s"] / max(anchor["total_tok_s"], 1e-9), 3)
    return row


@torch.no_grad()
def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="k3nn bench engine-spec")
    ap.add_argument("--config", default="k3_slice", help="KimiK3Config preset with random weights")
    ap.add_argument("--model", default=None, help="a trained target checkpoint (with --drafter)")
    ap.add_argument("--drafter", default=None, help="a trained DSpark drafter directory (with --model)")
    ap.add_argument("--conc", default="1,4,16", help="concurrencies (requests per batch)")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--accept", type=int, default=6, help="synthetic accepted drafts per window (-1: real)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=420.0)
    args = ap.parse_args(argv)
    if bool(args.model) != bool(args.drafter):
        raise SystemExit("--model and --drafter go together (a trained target and its drafter)")
    t_start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    conc = [int(c) for c in args.conc.split(",") if c]
    args.max_seqs = max(conc)
    model, drafter = _build(args, dev, dtype)
    V = model.config.vocab_size
    synthetic = None if args.accept < 0 or args.model else args.accept + 1
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (args.ctx,), generator=g).tolist() for _ in range(max(conc))]
    rows: list[dict] = []
    meta = {"config": args.model or args.config, "gamma": GAMMA, "ctx": args.ctx, "new": args.new,
            "acceptance_mode": f"synthetic ({args.accept} of {GAMMA} drafts per window)" if synthetic else "real",
            "dtype": str(dtype)}
    try:
        plain, spec = _engine(model, None, args, None), _engine(model, drafter, args, synthetic)
        check = _engine(model, drafter, args, None)  # real verification: greedy must equal the plain engine
        c0 = conc[0]
        cold_p = _batch(plain, prompts[:c0], args.new, dev)
        cold_s = _batch(spec, prompts[:c0], args.new, dev)
        rows.append(_row(f"cold first batch C={c0} plain", cold_p, None))
        rows.append(_row(f"cold first batch C={c0} spec", cold_s, cold_p))
        ref = _batch(check, prompts[:4], args.new, dev)
        base = _batch(plain, prompts[:4], args.new, dev)
        agree = [next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                 for x, y in zip(ref["outputs"], base["outputs"])]
        meta["greedy_agree_tokens"] = agree
        meta["greedy_check_acceptance_length"] = round(ref["acceptance_length"], 3)
        print(f"greedy spec (real verification) agrees with the plain engine on {agree} of {args.new} tokens "
              f"(acceptance {ref['acceptance_length']:.2f})", flush=True)
        meta["warmup_plain_s"] = round(plain.warmup(args.ctx), 2)
        meta["warmup_spec_s"] = round(spec.warmup(args.ctx), 2)
        print(f"warmup: plain {meta['warmup_plain_s']} s, spec {meta['warmup_spec_s']} s", flush=True)
        for c in conc:
            if time.perf_counter() - t_start > args.budget_s:
                print(f"budget reached: skipping C={c}", flush=True)
                continue
            first_p = _batch(plain, prompts[:c], args.new, dev)
            first_s = _batch(spec, prompts[:c], args.new, dev)
            rows.append(_row(f"after warmup first batch C={c} spec", first_s, first_p))
            res_p = [_batch(plain, prompts[:c], args.new, dev) for _ in range(args.reps)]
            res_s = [_batch(spec, prompts[:c], args.new, dev) for _ in range(args.reps)]
            med_p = min(res_p, key=lambda r: r["wall_s"])
            med_s = min(res_s, key=lambda r: r["wall_s"])
            rows.append(_row(f"warm C={c} plain", med_p, None))
            rows.append(_row(f"warm C={c} spec gamma={GAMMA}", med_s, med_p))
            rows[-1]["first_batch_vs_warm"] = round(first_s["wall_s"] / med_s["wall_s"], 2)
            print(rows[-1], flush=True)
    except Exception as e:  # record what failed, keep the rows measured so far
        rows.append({"case": "failed", "error": f"{type(e).__name__}: {e}"[:500]})
        print(rows[-1], flush=True)
    finally:
        path = write_results(SUITE, rows, meta)
        print_table(rows, ["case", "per_user_tok_s", "total_tok_s", "ttft_p50_ms", "acceptance_length", "speedup",
                           "speedup_total"])
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
