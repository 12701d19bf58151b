"""GPU check + timing of the fused KDA decode kernels (Triton ``head`` / ``split``, CUDA ``persistent`` / ``regs`` /
``block``) against eager and fla-core.

    PYTHONPATH=src python3 bench/gpu/kda_decode.py [--no-cuda] [--timing-first] [--shapes B:H[:T],...] [--variants NAME,...]

1. Build: the CUDA extension (kernels/kda/cuda_decode.py; compiled once, cached on disk by torch), timed.
2. Correctness: every variant below in bf16 and fp32, B = 1 and 64, T = 1 and 3, shuffled cache slots: max
   relative error of y, state and conv state vs the eager reference (k3nn.kernels.kda.decode), plus a race
   detector: the same B=64 bf16 call (T=1 and T=3) run 20 times from the same inputs must give bitwise identical
   y / state / conv state.
3. Timing: copy bandwidth measured in this process, then per-layer time of each variant replayed in a CUDA graph
   at H=96 B=1, 8, 64, 256 and H=32 B=64 (T=1, bf16 activations, fp32 state), and fla-core's
   ``fused_recurrent_kda`` (bare recurrence: no conv, no output norm) on the same shapes. State traffic counted
   as read + write 2·B·H·D²·4 bytes; ``frac_copy`` = achieved / copy bandwidth (target >= 0.80 at B >= 64).

Variants are picked through the kernel modules' environment overrides (read at each call): Triton
``K3NN_KDA_DECODE_PATH / _BV / _WARPS / _PF / _MAXNREG / _ORDER / _EVICT``, CUDA
``K3NN_KDA_CUDA_VARIANT / _WARPS / _STAGES / _ORDER`` (with ``K3NN_KDA_CUDA=1``). Variants that lost every shape
on the H200 are no longer run: split16w2, head16w2, head16w1, head64w8, head128w8, head128w16
(h200-run2-2026-11-30.log; head64w8 / head128w8 / head128w16 again in hb order, h200-s6-run2); the CUDA variants
behind cu-pers16s2 / cu-regs16 (h200-s5-run2); two chunks ahead uncapped or capped at 128 registers, BV=16,
8 warps (h200-s5-run3); 96 registers, no cache hints, the split path in hb order (h200-s6-run2/3). Stays within
~95 s: optional work is skipped (and says so) once the time budget runs low.
"""

from __future__ import annotations

import os
import sys
import time

import torch

T0 = time.time()
BUDGET_S = float(os.environ.get("KDA_DECODE_BUDGET_S", "92"))


def log(*a):
    print(*a, flush=True)


def left():
    return BUDGET_S - (time.time() - T0)


from k3nn import backend, ops
from k3nn.bench.common import device_meta, graph_bench_ms, rel_err
from k3nn.kernels.kda.triton_decode import decode_plan

def _pers(warps, stages):
    return dict(K3NN_KDA_CUDA_VARIANT="persistent", K3NN_KDA_CUDA_WARPS=str(warps), K3NN_KDA_CUDA_STAGES=str(stages))


def _head(bv, warps, pf=1, maxnreg=0, order="bh", evict="both"):
    return dict(K3NN_KDA_DECODE_PATH="head", K3NN_KDA_DECODE_BV=str(bv), K3NN_KDA_DECODE_WARPS=str(warps),
                K3NN_KDA_DECODE_PF=str(pf), K3NN_KDA_DECODE_MAXNREG=str(maxnreg), K3NN_KDA_DECODE_ORDER=order,
                K3NN_KDA_DECODE_EVICT=evict)


