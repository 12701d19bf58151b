"""Split-count sweep of the MLA decode at small batch (bf16, paged latent cache, 512 + 64, block 64): per split
count, the whole call timed in a CUDA graph (inputs rotate over copies larger than L2) and each kernel's own time
(stage 1, the split combine) from the profiler, for the CUDA warp-group kernel and the Triton default tile. Every
variant is first run into NaN-poisoned outputs and compared with the eager reference.

    python3 -m bench.gpu.mla_splits [--cases 1,32768,64;1,32768,96] [--splits 32,64,128,132]
        [--clusters 1,2,4,8]

With ``--clusters`` the warp-group kernel also runs with its splits merged in clusters of that many CTAs
(distributed shared memory) before the combine.

TB/s counts the latent cache only (``B·L·576·2`` bytes). After the warp-group kernel the combine is a programmatic
dependent launch: its profiler time then includes its wait for stage 1 (compare the graph totals).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

from k3nn.kernels.mla import triton_decode as td

from bench.common import rel_err
from bench.gpu.mla_decode import R, SCALE, graph_ms, launch, make_case, poisoned


def kernel_times(fn, calls: int = 8) -> dict[str, float]:
    """Mean device µs per call of each kernel ``fn(i)`` launches (profiler, eager launches)."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(i)
        torch.cuda.synchronize()
    tot = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name] += e.device_time / calls
    return dict(tot)


def short(name: str) -> str:
    for key in ("combine", "stage1", "wgmma"):
        if key in name:
            return key
    return name[:24]


def run_variant(label, call, sets, sl, ref, cache_bytes, n_calls):
    out = poisoned(sets[0][0])
    call(0, out)
    torch.cuda.synchronize()
    err, lerr = rel_err(out[0], ref[0]), (out[1] - ref[1]).abs().max().item()
    ok = "ok" if err < 1e-2 and lerr < 1e-2 else "WRONG"
    copies = len(sets)
    ms = graph_ms(lambda i: call(i % copies), n_calls)
    kt = kernel_times(lambda i: call(i % copies))
    parts = "  ".join(f"{short(k)} {v:6.1f}" for k, v in sorted(kt.items(), key=lambda kv: -kv[1]))
    print(f"{label:44s} {ms * 1e3:7.1f} us {cache_bytes / ms / 1e9:6.3f} TB/s  [{parts}]  err {err:.1e} {ok}",
          flush=True)


def anchors(case, sets, cache_bytes, n_calls):
    """A reduction and a copy over the same pools (the bytes a decode reads; the copy also writes them)."""
    copies = len(sets)
    dst = torch.empty_like(sets[0][1])
    acc = torch.empty((), device="cuda", dtype=torch.float32)
    for label, fn in (("sum of the pool", lambda i: acc.copy_(sets[i % copies][1].sum(dtype=torch.float32))),
                      ("copy of the pool", lambda i: dst.copy_(sets[i % copies][1]))):
        ms = graph_ms(fn, n_calls)
        print(f"{case} {label:35s} {ms * 1e3:7.1f} us {cache_bytes / ms / 1e9:6.3f} TB/s (read bytes)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1,32768,64;1,32768,96", help="B,L,H;... (Tq = 1)")
    ap.add_argument("--splits", default="32,64,96,128,132,192,256")
    ap.add_argument("--clusters", default="1", help="wgmma cluster-merge sizes to time (those dividing S)")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--ordered", action="store_true", help="each request's pages in pool order (not shuffled)")
    ap.add_argument("--copies", type=int, default=None, help="input copies (default: enough to exceed L2)")
    ap.add_argument("--anchors", action="store_true", help="also time a sum and a copy of the same pools")
    args = ap.parse_args()
    from k3nn.kernels.mla import cuda_decode as cdk

    why = cdk.available()
    if why:
        print(f"CUDA kernel not run: {why}")
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for spec in args.cases.split(";"):
        B, L, H = (int(x) for x in spec.split(","))
        sets, sl, ref, cache_bytes, n_calls = make_case(B, L, H, 1, copies=args.copies, ordered=args.ordered)
        case = f"B={B} L={L} H={H}{' ordered' if args.ordered else ''} x{len(sets)}"
        if args.anchors:
            anchors(case, sets, cache_bytes, n_calls)
        counts = sorted({int(s) for s in args.splits.split(",")} | {cdk.default_num_splits(B, H, L, sms)})
        clusters = [int(c) for c in args.clusters.split(",")]
        for S, C in [(S, C) for S in counts for C in clusters if S % C == 0] if not why else []:
            def call(i, out=None, S=S, C=C, sets=sets, sl=sl):
                q, pool, bt, o = sets[i]
                cdk.mla_decode_cuda(q[..., :R], q[..., R:], pool, bt, sl, SCALE, out=out or o, num_splits=S,
                                    cluster=C)
            run_variant(f"{case} wgmma S={S}{f' C={C}' if C > 1 else ''}", call, sets, sl, ref, cache_bytes,
                        n_calls)
        if not args.no_triton:
            base = td._default_plan(B, H, dev)
            for S in sorted({base.splits, *(int(s) for s in args.splits.split(","))}):
                plan = td.make_plan(tuple(base)[:-1], S)

                def tcall(i, out=None, plan=plan, sets=sets, sl=sl):
                    q, pool, bt, o = sets[i]
                    launch(plan, q, pool, bt, sl, out or o)
                run_variant(f"{case} triton {plan.short()}", tcall, sets, sl, ref, cache_bytes, n_calls)
        sets.clear()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
