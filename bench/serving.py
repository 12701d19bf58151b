"""serving: the Engine under the serving reports' workloads, against generate() in the same process.

For each (prompt, new) shape and concurrency C, C requests of random prompts (greedy, eos ignored) are submitted
together to one warm Engine (``warmup()`` first: graphs captured, kernels compiled); reported per row:

* ``per_user_tok_s``: mean over requests of (tokens after the first) / (finish − first token);
* ``total_tok_s``: every new token / wall time of the batch; ``ttft_mean_ms`` / ``ttft_p99_ms``; ``tpot_ms``
  (mean time per output token after the first); ``latency_ms`` (mean request latency);
* anchors measured in the same run: ``generate()`` at batch 1 (per-user decode tok/s, CUDA graphs) for C = 1,
  ``generate()`` on a static batch of C for C ≥ 4 (total tok/s), and the HBM bound of one decode step at B = 1
  (weights a token touches over the measured copy bandwidth); ``speedup`` = Engine / anchor on per-user tok/s at
  C = 1 and on total tok/s at C ≥ 4;
* ``compiles``: Triton compilations during the timed batch (0 after a complete warmup).

Rows with DSpark: ``--model DIR --drafter DIR`` (a trained pair, e.g. ``k3nn demo``'s: real acceptance) runs
the plain and speculative Engine and ``generate()`` with and without the drafter on 96-token prompts; on the
random-weight preset a drafter with synthetic acceptance (``--accept`` of γ = 7) against the plain Engine.

    k3nn bench serving [--config k3_slice] [--conc 1,4,16,64] [--shapes 2048:256,8192:1024]
    k3nn bench serving --model ~/.cache/k3nn/demo/model --drafter ~/.cache/k3nn/demo/drafter --conc 1,4
    k3nn bench serving --allow-cpu --config tiny --conc 1,2 --shapes 16:8 --accept -1   (CPU smoke run)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import print_table, sync, write_results

SUITE = "serving"
GAMMA = 7


class CompileCounter:
    """Counts Triton compilations (the runtime's pre-compile hook) while active."""

    def __init__(self):
        self.count = 0
        self.names: list[str] = []
        self.reprs: list[str] = []  # the specialisation each compile was for (argument types, divisibility)
        self._prev = None

    def __enter__(self):
        try:
            from triton import knobs

            self._prev = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self._hook
        except (ImportError, AttributeError):
            self._prev = None
        return self

    def _hook(self, *args, **kwargs):
        self.count += 1
        fn = kwargs.get("fn")
        self.names.append(str(getattr(getattr(fn, "jit_function", fn), "__name__", None) or kwargs.get("repr")))
        self.reprs.append(f"{kwargs.get('repr')} key={str(kwargs.get('key'))[:800]}")
        return False

    def __exit__(self, *exc):
        try:
            from triton import knobs

            knobs.runtime.jit_cache_hook = self._prev
        except (ImportError, AttributeError):
            pass


def _prompts(V: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (length,), generator=g).tolist() for _ in range(n)]


def engine_batch(engine, prompts, new: int, dev) -> dict:
    """One batch of requests submitted together, run to completion: the serving metrics of the docstring."""
    with CompileCounter() as cc:
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
    tpot = [(r.finish_time - r.first_token_time) / (len(r.output) - 1) for r in reqs if len(r.output) > 1]
    rounds = sum(r.spec_rounds for r in reqs)
    out = {"per_user_tok_s": statistics.mean(users) if users else 0.0,
           "total_tok_s": sum(len(r.output) for r in reqs) / wall,
           "ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1,
                                                                                         int(0.99 * len(ttft)))],
           "tpot_ms": 1e3 * statistics.mean(tpot) if tpot else 0.0,
           "latency_ms": 1e3 * statistics.mean(r.finish_time - r.arrival_time for r in reqs),
           "compiles": cc.count, "compiled": sorted(set(cc.names)), "compiled_reprs": cc.reprs,
           "outputs": [list(r.output) for r in reqs],
           "graph_capture_failures": engine.metrics()["graph_capture_failures"],  # steps that ran eagerly
           "acceptance_length": (sum(r.spec_accepted for r in reqs) + rounds) / rounds if rounds else None}
    for i in ids:
        del engine.requests[i]
    return out


