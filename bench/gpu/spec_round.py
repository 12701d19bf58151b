"""Where a speculative round of ``generate(drafter=)`` spends its time on a trained pair: wall and kernel ms per
generated token with and without the drafter, graph launches, host syncs, and the largest kernels.

    python -m bench.gpu.spec_round --model DIR --drafter DIR [--new 128]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.gpu.prefill_step import top_kernels


@torch.no_grad()
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.spec_round")
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from bench.serving import _heldout_prompts
    from k3nn.layers.dspark import DSparkDrafter
    from k3nn.model import KimiK3

    from bench.gpu.prefill_step import _sync

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = KimiK3.from_pretrained(args.model, dtype=dtype, device=str(dev)).eval()
    drafter = DSparkDrafter.from_pretrained(args.drafter, model, device=dev, dtype=dtype).eval()
    prompt = (_heldout_prompts(args.model, model.config.vocab_size, 1, 96)
              or torch.randint(0, model.config.vocab_size, (1, 96)).tolist())[0]
    ids = torch.tensor([prompt], device=dev)
    for name, kw in (("plain", {}), ("drafter", {"drafter": drafter})):
        for _ in range(3):
            model.generate(ids, max_new_tokens=args.new, eos_token_id=[], **kw)
        _sync()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=args.new, eos_token_id=[], **kw)
        _sync()
        wall = time.perf_counter() - t
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.generate(ids, max_new_tokens=args.new, eos_token_id=[], **kw)
            _sync()
        names = [e.name for e in prof.events()]
        count = {k: sum(n == k for n in names) for k in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel",
                                                          "cudaStreamSynchronize", "cudaMemcpyAsync",
                                                          "cudaGraphInstantiate")}
        kern, top = top_kernels(lambda: model.generate(ids, max_new_tokens=args.new, eos_token_id=[], **kw), 12)
        print(f"{name}: {args.new} tokens in {wall * 1e3:.1f} ms ({args.new / wall:.0f} tok/s); kernels "
              f"{kern:.1f} ms; calls {count}", flush=True)
        for r in top:
            print(f"    {r[1]:8.2f} ms {r[2]:5d}x  {r[0]}", flush=True)


if __name__ == "__main__":
    main()
