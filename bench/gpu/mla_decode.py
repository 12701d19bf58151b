"""GPU check and plan sweep for the Triton absorbed MLA decode (paged latent cache, bf16, 512 + 64, block 64).

1. Correctness: every candidate plan (tile × split count, plus pinned odd split counts) and the public tuned
   path against the eager absorbed reference on ragged batches (Tq = 2, uneven lengths, pages shuffled,
   unused rows NaN-poisoned). A plan that does not compile on this GPU is reported and left out.
2. Copy bandwidth measured in this process, then per case every plan timed in a CUDA graph, the plan the
   tuner picks, and FlashMLA (``sgl-flash-mla``, legacy SM90 kernel) when it imports. TB/s counts the latent
   cache only (``B·L·576·2`` bytes); caches rotate over enough copies to exceed L2.

    PYTHONPATH=src python3 bench/gpu/mla_decode.py [--quick]

Plans print as (BLOCK_H, BLOCK_N, warps, stages, lazy, SPLIT_V, splits).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from k3nn.bench.common import device_meta, rel_err
from k3nn.kernels.mla import triton_decode as td
from k3nn.kernels.mla.reference import mla_decode_reference

R, DR, BS = 512, 64, 64
SCALE = (128 + 64) ** -0.5
T0 = time.time()
BUDGET_S = 110.0


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def flashmla():
    try:
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata
    except Exception as e:  # noqa: BLE001 - run without the anchor, say why
        return None, f"{type(e).__name__}: {e}"
    return (flash_mla_with_kvcache, get_mla_metadata), "loaded"


def ragged_case(seed, lens, Tq, H, dt=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = [-(-n // BS) for n in lens]
    nb = sum(nblk) + 3
    pool = torch.full((nb, BS, R + DR), float("nan"), device="cuda", dtype=dt)
    perm = torch.randperm(nb, device="cuda", generator=g)
    table = torch.full((len(lens), max(nblk) + 1), 10 ** 6, dtype=torch.int32, device="cuda")
    k = 0
    for b, n in enumerate(lens):
        ids = perm[k:k + nblk[b]]
        k += nblk[b]
        table[b, :nblk[b]] = ids.int()
        rows = (torch.randn(n, R + DR, device="cuda", generator=g) * 0.5).to(dt)
        pool.view(-1, R + DR)[(ids.long()[:, None] * BS + torch.arange(BS, device="cuda")).view(-1)[:n]] = rows
    q = (torch.randn(len(lens), Tq, H, R + DR, device="cuda", generator=g) * 0.5).to(dt)
    return q, pool, table, torch.tensor(lens, dtype=torch.int32, device="cuda")


def launch(plan, q, pool, bt, sl, out, vis=None):
    _, Tq, H, _ = q.shape
    td._launch(plan, q[..., :R], q[..., R:], pool, bt, sl, vis, out[0], out[1], SCALE, Tq, H, Tq * H, R, DR)


def sweep_plans(B, M):
    dev = torch.device("cuda", torch.cuda.current_device())
    return td._candidates(B, M, dev)


def check(broken):
    """Every plan on two ragged shapes; returns the set of tiles that failed to compile or were wrong."""
    shapes = [(1, [1000, 461, 2049], 2, 64), (2, [4109, 77], 1, 96), (3, [130, 64, 1], 1, 16)]
    for seed, lens, Tq, H in shapes:
        q, pool, bt, sl = ragged_case(seed, lens, Tq, H)
        o_ref, lse_ref = mla_decode_reference(q[..., :R], q[..., R:], pool, bt, sl, SCALE, out_dtype=torch.float32)
        plans = sweep_plans(len(lens), Tq * H)
        plans += [p[:6] + (s,) for p in plans[:2] for s in (3, 17)]
        for p in plans:
            if p[:6] in broken:
                continue
            out = (torch.full(q.shape[:3] + (R,), float("nan"), device="cuda", dtype=q.dtype),
                   torch.full(q.shape[:3], float("nan"), device="cuda"))
            try:
                launch(p, q, pool, bt, sl, out)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this tile
                log(f"  plan {p}: FAILED TO RUN ({type(e).__name__}: {str(e)[:160]})")
                broken.add(p[:6])
                continue
            err, lerr = rel_err(out[0], o_ref), (out[1] - lse_ref).abs().max().item()
            ok = err < 1e-2 and lerr < 1e-2
            if not ok:
                broken.add(p[:6])
            log(f"  lens={lens} Tq={Tq} H={H} plan {p}: rel err {err:.2e} lse {lerr:.1e} {'ok' if ok else 'WRONG'}")
        # the public path (tuner included)
        from k3nn import backend
        from k3nn.ops import mla_decode

        with backend("triton"):
            o, lse = mla_decode(q[..., :R], q[..., R:], pool, bt, sl, SCALE)
        err, lerr = rel_err(o, o_ref), (lse - lse_ref).abs().max().item()
        log(f"  lens={lens} Tq={Tq} H={H} public mla_decode, plan {td.LAST_PLAN}: rel err {err:.2e} lse {lerr:.1e} "
            f"{'ok' if err < 1e-2 and lerr < 1e-2 else 'WRONG'}")
        del q, pool, bt, sl


def graph_ms(fn, n_calls, rep=8):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / n_calls)
    ts.sort()
    return ts[len(ts) // 2]


def time_case(B, L, H, Tq, fm, copy_tbps, broken, rows):
    dt = torch.bfloat16
    nblk = L // BS
    cache_bytes = B * L * (R + DR) * dt.itemsize
    copies = min(8, max(1, math.ceil(150e6 / cache_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(B * 7 + H)
    sets = []
    for _ in range(copies):
        pool = (torch.randn(B * nblk + 4, BS, R + DR, device="cuda", generator=gen) * 0.5).to(dt)
        bt = torch.randperm(B * nblk + 4, device="cuda", generator=gen)[:B * nblk].view(B, nblk).int()
        q = (torch.randn(B, Tq, H, R + DR, device="cuda", generator=gen) * 0.5).to(dt)
        out = (torch.empty(B, Tq, H, R, device="cuda", dtype=dt), torch.empty(B, Tq, H, device="cuda"))
        sets.append((q, pool, bt, out))
    sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
    n_calls = max(copies, min(40, int(2e9 // cache_bytes) or 1))
    n_calls = copies * max(1, n_calls // copies)
    case = f"B={B} L={L} H={H} Tq={Tq}"
    res = []

    def add(name, ms):
        tb = cache_bytes / ms / 1e9
        res.append((name, ms, tb))

    for p in sweep_plans(B, Tq * H):
        if p[:6] in broken:
            continue
        if time.time() - T0 > BUDGET_S:
            log(f"  {case}: time budget reached, remaining plans skipped")
            break
        try:
            ms = graph_ms(lambda i, p=p: launch(p, sets[i % copies][0], sets[i % copies][1], sets[i % copies][2],
                                                sl, sets[i % copies][3]), n_calls)
        except Exception as e:  # noqa: BLE001
            log(f"  {case} plan {p}: failed ({type(e).__name__}: {str(e)[:120]})")
            continue
        add(str(p), ms)
    # the plan the tuner picks (tuning runs here, outside capture)
    from k3nn import backend
    from k3nn.ops import mla_decode

    def pub(i):
        q, pool, bt, out = sets[i % copies]
        mla_decode(q[..., :R], q[..., R:], pool, bt, sl, SCALE, out=out, check=False)

    try:
        with backend("triton"):
            q, pool, bt, out = sets[0]
            mla_decode(q[..., :R], q[..., R:], pool, bt, sl, SCALE, out=out)
            tuned = td.LAST_PLAN
            add(f"tuned {tuned}", graph_ms(pub, n_calls))
    except Exception as e:  # noqa: BLE001
        log(f"  {case} public (tuned) path failed: {type(e).__name__}: {str(e)[:160]}")
    fm_ms = None
    if fm is not None:
        fwd, get_meta = fm
        try:
            metas = [get_meta()[0] for _ in sets]

            def fcall(i):
                q, pool, bt, _ = sets[i % copies]
                fwd(q, pool.unsqueeze(2), bt, sl, R, metas[i % copies], softmax_scale=SCALE, causal=Tq > 1,
                    use_legacy=True)

            for i in range(copies):
                fcall(i)
            fm_ms = graph_ms(fcall, n_calls)
            add("FlashMLA (sgl-flash-mla legacy sm90)", fm_ms)
        except Exception as e:  # noqa: BLE001
            log(f"  {case} FlashMLA failed: {type(e).__name__}: {str(e)[:160]}")
    best = min((r for r in res if not r[0].startswith("Flash")), key=lambda r: r[1], default=None)
    for name, ms, tb in res:
        vs = f"{fm_ms / ms:5.2f}x" if fm_ms else "   - "
        mark = " <= best" if best and name == best[0] else ""
        print(f"{case:24s} {name:44s} {ms * 1e3:8.1f} us {tb:6.3f} TB/s {tb / copy_tbps:5.1%} copy  vs FlashMLA {vs}"
              f"{mark}", flush=True)
        rows.append((case, name, ms, tb, fm_ms))
    sets.clear()
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only B=64 L=8K H=64 and B=1 L=32K H=64")
    args = ap.parse_args()
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    import triton

    log(f"triton {triton.__version__}; tiles {td._GPU_TILES}")
    fm, why = flashmla()
    log(f"FlashMLA: {why}")
    broken: set = set()
    log("== correctness (bf16 vs eager reference)")
    check(broken)
    if broken:
        log(f"plans left out of timing: {sorted(broken)}")
    meta = device_meta()
    copy_tbps = meta.get("copy_tbps") or 4.2
    log(f"== copy bandwidth {copy_tbps} TB/s (same process); timing in CUDA graphs, latent-cache bytes only")
    cases = [(64, 8192, 64, 1), (1, 32768, 64, 1), (64, 8192, 96, 1), (1, 32768, 96, 1), (128, 4096, 64, 1),
             (64, 8192, 64, 2)]
    if args.quick:
        cases = cases[:2]
    rows = []
    for B, L, H, Tq in cases:
        if time.time() - T0 > BUDGET_S:
            log(f"time budget reached: B={B} L={L} H={H} Tq={Tq} skipped")
            continue
        time_case(B, L, H, Tq, fm, copy_tbps, broken, rows)
    log("== summary: best k3nn plan per case")
    for case in dict.fromkeys(r[0] for r in rows):
        rs = [r for r in rows if r[0] == case and not r[1].startswith("Flash")]
        if not rs:
            continue
        b = min(rs, key=lambda r: r[2])
        tuned = [r for r in rs if r[1].startswith("tuned")]
        fm_ms = b[4]
        print(f"{case:24s} best {b[1]:34s} {b[3]:6.3f} TB/s ({b[3] / copy_tbps:5.1%})"
              + (f"  vs FlashMLA {fm_ms / b[2]:5.2f}x" if fm_ms else "")
              + (f"  | tuned {tuned[0][3]:6.3f} TB/s" if tuned else ""), flush=True)
    log("done")


if __name__ == "__main__":
    main()
