"""Two-GPU NCCL probe: latency and bandwidth of the collectives DCP / TP / EP use, eager and in a CUDA graph.

    python3 -m torch.distributed.run --nproc-per-node 2 -m bench.gpu.nccl_probe
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def timed(fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters * 1e3  # us


def main():
    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    W = dist.get_world_size()
    print(f"[rank {rank}] p2p access to peer: {torch.cuda.can_device_access_peer(rank, 1 - rank)}", flush=True)
    for nbytes in (4, 64 << 10, 2 << 20, 8 << 20, 64 << 20):
        n = max(1, nbytes // 2)
        x = torch.randn(n * W, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        z = torch.empty(n * W, device="cuda", dtype=torch.bfloat16)
        ar = timed(lambda: dist.all_reduce(x))
        ag = timed(lambda: dist.all_gather_into_tensor(z, y))
        rs = timed(lambda: dist.reduce_scatter_tensor(y, x))
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(10):
                dist.all_reduce(x)
        ar_graph = timed(g.replay, iters=10) / 10
        if rank == 0:
            mb = n * 2 * W / 1e6
            print(f"{n * 2 * W:>10d} B (all-reduce buffer {mb:.3f} MB): all_reduce {ar:8.1f} us ({mb / ar * 1e3 / 1e3:.1f} GB/s)"
                  f"  in graph {ar_graph:8.1f} us | all_gather {ag:8.1f} us | reduce_scatter {rs:8.1f} us", flush=True)
    dist.barrier()
    torch.cuda.synchronize()
    os._exit(0)  # skip NCCL teardown: with graph-captured collectives it can hang the launcher


if __name__ == "__main__":
    main()
