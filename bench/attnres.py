"""``k3nn bench attnres``: AttnRes depth mix bandwidth, and the two-phase form vs per-sublayer mixing.

1. Fused mix (Triton) vs the eager PyTorch mix at the K3 width (d = 7168, bf16) for S sources and T tokens:
   achieved TB/s for the bytes the mix must move ((S + 1)·T·d·2: every source read once, h written once),
   against the copy bandwidth measured in the same run.
2. One block of 12 layers (24 pseudo-queries) over 8 stored blocks (K3's last full block): 24 fused mixes
   vs phase 1 (one launch, all 24 queries) + 24 phase-2 merges; and the sublayer prologue as the model runs
   it (residual add + mix + RMSNorm, eager add/norm) vs phase 2 with the add and the norm fused.

Inputs rotate over enough copies to exceed L2 (decode-sized calls are replayed from a CUDA graph).
"""

from __future__ import annotations

import argparse
import itertools
import math
from typing import Any, Callable

import torch

from bench.common import bench_ms, device_meta, graph_bench_ms, print_table, rel_err, write_results

ROTATE_BYTES = 256 << 20  # > 5× the H200's L2
DEV = "cuda"


def _rotating_ms(calls: list[Callable[[], Any]], graph: bool) -> float:
    """Per-call ms of a list of equivalent calls on different inputs (each call once per replay)."""
    it = itertools.cycle(calls)
    if graph:
        return graph_bench_ms(lambda: next(it)(), inner=len(calls), rep=10)
    return bench_ms(lambda: next(it)())


def _n_sets(bytes_per_call: int, cap: int = 1000) -> int:
    return max(1, min(cap, math.ceil(ROTATE_BYTES / max(bytes_per_call, 1))))


def bench_mix(d: int, tokens: list[int], sources: list[int], variants: list[dict], rows: list[dict],
              with_eager: bool = True, names: list[str] | None = None) -> None:
    from k3nn.kernels.attnres.triton_mix import attnres_mix_triton
    from k3nn.layers.attnres import attnres_mix_reference

    dev, dt = DEV, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    qw = (torch.randn(d, device=dev, generator=g) / math.sqrt(d) * 3).to(dt)
    nw = (0.5 + torch.rand(d, device=dev, generator=g)).to(dt)
    for T, S in itertools.product(tokens, sources):
        nbytes = (S + 1) * T * d * 2
        sets = [[torch.randn(T, d, device=dev, generator=g, dtype=dt) * (1 + j) for j in range(S)]
                for _ in range(_n_sets(nbytes))]
        ref = attnres_mix_reference(sets[0], qw, nw, 1e-5)
        err = rel_err(attnres_mix_triton(sets[0], qw, nw, 1e-5), ref)
        assert err < 1e-2, f"attnres_mix T={T} S={S}: rel err {err}"
        graph = T * d * S * 2 < (64 << 20)
        eager_ms = None
        if with_eager:
            eager_ms = _rotating_ms([lambda s=s: attnres_mix_reference(s, qw, nw, 1e-5) for s in sets], graph)
        for i, kw in enumerate(variants or [{}]):
            e = rel_err(attnres_mix_triton(sets[0], qw, nw, 1e-5, **kw), ref)
            assert e < 1e-2, f"attnres_mix T={T} S={S} {kw}: rel err {e}"
            ms = _rotating_ms([lambda s=s: attnres_mix_triton(s, qw, nw, 1e-5, **kw) for s in sets], graph)
            tag = f" {names[i]}" if names else "".join(f" {k}={int(v)}" for k, v in kw.items())
            rows.append({"case": f"mix d={d} T={T} S={S} bf16{tag}", "k3nn_ms": round(ms, 5),
                         "anchor": "eager torch mix" if eager_ms else None,
                         "anchor_ms": round(eager_ms, 5) if eager_ms else None,
                         "tbps": round(nbytes / ms / 1e9, 3), "rel_err": err, "graph": graph})
        del sets
        torch.cuda.empty_cache()


