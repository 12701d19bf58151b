"""e2e: decode tokens/s of the whole model on the ``k3_slice`` preset (K3's layer dims, 8 layers, 128 MXFP4
experts top-16), one decode step = forward of one token per row + greedy pick, as ``generate()`` runs it.

Modes, side by side in one run on the same prefilled cache (cloned per mode):

* ``eager``: every op on the eager backend, standard decode step, no graph (the anchor);
* ``triton``: the auto backend (Triton kernels where they exist), standard step, no graph;
* ``triton+graphs``: the same step captured in a CUDA graph and replayed;
* ``latency_specialized``: the same layers with their decode weights prepared (packed projections) and MLA
  reading the static latent pool (``make_decode_runner(decode_backend="latency_specialized")``) in a CUDA graph.

Each mode's first-step logits are compared with eager's (relative error) and its greedy tokens with eager's
(agreement up to the first difference: bf16 kernels may flip near-ties). Kernel launches per step are counted
with ``torch.profiler`` on one non-graph step of that mode (CUDA kernels + memcpy/memset), per layer =
launches / layers; the latency-specialized rows carry the top kernels by device time (per-op breakdown).

    k3nn bench e2e [--batches 1,8,64] [--steps 16] [--ctx 128] [--budget-s 400]
    k3nn bench e2e --allow-cpu --config tiny   (CPU smoke run: timings are not results)
    torchrun --nproc-per-node 2 -m bench.e2e --tp   (tensor parallel over 2 GPUs: e2e-tp-*.json)
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from k3nn.cache.hybrid import HybridCache, KDAState
from k3nn.config import KimiK3Config
from k3nn.decode.runner import make_decode_runner

from bench.common import print_table, rel_err, sync, write_results
from bench.models import build_model

SUITE = "e2e"
MODES = {  # name: (backend, cuda_graph, decode_backend)
    "eager": ("eager", False, "auto"),
    "triton": ("auto", False, "auto"),
    "triton+graphs": ("auto", True, "auto"),
    "latency_specialized": ("auto", True, "latency_specialized"),
}


def clone_cache(src: HybridCache) -> HybridCache:
    c = HybridCache(src.config, src.batch_size, src.max_length, src.dtype, src.device,
                    mla_pool=any(not isinstance(s, KDAState) and s.kv is not None for s in src.layers))
    for a, b in zip(c.layers, src.layers):
        if isinstance(a, KDAState):
            a.recurrent.copy_(b.recurrent)
            a.conv.copy_(b.conv)
        elif a.kv is not None:
            a.kv.copy_(b.kv)
        else:
            a.latent.copy_(b.latent)
            a.rope.copy_(b.rope)
    c.key_mask.copy_(src.key_mask)
    c.valid_counts.copy_(src.valid_counts)
    c.seen_tokens = src.seen_tokens
    return c


def count_launches(fn, dev) -> tuple[int, list[dict]]:
    """Device kernels (and memcpy/memset) launched by one call of ``fn``; plus the top kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sync(dev)
    with profile(activities=acts) as prof:
        fn()
        sync(dev)
    if dev.type != "cuda":  # CPU smoke run: count aten ops instead
        ev = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        return sum(e.count for e in ev), []
    from torch.autograd import DeviceType

    ev = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    n = sum(e.count for e in ev)
    t = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)  # noqa: E731
    top = sorted(ev, key=t, reverse=True)[:15]
    return n, [{"kernel": e.key[:120], "count": e.count, "device_us": round(t(e), 1)} for e in top]


def run_mode(model, base: HybridCache, first: torch.Tensor, mode: str, steps: int, warm: int = 3):
    backend, graph, dec = MODES[mode]
    dev = base.device
    model.backend = backend
    try:
        return _run_mode(model, base, first, backend, graph, dec, steps, warm, dev)
    finally:
        model.backend = None


def _run_mode(model, base, first, backend, graph, dec, steps, warm, dev):
    cache = clone_cache(base)
    runner = make_decode_runner(model, cache, cuda_graph=graph, decode_backend=dec)
    nxt, toks, logits0 = first, [], None
    for i in range(warm):
        logits = runner(nxt[:, None])
        if i == 0:
            logits0 = logits.float().clone()
        nxt = logits.argmax(-1)
        toks.append(nxt)
    sync(dev)
    t0 = time.perf_counter()
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    for _ in range(steps):
        nxt = runner(nxt[:, None]).argmax(-1)
        toks.append(nxt)
    if dev.type == "cuda":
        b.record()
        b.synchronize()
        ms = a.elapsed_time(b) / steps
    else:
        ms = (time.perf_counter() - t0) * 1e3 / steps
    info = dict(path=runner.name, graph=runner.uses_graph, fallback=runner.fallback_reason)
    # launches of one step of this path, run eagerly (what the graph holds when captured)
    step_fn = runner.fn
    runner.close()
    cache.set_static(runner.mode != "standard")
    n, top = count_launches(lambda: step_fn(nxt[:, None]), dev)
    cache.set_static(False)
    return ms, torch.stack(toks, 1), logits0, info, n, top


