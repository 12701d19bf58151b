"""GPU check and plan sweep for the Triton absorbed MLA decode (paged latent cache, bf16, 512 + 64, block 64).

Per case: the eager reference once, then every plan of the sweep launched into NaN-poisoned outputs and
compared with it (a wrong or failing plan is reported and not timed), then timed in a CUDA graph next to
FlashMLA (``sgl-flash-mla``, legacy SM90 kernel) when it imports. Cases run in priority order under a time
budget (compile time included); later cases sweep only the tiles that did best in the first one. A ragged
batch (uneven lengths, a 1-token request, shuffled pages, NaN in unused rows) checks every tile first.

TB/s counts the latent cache only (``B·L·576·2`` bytes), against the copy bandwidth measured in this process;
caches rotate over enough copies to exceed L2.

    python3 -m bench.gpu.mla_decode [--quick] [--budget 100] [--cuda-only] [--no-cuda] [--tiles a,b]

The CUDA kernel (``k3nn.kernels.mla.cuda_decode``) runs after the sweep at B=64 L=8K H=64/96 and B=1 L=32K
H=64 next to the default Triton plan, with its nvcc build time, at its default split count and a few others;
``--cuda-only`` runs only that comparison.

Plans print as ``BHxBN w<warps> s<stages> [v2] -<flags>/S<splits>`` with flags L = lazy rescale, A = block ids
read a tile ahead, O = scores behind the opaque branch (see ``k3nn.kernels.mla.triton_decode``); the
summary also gives the full tuple to pin with ``k3nn.kernels.registry.tuning(mla_decode_tile=(bh, bn, warps, stages, lazy, sv, ahead, opaque, tma))`` (flag T = whole tiles through tensor
descriptors).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from k3nn.kernels.mla import triton_decode as td
from k3nn.kernels.mla.reference import mla_decode_reference

from bench.common import device_meta, graph_bench_ms, rel_err

R, DR, BS = 512, 64, 64
SCALE = (128 + 64) ** -0.5
T0 = time.time()

# (tag, tile): tile = Plan fields without the split count.
SWEEP_TILES = [
    ("default", (32, 64, 4, 2, True)),
    ("mma2-deep", (32, 32, 4, 3, True, 1, True)),
    ("w64", (64, 64, 8, 2, True)),
    ("w64-eager", (64, 64, 8, 2, False)),
    ("opaque", (64, 64, 8, 2, False, 1, True, True)),
    ("opaque-lazy", (64, 64, 8, 2, True, 1, True, True)),
    ("deep-opaque-lazy", (64, 32, 8, 4, True, 1, True, True)),
    ("deep-opaque", (64, 32, 8, 4, False, 1, True, True)),
    ("deep-dup", (64, 32, 8, 4, True, 1, True, False)),
    ("colsplit-deep", (64, 32, 4, 4, True, 2, True, False)),
    ("colsplit64", (64, 64, 4, 2, False, 2, True, False)),
    ("tma-opaque", (64, 64, 8, 2, False, 1, True, True, True)),
    ("tma-opaque-lazy", (64, 64, 8, 2, True, 1, True, True, True)),
    ("tma-deep-opaque", (64, 32, 8, 4, False, 1, True, True, True)),
    ("tma-deep-opaque-lazy", (64, 32, 8, 4, True, 1, True, True, True)),
    ("tma-deep3-opaque", (64, 32, 8, 3, False, 1, True, True, True)),
    # column split through descriptors (not yet timed): half the partial output per program at B=1
    ("tma-colsplit-opaque", (64, 64, 8, 2, False, 2, True, True, True)),
    ("tma-colsplit-deep", (64, 32, 8, 4, False, 2, True, True, True)),
    ("tma-colsplit-w4", (64, 32, 4, 3, False, 2, True, False, True)),
]
# (B, L, H, Tq, tiles): "all" sweeps every tile; an int n sweeps the n best tiles of the first case + default.
CASES = [
    (64, 8192, 64, 1, "all"),
    (1, 32768, 64, 1, "all"),
    (64, 8192, 96, 1, "all"),
    (1, 32768, 96, 1, "all"),
    (64, 8192, 64, 2, 4),
    (128, 4096, 64, 1, 4),
]


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def flashmla():
    try:
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata
    except Exception as e:  # noqa: BLE001 - run without the anchor, say why
        return None, f"{type(e).__name__}: {e}"
    return (flash_mla_with_kvcache, get_mla_metadata), "loaded"


def launch(plan, q, pool, bt, sl, out, vis=None):
    _, Tq, H, _ = q.shape
    td._launch(plan, q[..., :R], q[..., R:], pool, bt, sl, vis, out[0], out[1], SCALE, Tq, H, Tq * H, R, DR)


def poisoned(q):
    return (torch.full(q.shape[:3] + (R,), float("nan"), device="cuda", dtype=q.dtype),
            torch.full(q.shape[:3], float("nan"), device="cuda"))


def check_plan(plan, q, pool, bt, sl, ref):
    """None if the plan matches the reference, else why not."""
    out = poisoned(q)
    try:
        launch(plan, q, pool, bt, sl, out)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this tile on this GPU
        return f"FAILED TO RUN ({type(e).__name__}: {str(e)[:160]})"
    err, lerr = rel_err(out[0], ref[0]), (out[1] - ref[1]).abs().max().item()
    return None if err < 1e-2 and lerr < 1e-2 else f"WRONG (rel err {err:.2e}, lse {lerr:.1e})"


def ragged_check(tiles, broken):
    """Every tile on a ragged batch (Tq = 1, uneven lengths, pages shuffled, unused rows NaN): the timing
    cases are uniform."""
    g = torch.Generator(device="cuda").manual_seed(1)
    lens = [1000, 1, 2049, 77]
    nblk = [-(-n // BS) for n in lens]
    nb = sum(nblk) + 3
    pool = torch.full((nb, BS, R + DR), float("nan"), device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(nb, device="cuda", generator=g)
    bt = torch.full((len(lens), 48), 10 ** 6, dtype=torch.int32, device="cuda")
    k = 0
    for b, n in enumerate(lens):
        ids = perm[k:k + nblk[b]]
        k += nblk[b]
        bt[b, :nblk[b]] = ids.int()
        rows = (torch.randn(n, R + DR, device="cuda", generator=g) * 0.5).bfloat16()
        pool.view(-1, R + DR)[(ids.long()[:, None] * BS + torch.arange(BS, device="cuda")).view(-1)[:n]] = rows
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for H in (64, 96):
        q = (torch.randn(len(lens), 1, H, R + DR, device="cuda", generator=g) * 0.5).bfloat16()
        ref = mla_decode_reference(q[..., :R], q[..., R:], pool, bt, sl, SCALE, out_dtype=torch.float32)
        for tag, tile in tiles:
            if tag in broken:
                continue
            for s in (1, 3, 40):  # one split (stage 1 writes the result: a separate compile) and split-KV
                why = check_plan(td.make_plan(tile, s), q, pool, bt, sl, ref)
                if why:
                    log(f"  ragged H={H} {tag} {td.make_plan(tile, s).short()}: {why}")
                    broken.add(tag)
                    break
        log(f"  ragged check H={H}: {sum(t not in broken for t, _ in tiles)} tiles ok, broken {sorted(broken)}")


def graph_ms(fn, n_calls, rep=7):
    """Per-call ms of ``fn(i)``, i = 0 … n_calls − 1, replayed in one CUDA graph (inputs rotate over copies)."""
    return graph_bench_ms(fn, inner=n_calls, rep=rep, indexed=True)


def make_case(B, L, H, Tq, dt=torch.bfloat16, copies=None, ordered=False):
    """Inputs of one case: enough copies of (q, pool, block table, out) to exceed L2 (or ``copies``), shuffled pages
    (``ordered``: each request's pages in pool order); the lengths, the fp32 reference on the first copy, the cache
    bytes a decode moves and the calls per timed graph."""
    nblk = L // BS
    cache_bytes = B * L * (R + DR) * dt.itemsize
    copies = copies or min(8, max(1, math.ceil(200e6 / cache_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(B * 7 + H + Tq)
    sets = []
    for _ in range(copies):
        pool = (torch.randn(B * nblk + 4, BS, R + DR, device="cuda", generator=gen) * 0.5).to(dt)
        bt = torch.randperm(B * nblk + 4, device="cuda", generator=gen)[:B * nblk].view(B, nblk).int()
        if ordered:
            bt = torch.arange(B * nblk, device="cuda", dtype=torch.int32).view(B, nblk)
        q = (torch.randn(B, Tq, H, R + DR, device="cuda", generator=gen) * 0.5).to(dt)
        out = (torch.empty(B, Tq, H, R, device="cuda", dtype=dt), torch.empty(B, Tq, H, device="cuda"))
        sets.append((q, pool, bt, out))
    sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
    q0, pool0, bt0, _ = sets[0]
    ref = mla_decode_reference(q0[..., :R], q0[..., R:], pool0, bt0, sl, SCALE, out_dtype=torch.float32)
    n_calls = copies * max(1, min(40, int(2e9 // cache_bytes) or 1) // copies)
    return sets, sl, ref, cache_bytes, n_calls


def split_counts(B, M, tile, dev):
    t = td.make_plan(tile, 1)
    one = td.wave_splits(B, M, dev, t.bh, t.sv)
    two = td.wave_splits(B, M, dev, t.bh, t.sv, waves=2.0)
    return one, two


def time_case(B, L, H, Tq, tiles, fm, copy_tbps, broken, rows, budget, deep):
    """Times ``tiles`` (first at the one-wave split count; the three best again at two waves, and one wave
    rounded up when ``deep``); returns [(ms, tag, plan)] best first."""
    dev = torch.device("cuda", torch.cuda.current_device())
    sets, sl, ref, cache_bytes, n_calls = make_case(B, L, H, Tq)
    copies = len(sets)
    q0, pool0, bt0, _ = sets[0]
    case = f"B={B} L={L} H={H} Tq={Tq}"
    res = []
    M = Tq * H

    def run_plan(tag, plan):
        if time.time() - T0 > budget:
            return False
        why = check_plan(plan, q0, pool0, bt0, sl, ref)
        if why:
            log(f"  {case} {tag} {plan.short()}: {why}")
            return True
        ms = graph_ms(lambda i: launch(plan, *sets[i % copies][:3], sl, sets[i % copies][3]), n_calls)
        res.append((ms, tag, plan))
        tb = cache_bytes / ms / 1e9
        print(f"{case:22s} {tag:17s} {plan.short():26s} {ms * 1e3:8.1f} us {tb:6.3f} TB/s {tb / copy_tbps:6.1%} copy",
              flush=True)
        return True

    for tag, tile in tiles:
        if tag in broken:
            continue
        if not run_plan(tag, td.make_plan(tile, split_counts(B, M, tile, dev)[0])):
            log(f"  time budget reached in {case}")
            break
    tried = {p for _, _, p in res}
    for _, tag, plan in sorted(res)[:3]:
        two = split_counts(B, M, plan.tile, dev)[1]
        extra = [two] + ([td.choose_num_splits(B, M, dev, plan.bh, 1, plan.sv)] if deep else [])
        for s in extra:
            p = td.make_plan(plan.tile, s)
            if p not in tried:
                tried.add(p)
                run_plan(tag, p)
    fm_ms = None
    if fm is not None and time.time() - T0 < budget + 10:
        fwd, get_meta = fm
        try:
            metas = [get_meta()[0] for _ in sets]

            def fcall(i):
                q, pool, bt, _ = sets[i % copies]
                return fwd(q, pool.unsqueeze(2), bt, sl, R, metas[i % copies], softmax_scale=SCALE, causal=Tq > 1,
                           use_legacy=True)

            fo, _ = fcall(0)
            f_err = rel_err(fo, ref[0])
            for i in range(1, copies):
                fcall(i)
            fm_ms = graph_ms(fcall, n_calls)
            tb = cache_bytes / fm_ms / 1e9
            print(f"{case:22s} {'FlashMLA':17s} {'sgl-flash-mla legacy sm90':26s} {fm_ms * 1e3:8.1f} us {tb:6.3f} TB/s "
                  f"{tb / copy_tbps:6.1%} copy (rel err {f_err:.1e})", flush=True)
        except Exception as e:  # noqa: BLE001
            log(f"  {case} FlashMLA failed: {type(e).__name__}: {str(e)[:160]}")
    best = sorted(res)
    rows.append((case, cache_bytes, best, fm_ms))
    sets.clear()
    torch.cuda.empty_cache()
    return best


CUDA_CASES = [(64, 8192, 64, 1), (64, 8192, 96, 1), (1, 32768, 64, 1), (1, 32768, 96, 1), (64, 8192, 64, 2)]


def cuda_compare(copy_tbps):
    """The CUDA (warp-group MMA, sm_90) kernel at its default split count and a few others, against the default
    Triton plan, same inputs."""
    from k3nn.kernels.mla import cuda_decode as cdk

    why = cdk.available()
    if why:
        log(f"CUDA kernel not run: {why}")
        return
    t0 = time.time()
    try:
        cdk.build()
    except Exception as e:  # noqa: BLE001 - report the compiler's complaint and carry on
        log(f"CUDA kernel FAILED TO BUILD: {type(e).__name__}: {str(e)[-2000:]}")
        return
    log(f"CUDA kernel build/load {time.time() - t0:.1f} s (nvcc; cached on disk afterwards)")
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for B, L, H, Tq in CUDA_CASES:
        nblk = L // BS
        sets, sl, ref, cache_bytes, n_calls = make_case(B, L, H, Tq)
        copies = len(sets)
        q0, pool0, bt0, _ = sets[0]
        case = f"B={B} L={L} H={H} Tq={Tq}"
        M = Tq * H
        best = {}
        for name in ("wgmma",):
            bn = cdk.WG_BLOCK_N
            dflt = cdk.default_num_splits(B, M, nblk * BS, sms)
            for S in sorted({dflt, max(1, dflt // 2), min(cdk.MAX_SPLITS, 2 * dflt)}):
                kw = dict(num_splits=S)

                def call(i, kw=kw, sets=sets, copies=copies, sl=sl):
                    q, pool, bt, o = sets[i % copies]
                    cdk.mla_decode_cuda(q[..., :R], q[..., R:], pool, bt, sl, SCALE, out=o, **kw)
                out = poisoned(q0)
                try:
                    cdk.mla_decode_cuda(q0[..., :R], q0[..., R:], pool0, bt0, sl, SCALE, out=out, **kw)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    log(f"  {case} CUDA {name} S={S} FAILED TO RUN ({type(e).__name__}: {str(e)[:300]})")
                    break
                err, lerr = rel_err(out[0], ref[0]), (out[1] - ref[1]).abs().max().item()
                ok = "ok" if err < 1e-2 and lerr < 1e-2 else "WRONG"
                ms = graph_ms(call, n_calls)
                tb = cache_bytes / ms / 1e9
                if ok == "ok" and (name not in best or ms < best[name][0]):
                    best[name] = (ms, S)
                tag = f"CUDA {name}" + (" (default)" if S == dflt else "")
                desc = f"64x{bn} w8 S{S}"
                print(f"{case:22s} {tag:17s} {desc:26s} {ms * 1e3:8.1f} us {tb:6.3f} TB/s {tb / copy_tbps:6.1%} copy  "
                      f"rel err {err:.1e} lse {lerr:.1e} {ok}", flush=True)
        if best:
            print(f"{case:22s} CUDA best per variant: " + ", ".join(
                f"{n} S={S} {cache_bytes / ms / 1e9:.3f} TB/s" for n, (ms, S) in sorted(best.items())), flush=True)
        plan = td._default_plan(B, M, dev)
        why = check_plan(plan, q0, pool0, bt0, sl, ref)
        if why:
            log(f"  {case} triton default {plan.short()}: {why}")
        else:
            ms = graph_ms(lambda i, sets=sets, copies=copies, sl=sl, plan=plan:
                          launch(plan, *sets[i % copies][:3], sl, sets[i % copies][3]), n_calls)
            tb = cache_bytes / ms / 1e9
            print(f"{case:22s} {'triton default':17s} {plan.short():26s} {ms * 1e3:8.1f} us {tb:6.3f} TB/s "
                  f"{tb / copy_tbps:6.1%} copy", flush=True)
        sets.clear()
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only B=64 L=8K H=64 and B=1 L=32K H=64")
    ap.add_argument("--budget", type=float, default=100.0, help="seconds after which no new plan starts")
    ap.add_argument("--tiles", default="", help="comma-separated sweep tags: only these tiles")
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA kernel comparison")
    ap.add_argument("--cuda-only", action="store_true",
                    help="only the CUDA kernel against the default Triton plan (no sweep, no FlashMLA)")
    args = ap.parse_args()
    import triton

    log(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    fm, why = flashmla()
    log(f"FlashMLA: {why}")
    meta = device_meta()
    copy_tbps = meta.get("copy_tbps") or 4.2
    log(f"copy bandwidth {copy_tbps} TB/s (same process); timing in CUDA graphs, latent-cache bytes only")
    if args.cuda_only:
        log("== CUDA kernel vs the default Triton plan")
        cuda_compare(copy_tbps)
        log("done")
        return
    global SWEEP_TILES
    if args.tiles:
        want = args.tiles.split(",")
        SWEEP_TILES = [(t, tile) for t, tile in SWEEP_TILES if t in want]
    broken: set = set()
    log("== ragged correctness (bf16 vs eager reference), every tile")
    ragged_check(SWEEP_TILES, broken)
    cases = CASES[:2] if args.quick else CASES
    rows = []
    first = None
    for B, L, H, Tq, which in cases:
        if time.time() - T0 > args.budget:
            log(f"time budget reached: B={B} L={L} H={H} Tq={Tq} skipped")
            continue
        if which == "all" or first is None:
            tiles = SWEEP_TILES
        else:
            keep = list(dict.fromkeys(["default"] + [tag for _, tag, _ in first]))[:which + 1]
            tiles = [(t, tile) for t, tile in SWEEP_TILES if t in keep]
        log(f"== B={B} L={L} H={H} Tq={Tq}: {len(tiles)} tiles")
        best = time_case(B, L, H, Tq, tiles, fm, copy_tbps, broken, rows, args.budget, deep=B > 1)
        if first is None:
            first = best
    log("== summary: best k3nn plan per case (latent-cache TB/s; floor 2.5 TB/s, goal 85% of copy)")
    for case, nbytes, best, fm_ms in rows:
        if not best:
            print(f"{case:22s} no plan timed", flush=True)
            continue
        ms, tag, plan = best[0]
        tb = nbytes / ms / 1e9
        dflt = [r for r in best if r[1] == "default"]
        line = (f"{case:22s} best {tag:17s} {plan.short():26s} {tb:6.3f} TB/s ({tb / copy_tbps:5.1%} of copy)"
                + (f"  FlashMLA {nbytes / fm_ms / 1e9:6.3f} TB/s (k3nn at {fm_ms / ms:4.2f}x its speed)" if fm_ms else "")
                + (f"  | default {nbytes / dflt[0][0] / 1e9:6.3f} TB/s" if dflt else ""))
        print(line, flush=True)
        print(f"{'':22s}   tile {tuple(plan.tile)} splits {plan.splits}; runner-up: "
              + ", ".join(f"{t} {p.short()} {nbytes / m / 1e9:.2f}" for m, t, p in best[1:4]), flush=True)
    if not args.no_cuda:
        log("== CUDA kernel vs the default Triton plan")
        cuda_compare(copy_tbps)
    log("done")


if __name__ == "__main__":
    main()