def bench_block(d: int, tokens: list[int], stored: int, rows: list[dict], state_dtypes) -> None:
    """Block of 12 layers = 24 queries over ``stored`` blocks + the intra-block partial."""
    from k3nn.kernels.attnres.reference import rmsnorm_reference
    from k3nn.kernels.attnres.triton_mix import attnres_mix_triton, attnres_phase1_triton, attnres_phase2_triton
    from k3nn.layers.attnres import attnres_mix_reference

    dev, dt, Q = DEV, torch.bfloat16, 24
    g = torch.Generator(device=dev).manual_seed(1)
    QW = (torch.randn(Q, d, device=dev, generator=g) / math.sqrt(d) * 3).to(dt)
    QN = (0.5 + torch.rand(Q, d, device=dev, generator=g)).to(dt)
    pw = (0.5 + torch.rand(d, device=dev, generator=g)).to(dt)

    for T in tokens:
        def mk():
            return {"blocks": [torch.randn(T, d, device=dev, generator=g, dtype=dt) * (1 + j) for j in range(stored)],
                    "parts": [torch.randn(T, d, device=dev, generator=g, dtype=dt) for _ in range(Q)],
                    "upd": [torch.randn(T, d, device=dev, generator=g, dtype=dt) * 0.1 for _ in range(Q)]}

        per_block_bytes = (stored + 2 * Q) * T * d * 2
        sets = [mk() for _ in range(_n_sets(per_block_bytes, cap=120))]
        graph = T <= 256

        def per_sublayer(s):
            outs = [attnres_mix_triton(s["blocks"], QW[0], QN[0])]
            for i in range(1, Q):
                outs.append(attnres_mix_triton(s["blocks"] + [s["parts"][i]], QW[i], QN[i]))
            return outs

        def two_phase(s, sd):
            o, m, l = attnres_phase1_triton(s["blocks"], QW, QN, 1e-5, sd)
            outs = [attnres_phase2_triton(o[0], m[0], l[0], None, QW[0], QN[0], dtype=dt).mix]
            for i in range(1, Q):
                outs.append(attnres_phase2_triton(o[i], m[i], l[i], s["parts"][i], QW[i], QN[i]).mix)
            return outs

        def prologue_eager_add_norm(s):  # what the model does today: add, mix, RMSNorm
            outs = []
            for i in range(1, Q):
                p = s["parts"][i] + s["upd"][i]
                h = attnres_mix_triton(s["blocks"] + [p], QW[i], QN[i])
                outs.append(rmsnorm_reference(h, pw, 1e-5))
            return outs

        def prologue_fused(s):
            o, m, l = attnres_phase1_triton(s["blocks"], QW, QN)
            return [attnres_phase2_triton(o[i], m[i], l[i], s["parts"][i], QW[i], QN[i], update=s["upd"][i],
                                          post_norm_weight=pw).normed for i in range(1, Q)]

        # correctness against the eager reference (one softmax over all sources), same run
        s0 = sets[0]
        want = [attnres_mix_reference(s0["blocks"], QW[0], QN[0], 1e-5)] + [
            attnres_mix_reference(s0["blocks"] + [s0["parts"][i]], QW[i], QN[i], 1e-5) for i in range(1, Q)]
        errs = {"per_sublayer": max(rel_err(a, b) for a, b in zip(per_sublayer(s0), want))}
        for sd in state_dtypes:
            errs[f"two_phase_{sd}"] = max(rel_err(a, b) for a, b in zip(two_phase(s0, sd), want))
        errs["prologue"] = max(rel_err(a, b) for a, b in zip(prologue_fused(s0),
                                                             prologue_eager_add_norm(s0)))
        for k, e in errs.items():
            assert e < 1e-2, f"block T={T} {k}: rel err {e}"

        base = _rotating_ms([lambda s=s: per_sublayer(s) for s in sets], graph)
        mix_bytes = sum((stored + (i > 0) + 1) for i in range(Q)) * T * d * 2
        rows.append({"case": f"block12 d={d} T={T} stored={stored}: 24 fused mixes", "k3nn_ms": round(base, 4),
                     "tbps": round(mix_bytes / base / 1e9, 3), "rel_err": errs["per_sublayer"], "graph": graph})
        for sd in state_dtypes:
            ms = _rotating_ms([lambda s=s: two_phase(s, sd) for s in sets], graph)
            sb = 4 if sd == torch.float32 else 2
            tp_bytes = (stored * 2 + Q * sb + Q * (sb + 2) + (Q - 1) * 2) * T * d
            rows.append({"case": f"block12 d={d} T={T} stored={stored}: phase1 + 24 phase2, state {sd}",
                         "k3nn_ms": round(ms, 4), "anchor": "24 fused mixes", "anchor_ms": round(base, 4),
                         "tbps": round(tp_bytes / ms / 1e9, 3), "rel_err": errs[f"two_phase_{sd}"], "graph": graph})
        eager_pro = _rotating_ms([lambda s=s: prologue_eager_add_norm(s) for s in sets], graph)
        fused = _rotating_ms([lambda s=s: prologue_fused(s) for s in sets], graph)
        rows.append({"case": f"block12 d={d} T={T} stored={stored}: phase1 + 23 phase2(add+merge+norm)",
                     "k3nn_ms": round(fused, 4), "anchor": "add + fused mix + eager RMSNorm",
                     "anchor_ms": round(eager_pro, 4), "rel_err": errs["prologue"], "graph": graph})
        del sets
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="k3nn bench attnres", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=7168)
    ap.add_argument("--tokens", default="1,64,8192", help="token counts for the mix")
    ap.add_argument("--sources", default="2,5,9", help="source counts for the mix")
    ap.add_argument("--sweep", default="", help="also time kernel variants warps:prefetch:qv_reload:join"
                    "[:ordered:fence] (e.g. 8:2:1:1,16:3:0:1:1:1) at T=8192 S=5,9 and T=64 S=9")
    ap.add_argument("--schedules", default="", help="also time named mix schedules (triton_mix.MIX_SCHEDULES, "
                    "e.g. stream-16w-pf2-l2x4-lazy) at T=8192 S=2,5,9 and T=64 S=9")
    ap.add_argument("--block-tokens", default="1,64,2048", help="token counts for the block-of-12 comparison")
    ap.add_argument("--stored", type=int, default=8, help="stored blocks in the block comparison")
    ap.add_argument("--skip-block", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("k3nn bench attnres needs a CUDA GPU")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    meta = device_meta()
    rows: list[dict] = []
    bench_mix(args.d, ints(args.tokens), ints(args.sources), [], rows)
    if args.sweep:
        keys = ("num_warps", "prefetch", "qv_reload", "join", "ordered", "fence")
        variants = [{k: (int(x) if k in ("num_warps", "prefetch", "fence") else bool(int(x)))
                     for k, x in zip(keys, v.split(":"))} for v in args.sweep.split(",")]
        for T, S in ((8192, 9), (8192, 5), (64, 9)):
            bench_mix(args.d, [T], [S], variants, rows, with_eager=False)
    if args.schedules:
        from k3nn.kernels.attnres.triton_mix import MIX_SCHEDULES

        names = [n for n in args.schedules.split(",") if n]
        for T, S in ((8192, 9), (8192, 5), (8192, 2), (64, 9)):
            bench_mix(args.d, [T], [S], [MIX_SCHEDULES[n] for n in names], rows, with_eager=False, names=names)
    if not args.skip_block:
        bench_block(args.d, ints(args.block_tokens), args.stored, rows, [torch.float32, torch.bfloat16])
    for r in rows:
        if "tbps" in r and meta.get("copy_tbps"):
            r["frac_copy_bw"] = round(r["tbps"] / meta["copy_tbps"], 3)
        if r.get("anchor_ms"):
            r["speedup"] = round(r["anchor_ms"] / r["k3nn_ms"], 3)
    print(f"copy {meta.get('copy_tbps')} TB/s on {meta.get('gpu')}")
    print_table(rows, ["case", "k3nn_ms", "anchor_ms", "speedup", "tbps", "frac_copy_bw"])
    path = write_results("attnres", rows, {"d": args.d})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
