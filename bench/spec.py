"""spec: DSpark speculative decoding throughput vs plain decoding, B=1, on K3-shaped models.

Per config (``small`` by default, then ``k3_slice`` when the time budget allows), side by side in one run:

* ``plain``: ``model.generate(prompt, max_new_tokens=N)`` (greedy, standard decode path, no drafter) — the anchor;
* ``dspark γ=7, accept A/7, <rollback>``: ``generate(..., drafter=DSparkDrafter)`` in synthetic-acceptance mode:
  the drafter (random weights, 1 layer) runs its full backbone + Markov sampling every round and every window is
  verified by one target forward, but each round keeps exactly A drafts (+ the target's token), so the numbers
  measure the machinery at a fixed acceptance, not a drafter's quality. On CUDA the rounds run as replayed CUDA
  graphs (``cuda_graph`` auto); each row reports ``spec_mode`` / ``graphs`` (which steps were captured) and
  ``graph_fallback`` (why a capture failed or the graph path was not taken); one ``cuda_graph=False`` row keeps
  the eager round for comparison.

Decode time = time(N new tokens) − time(1 new token) (the prefill and first token cancel), median of ``--reps``.
Before timing, the lossless path is checked in the same run: speculative greedy with drafts taken from plain
greedy's own output (real verification, no synthetic acceptance) must reproduce plain greedy's tokens; the
length of the agreeing prefix is recorded (bf16 windows can flip near-ties, so it is reported, not asserted).

    k3nn bench spec [--configs small,k3_slice] [--new 129] [--ctx 128] [--reps 3] [--budget-s 200]
    k3nn bench spec --allow-cpu --configs tiny --new 17 --ctx 8 --reps 1   (CPU smoke run: not results)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3nn.config import KimiK3Config
from k3nn.layers.dspark import DraftProposal, DSparkConfig, DSparkDrafter
from k3nn.spec import SpecOptions, rollback_memory_bytes

from bench.common import print_table, sync, write_results

SUITE = "spec"
GAMMA = 7


class ReferenceDrafter:
    """Drafts a known continuation ``ref`` [B, n] (e.g. plain greedy's output): acceptance then comes from the
    real verification, which checks the lossless path end to end."""

    target_layers: list[int] = []

    def __init__(self, ref: torch.Tensor, prompt_len: int):
        self.ref, self.prompt_len = ref, prompt_len

    def new_state(self, batch_size, capacity):
        return None

    def extend(self, *args, **kwargs):
        pass

    def propose(self, state, anchor, anchor_pos, n, sample_cfg=None, generator=None):
        ref = torch.cat([self.ref, self.ref.new_zeros(self.ref.shape[0], n + 1)], 1)
        j = (anchor_pos - self.prompt_len + 1)[:, None] + torch.arange(n, device=anchor.device)
        return DraftProposal(ref.gather(1, j.clamp(max=ref.shape[1] - 1)), None, None)


def _time(fn, dev, reps):
    out = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _build(name: str, dev: torch.device, dtype: torch.dtype):
    cfg = getattr(KimiK3Config, name)()
    if dev.type == "cuda" or name != "tiny":
        from bench.models import build_model

        model = build_model(cfg, str(dev), dtype)
    else:
        from k3nn.model import KimiK3

        model = KimiK3(cfg, dtype=dtype, seed=0).eval()
    dcfg = DSparkConfig.for_target(cfg, num_layers=1, num_heads=max(1, cfg.hidden_size // 128),
                                   block_size=GAMMA, markov_rank=min(256, cfg.vocab_size))
    drafter = DSparkDrafter(dcfg, model, device=dev, dtype=dtype).eval()
    return cfg, model, drafter


@torch.no_grad()
def run_config(name: str, dev, dtype, args, rows: list[dict]) -> None:
    t0 = time.perf_counter()
    cfg, model, drafter = _build(name, dev, dtype)
    print(f"built {name} in {time.perf_counter() - t0:.1f}s", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, args.ctx), generator=gen, device=dev)
    N = args.new

    def plain(n):
        return model.generate(ids, max_new_tokens=n)

    def spec(n, opts, d=drafter):
        d.spec_options = opts
        return model.generate(ids, max_new_tokens=n, drafter=d, num_assistant_tokens=GAMMA)

    ref = plain(N)
    # lossless check (real verification, drafts = plain greedy's continuation)
    rd = ReferenceDrafter(ref[:, args.ctx:], args.ctx)
    chk = spec(N, SpecOptions(), rd)
    same = (chk[0, args.ctx:] == ref[0, args.ctx:]).long()
    agree = int(same.cumprod(0).sum())
    check_al = rd.last_stats.acceptance_length
    chk_st = rd.last_stats
    print(f"{name}: spec greedy (reference drafts) agrees with plain greedy on {agree}/{N} tokens, "
          f"acceptance length {check_al:.2f}, mode {chk_st.mode}, graphs {chk_st.graphs}, "
          f"fallback {chk_st.fallback}", flush=True)
    plain(2)
    t_one = _time(lambda: plain(1), dev, args.reps)
    t_plain = _time(lambda: plain(N), dev, args.reps) - t_one
    ms_plain = t_plain / (N - 1)
    meta_case = f"{name} B=1 ctx={args.ctx} new={N}"
    rows.append({"case": f"{meta_case} plain", "k3nn_ms": round(ms_plain, 4),
                 "tokens_per_s": round(1e3 / ms_plain, 1),
                 "greedy_agree_tokens": agree, "greedy_check_acceptance_length": round(check_al, 3),
                 "greedy_check_spec_mode": chk_st.mode, "greedy_check_graph_fallback": chk_st.fallback})
    variants = [(6, "replay", None), (6, "slots", None), (5, "replay", None), (6, "replay", False)]
    for acc, rb, cg in variants:
        if time.perf_counter() - args.t_start > args.budget_s:
            print(f"budget reached: skipping {name} accept {acc} {rb} cuda_graph={cg}", flush=True)
            continue
        opts = SpecOptions(rollback=rb, synthetic_acceptance_length=acc + 1, cuda_graph=cg)
        spec(N, opts)
        t_one = _time(lambda: spec(1, opts), dev, args.reps)
        t = _time(lambda: spec(N, opts), dev, args.reps) - t_one
        st = drafter.last_stats
        if t <= 0:  # timing noise larger than the decode time (CPU smoke runs): no number
            rows.append({"case": f"{meta_case} dspark accept={acc}/{GAMMA} rollback={rb} cuda_graph={cg}",
                         "error": "noise", "spec_mode": st.mode, "graph_fallback": st.fallback})
            continue
        ms = t / (N - 1)
        mem = rollback_memory_bytes(cfg, GAMMA, 1, rb, dtype)
        rows.append({"case": f"{meta_case} dspark gamma={GAMMA} accept={acc}/{GAMMA} rollback={rb}"
                             + ("" if cg is None else f" cuda_graph={cg}"),
                     "spec_mode": st.mode, "graphs": st.graphs, "graph_fallback": st.fallback,
                     "k3nn_ms": round(ms, 4), "anchor": "plain decode (no speculation)",
                     "anchor_ms": round(ms_plain, 4), "speedup": round(ms_plain / ms, 3),
                     "tokens_per_s": round(1e3 / ms, 1), "acceptance_length": round(st.acceptance_length, 3),
                     "rounds": st.rounds, "rollback_extra_bytes": mem["extra"],
                     "kda_committed_bytes": mem["committed"]})
        print(rows[-1], flush=True)
    del model, drafter
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="k3nn bench spec")
    ap.add_argument("--configs", default="small,k3_slice")
    ap.add_argument("--new", type=int, default=129, help="new tokens per generate call")
    ap.add_argument("--ctx", type=int, default=128, help="prompt tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting new cases after this long")
    args = ap.parse_args(argv)
    args.t_start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows: list[dict] = []
    try:
        for name in [c for c in args.configs.split(",") if c]:
            if time.perf_counter() - args.t_start > args.budget_s:
                print(f"budget reached: skipping {name}", flush=True)
                continue
            try:
                run_config(name, dev, dtype, args, rows)
            except Exception as e:  # record and go on to the next config
                print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
                rows.append({"case": f"{name} failed", "error": f"{type(e).__name__}: {e}"[:500]})
    finally:
        path = write_results(SUITE, rows, {"gamma": GAMMA, "drafter_layers": 1, "batch": 1,
                                           "acceptance_mode": "synthetic (accept A of gamma drafts per round)"})
        print_table(rows, ["case", "k3nn_ms", "anchor_ms", "speedup", "acceptance_length", "spec_mode",
                           "graph_fallback"])
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
