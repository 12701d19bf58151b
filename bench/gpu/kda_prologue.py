"""GPU check + timing of the KDA prefill prologue kernels: ``ops.short_conv`` (causal conv + SiLU + L2 norm of q, k),
``ops.kda_gate`` and ``ops.gated_rmsnorm``, Triton against eager.

    python3 -m bench.gpu.kda_prologue [--tokens 8192,32768] [--heads 32] [--head-dim 128] [--sweep]

1. Correctness, bf16 activations on CUDA: for each T, the Triton output of every op against eager (relative
   error printed; the final conv state must be bitwise equal), the short conv also over 4 packed sequences with
   history, and both gate kinds.
2. Timing (CUDA events, bench.common.bench_ms, inputs far larger than L2) of eager and Triton, plus the
   composition the layer ran before the fused op (``short_conv`` + two ``l2norm``) as "before". GB/s counts the
   bytes an op must move once: short conv 2·T·3C·2 (x read, y written), gate T·C·(2 + 4) (f bf16 in, g fp32
   out), gated RMSNorm 3·T·C·2 (x, gate in, y out); C = H·D.
3. ``--sweep``: the short conv at (BT, num_warps) tiles around the default (kernels/kda/triton_prologue.py
   ``conv_config`` should be set from the fastest).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from k3nn import backend, ops
from k3nn.kernels.kda.prologue import l2norm, short_conv

from bench.common import bench_ms, rel_err

T0 = time.time()
DEV = "cuda"
DT = torch.bfloat16


def say(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def inputs(T: int, H: int, D: int, W: int, g: torch.Generator) -> dict:
    C = H * D
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731
    return dict(x=r(1, T, 3 * C).to(DT), w=(r(3 * C, W) * 0.5).to(DT), h0=r(1, W - 1, 3 * C).to(DT),
                f=(r(1, T, C) * 3).to(DT), A_log=r(H) * 0.5, dt_bias=r(C), o=r(1, T, H, D).to(DT),
                gate=r(1, T, H, D).to(DT), nw=(0.5 + torch.rand(D, device=DEV, generator=g)).to(DT))


def calls(a: dict, H: int, D: int) -> dict:
    C = H * D
    return {
        "short_conv": lambda: ops.short_conv(a["x"], a["w"], a["h0"], l2norm_channels=2 * C, head_dim=D),
        "kda_gate softplus": lambda: ops.kda_gate(a["f"], a["A_log"], a["dt_bias"], "softplus", -5.0, D),
        "kda_gate lower_bound": lambda: ops.kda_gate(a["f"], a["A_log"], a["dt_bias"], "lower_bound", -5.0, D),
        "gated_rmsnorm": lambda: ops.gated_rmsnorm(a["o"], a["gate"], a["nw"], 1e-5),
    }


def before(a: dict, H: int, D: int):
    """The layer's composition before the fused op: conv + SiLU, then the L2 norms of q and k."""
    y, fin = short_conv(a["x"], a["w"], a["h0"])
    q, k, _ = y.split(H * D, dim=-1)
    return l2norm(q.unflatten(-1, (H, D))), l2norm(k.unflatten(-1, (H, D))), fin


def run(name: str, fn):
    with backend(name):
        out = fn()
    return out if isinstance(out, tuple) else (out,)


def correctness(a: dict, T: int, H: int, D: int, W: int) -> bool:
    ok = True
    for op, fn in calls(a, H, D).items():
        ref, got = run("eager", fn), run("triton", fn)
        errs = [rel_err(o, r) for o, r in zip(got, ref)]
        good = errs[0] < 1e-2 and all(e == 0.0 for e in errs[1:])  # states are copies: bitwise
        ok &= good
        say(f"T={T:6d} {op:22s} rel err {', '.join(f'{e:.2e}' for e in errs)}{'' if good else '  FAIL'}")
    C = 3 * H * D
    lens = [T // 2, 1, 0, T - T // 2 - 1]
    cu = torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
    h0 = torch.randn(len(lens), W - 1, C, device=DEV).to(DT)
    fn = lambda: ops.short_conv(a["x"], a["w"], h0, cu, l2norm_channels=2 * H * D, head_dim=D)  # noqa: E731
    ref, got = run("eager", fn), run("triton", fn)
    e_y, e_s = rel_err(got[0], ref[0]), rel_err(got[1], ref[1])
    good = e_y < 1e-2 and torch.equal(got[1], ref[1])
    ok &= good
    say(f"T={T:6d} short_conv varlen {lens} rel err {e_y:.2e}, {e_s:.2e}{'' if good else '  FAIL'}")
    return ok


def timing(a: dict, T: int, H: int, D: int) -> list[dict]:
    C = H * D
    nbytes = {"short_conv": 2 * T * 3 * C * 2, "kda_gate softplus": T * C * 6, "kda_gate lower_bound": T * C * 6,
              "gated_rmsnorm": 3 * T * C * 2}
    rows = []
    ms = bench_ms(lambda: before(a, H, D))
    rows.append(dict(T=T, op="short_conv", impl="before", ms=ms, gbps=nbytes["short_conv"] / ms / 1e6))
    for op, fn in calls(a, H, D).items():
        for impl in ("eager", "triton"):
            with backend(impl):
                ms = bench_ms(fn)
            rows.append(dict(T=T, op=op, impl=impl, ms=ms, gbps=nbytes[op] / ms / 1e6))
    return rows


def sweep(a: dict, T: int, H: int, D: int) -> None:
    from k3nn.kernels.kda.triton_prologue import conv_config, short_conv_triton

    W = a["w"].shape[1]
    dflt = conv_config(D, W)
    nbytes = 2 * T * 3 * H * D * 2
    for bt in (8, 16, 32, 64, 128):
        for warps in (2, 4, 8):
            cfg = (D, bt, warps)
            ms = bench_ms(lambda: short_conv_triton(a["x"], a["w"], a["h0"], None, 2 * H * D, D, config=cfg))
            say(f"T={T:6d} short_conv BT={bt:3d} warps={warps}  {ms:7.3f} ms  {nbytes / ms / 1e6:7.0f} GB/s"
                f"{'  (default)' if (bt, warps) == dflt else ''}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192,32768", help="comma-separated token counts")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--width", type=int, default=4, help="short conv kernel size")
    ap.add_argument("--sweep", action="store_true", help="also time the short conv over tile configs")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", flush=True)
        return 2
    import triton

    H, D, W = args.heads, args.head_dim, args.width
    say(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}  H={H} D={D} W={W}")
    g = torch.Generator(device=DEV).manual_seed(0)
    ok, rows = True, []
    with torch.no_grad():
        for T in tokens:
            a = inputs(T, H, D, W, g)
            ok &= correctness(a, T, H, D, W)
            if not args.skip_timing:
                rows += timing(a, T, H, D)
            if args.sweep:
                sweep(a, T, H, D)
            del a
            torch.cuda.empty_cache()
    if rows:
        print("\n     T  op                     impl         ms      GB/s  vs eager", flush=True)
        eager = {(r["T"], r["op"]): r["ms"] for r in rows if r["impl"] == "eager"}
        for r in rows:
            print(f"{r['T']:6d}  {r['op']:22s} {r['impl']:8s} {r['ms']:9.3f} {r['gbps']:9.0f}"
                  f"  {eager[(r['T'], r['op'])] / r['ms']:6.2f}x", flush=True)
    say("done" + ("" if ok else " (CORRECTNESS FAILURES above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