# name -> (backend, environment); the first Triton entry of each path is that path's default
VARIANTS = {
    "split32w4": ("triton", dict(K3NN_KDA_DECODE_PATH="split", K3NN_KDA_DECODE_BV="32", K3NN_KDA_DECODE_WARPS="4")),
    # the default: [D, 64] chunks, 4 warps, the compiler's register count, hb order (h200-s6-run5..7)
    "head64w4hb": ("triton", _head(64, 4, 1, 0, "hb")),
    "head64w4r168hb": ("triton", _head(64, 4, 1, 168, "hb")),  # 3 programs per SM: spills
    "head64w4hbev-load": ("triton", _head(64, 4, 1, 0, "hb", "load")),  # the default hints from B·H = 16384
    "head64w4hbev-store": ("triton", _head(64, 4, 1, 0, "hb", "store")),
    "head64w4": ("triton", _head(64, 4, 1, 0, "bh")),
    # [D, 32] chunks (the default before h200-s6-run5: 128 registers, bh order). hb launches the heads of one
    # request together (one contiguous 6 MB state block per request at H=96): +7.5% at B=64, +9.6% at B=256
    # (h200-s6-run1); ev-store (evict_first on the stores only): +1.3% at B=64 H=96, -2.5% at H=32
    "head32w4": ("triton", _head(32, 4, 1, 128)),
    "head32w4hb": ("triton", _head(32, 4, 1, 128, "hb")),
    "head32w4hbev-store": ("triton", _head(32, 4, 1, 128, "hb", "store")),
    "head32w4pf2r168hb": ("triton", _head(32, 4, 2, 168, "hb")),
    # CUDA (h200-s5-run2: behind head32w4 at every batch): persistent (one CTA per SM looping over
    # request-heads, state tiles streamed into shared memory STAGES ahead by bulk async copies), regs (one CTA
    # per request-head, 16-byte state loads into registers); regs / block in hb order (grid (H, B)): +1-3%
    # (h200-s6-run4)
    "cu-pers16s2": ("cuda", _pers(16, 2)),
    "cu-regs16": ("cuda", dict(K3NN_KDA_CUDA_VARIANT="regs", K3NN_KDA_CUDA_WARPS="16")),
    "cu-regs16hb": ("cuda", dict(K3NN_KDA_CUDA_VARIANT="regs", K3NN_KDA_CUDA_WARPS="16", K3NN_KDA_CUDA_ORDER="hb")),
    "cu-regs8hb": ("cuda", dict(K3NN_KDA_CUDA_VARIANT="regs", K3NN_KDA_CUDA_WARPS="8", K3NN_KDA_CUDA_ORDER="hb")),
    "cu-blockhb": ("cuda", dict(K3NN_KDA_CUDA_VARIANT="block", K3NN_KDA_CUDA_ORDER="hb")),
}
ENV = ("K3NN_KDA_DECODE_PATH", "K3NN_KDA_DECODE_BV", "K3NN_KDA_DECODE_WARPS", "K3NN_KDA_DECODE_PF",
       "K3NN_KDA_DECODE_MAXNREG", "K3NN_KDA_DECODE_ORDER", "K3NN_KDA_DECODE_EVICT", "K3NN_KDA_CUDA_VARIANT",
       "K3NN_KDA_CUDA_WARPS", "K3NN_KDA_CUDA_STAGES", "K3NN_KDA_CUDA_GRID", "K3NN_KDA_CUDA_ORDER")
RACE = ("split32w4", "head64w4hb", "head32w4hbev-store", "cu-pers16s2")
D, W = 128, 4


def use(variant):
    """Set the environment for ``variant`` ("auto": no override) and return the backend to call."""
    for k in ENV:
        os.environ.pop(k, None)
    if variant == "auto":
        return "triton"
    be, env = VARIANTS[variant]
    os.environ.update(env)
    return be


