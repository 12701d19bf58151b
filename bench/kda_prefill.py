"""kda-prefill: k3nn Triton ``kda_chunk`` vs fla-core ``chunk_kda`` (bf16, K = V = 128), side by side.

Cases: B=1, T 4K–64K, H 32 (Kimi Linear softplus gate) and H 96 (K3 bounded gate); fla runs its general path
(no ``safe_gate``: a first attempt with it ended in an illegal memory access, origin not pinned down); one packed
varlen case; and the cost of exporting two checkpoints in the same pass. Each case is checked first: k3nn against the eager token-by-token reference on a
prefix (fp32 math) and against fla on the full shape.

    k3nn bench kda-prefill [--quick]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from k3nn import backend, ops
from k3nn.kernels.kda.reference import kda_recurrent_reference

from bench.common import bench_ms, device_meta, print_table, rel_err, write_results

SUITE = "kda-prefill"


def _inputs(B, T, H, D, gate, gen, dev="cuda", dtype=torch.bfloat16):
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = F.normalize(r(B, T, H, D), dim=-1).to(dtype)
    k = F.normalize(r(B, T, H, D), dim=-1).to(dtype)
    v = r(B, T, H, D).to(dtype)
    x = r(B, T, H, D)
    if gate == "lower_bound":
        g = -5.0 * torch.sigmoid(x - 2.0)
    else:  # Kimi Linear init: A in [1, 16], dt ~ 1e-3..1e-1
        A = torch.empty(H, device=dev).uniform_(1, 16, generator=gen)
        g = -A[:, None] * F.softplus(x - 4.0)
    beta = torch.sigmoid(r(B, T, H))
    h0 = r(B, H, D, D) * 0.1
    return q, k, v, g.float().contiguous(), beta, h0


def _fla():
    try:
        from fla.ops.kda import chunk_kda
        return chunk_kda
    except Exception as e:  # pragma: no cover - depends on the machine
        print(f"fla-core not importable ({type(e).__name__}: {e}); anchor columns left empty")
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="k3nn bench kda-prefill")
    ap.add_argument("--quick", action="store_true", help="four shapes (T 4K-32K, H 32 and 96), no varlen case")
    ap.add_argument("--cases", default=None, metavar="T:H:GATE,...",
                    help="only these shapes (B=1), e.g. 65536:96:lower_bound,65536:32:softplus; no varlen case")
    args = ap.parse_args(argv)
    dev = "cuda"
    device_meta()  # ceilings first (cached), so results can still be written if a later kernel fails
    gen = torch.Generator(device=dev).manual_seed(0)
    chunk_kda = _fla()
    D = 128
    # most telling first: a run stopped by its time limit (SIGINT) still writes what it measured
    cases = [(1, 8192, 96, "lower_bound"), (1, 4096, 32, "softplus"), (1, 32768, 96, "lower_bound"),
             (1, 16384, 32, "softplus"), (1, 8192, 96, "softplus"), (1, 65536, 32, "softplus")]
    if args.quick:
        cases = cases[:4]
    if args.cases:
        cases = [_parse_case(c) for c in args.cases.split(",") if c.strip()]
    rows = []
    try:
        _cases(cases, rows, chunk_kda, gen, dev, D)
        if not (args.quick or args.cases):
            _varlen(rows, chunk_kda, gen, dev, D)
    except KeyboardInterrupt:  # `timeout -s INT`: keep what was measured
        print("interrupted: writing the rows measured so far")
    print_table(rows, ["case", "k3nn_ms", "anchor_ms", "speedup", "ckpt2_overhead", "err_vs_eager_prefix",
                       "err_vs_fla"])
    sp = [r["speedup"] for r in rows if "speedup" in r]
    meta = {"suite": SUITE, "geomean_speedup": round(math.exp(sum(map(math.log, sp)) / len(sp)), 3) if sp else None}
    path = write_results(SUITE, rows, meta)
    print(f"wrote {path}")
    return rows


def _parse_case(text: str):
    """``T:H:GATE`` → (1, T, H, GATE); a clear error naming --cases otherwise."""
    try:
        t, h, gate = text.strip().split(":")
        t, h = int(t), int(h)
    except ValueError:
        raise SystemExit(f"--cases: expected T:H:GATE (e.g. 65536:96:lower_bound), got {text!r}") from None
    if gate not in ("softplus", "lower_bound") or t < 1 or h < 1:
        raise SystemExit(f"--cases: T and H must be positive and GATE softplus or lower_bound, got {text!r}")
    return 1, t, h, gate


def _kernel_split(run):
    """Milliseconds per call of each k3nn kernel (torch.profiler), to see where the time goes."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        out = {}
        for e in prof.key_averages():
            if e.key.startswith(("_kda_", "_split_", "_g_")):  # the chunk forward's kernels
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                out[e.key.strip("_") + "_ms"] = round(t / 5 / 1e3, 4)
        return out
    except Exception as e:  # pragma: no cover - diagnostics only
        return {"split_error": f"{type(e).__name__}: {e}"}


