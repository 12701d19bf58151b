"""dcp: one MLA decode step with decode context parallelism (:mod:`k3nn.parallel.dcp`) on W ranks against one
device holding the whole cache.

Per case ``B,L,H`` (K3 latent dims: kv_lora 512 + rope 64, block 64; bf16 on CUDA, fp32 on CPU), a cache of B
requests × L tokens is sharded over the W ranks (interleave ``--interleave``) and ``dcp_attention`` decodes one
token per request: with replicated heads (default; a layer without tensor parallelism) local decode, one
all-gather of (o, lse) and the fused merge; with ``--heads sharded`` (H/W query heads per rank) all-gather Q,
local decode, LSE all-gather, fused merge, reduce-scatter. The anchor: rank 0 decoding the whole cache alone with
``mla_decode`` (same process, no collectives). Rows carry ``tpot_ratio`` = k3nn_ms / anchor_ms and the KV bytes
per rank. Rank 0 writes ``mla-dcp-<date>.json`` on CUDA (a CPU / gloo run is a smoke test of the code path).

    python -m torch.distributed.run --nproc-per-node 2 -m bench.dcp [--cases B,L,H[;B,L,H...]] \\
        [--backend auto|triton|eager] [--heads replicated|sharded] [--interleave I] [--eager] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist

from k3nn.cache.pages import PagedLatentCache
from k3nn.kernels.registry import backend as use_backend
from k3nn.ops.mla import mla_decode
from k3nn.parallel.dcp import DCPContext, dcp_attention, dcp_local_lens

from bench.common import init_ranks, wall_ms, write_results

SUITE = "mla-dcp"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m torch.distributed.run --nproc-per-node W -m bench.dcp",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", metavar="B,L,H[;B,L,H...]", default="64,8192,64;1,131072,64;1,262144,64;1,524288,64",
                    help="requests, tokens per request, query heads; one case per ';'")
    ap.add_argument("--backend", default="auto", help="kernel backend of the decode (auto, triton, eager, cuda)")
    ap.add_argument("--interleave", type=int, default=1, help="tokens per rank before the next rank's turn")
    ap.add_argument("--heads", choices=("sharded", "replicated"), default="replicated",
                    help="queries of all H heads on every rank (1 collective; what a layer without tensor "
                         "parallelism does) or of H/W heads per rank (3 collectives, for TP-sharded heads)")
    ap.add_argument("--eager", action="store_true",
                    help="time eager steps only (default on CUDA: also steps replayed from CUDA graphs)")
    ap.add_argument("--graph-steps", type=int, default=10, help="decode steps captured per CUDA graph")
    ap.add_argument("--lens-per-layer", action="store_true",
                    help="count the rank-local lengths kernel in every layer's step (default: computed once per "
                         "decode step and shared by all MLA layers, as a model step does)")
    ap.add_argument("--profile", action="store_true",
                    help="print rank 0's torch.profiler tables of eager steps and graph replays")
    args = ap.parse_args(argv)
    cases = [tuple(int(v) for v in c.split(",")) for c in args.cases.split(";") if c.strip()]
    if not cases or any(len(c) != 3 for c in cases):
        raise SystemExit(f"--cases wants B,L,H[;B,L,H...], got {args.cases!r}")
    cuda = init_ranks().type == "cuda"
    graphs = cuda and not args.eager
    try:
        ctx = DCPContext.from_group(interleave=args.interleave)
        rows = []
        for case in cases:
            rows += bench_case(ctx, *case, backend_name=args.backend, graph=graphs, graph_steps=args.graph_steps,
                               heads=args.heads, lens_per_layer=args.lens_per_layer, profile=args.profile)
        if ctx.rank == 0 and cuda:
            path = write_results(SUITE, rows, {"world_size": ctx.world_size, "backend": dist.get_backend(ctx.group),
                                               "graphs": graphs, "heads": args.heads})
            print(f"wrote {path}", flush=True)
        if graphs:  # NCCL teardown with graph-captured collectives can hang the launcher: leave at once
            torch.cuda.synchronize()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return 0
    finally:
        dist.destroy_process_group()


_KEEP: list = []  # see bench_case


def bench_case(ctx: DCPContext, B: int, L: int, H: int, backend_name: str = "auto", graph: bool = False,
               graph_steps: int = 10, heads: str = "replicated", lens_per_layer: bool = False,
               profile: bool = False) -> list[dict]:
    """Per-step time of ``dcp_attention`` (sharded heads: all-gather Q, local decode, LSE all-gather, fused
    merge, reduce-scatter; replicated heads: local decode, all-gather of (o, lse), fused merge) over a cache of
    B requests × L tokens sharded on W ranks, against one rank decoding the whole cache alone (rank 0, same
    process, no collectives).

    Eager steps are timed by the host wall clock (``*_eager_ms``). With ``graph`` (CUDA) ``graph_steps`` steps
    are captured in one CUDA graph (NCCL collectives included) and replays are timed with CUDA events:
    ``k3nn_ms`` / ``anchor_ms`` are then graph times per step, as a serving loop replaying a captured decode
    step would see them. ``profile`` prints rank 0's profile of eager steps (host ops, kernels) and, with graphs,
    of graph replays (kernels)."""
    W, r, dr, bs = ctx.world_size, 512, 64, 64
    cuda = torch.cuda.is_available()
    graph = graph and cuda
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if H % W and heads == "sharded":
        raise ValueError(f"--heads sharded: H={H} must divide by the world size {W}")
    Hq = H // W if heads == "sharded" else H
    g = torch.Generator(device=dev).manual_seed(1234 + ctx.rank)

    def sync(together):
        if cuda:
            torch.cuda.synchronize()
        if W > 1 and together:
            dist.barrier(group=ctx.group)

    def timed(fn, together=True):
        return wall_ms(fn, barrier=W > 1 and together, group=ctx.group)

    def capture(fn, together=True):
        """``graph_steps`` calls of fn in one CUDA graph, after a warm-up on a side stream (torch wants the
        first use of an NCCL communicator, and any lazy init, outside capture)."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        sync(together)
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            for _ in range(graph_steps):
                fn()
        torch.cuda.synchronize()
        return cg

    def replay_ms(cg, reps=20, together=True):
        for _ in range(3):
            cg.replay()
        sync(together)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            cg.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / (reps * graph_steps)

    def show(prof, by):
        print(prof.key_averages().table(sort_by=by, row_limit=14), flush=True)

    def profiled():
        from torch.profiler import ProfilerActivity, profile as torch_profile

        if ctx.rank:
            return contextlib.nullcontext()
        return torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))

    def make(world, rank, heads):
        cache = PagedLatentCache(1, B * -(-L // (bs * world)) + 1, r, dr, block_size=bs, dtype=dtype, device=dev,
                                 world_size=world, rank=rank, interleave=ctx.interleave if world > 1 else 1)
        ids = list(range(B))
        for i in ids:
            cache.add(i)
        cache.extend(ids, L)
        cache.pools[0].copy_(torch.randn(cache.pools[0].shape, device=dev, generator=g).to(dtype))
        q = torch.randn(B, 1, heads, r + dr, device=dev, generator=g).to(dtype)
        return cache, q, ids

    keep = _KEEP  # graphs with captured collectives (and what they read) live until the process ends
    cache, q, ids = make(W, ctx.rank, Hq)
    bt, sl = cache.block_table(ids), cache.seq_lens(ids)
    out = (torch.empty(B, 1, Hq, r, device=dev), torch.empty(B, 1, Hq, device=dev))
    ql, qr, pool = q[..., :r], q[..., r:], cache.pools[0]  # halves of one tensor: no copy before the gather

    lens = None if lens_per_layer else dcp_local_lens(sl, 1, ctx)  # once per model step, shared by the layers

    def step():
        dcp_attention(ql, qr, pool, bt, sl, 0.0722, ctx, heads=heads, check=False, out=out, local_lens=lens)

    ms_dcp_graph = None
    with use_backend(backend_name):
        dcp_attention(ql, qr, pool, bt, sl, 0.0722, ctx, heads=heads, out=out)  # checks the inputs, tunes
        ms_dcp = timed(step)
        if graph:
            cg = capture(step)
            keep.append(cg)
            ms_dcp_graph = replay_ms(cg)
        if profile:  # where a DCP step's time goes (rank 0 host ops and kernels; the peer runs the same steps)
            sync(True)
            with profiled() as prof:
                for _ in range(5):
                    step()
                if cuda:
                    torch.cuda.synchronize()
            if ctx.rank == 0:
                print("[dcp profile] 5 eager steps", flush=True)
                show(prof, "self_cpu_time_total")
                if cuda:
                    show(prof, "self_cuda_time_total")
            if graph:
                sync(True)
                with profiled() as prof:
                    for _ in range(2):
                        cg.replay()
                    torch.cuda.synchronize()
                if ctx.rank == 0:
                    print(f"[dcp profile] 2 graph replays = {2 * graph_steps} steps", flush=True)
                    show(prof, "self_cuda_time_total")
    kv_bytes = cache.pools[0].numel() * cache.pools[0].element_size()
    if graph:
        keep.append(cache)
    else:
        del cache
    rows = []
    if ctx.rank == 0:
        full, qf, ids = make(1, 0, H)
        btf, slf = full.block_table(ids), full.seq_lens(ids)
        qlf, qrf, poolf = qf[..., :r], qf[..., r:], full.pools[0]

        def one():
            mla_decode(qlf, qrf, poolf, btf, slf, 0.0722, check=False)

        ms_one_graph = None
        with use_backend(backend_name):
            mla_decode(qlf, qrf, poolf, btf, slf, 0.0722)  # checks the inputs, tunes
            ms_one = timed(one, together=False)
            if graph:
                cg1 = capture(one, together=False)
                keep.extend((cg1, full))
                ms_one_graph = replay_ms(cg1, together=False)
        kv_one = full.pools[0].numel() * full.pools[0].element_size()
        k_ms, a_ms = (ms_dcp_graph, ms_one_graph) if graph else (ms_dcp, ms_one)
        row = {"case": f"B={B} L={L} H={H} Tq=1 W={W} I={ctx.interleave} {str(dtype)[6:]} heads={heads}",
               "lens": "per layer" if lens_per_layer else "once per step (outside the timed layer step)",
               "k3nn_ms": round(k_ms, 4), "anchor": "k3nn mla_decode on one device, whole cache",
               "anchor_ms": round(a_ms, 4), "kv_bytes_per_rank": kv_bytes, "kv_bytes_one_device": kv_one,
               "tpot_ratio": round(k_ms / a_ms, 3),
               "k3nn_eager_ms": round(ms_dcp, 4), "anchor_eager_ms": round(ms_one, 4),
               "tpot_ratio_eager": round(ms_dcp / ms_one, 3),
               "timing": (f"CUDA events over graph replays ({graph_steps} steps per graph); *_eager_ms: host wall "
                          "clock per eager step, 20 steps") if graph else "host wall clock per eager step, 20 steps"}
        rows.append(row)
        print(f"[dcp bench] {row}", flush=True)
    if W > 1:
        dist.barrier(group=ctx.group)
    return rows



if __name__ == "__main__":
    raise SystemExit(main())
