"""GPU diagnosis: is speculative greedy lossless on the GPU? Plain greedy's continuation is drafted back
(ReferenceDrafter: real verification, so every draft should be accepted up to bf16 near-ties) through each
speculative round mode: eager rounds (cuda_graph=False), the graph-safe static round without capture
("static") and with captured graphs (True). Per mode: tokens equal to plain greedy (leading run), the
acceptance length, the graphs captured; then one verify window's logits vs the plain decode steps' logits.

    python3 -m bench.gpu.diag_spec [--configs tiny,small] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

from k3nn import KimiK3, KimiK3Config
from k3nn.spec import SpecOptions

from bench.spec import ReferenceDrafter

GAMMA = 7


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--new", type=int, default=48)
    args = ap.parse_args()
    dev = "cuda"
    for name in args.configs.split(","):
        cfg = getattr(KimiK3Config, name)()
        for dt in args.dtypes.split(","):
            dtype = getattr(torch, dt)
            t0 = time.perf_counter()
            model = KimiK3(cfg, dtype=dtype, seed=0).to(dev).eval()
            ids = torch.randint(0, cfg.vocab_size, (1, args.ctx), generator=torch.Generator().manual_seed(0)).to(dev)
            for plain_graph in (False, True):
                ref = model.generate(ids, max_new_tokens=args.new, cuda_graph=plain_graph)
                print(f"== {name} {dt}: plain greedy cuda_graph={plain_graph} ({time.perf_counter() - t0:.1f}s)",
                      flush=True)
            for backend in (None, "eager"):
                model.backend = backend
                for mode in (False, "static", True):
                    rd = ReferenceDrafter(ref[:, args.ctx:], args.ctx)
                    rd.spec_options = SpecOptions(cuda_graph=mode)
                    try:
                        out = model.generate(ids, max_new_tokens=args.new, drafter=rd, num_assistant_tokens=GAMMA)
                    except Exception as e:  # keep diagnosing the other modes
                        print(f"   backend={backend} mode={mode!r}: {type(e).__name__}: {e}"[:300], flush=True)
                        continue
                    same = (out[0, args.ctx:] == ref[0, args.ctx:]).long()
                    st = rd.last_stats
                    print(f"   backend={backend} mode={mode!r}: agree {int(same.cumprod(0).sum())}/{args.new} "
                          f"acceptance {st.acceptance_length:.2f} rounds {st.rounds} path {st.mode} "
                          f"graphs {st.graphs} fallback {st.fallback}", flush=True)
                model.backend = None
            # one verify window vs plain steps: logits of the window's positions
            cache = model.new_cache(1, args.ctx + 32)
            model(ids, cache=cache, logits_to_keep=1)
            win = ref[:, args.ctx:args.ctx + GAMMA + 1]
            lw = model(win, cache=cache).logits.float()
            cache2 = model.new_cache(1, args.ctx + 32)
            model(ids, cache=cache2, logits_to_keep=1)
            steps = torch.cat([model(win[:, i:i + 1], cache=cache2).logits.float() for i in range(GAMMA + 1)], 1)
            rel = ((lw - steps).norm(dim=-1) / steps.norm(dim=-1)).flatten().tolist()
            agree = (lw.argmax(-1) == steps.argmax(-1)).float().mean().item()
            print(f"   window (T={GAMMA + 1}, dynamic cache) vs T=1 steps: per-position rel err "
                  f"{['%.2g' % r for r in rel]} argmax agree {agree:.2f}", flush=True)
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
