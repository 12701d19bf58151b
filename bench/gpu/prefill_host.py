#!/usr/bin/env python3
"""Is a short whole-model prefill bound by the host? The 4-layer Kimi-Linear slice (3 KDA + 1 MLA, 32 experts top-8)
in bf16, built directly, one forward with ``logits_to_keep=1`` per call at each T:

    fresh cache      the cache allocated inside the call (what an independent harness times)
    reset cache      one cache allocated once, reset in place before each call
    new_cache alone  the allocation by itself

then one call's host time (until the forward returns, every kernel launched) against its device time (until the
stream drains). When the two are close the device waits for the host: launches, not kernels, set the time.

    python3 -m bench.gpu.prefill_host [--T 512,2048]
"""

from __future__ import annotations

import argparse
import time

import torch

from k3nn import KimiK3, KimiK3Config


def _times(fn, reps: int = 10, warm: int = 3) -> tuple[float, float]:
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return ts[0], ts[len(ts) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", default="512,2048", help="comma-separated prompt lengths")
    args = ap.parse_args(argv)
    cfg = KimiK3Config.kimi_linear_48b(num_hidden_layers=4, mla_layers=[3], num_experts=32)
    m = KimiK3(cfg, device="cuda", dtype=torch.bfloat16, seed=0).eval()
    for T in (int(t) for t in args.T.split(",") if t):
        ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
        pre = m.new_cache(1, T)

        @torch.no_grad()
        def fresh():
            return m(ids, cache=m.new_cache(1, T), logits_to_keep=1).logits

        @torch.no_grad()
        def reuse():
            pre.reset()
            return m(ids, cache=pre, logits_to_keep=1).logits

        for name, fn in (("fresh cache", fresh), ("reset cache", reuse), ("new_cache alone", lambda: m.new_cache(1, T)),
                         ("fresh cache", fresh), ("reset cache", reuse)):
            lo, med = _times(fn)
            print(f"T={T} {name:16s} min {lo:.2f} ms  median {med:.2f} ms", flush=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fresh()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"T={T} fresh call: host returns after {1e3 * (t1 - t0):.2f} ms, device done at {1e3 * (t2 - t0):.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()