def engines_best(engines: dict, prompts, new: int, dev, metric: str, reps: int = 3) -> dict:
    """:func:`engine_batch` ``reps`` times per engine (the prefix cache cleared in between: every run prefills), the
    engines' runs alternating (A B C, A B C, ...) so a drift of the host or the clocks during the measurement reaches
    each of them alike; per engine, the run with the best ``metric`` (as the ``generate()`` anchors take the best of
    their runs), ``compiles`` summed over its runs."""
    runs: dict = {k: [] for k in engines}
    for _ in range(reps):
        for k, engine in engines.items():
            if engine.prefix is not None:
                engine.prefix.clear()
            runs[k].append(engine_batch(engine, prompts, new, dev))
    out = {}
    for k, rs in runs.items():
        best = max(rs, key=lambda r: r[metric])
        best["compiles"] = sum(r["compiles"] for r in rs)
        best["runs"] = [round(r[metric], 1) for r in rs]
        out[k] = best
    return out


def generate_decode_tok_s(model, prompt: list[int], new: int, dev, drafter=None) -> tuple[float, list[int]]:
    """generate() at batch 1: decode tokens/s (the time of ``new`` tokens minus that of one, per extra token)."""
    ids = torch.tensor([prompt], device=dev)
    kw = dict(drafter=drafter) if drafter is not None else {}
    for _ in range(2):  # warm: graphs captured, kernels compiled
        model.generate(ids, max_new_tokens=new, eos_token_id=[], **kw)
    times = {}
    for n in (1, new):
        best = float("inf")
        for _ in range(2):
            sync(dev)
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=n, eos_token_id=[], **kw)
            sync(dev)
            best = min(best, time.perf_counter() - t0)
        times[n] = best
    return (new - 1) / max(times[new] - times[1], 1e-9), out[0, len(prompt):].tolist()


def generate_batch_tok_s(model, prompts, new: int, dev) -> float:
    """generate() on a static batch of the prompts (same length): total new tokens / wall. The prefill goes in
    chunks of at most 32768 tokens over the batch (16 prompts of 8K in one forward need a 16.5 GB MLP
    activation on ``k3_slice``); the tokens are the same."""
    ids = torch.tensor(prompts, device=dev)
    chunk = max(512, 32768 // len(prompts))
    model.generate(ids, max_new_tokens=new, eos_token_id=[], prefill_chunk_size=chunk)
    sync(dev)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, eos_token_id=[], prefill_chunk_size=chunk)
    sync(dev)
    return len(prompts) * new / (time.perf_counter() - t0)


def hbm_bound_ms(model, copy_tbps: float | None) -> float | None:
    """Weights one decode token touches at B = 1 (dense, lm_head, top-k routed experts per MoE layer) over the
    copy bandwidth."""
    if not copy_tbps:
        return None
    from k3nn.layers.moe import Experts

    cfg = model.config
    total = 0
    for mod in model.modules():
        own = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
        nbytes = sum(t.numel() * t.element_size() for t in own)
        if isinstance(mod, Experts):
            nbytes = nbytes * cfg.num_experts_per_token // cfg.num_experts
        total += nbytes
    if cfg.tie_word_embeddings:
        total -= model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    total -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()  # one row
    return total / (copy_tbps * 1e12) * 1e3