def _cases(cases, rows, chunk_kda, gen, dev, D):
    for B, T, H, gate in cases:
        q, k, v, g, beta, h0 = _inputs(B, T, H, D, gate, gen)
        with backend("triton"):
            run = lambda: ops.kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)  # noqa: E731
            o, ht = run()
            P = 512
            ro, rht = kda_recurrent_reference(q[:, :P], k[:, :P], v[:, :P], g[:, :P], beta[:, :P],
                                              initial_state=h0, output_final_state=True)
            o_p, ht_p = ops.kda_chunk(q[:, :P], k[:, :P], v[:, :P], g[:, :P], beta[:, :P], initial_state=h0,
                                      output_final_state=True)
            err_ref = max(rel_err(o_p, ro), rel_err(ht_p, rht))
            ms = bench_ms(run)
            cps = [T // 3 + 7, (2 * T) // 3 + 13]
            run_ck = lambda: ops.kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,  # noqa: E731
                                           checkpoint_positions=cps)
            _, _, ck = run_ck()
            _, _, rck = kda_recurrent_reference(q[:, :cps[0]], k[:, :cps[0]], v[:, :cps[0]], g[:, :cps[0]],
                                                beta[:, :cps[0]], initial_state=h0,
                                                checkpoint_positions=[cps[0]]) if T <= 8192 else (0, 0, None)
            err_ck = rel_err(ck[:1], rck) if rck is not None else float("nan")
            ms_ck = bench_ms(run_ck)
            split = _kernel_split(run)
        row = {"case": f"B{B} T{T} H{H} K{D} V{D} bf16 gate={gate}", "k3nn_ms": round(ms, 4), **split,
               "err_vs_eager_prefix": float(f"{err_ref:.3g}"), "ckpt2_ms": round(ms_ck, 4),
               "ckpt2_overhead": round(ms_ck / ms - 1, 4), "err_ckpt": float(f"{err_ck:.3g}"),
               "mtok_per_s": round(B * T / ms / 1e3, 2)}
        if chunk_kda is not None:
            print(f"k3nn done: {row}", flush=True)
            kw = {}  # general path (see the module docstring)
            try:
                fq, fk, fv, fg, fb, fh = (t.clone() for t in (q, k, v, g, beta, h0))
                fo, fht = chunk_kda(fq, fk, fv, fg, fb, initial_state=fh, output_final_state=True, **kw)
                row["err_vs_fla"] = float(f"{max(rel_err(o, fo), rel_err(ht, fht)):.3g}")
                row["anchor"] = "fla-core 0.6.0 chunk_kda" + (" safe_gate" if kw else "")
                row["anchor_ms"] = round(bench_ms(lambda: chunk_kda(fq, fk, fv, fg, fb, initial_state=fh,
                                                                    output_final_state=True, **kw)), 4)
                row["speedup"] = round(row["anchor_ms"] / row["k3nn_ms"], 3)
            except Exception as e:  # a failing anchor must not lose the k3nn rows (the context may be dead)
                row["anchor_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                raise KeyboardInterrupt from e
        rows.append(row)
        print(row, flush=True)
        del q, k, v, g, beta, h0
        torch.cuda.empty_cache()


def _varlen(rows, chunk_kda, gen, dev, D):
    # packed varlen (FlashKDA's uneven mix), H=96 bounded gate
    lens = [1300, 547, 2048, 963, 271, 3063]
    T = sum(lens)
    H = 96
    q, k, v, g, beta, _ = _inputs(1, T, H, D, "lower_bound", gen)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device=dev, dtype=torch.int32)
    h0 = torch.randn(len(lens), H, D, D, device=dev, generator=gen) * 0.1
    with backend("triton"):
        run = lambda: ops.kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)  # noqa: E731
        o, ht = run()
        ms = bench_ms(run)
    ro, rht = kda_recurrent_reference(q[:, :1300], k[:, :1300], v[:, :1300], g[:, :1300], beta[:, :1300],
                                      initial_state=h0[:1], output_final_state=True)
    row = {"case": f"varlen {lens} H{H} bf16 gate=lower_bound", "k3nn_ms": round(ms, 4),
           "err_vs_eager_prefix": float(f"{max(rel_err(o[:, :1300], ro), rel_err(ht[:1], rht)):.3g}")}
    if chunk_kda is not None:
        cu64 = cu.long()
        fo, fht = chunk_kda(q, k, v.clone(), g.clone(), beta, initial_state=h0.clone(), output_final_state=True,
                            cu_seqlens=cu64)
        row["err_vs_fla"] = float(f"{max(rel_err(o, fo), rel_err(ht, fht)):.3g}")
        row["anchor"] = "fla-core 0.6.0 chunk_kda varlen"
        fv, fg, fh = v.clone(), g.clone(), h0.clone()
        row["anchor_ms"] = round(bench_ms(lambda: chunk_kda(q, k, fv, fg, beta, initial_state=fh,
                                                            output_final_state=True, cu_seqlens=cu64)), 4)
        row["speedup"] = round(row["anchor_ms"] / row["k3nn_ms"], 3)
    rows.append(row)
    print(row, flush=True)


if __name__ == "__main__":
    main()