def _over_budget(local: bool, tp: bool, dev) -> bool:
    """Rank 0 decides for every rank (ranks that disagree would deadlock in the collectives)."""
    if not tp:
        return local
    import torch.distributed as dist

    t = torch.tensor([int(local)], device=dev)
    dist.broadcast(t, 0)
    return bool(t.item())


@torch.no_grad()
def main(argv=None):
    ap = argparse.ArgumentParser(prog="k3nn bench e2e")
    ap.add_argument("--config", default="k3_slice", help="preset: k3_slice (default) or tiny (CPU smoke)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=128, help="prompt tokens prefilled before decoding")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting new cases after this long")
    ap.add_argument("--tp", action="store_true",
                    help="under torchrun: shard the model over the ranks (k3nn.parallel.tp); rank 0 writes")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world = 0, 1
    if args.tp:
        import torch.distributed as dist

        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = getattr(KimiK3Config, args.config)()
    model = build_model(cfg, str(dev), dtype)  # same seed on every rank: the same full weights
    if args.tp:
        from k3nn.parallel.tp import apply_tensor_parallel

        apply_tensor_parallel(model)
    L = cfg.num_hidden_layers
    tag = f" tp{world}" if args.tp else ""
    print(f"built {args.config}{tag} on {dev} in {time.perf_counter() - t_start:.1f}s", flush=True)
    rows: list[dict] = []
    modes = [m for m in args.modes.split(",") if m]
    try:
        for B in [int(b) for b in args.batches.split(",")]:
            gen = torch.Generator(device=dev).manual_seed(B)
            ids = torch.randint(0, cfg.vocab_size, (B, args.ctx), generator=gen, device=dev)
            base = HybridCache(model.config, B, args.ctx + args.steps + 8, dtype, dev, mla_pool=True)
            logits = model(ids, cache=base, logits_to_keep=1).logits[:, -1]
            first = logits.argmax(-1)
            ref = None
            for mode in modes:
                if _over_budget(time.perf_counter() - t_start > args.budget_s, args.tp, dev):
                    print(f"budget reached: skipping B={B} {mode}", flush=True)
                    continue
                t0 = time.perf_counter()
                try:
                    ms, toks, l0, info, n, top = run_mode(model, base, first, mode, args.steps)
                except Exception as e:  # record and go on: one broken mode must not lose the others
                    rows.append({"case": f"{args.config}{tag} B{B} ctx{args.ctx} {mode}", "error": f"{type(e).__name__}: {e}"[:400]})
                    print(rows[-1], flush=True)
                    model.backend = None
                    continue
                row = {"case": f"{args.config}{tag} B{B} ctx{args.ctx} {str(dtype)[6:]} {mode}", "mode": mode, "batch": B,
                       "k3nn_ms": round(ms, 4), "tokens_per_s": round(B * 1e3 / ms, 1),
                       "launches_per_step": n, "launches_per_layer": round(n / L, 1), **info,
                       "wall_s": round(time.perf_counter() - t0, 1)}
                if mode == "eager":
                    ref = (ms, toks, l0)
                elif ref is not None:
                    same = (toks == ref[1]).all(0).long()
                    row.update(anchor="k3nn eager", anchor_ms=round(ref[0], 4),
                               speedup=round(ref[0] / ms, 2), logits_rel_err_vs_eager=float(f"{rel_err(l0, ref[2]):.3g}"),
                               greedy_steps_equal_to_eager=int(same.cumprod(0).sum()), greedy_steps=toks.shape[1])
                if mode.startswith("latency_specialized"):
                    row["top_kernels"] = top
                rows.append(row)
                print({k: v for k, v in row.items() if k != "top_kernels"}, flush=True)
            del base
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        meta = {"suite": SUITE, "config": args.config, "tp": world, "layers": L, "ctx": args.ctx, "steps": args.steps,
                "note": "tokens/s = B / step time; a step = one-token forward + greedy argmax"}
        path = write_results(SUITE + ("-tp" if args.tp else ""), rows, meta) if rows and rank == 0 else None
        if args.tp:
            import torch.distributed as dist

            dist.destroy_process_group()
        if rank:
            return rows
        print_table(rows, ["case", "k3nn_ms", "tokens_per_s", "speedup", "launches_per_layer", "graph",
                           "logits_rel_err_vs_eager", "greedy_steps_equal_to_eager"])
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