def _engine(model, drafter, max_seqs: int, prompt: int, new: int, synthetic: int | None, budget: int = 8192,
            async_scheduling: bool = True):
    from k3nn.engine import Engine, EngineConfig
    from k3nn.spec import SpecOptions

    pages = max_seqs * (-(-(prompt + new + GAMMA + 1) // 64)) + 16
    cfg = EngineConfig(max_num_seqs=max_seqs, num_pages=pages, num_snapshots=max(4, max_seqs),
                       max_num_batched_tokens=max(budget, prompt), async_scheduling=async_scheduling,
                       spec=SpecOptions(synthetic_acceptance_length=synthetic) if synthetic else None)
    return Engine(model, cfg, drafter=drafter)


def _explain_compiles(res: dict, warm: CompileCounter) -> None:
    """Print each specialisation compiled during a timed batch next to those warmup compiled of the same kernel."""
    for r in res.get("compiled_reprs", []):
        name = r.split("[", 1)[0]
        print(f"compiled after warmup: {r}", flush=True)
        for w in warm.reprs:
            if w.split("[", 1)[0] == name:
                print(f"    warmup had: {w}", flush=True)


def _row(case: str, res: dict, anchor: str | None = None, anchor_val: float | None = None,
         metric: str = "per_user_tok_s", **extra) -> dict:
    row = {"case": case, **{k: round(v, 2) for k, v in res.items() if isinstance(v, float)},
           "compiles": res.get("compiles", 0)}
    if res.get("compiled"):
        row["compiled"] = res["compiled"]
    if res.get("graph_capture_failures"):  # some step shapes ran eagerly: the row does not time the graphs
        row["graph_capture_failures"] = res["graph_capture_failures"]
    if res.get("acceptance_length"):
        row["acceptance_length"] = round(res["acceptance_length"], 3)
    if res.get("runs"):
        row["runs"] = res["runs"]
    if anchor is not None and anchor_val:
        row.update(anchor=anchor, anchor_value=round(anchor_val, 2), speedup_metric=metric,
                   speedup=round(res[metric] / anchor_val, 3))
    row.update(extra)
    return row


@torch.no_grad()
def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="k3nn bench serving")
    ap.add_argument("--config", default="k3_slice", help="KimiK3Config preset with random weights")
    ap.add_argument("--model", default=None, help="a trained checkpoint (with --drafter: real acceptance rows)")
    ap.add_argument("--drafter", default=None, help="a trained DSpark drafter directory (with --model)")
    ap.add_argument("--conc", default="1,4,16,64")
    ap.add_argument("--shapes", default="2048:256,8192:1024", help="prompt:new pairs")
    ap.add_argument("--accept", type=int, default=6, help="synthetic accepted drafts of 7 for the preset's spec "
                                                          "rows (-1: no spec rows)")
    ap.add_argument("--budget-s", type=float, default=900.0)
    ap.add_argument("--sync-rows", action="store_true",
                    help="beside each Engine row (plain, and with the demo's drafter), the same batch with "
                         "async_scheduling off (anchor: that row)")
    ap.add_argument("--max-batched-tokens", type=int, default=8192,
                    help="the Engine's max_num_batched_tokens on the preset (at least the prompt length)")
    args = ap.parse_args(argv)
    import faulthandler

    faulthandler.dump_traceback_later(max(30.0, args.budget_s - 20), exit=False)  # where a run past its budget is
    t_start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    conc = [int(c) for c in args.conc.split(",") if c]
    shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",") if s]
    from bench.records import device_meta

    meta = device_meta()
    rows: list[dict] = []
    path = None

    def save():
        nonlocal path
        path = write_results(SUITE, rows, {"config": args.model or args.config,
                                           "max_num_batched_tokens": args.max_batched_tokens}, path=path)

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    if args.model:
        _trained(args, dev, dtype, conc, rows, save, left)
    else:
        from bench.models import bench_model

        cfg, model = bench_model(args.config, dev)
        print(f"[{time.perf_counter() - t_start:.0f}s] model built", flush=True)
        bound = hbm_bound_ms(model, meta.get("copy_tbps"))
        name = args.config
        for prompt, new in shapes:
            if left() < 30:
                break
            eng = _engine(model, None, max(conc), prompt, new, None, args.max_batched_tokens)
            with CompileCounter() as warm_cc:
                wu = eng.warmup(prompt_len=min(prompt, 512))
            eng_sync = None
            if args.sync_rows:
                eng_sync = _engine(model, None, max(conc), prompt, new, None, args.max_batched_tokens, False)
                eng_sync.warmup(prompt_len=min(prompt, 512))
            print(f"[{time.perf_counter() - t_start:.0f}s] warmup {wu:.1f}s, graphs "
                  f"{len(eng.runner.graphs.graphs)}, failed {list(eng.runner.graphs.failed)}", flush=True)
            for c in conc:
                if left() < 30:
                    break
                ps = _prompts(cfg.vocab_size, c, prompt, seed=prompt + c)
                res = engine_batch(eng, ps, new, dev)
                _explain_compiles(res, warm_cc)
                if c == 1:
                    tok_s, ref = generate_decode_tok_s(model, ps[0], min(new, 256), dev)
                    rows.append(_row(f"{name} C=1 prompt={prompt} new={new}", res, "generate() batch 1, CUDA graph",
                                     tok_s, warmup_s=round(wu, 2),
                                     hbm_bound_tok_s=round(1e3 / bound, 1) if bound else None))
                else:
                    tot = generate_batch_tok_s(model, ps, new, dev)
                    rows.append(_row(f"{name} C={c} prompt={prompt} new={new}", res,
                                     f"generate() static batch of {c}", tot, metric="total_tok_s"))
                print(rows[-1], flush=True)
                if eng_sync is not None:
                    _sync_row(rows, f"{name} C={c} prompt={prompt} new={new} sync", c, res,
                              engine_batch(eng_sync, ps, new, dev))
                save()
            del eng
        if args.accept >= 0 and left() > 60:
            from k3nn.layers.dspark import DSparkConfig, DSparkDrafter

            dcfg = DSparkConfig.for_target(cfg, num_layers=1, num_heads=max(1, cfg.hidden_size // 128),
                                           block_size=GAMMA, markov_rank=min(256, cfg.vocab_size))
            drafter = DSparkDrafter(dcfg, model, device=dev, dtype=dtype).eval()
            prompt, new = shapes[0]
            for c in [c for c in conc if c <= 16]:
                if left() < 60:
                    break
                plain = _engine(model, None, c, prompt, new, None)
                plain.warmup(prompt_len=min(prompt, 512), batch_sizes=[c])
                spec = _engine(model, drafter, c, prompt, new, args.accept + 1)
                spec.warmup(prompt_len=min(prompt, 512), batch_sizes=[c])
                ps = _prompts(cfg.vocab_size, c, prompt, seed=7 + c)
                a = engine_batch(plain, ps, new, dev)
                b = engine_batch(spec, ps, new, dev)
                rows.append(_row(f"{name} C={c} prompt={prompt} new={new} spec", b,
                                 f"the plain Engine (synthetic acceptance {args.accept} of {GAMMA})",
                                 a["per_user_tok_s" if c == 1 else "total_tok_s"],
                                 metric="per_user_tok_s" if c == 1 else "total_tok_s"))
                print(rows[-1], flush=True)
                save()
    if rows:
        save()
        print_table([{k: r.get(k, "") for k in ("case", "per_user_tok_s", "total_tok_s", "ttft_mean_ms",
                                                 "ttft_p99_ms", "tpot_ms", "anchor_value", "speedup", "compiles")}
                     for r in rows],
                    ["case", "per_user_tok_s", "total_tok_s", "ttft_mean_ms", "ttft_p99_ms", "tpot_ms",
                     "anchor_value", "speedup", "compiles"])
        print(f"results: {path}")
    return rows


def _sync_row(rows: list, case: str, c: int, plain: dict, res: dict) -> None:
    """The batch's result ``res`` on an Engine with ``async_scheduling`` off, anchored on the default Engine's row
    ``plain`` (per-user tok/s at C=1, total tok/s above; below 1×: the overlap wins), with whether the tokens are the
    same."""
    metric = "per_user_tok_s" if c == 1 else "total_tok_s"
    rows.append(_row(case, res, "the Engine with async_scheduling", plain[metric], metric=metric,
                     same_tokens=res["outputs"] == plain["outputs"]))
    print(rows[-1], flush=True)


def _heldout_prompts(model_dir: str, vocab: int, n: int, plen: int) -> list[list[int]] | None:
    """``n`` prompts of ``plen`` tokens from the starts of the demo corpus' held-out files (the Python standard
    library, the text ``k3nn demo`` trains on), or None where the checkpoint has no tokenizer or no such files."""
    import os

    from k3nn.demo import load_corpus
    from k3nn.tokenizer import load_tokenizer

    if not os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return None
    try:
        docs = load_corpus(max_train_mb=0.01, max_heldout_mb=0.5).heldout
    except SystemExit:
        return None
    tok = load_tokenizer(model_dir, vocab)
    ids = [t for t in (tok.encode(text)[:plen] for _, text in docs) if len(t) == plen]
    return ids[:n] if len(ids) >= n else None


def _trained(args, dev, dtype, conc, rows, save, left) -> None:
    """A trained target + drafter (real acceptance): generate() with / without the drafter at batch 1, the
    plain and speculative Engine at each concurrency, on 96-token prompts from held-out files of the text the
    demo trains on (else the model's own greedy continuations)."""
    from k3nn.layers.dspark import DSparkDrafter
    from k3nn.model import KimiK3

    model = KimiK3.from_pretrained(args.model, dtype=dtype, device=str(dev)).eval()
    drafter = DSparkDrafter.from_pretrained(args.drafter, model, device=dev, dtype=dtype).eval()
    V = model.config.vocab_size
    new, plen = 128, 96
    prompts = _heldout_prompts(args.model, V, max(conc), plen)
    if prompts is None:  # no tokenizer or no Python source here: the model's own greedy continuations
        seeds = _prompts(V, max(conc), 8, seed=11)
        prompts = [model.generate(torch.tensor([s], device=dev), max_new_tokens=plen - 8, eos_token_id=[])[0].tolist()
                   for s in seeds]
    plain_g, ref = generate_decode_tok_s(model, prompts[0], new, dev)
    spec_g, out = generate_decode_tok_s(model, prompts[0], new, dev, drafter=drafter)
    acc = drafter.last_stats.acceptance_length
    rows.append({"case": f"demo generate() prompt={plen} new={new} spec", "per_user_tok_s": round(spec_g, 1),
                 "anchor": "generate() without the drafter", "anchor_value": round(plain_g, 1),
                 "speedup": round(spec_g / plain_g, 3), "acceptance_length": round(acc, 3),
                 "same_tokens": out == ref})
    print(rows[-1], flush=True)
    save()
    for c in conc:
        if left() < 30:
            break
        engines = {"plain": _engine(model, None, c, plen, new, None),
                   "spec": _engine(model, drafter, c, plen, new, None)}
        if args.sync_rows:
            engines["sync"] = _engine(model, None, c, plen, new, None, async_scheduling=False)
            engines["spec sync"] = _engine(model, drafter, c, plen, new, None, async_scheduling=False)
        for e in engines.values():
            e.warmup(prompt_len=plen, batch_sizes=[c])
        metric = "per_user_tok_s" if c == 1 else "total_tok_s"
        res = engines_best(engines, prompts[:c], new, dev, metric)  # runs alternate between the engines
        a, b = res["plain"], res["spec"]
        if c == 1:
            rows.append(_row(f"demo C=1 prompt={plen} new={new}", a, "generate() batch 1, CUDA graph", plain_g))
        else:
            tot = generate_batch_tok_s(model, prompts[:c], new, dev)
            rows.append(_row(f"demo C={c} prompt={plen} new={new}", a, f"generate() static batch of {c}", tot,
                             metric="total_tok_s"))
        rows.append(_row(f"demo C={c} prompt={plen} new={new} spec", b, "the plain Engine", a[metric],
                         metric=metric, same_tokens=a["outputs"] == b["outputs"]))
        print(rows[-2], rows[-1], flush=True)
        if args.sync_rows:
            _sync_row(rows, f"demo C={c} prompt={plen} new={new} sync", c, a, res["sync"])
            _sync_row(rows, f"demo C={c} prompt={plen} new={new} spec sync", c, b, res["spec sync"])
        save()


if __name__ == "__main__":
    main()
