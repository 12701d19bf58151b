"""Where a whole-model prefill spends its time: the 4-layer Kimi-Linear slice (3 KDA + 1 MLA, 32 experts top-8)
in bf16, one forward with a fresh cache at each T under torch.profiler. Per T: the wall time (minimum of five warm
calls, no profiler), the kernel time, kernel launches and host synchronisations of one call, the host ops by self
CPU time, and the kernels by total CUDA time. Where the wall time stays flat while the kernel time falls, the host
is the limit.

    python -m bench.gpu.prefill_profile [--T 512,2048,32768] [--top 30] [--experts 32] [--from-transformers]

``--from-transformers`` builds the model as ``bench prefill`` does (transformers' ``KimiLinearForCausalLM`` with
random weights and biases, saved and loaded by ``KimiK3.from_pretrained``; needs transformers), to compare the
two builds' wall times.
"""

from __future__ import annotations

import argparse
import time

import torch

from k3nn import KimiK3, KimiK3Config

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="32768", help="comma-separated prompt lengths")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--from-transformers", action="store_true", help="build the model as bench prefill does")
    args = ap.parse_args()
    if args.from_transformers:
        from bench.prefill import build_pair

        hf, m = build_pair(args.layers, args.experts, 163840)
        del hf
        cfg = m.config
    else:
        cfg = KimiK3Config.kimi_linear_48b(num_hidden_layers=args.layers, mla_layers=[3], num_experts=args.experts)
        m = KimiK3(cfg, device="cuda", dtype=torch.bfloat16, seed=0).eval()
    print(f"# router weight {m.model.layers[1].block_sparse_moe.gate.weight.dtype}, model {m.lm_head.weight.dtype}")
    from torch.profiler import ProfilerActivity, profile

    for T in (int(t) for t in args.T.split(",") if t):
        ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")

        def run():
            with torch.no_grad():
                return m(ids, cache=m.new_cache(1, T), logits_to_keep=1).logits

        run()
        run()
        walls = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        avg = prof.key_averages()
        kernels = sum(e.self_device_time_total for e in avg) / 1e3
        launches = sum(e.count for e in avg if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                                          "cuLaunchKernelEx"))
        syncs = {e.key: e.count for e in avg if e.key in SYNC_CALLS or "Memcpy" in e.key}
        print(f"# T={T}: wall {min(walls):.2f} ms (min of 5; median {sorted(walls)[2]:.2f}), kernels {kernels:.2f} ms, "
              f"{launches} launches, sync / copy calls {syncs}", flush=True)
        print(avg.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60), flush=True)
        print(avg.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=70), flush=True)


if __name__ == "__main__":
    main()
