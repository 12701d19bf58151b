"""ep: one latent MoE layer run expert-parallel (:mod:`k3nn.parallel.ep`) on W ranks against the same layer with
every expert on one rank, on the same tokens.

The layer is the self-check's (``python -m k3nn.parallel.ep``): K3 expert dims divided by ``--dim-scale``,
``--experts`` experts top-``--topk``, bf16 and MXFP4 experts, ``--tokens`` tokens per rank. Each rank first runs
the whole layer on all ranks' tokens (the anchor, timed on its own tokens), then its expert slice with the
all-to-all dispatch and combine; the rows carry the relative error of the expert-parallel output against the
whole layer. Steps are timed by the host wall clock (20 steps after 3 warm-up ones; the ranks start together).
Rank 0 writes ``moe-ep-<date>.json`` on CUDA (a CPU / gloo run is a smoke test of the code path).

    python -m torch.distributed.run --nproc-per-node 2 -m bench.ep [--tokens 64] [--experts 64] [--topk 16]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from k3nn.parallel.ep import _check_layer, apply_expert_parallel

from bench.common import init_ranks, rel_err, wall_ms, write_results

SUITE = "moe-ep"


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m torch.distributed.run --nproc-per-node W -m bench.ep",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--dim-scale", type=int, default=1, help="divide K3's expert dims (3584 -> 3072) by this")
    args = ap.parse_args(argv)
    dev = init_ranks()
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    try:
        for mx in (False, True):
            moe, x = _check_layer(mx, args.experts, args.topk, args.dim_scale, args.tokens, dev, dtype)
            mine = x[rank * args.tokens:(rank + 1) * args.tokens]
            ref = moe(x)[rank * args.tokens:(rank + 1) * args.tokens]
            one = wall_ms(lambda: moe(mine))
            apply_expert_parallel(moe)
            err = rel_err(moe(mine), ref)
            ms = wall_ms(lambda: moe(mine), barrier=True)
            kind = "mxfp4" if mx else ("bf16" if dtype == torch.bfloat16 else "fp32")
            print(f"[ep bench rank {rank}/{world} {kind} E={args.experts} k={args.topk} {dist.get_backend()}] "
                  f"rel err {err:.2e}  ep {ms:.3f} ms vs one rank {one:.3f} ms", flush=True)
            if rank == 0:
                rows.append({"case": f"ep{world} latent {kind} E={args.experts} k={args.topk} "
                                     f"N={args.tokens}/rank D={x.shape[1]}", "k3nn_ms": round(ms, 4),
                             "anchor": "the same layer, every expert on one rank, same tokens",
                             "anchor_ms": round(one, 4), "rel_err_vs_one_rank": float(f"{err:.3g}"),
                             "timing": "host wall clock per step, 20 steps"})
        if rows and cuda:
            print(f"wrote {write_results(SUITE, rows, {'world_size': world, 'backend': dist.get_backend()})}")
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