def inputs(B, T, H, dtype, seed, N=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")
    C = H * D
    N = N or B + 3
    p = [r(B, T, 3 * C).to(dtype), r(B, T, C).to(dtype), r(B, T, H).to(dtype), r(B, T, C).to(dtype),
         (r(3 * C, W) * 0.5).to(dtype), torch.rand(H, generator=g, device="cuda").mul(2.7),
         r(C), (1 + 0.1 * r(D))]
    S = r(N, H, D, D) * 0.05
    cs = r(N, W - 1, 3 * C).to(dtype)
    idx = torch.randperm(N, generator=g, device="cuda")[:B].to(torch.int32)
    return p, S, cs, idx


def call(be, p, S, cs, idx, kw):
    with backend(be):
        return ops.kda_fused_decode(*p, S, cs, idx, **kw)


def correctness(variants):
    log("== correctness vs eager (max rel err of y | state | conv state), shuffled slots ==")
    worst = {}
    cases = [(dt, B, T) for dt in (torch.float32, torch.bfloat16) for B in (1, 64) for T in (1, 3)]
    refs = {}
    for dt, B, T in cases:
        gate = "lower_bound" if T == 1 else "softplus"
        kw = dict(gate_kind=gate, lower_bound=-5.0, norm_eps=1e-5)
        p, S, cs, idx = inputs(B, T, 96, dt, seed=B * 10 + T)
        S_r, c_r = S.clone(), cs.clone()
        y_r = call("eager", p, S_r, c_r, idx, kw)
        refs[(dt, B, T)] = (p, S, cs, idx, kw, y_r, S_r, c_r)
    for v in variants:
        if left() < 50:
            log(f"  (time budget: correctness of {v} and later variants skipped)")
            break
        be = use(v)
        errs = []
        for (dt, B, T), (p, S, cs, idx, kw, y_r, S_r, c_r) in refs.items():
            S_t, c_t = S.clone(), cs.clone()
            try:
                y_t = call(be, p, S_t, c_t, idx, kw)
            except Exception as e:  # noqa: BLE001
                log(f"  {v:11s} {str(dt)[6:]:8s} B={B:<3d} T={T}  failed {type(e).__name__}: {e}   <-- FAIL")
                errs.append((float("inf"),) * 3)
                continue
            e = (rel_err(y_t, y_r), rel_err(S_t, S_r), rel_err(c_t.float(), c_r.float()))
            errs.append(e)
            tol = 1e-4 if dt == torch.float32 else 3e-2
            flag = "" if max(e) <= tol else "   <-- FAIL"
            log(f"  {v:11s} {str(dt)[6:]:8s} B={B:<3d} T={T}  y {e[0]:.2e}  S {e[1]:.2e}  conv {e[2]:.2e}{flag}")
        worst[v] = max((max(e) for e in errs), default=float("nan"))
    return worst


def race_check(variants):
    log("== race detector: same B=64 H=96 bf16 call 20x from the same inputs, bitwise identical? ==")
    for T in (1, 3):
        p, S, cs, idx = inputs(64, T, 96, torch.bfloat16, seed=777 + T)
        kw = dict(gate_kind="lower_bound", lower_bound=-5.0, norm_eps=1e-5)
        for v in variants:
            if left() < 40:
                log("  (time budget: remaining race checks skipped)")
                return
            be = use(v)
            first, bad = None, 0
            for _ in range(20):
                S_t, c_t = S.clone(), cs.clone()
                out = (call(be, p, S_t, c_t, idx, kw), S_t, c_t)
                if first is None:
                    first = out
                elif not all(torch.equal(a, b) for a, b in zip(out, first)):
                    bad += 1
            torch.cuda.synchronize()
            log(f"  {v:11s} T={T}: {'identical' if bad == 0 else f'{bad}/19 runs DIFFER  <-- RACE'}")


def fla_args(p, S, B, H, T=1):
    """fla's ``fused_recurrent_kda`` arguments for the same step (bare recurrence: q, k, v taken from the
    un-convolved projections, gate / β / L2 norm in its kernel): ``(args, kwargs)``."""
    y = p[0].float().reshape(B, T, 3, H, D)
    q, k, v = (y[:, :, i].to(torch.bfloat16).contiguous() for i in range(3))
    g = p[1].reshape(B, T, H, D).contiguous()
    fkw = dict(A_log=p[5], dt_bias=p[6], initial_state=S[:B].clone(), output_final_state=True,
               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
               lower_bound=-5.0)
    return (q, k, v, g, p[2].contiguous()), fkw


def fla_fn():
    try:
        from fla.ops.kda import fused_recurrent_kda
        return fused_recurrent_kda
    except Exception as e:  # noqa: BLE001
        log(f"fla-core not importable ({type(e).__name__}: {e}); fla column left empty")
        return None


def _arg(flag, default):
    a = sys.argv[1:]
    return a[a.index(flag) + 1] if flag in a else default


# --shapes B:H[:T],... (default: the five below, T = 1; T > 1: verify windows); --timing-first: time before the
# correctness checks
SHAPES = [(tuple(int(x) for x in s.split(":")) + (1,))[:3]
          for s in _arg("--shapes", "1:96,8:96,64:96,256:96,64:32").split(",")]


def timing(variants, copy_tbps):
    log("== per-layer time in a CUDA graph (bf16 activations, fp32 state, lower_bound gate) ==")
    fr = fla_fn()
    summary = []
    for B, H, T in SHAPES:
        tag = f"B={B} H={H}" + (f" T={T}" if T > 1 else "")
        if left() < 8:
            log(f"  (time budget: {tag} and later shapes skipped)")
            break
        p, S, cs, idx = inputs(B, T, H, torch.bfloat16, seed=B + H + T - 1)
        kw = dict(gate_kind="lower_bound", lower_bound=-5.0, norm_eps=1e-5)
        nbytes = 2 * B * H * D * D * 4
        use("auto")
        auto = decode_plan(B, H, D)
        row = []
        for v in ["auto"] + variants:
            if left() < 6:
                log("  (time budget: remaining variants skipped)")
                break
            be = use(v)
            try:
                ms = graph_bench_ms(lambda a=(p, S, cs, idx, kw), be=be: call(be, *a))
            except Exception as e:  # noqa: BLE001
                log(f"  {tag} {v}: failed {type(e).__name__}: {e}")
                continue
            row.append((v if v != "auto" else f"auto={auto[0]}{auto[1]}w{auto[2]}", ms))
        use("auto")
        if fr is not None and left() > 4:
            fa, fkw = fla_args(p, S, B, H, T)
            try:
                fr(*fa, **fkw)
                row.append(("fla fused_recurrent_kda", graph_bench_ms(lambda a=fa, kw_=fkw: fr(*a, **kw_))))
            except Exception as e:  # noqa: BLE001
                log(f"  fla failed at {tag}: {type(e).__name__}: {e}")
        log(f"  -- {tag} (state {nbytes / 1e6:.1f} MB moved per call)")
        log(f"     {'variant':26s} {'us':>8s} {'TB/s':>7s} {'frac_copy':>9s}")
        for name, ms in row:
            tb = nbytes / ms / 1e9
            log(f"     {name:26s} {ms * 1e3:8.2f} {tb:7.3f} {tb / copy_tbps:9.3f}")
        best = min((r for r in row if not r[0].startswith("fla")), key=lambda r: r[1], default=None)
        if best:
            summary.append(f"{tag}: best {best[0]} {best[1] * 1e3:.2f} us "
                           f"({nbytes / best[1] / 1e9 / copy_tbps:.3f} of copy BW)")
        for fam in ("head", "cu-"):  # best persistent CUDA kernel, best CUDA kernel of any kind
            cu = min((r for r in row if r[0].startswith(fam)), key=lambda r: r[1], default=None)
            if cu:
                summary.append(f"{tag}: best {fam}* {cu[0]} {cu[1] * 1e3:.2f} us "
                               f"({nbytes / cu[1] / 1e9 / copy_tbps:.3f} of copy BW)")
        p = S = cs = None
        torch.cuda.empty_cache()
    log("== summary ==")
    for s in summary:
        log("  " + s)


def main():
    if not torch.cuda.is_available():
        log("needs a CUDA GPU")
        return 1
    import triton

    log(f"torch {torch.__version__}  triton {triton.__version__}  {torch.cuda.get_device_name()}")
    meta = device_meta()
    copy_tbps = meta["copy_tbps"]
    log(f"copy bandwidth {copy_tbps} TB/s (read + write), setup {time.time() - T0:.1f}s")
    variants = _arg("--variants", ",".join(VARIANTS)).split(",")  # --variants a,b,...: these only
    os.environ["K3NN_KDA_CUDA"] = "1"  # the CUDA kernels are opt-in
    from k3nn.kernels.kda import cuda_decode

    cuda_decode.available.cache_clear()
    why = "--no-cuda" if "--no-cuda" in sys.argv[1:] else cuda_decode.available()
    if why is None:
        t = time.time()
        try:
            cuda_decode.build()
            log(f"CUDA extension built / loaded in {time.time() - t:.1f}s")
        except Exception as e:  # noqa: BLE001
            why = f"build failed: {type(e).__name__}: {str(e)[-2000:]}"
    if why is not None:
        log(f"CUDA variants skipped: {why}")
        variants = [v for v in variants if VARIANTS[v][0] != "cuda"]
    if "--timing-first" in sys.argv[1:]:
        timing(variants, copy_tbps)
    worst = correctness(variants)
    log("   worst rel err per variant: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    race_check([v for v in RACE if v in variants])
    log(f"   ({time.time() - T0:.1f}s so far)")
    if "--timing-first" not in sys.argv[1:]:
        timing(variants, copy_tbps)
    use("auto")
    log(f"done in {time.time() - T0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
