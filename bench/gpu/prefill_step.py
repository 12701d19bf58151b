"""The Engine's prefill against generate()'s: C fresh prompts submitted together, time until every first token,
against ``generate(max_new_tokens=1)`` on the static batch; per step budget (``max_num_batched_tokens``), and the
kernels of one 4-prompt chunk next to generate()'s prefill of the same batch.

    python -m bench.gpu.prefill_step --config k3_slice --prompt 2048 --conc 4,16 --budgets 8192,16384,32768
"""

from __future__ import annotations

import argparse
import time

import torch


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_prefill_s(eng, prompts, trace: bool = False) -> float:
    """Wall seconds from submitting ``prompts`` (4 new tokens each, so the first ones decode while the others
    prefill, as in serving) to the last first token; ``trace`` prints each step's work and wall ms."""
    steps = []
    if trace:
        orig_schedule, orig_step = eng.schedule, eng.step

        def schedule():
            dec, pre = orig_schedule()
            steps.append([len(dec), [n for _, n in pre]])
            return dec, pre

        def step():
            _sync()
            t = time.perf_counter()
            out = orig_step()
            _sync()
            if steps:
                steps[-1].append(round((time.perf_counter() - t) * 1e3, 1))
            return out

        eng.schedule, eng.step = schedule, step
    _sync()
    t = time.perf_counter()
    ids = [eng.add_request(p, max_new_tokens=4, ignore_eos=True) for p in prompts]
    list(eng.stream())
    _sync()
    first = max(eng.requests[i].first_token_time for i in ids) - t
    if trace:
        del eng.schedule, eng.step
        for s in steps:
            print(f"    step: {s[0]} decode rows, prefill chunks {s[1]}, {s[2] if len(s) > 2 else '?'} ms", flush=True)
    for i in ids:
        del eng.requests[i]
    return first


def generate_prefill_s(model, prompts) -> float:
    ids = torch.tensor(prompts, device=model.lm_head.weight.device)
    _sync()
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, eos_token_id=[])
    _sync()
    return time.perf_counter() - t


def top_kernels(fn, k: int = 14) -> tuple[float, list[tuple[str, float, int]]]:
    """(kernel ms, [(name, ms, count)] of the ``k`` largest kernel names) of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    acc: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = acc.setdefault(e.name[:70], [0.0, 0])
            a[0] += e.device_time / 1e3
            a[1] += 1
    total = sum(v[0] for v in acc.values())
    return total, sorted(((n, round(v[0], 2), v[1]) for n, v in acc.items()), key=lambda x: -x[1])[:k]


@torch.no_grad()
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.prefill_step")
    ap.add_argument("--config", default="k3_slice")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--conc", default="4,16")
    ap.add_argument("--budgets", default="8192,16384,32768")
    ap.add_argument("--profile", type=int, default=4, help="profile a chunk of this many prompts (0: none)")
    args = ap.parse_args(argv)
    from bench.models import bench_model
    from k3nn.engine import Engine, EngineConfig

    _, model = bench_model(args.config, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    V, L = model.config.vocab_size, args.prompt
    conc = [int(c) for c in args.conc.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    g = torch.Generator().manual_seed(0)

    def prompts(n):
        return [torch.randint(0, V, (L,), generator=g).tolist() for _ in range(n)]

    C = max(conc)
    engines = {}
    for bud in budgets:
        pages = C * (-(-(L + 64) // 64)) * 3 + 16
        eng = Engine(model, EngineConfig(max_num_seqs=C, num_pages=pages, num_snapshots=C,
                                         max_num_batched_tokens=max(bud, L)))
        t = time.perf_counter()
        eng.warmup(prompt_len=min(L, 512), batch_sizes=[C])
        print(f"budget {bud}: warmup {time.perf_counter() - t:.1f}s", flush=True)
        engines[bud] = eng
    for c in conc:
        for _ in range(2):
            generate_prefill_s(model, prompts(c))
        gen = min(generate_prefill_s(model, prompts(c)) for _ in range(3))
        line = [f"C={c} x {L}: generate() prefill {gen * 1e3:.1f} ms"]
        for bud, eng in engines.items():
            engine_prefill_s(eng, prompts(c))
            e = min(engine_prefill_s(eng, prompts(c)) for _ in range(3))
            line.append(f"engine[{bud}] {e * 1e3:.1f} ms ({gen / e:.3f}x)")
        print(" | ".join(line), flush=True)
        if c == max(conc):
            for bud, eng in engines.items():
                print(f"  steps of C={c}, budget {bud}:", flush=True)
                engine_prefill_s(eng, prompts(c), trace=True)
    if args.profile:
        eng = engines[budgets[0]]
        n = args.profile
        gk, gtop = top_kernels(lambda: generate_prefill_s(model, prompts(n)))
        ek, etop = top_kernels(lambda: engine_prefill_s(eng, prompts(n)))
        print(f"kernels, {n} x {L}: generate() {gk:.1f} ms, engine {ek:.1f} ms", flush=True)
        for name, rows in (("generate()", gtop), ("engine", etop)):
            print(f"  {name}:", flush=True)
            for r in rows:
                print(f"    {r[1]:8.2f} ms {r[2]:5d}x  {r[0]}", flush=True)


if __name__ == "__main__":
    main()
