"""Per-token cost of the Engine's per-request sampling (k3nn.engine.sampling.RequestSampler) at Kimi's vocabulary.

    python3 -m bench.gpu.sampling_overhead [--vocab 163840] [--tokens 200]
    python3 -m bench.gpu.sampling_overhead --device cpu --vocab 4096 --tokens 20   # the CPU parts

1. Checks: the device sampler's processed scores and verify window (penalties, min_tokens, warpers) equal the CPU
   sampler's; under ``torch.cuda.set_sync_debug_mode("error")`` they run without a host sync; greedy ``choose``
   gives the CPU token and ``logprobs`` the CPU values.
2. Timing, per configuration (plain argmax; greedy + penalties; sampling with temperature / top-k / top-p;
   sampling + penalties + min_tokens; the same with logprobs=5): host wall microseconds per ``choose`` over a
   decode of ``--tokens`` tokens (its output growing, so the count tensors update every step; ``choose`` ends in
   the one sync that reads the token), and CUDA-event microseconds of ``window_scores`` for a window of 8.

Writes ``sampling-<timestamp>.json`` (``meta`` + ``rows``, bench.common's schema) to $K3NN_RESULTS_DIR (default
bench/results) and prints a table; exits 1 when a check fails (after writing the file).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from k3nn.engine.request import SamplingParams
from k3nn.engine.sampling import RequestSampler

CONFIGS = {
    "argmax": dict(),
    "greedy+penalties": dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3),
    "sample": dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.95),
    "sample+penalties+min_tokens": dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.95,
                                        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3,
                                        min_tokens=16, stop_token_ids=[7]),
    "sample+penalties+logprobs": dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.95,
                                      repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3,
                                      logprobs=5),
}


def make(kw, V, device, prompt, max_new):
    g = torch.Generator(device=device).manual_seed(0) if kw.get("do_sample") else None
    return RequestSampler(SamplingParams(max_new_tokens=max_new, **kw), prompt, vocab_size=V, eos_ids=[2],
                          device=device, generator=g)


def check(V, device, prompt) -> dict:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, V, generator=g) * 3
    out = torch.randint(0, V, (40,), generator=g).tolist()
    drafts = torch.randint(0, V, (7,), generator=g)
    kw = CONFIGS["sample+penalties+min_tokens"] | dict(min_tokens=44)
    dev, cpu = make(kw, V, device, prompt, 64), make(kw, V, "cpu", prompt, 64)
    dl, dd = logits.to(device), drafts.to(device)
    dev.scores(dl[0], out[:30])
    sync_free = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        s1, s3 = dev.scores(dl[0], out[:31]), dev.scores(dl[0], out[:34])
        w = dev.window_scores(dl, out, dd)
        sync_free = True if device == "cuda" else None
    except RuntimeError as e:
        print(f"host sync inside scores/window_scores: {e}", flush=True)
        sync_free = False
        s1 = s3 = w = None
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    res = {"sync_free": sync_free}
    if s1 is not None:
        err = max((s1.cpu() - cpu.scores(logits[0], out[:31])).abs().nan_to_num().max().item(),
                  (s3.cpu() - cpu.scores(logits[0], out[:34])).abs().nan_to_num().max().item(),
                  (w.cpu() - cpu.window_scores(logits, out, drafts)).abs().nan_to_num().max().item())
        res["scores_max_err"] = err
    gk = CONFIGS["greedy+penalties"] | dict(logprobs=5)
    t_dev, lp_dev = make(gk, V, device, prompt, 64).choose(dl[0], out)
    t_cpu, lp_cpu = make(gk, V, "cpu", prompt, 64).choose(logits[0], out)
    res["greedy_token_equal"] = t_dev == t_cpu and list(lp_dev.top) == list(lp_cpu.top)
    res["logprob_err"] = abs(lp_dev.logprob - lp_cpu.logprob)
    res["ok"] = bool(sync_free is not False and res.get("scores_max_err", 1.0) < 1e-4 and res["greedy_token_equal"]
                     and res["logprob_err"] < 1e-4)
    return res


def time_config(name, kw, V, device, prompt, tokens) -> dict:
    g = torch.Generator(device="cpu").manual_seed(2)
    logits = (torch.randn(16, V, generator=g) * 3).to(device=device, dtype=torch.bfloat16)
    s = make(kw, V, device, prompt, tokens + 64)
    out: list[int] = []
    for i in range(8):  # warm-up
        out.append(s.choose(logits[i % 16], out)[0])
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(tokens):
        out.append(s.choose(logits[i % 16], out)[0])
    choose_us = (time.perf_counter() - t0) / tokens * 1e6
    window = logits[:8].float()
    drafts = torch.randint(0, V, (7,), generator=g).to(device)
    if device == "cuda":
        from bench.common import bench_ms

        window_us = bench_ms(lambda: s.window_scores(window, out, drafts)) * 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(5):
            s.window_scores(window, out, drafts)
        window_us = (time.perf_counter() - t0) / 5 * 1e6
    return {"name": name, "vocab": V, "tokens": tokens, "choose_us": round(choose_us, 1),
            "window8_us": round(window_us, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--out", default=None, help="result directory (default $K3NN_RESULTS_DIR or bench/results)")
    a = ap.parse_args(argv)
    V, device = a.vocab, a.device
    prompt = torch.randint(0, V, (a.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    checks = check(V, device, prompt)
    print(f"checks: {checks}", flush=True)
    rows = [time_config(n, kw, V, device, prompt, a.tokens) for n, kw in CONFIGS.items()]
    print(f"{'config':30s} {'choose us/token':>16s} {'window(8) us':>13s}")
    for r in rows:
        print(f"{r['name']:30s} {r['choose_us']:16.1f} {r['window8_us']:13.1f}")
    from bench.common import write_results

    path = write_results("sampling", rows, {"checks": checks, "device": device}, out_dir=a.out)
    print(f"wrote {path}", flush=True)
    return 0 if checks["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
