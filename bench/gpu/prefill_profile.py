"""Where a whole-model prefill spends its GPU time: the 4-layer Kimi-Linear slice (3 KDA + 1 MLA, 32 experts top-8)
in bf16, one forward with a fresh cache at T tokens under torch.profiler, kernels sorted by total CUDA time.

    python -m bench.gpu.prefill_profile [--T 32768] [--top 30] [--experts 32]
"""

from __future__ import annotations

import argparse

import torch

from k3nn import KimiK3, KimiK3Config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    cfg = KimiK3Config.kimi_linear_48b(num_hidden_layers=args.layers, mla_layers=[3], num_experts=args.experts)
    m = KimiK3(cfg, device="cuda", dtype=torch.bfloat16, seed=0).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, args.T), device="cuda")

    def run():
        with torch.no_grad():
            return m(ids, cache=m.new_cache(1, args.T), logits_to_keep=1).logits

    run()
    run()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    print(f"# T={args.T}: {total:.1f} ms of kernels")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=70))


if __name__ == "__main__":
    main()
