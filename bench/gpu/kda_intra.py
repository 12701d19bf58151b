"""GPU check of the Triton chunked KDA forward: correctness, then the intra kernel and the full forward vs fla.

    PYTHONPATH=src python3 bench/gpu/kda_intra.py

1. Correctness against the eager chunk form ``kda_chunk_eager`` (fp32 math on the same rounded inputs): bf16
   T=300 H=4 varlen with checkpoints and an initial state (bounded and softplus gates, and a softplus gate
   scaled so the pairwise diagonal fallback runs), and one fp32 case.
2. Per-config timing of ``_kda_intra`` (every autotune variant, T=8192 H=96 bounded gate) and the autotuner's
   pick.
3. Table: intra kernel alone, full forward, fla-core ``chunk_kda`` on the same inputs, speedup vs fla, at
   T=8192 H=96 and T=4096 H=32 (B=1, K=V=128, bf16; g from the softplus gate and the K3 bounded gate).

Self-contained apart from k3nn itself; fla is optional. Stays well under 120 s including compilation.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
import triton

from k3nn.kernels.kda import triton_chunk as tc
from k3nn.kernels.kda.chunk_torch import kda_chunk_eager

T0 = time.time()
D = 128
DEV = "cuda"
HALF = torch.bfloat16
SHAPES = [(8192, 96, "lower_bound"), (8192, 96, "softplus"), (4096, 32, "softplus"), (4096, 32, "lower_bound")]


def say(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(T, H, gate, gen, dtype=None, K=D, V=D, decay=1.0, N=1):
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    dtype = dtype or HALF
    q = F.normalize(r(1, T, H, K), dim=-1).to(dtype)
    k = F.normalize(r(1, T, H, K), dim=-1).to(dtype)
    v = r(1, T, H, V).to(dtype)
    x = r(1, T, H, K)
    if gate == "lower_bound":  # K3: lower_bound · sigmoid(·), lower_bound = −5
        g = -5.0 * torch.sigmoid(x - 2.0)
    else:  # Kimi Linear: −exp(A_log) · softplus(·), A in [1, 16]
        A = torch.empty(H, device=DEV).uniform_(1, 16, generator=gen)
        g = -decay * A[:, None] * F.softplus(x - 4.0)
    beta = torch.sigmoid(r(1, T, H))
    h0 = r(N, H, K, V) * 0.1
    return q, k, v, g.float().contiguous(), beta, h0


def check(gen, cases):
    lens = [37, 0, 150, 113]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEV, dtype=torch.int32)
    cps = [[10, 37], [0], [64, 100, 150], [1, 50]]
    worst = 0.0
    for name, dt, gate, decay in cases:
        q, k, v, g, beta, h0 = inputs(300, 4, gate, gen, dtype=dt, decay=decay, N=len(lens))
        o, ht, ck = tc.kda_chunk_triton_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            cu_seqlens=cu, checkpoint_positions=cps)
        sync()
        f = lambda t: t.float()  # noqa: E731
        ro, rht, rck = kda_chunk_eager(f(q), f(k), f(v), g, beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu, checkpoint_positions=cps)
        e = (rel(o, ro), rel(ht, rht), rel(ck, rck))
        worst = max(worst, *e)
        tol = 2e-2 if dt != torch.float32 else 5e-3
        verdict = "ok" if max(e) < tol else "FAIL"
        say(f"  {name:36s} rel err o {e[0]:.2e}  final {e[1]:.2e}  ckpt {e[2]:.2e}  (tol {tol:g}) {verdict}")
    return worst


def plan(T, H):
    (NC, c_start, c_len, *_), _, _ = tc.build_chunk_plan(1, T, None, [], DEV)
    return NC, c_start, c_len


def intra_bytes(T, H, NC, dt_size=2):
    ins = T * H * (3 * D * dt_size + D * 4 + 4)  # q, k, v, g fp32, beta
    outs = NC * H * (64 * D * dt_size * 4 + 64 * 64 * dt_size + D * 4 + 2 * 64 * 64 * 4)  # qg kg w u, A, egl, X
    return ins + outs


def variants(gen):
    T, H, _ = SHAPES[0]
    q, k, v, g, beta, _ = inputs(T, H, "lower_bound", gen)
    NC, cs, cl = plan(T, H)
    scale = D ** -0.5
    ref = None
    say(f"_kda_intra variants at T={T} H={H} bounded gate ({len(tc._kda_intra.configs)} configs)")
    best = None
    for cfg in tc._kda_intra.configs:
        try:
            out = tc._intra_launch(q, k, v, g, beta, scale, NC, cs, cl, config=cfg)
            sync()
            if ref is None:
                ref = out
            err = max(rel(a, b) for a, b in zip(out, ref))
            ms = triton.testing.do_bench(lambda: tc._intra_launch(q, k, v, g, beta, scale, NC, cs, cl, config=cfg),
                                         return_mode="median")
            tbps = intra_bytes(T, H, NC) / ms / 1e9
            say(f"  {cfg_name(cfg)}: {ms:.3f} ms  ({tbps:.2f} TB/s)  diff vs first {err:.1e}")
            best = min(best or (ms, cfg_name(cfg)), (ms, cfg_name(cfg)))
        except Exception as e:  # a variant that does not compile or fit must not stop the run
            say(f"  {cfg_name(cfg)}: failed {type(e).__name__}: {str(e)[:200]}")
    tc._intra_launch(q, k, v, g, beta, scale, NC, cs, cl)  # autotuned
    pick = getattr(tc._kda_intra, "best_config", None)
    say(f"  fastest measured: {best}; autotuner picked: {cfg_name(pick) if pick else '?'}")


def cfg_name(c):
    return " ".join(f"{k}={v}" for k, v in c.kwargs.items()) + f" warps={c.num_warps} stages={c.num_stages}"


def fla():
    try:
        from fla.ops.kda import chunk_kda
        return chunk_kda
    except Exception as e:  # optional anchor
        say(f"fla-core not importable ({type(e).__name__}: {e}); anchor columns left empty")
        return None


def table(gen, chunk_kda):
    rows = []
    for T, H, gate in SHAPES:
        q, k, v, g, beta, h0 = inputs(T, H, gate, gen)
        NC, cs, cl = plan(T, H)
        scale = D ** -0.5
        t_in = triton.testing.do_bench(lambda: tc._intra_launch(q, k, v, g, beta, scale, NC, cs, cl),
                                       return_mode="median")
        run = lambda: tc.kda_chunk_triton_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True)  # noqa: E731
        o, ht, _ = run()
        t_full = triton.testing.do_bench(run, return_mode="median")
        row = dict(case=f"T{T} H{H} {gate}", intra=t_in, full=t_full, fla=None, err=None)
        if chunk_kda is not None:
            try:
                fq, fk, fv, fg, fb, fh = (t.clone() for t in (q, k, v, g, beta, h0))
                fo, fht = chunk_kda(fq, fk, fv, fg, fb, initial_state=fh, output_final_state=True)
                row["err"] = max(rel(o, fo), rel(ht, fht))
                row["fla"] = triton.testing.do_bench(
                    lambda: chunk_kda(fq, fk, fv, fg, fb, initial_state=fh, output_final_state=True),
                    return_mode="median")
            except Exception as e:
                say(f"  fla failed on {row['case']}: {type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
        sp = f"{row['fla'] / t_full:.2f}x" if row["fla"] else "-"
        say(f"  {row['case']:22s} intra {t_in:.3f} ms ({intra_bytes(T, H, NC) / t_in / 1e9:.2f} TB/s)  "
            f"full {t_full:.3f} ms  fla {row['fla'] or float('nan'):.3f} ms  speedup {sp}  "
            f"rel diff vs fla {row['err'] if row['err'] is not None else float('nan'):.2e}")
        if DEV == "cuda":
            torch.cuda.empty_cache()
    print("\n| case | intra ms | full ms | fla ms | speedup vs fla |", flush=True)
    print("|---|---|---|---|---|", flush=True)
    for r in rows:
        sp = f"{r['fla'] / r['full']:.2f}x" if r["fla"] else "-"
        fl = f"{r['fla']:.3f}" if r["fla"] else "-"
        print(f"| {r['case']} | {r['intra']:.3f} | {r['full']:.3f} | {fl} | {sp} |", flush=True)


def main():
    name = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    say(f"{name} torch {torch.__version__} triton {triton.__version__}")
    gen = torch.Generator(device=DEV).manual_seed(0)
    chunk_kda = fla()
    variants(gen)  # compiles every bf16 variant once; the autotuner then only times them
    say("correctness vs kda_chunk_eager (fp32 math on the same inputs), T=300 H=4 varlen + checkpoints + h0")
    h = str(HALF).replace("torch.", "")
    worst = check(gen, [(f"{h} lower_bound", HALF, "lower_bound", 1.0), (f"{h} softplus", HALF, "softplus", 1.0),
                        (f"{h} softplus x30 (pairwise diag)", HALF, "softplus", 30.0)])
    table(gen, chunk_kda)
    if time.time() - T0 < 85:  # fp32 compiles its own variants: last, and only with time to spare
        bad32 = check(gen, [("fp32 softplus", torch.float32, "softplus", 1.0)]) >= 5e-3
    else:
        say("fp32 check skipped (time)")
        bad32 = False
    say(f"done; worst {h} rel err vs eager {worst:.2e}")
    return 0 if worst < 2e-2 and not bad32 else 1


if __name__ == "__main__":
    sys.exit(main())
