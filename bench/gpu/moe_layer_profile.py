#!/usr/bin/env python3
"""Per-kernel CUDA time of one bf16 latent MoE layer (route, align, up / down GEMMs, finalize) at T tokens: K3's
latent expert shapes (3584 → 3072 → 3584, SiTU-GLU), top-16 of 128 experts. Whatever k3nn is first on the path is
profiled, so two trees can be compared on one machine in one session (an older tree through PYTHONPATH):

    python3 bench/gpu/moe_layer_profile.py [T ...]
    PYTHONPATH=/path/to/old/src python3 bench/gpu/moe_layer_profile.py 2048 8192
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import k3nn
from k3nn.kernels.moe.triton_fused import fused_expert_outputs, moe_finalize_triton
from k3nn.layers.moe import route

D, INTER, TOPK, E = 3584, 3072, 16, 128


def main(argv=None):
    lengths = [int(t) for t in (sys.argv[1:] if argv is None else argv)] or [2048, 8192]
    print("k3nn from", k3nn.__file__, flush=True)
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w1 = (torch.randn(E, INTER, D, device=dev, generator=g) / D ** 0.5).to(bf)
    w3 = (torch.randn(E, INTER, D, device=dev, generator=g) / D ** 0.5).to(bf)
    w2 = (torch.randn(E, D, INTER, device=dev, generator=g) / INTER ** 0.5).to(bf)
    gain = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).to(bf)
    bias = 0.05 * torch.randn(E, device=dev, generator=g)

    def layer(logits, z):
        ids, w = route(logits, bias, TOPK, True, 1.0)
        y = fused_expert_outputs(z, w1, w3, w2, ids, "situ", 4.0, 25.0)
        return moe_finalize_triton(y, w, gain, 1e-5)

    for T in lengths:
        logits = torch.randn(T, E, device=dev, generator=g)
        z = torch.randn(T, D, device=dev, generator=g).to(bf)
        for _ in range(3):
            layer(logits, z)
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            layer(logits, z)
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) * 1e3)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            layer(logits, z)
            torch.cuda.synchronize()
        print(f"T={T}: min {min(ts):.3f} ms, median {sorted(ts)[2]:.3f} ms", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70),
              flush=True)


if __name__ == "__main__":
    main()
