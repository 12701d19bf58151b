"""One warm Engine decode step, profiled: wall time vs CUDA kernel time, kernel launches, host syncs, and the
host time of each phase of ``Engine.step`` (schedule, draft, forward, draws, outputs).

    python -m bench.gpu.engine_step --config k3_slice --ctx 2048
    python -m bench.gpu.engine_step --model DIR --drafter DIR      (a trained pair: verify steps too)
"""

from __future__ import annotations

import argparse
import time

import torch


def profile_steps(engine, n_steps: int = 8) -> dict:
    """Run ``n_steps`` warm steps of the engine's current requests under the profiler: per step wall ms, kernel
    ms (sum of CUDA kernel durations), launches and synchronisations (cudaStreamSynchronize / cudaMemcpy
    calls that block)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n_steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n_steps
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_ms = sum(e.device_time for e in kern) / 1e3 / n_steps
    names = [e.name for e in prof.events()]
    launches = sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
                   for n in names) / n_steps
    graphs = sum(n == "cudaGraphLaunch" for n in names) / n_steps
    syncs = sum(n in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync") for n in names) / n_steps
    return {"wall_ms": round(wall * 1e3, 3), "kernel_ms": round(kernel_ms, 3),
            "host_beyond_kernels_ms": round(wall * 1e3 - kernel_ms, 3), "kernels_per_step": len(kern) / n_steps,
            "launch_calls": launches, "graph_launches": graphs, "sync_or_copy_calls": syncs}


def phase_times(engine, n_steps: int = 8) -> dict:
    """Host ms per phase of a step (synchronising after each, so the phases do not overlap)."""
    import k3nn.engine.engine as E

    acc: dict[str, float] = {}
    orig = {k: getattr(engine, k) for k in ("schedule", "_forward", "_draw")}
    orig_draft = E.draft

    def timed(name, fn):
        def wrap(*a, **k):
            torch.cuda.synchronize()
            t = time.perf_counter()
            r = fn(*a, **k)
            torch.cuda.synchronize()
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
            return r
        return wrap

    for k, f in orig.items():
        setattr(engine, k, timed(k, f))
    E.draft = timed("draft", orig_draft)
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n_steps):
            engine.step()
        total = time.perf_counter() - t0
    finally:
        for k in orig:
            delattr(engine, k)
        E.draft = orig_draft
    out = {k: round(v / n_steps * 1e3, 3) for k, v in acc.items()}
    out["step_ms"] = round(total / n_steps * 1e3, 3)
    return out


@torch.no_grad()
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.engine_step")
    ap.add_argument("--config", default="k3_slice")
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--conc", default="1,16")
    args = ap.parse_args(argv)
    from k3nn.engine import Engine, EngineConfig

    dev = torch.device("cuda")
    drafter = None
    if args.model:
        from k3nn.layers.dspark import DSparkDrafter
        from k3nn.model import KimiK3

        model = KimiK3.from_pretrained(args.model, dtype=torch.bfloat16, device="cuda").eval()
        if args.drafter:
            drafter = DSparkDrafter.from_pretrained(args.drafter, model, device=dev, dtype=torch.bfloat16).eval()
    else:
        from bench.models import bench_model

        _, model = bench_model(args.config, dev)
    V = model.config.vocab_size
    for c in [int(x) for x in args.conc.split(",")]:
        for d in ([None, drafter] if drafter is not None else [None]):
            pages = c * (-(-(args.ctx + 300) // 64)) + 8
            eng = Engine(model, EngineConfig(max_num_seqs=c, num_pages=pages, num_snapshots=4,
                                             max_num_batched_tokens=max(8192, args.ctx)), drafter=d)
            t = time.perf_counter()
            eng.warmup(prompt_len=min(args.ctx, 256), batch_sizes=[c])
            wu = time.perf_counter() - t
            g = torch.Generator().manual_seed(c)
            for _ in range(c):
                eng.add_request(torch.randint(0, V, (args.ctx,), generator=g).tolist(), max_new_tokens=200,
                                ignore_eos=True)
            while any(r.num_computed < len(r.prompt) for r in eng.running) or eng.waiting:
                eng.step()
            for _ in range(3):
                eng.step()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(8):
                eng.step()
            torch.cuda.synchronize()
            free_ms = (time.perf_counter() - t) / 8 * 1e3  # the real step: no profiler, no syncs between phases
            prof = profile_steps(eng)
            ph = phase_times(eng)
            print(f"C={c} drafter={d is not None} warmup {wu:.1f}s graphs {len(eng.runner.graphs.graphs)} "
                  f"failed {list(eng.runner.graphs.failed.items())[:2]}", flush=True)
            print(f"  step (unprofiled): {free_ms:.3f} ms", flush=True)
            print("  profile:", prof, flush=True)
            print("  phases :", ph, flush=True)
            for rid in list(eng.requests):
                eng.abort(rid)
            del eng


if __name__ == "__main__":
    main()
