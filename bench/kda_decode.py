"""kda-decode: the fused KDA decode op (conv + gate + β + L2 norm + recurrence + gated RMSNorm, one launch per
layer) replayed in a CUDA graph, vs fla-core ``fused_recurrent_kda`` (recurrence with in-kernel gate, β and
L2 norm; no conv, no output norm) on the same shapes.

Reports per-layer time and the achieved bandwidth of the fp32 state (read + write, 2·B·H·D²·4 bytes) against
the copy ceiling measured in the same run. Requests sit in shuffled cache slots (``state_indices``).

    k3nn bench kda-decode [--quick]
"""

from __future__ import annotations

import argparse

import torch

from k3nn import backend, ops
from k3nn.kernels.kda.triton_decode import decode_plan

from bench.common import graph_bench_ms, print_table, rel_err, write_results

SUITE = "kda-decode"


def _layer(B, T, H, D, W, N, gate_kind, gen, dev="cuda", dtype=torch.bfloat16):
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    C = H * D
    p = dict(qkv=r(B, T, 3 * C).to(dtype), f=r(B, T, C).to(dtype), b=r(B, T, H).to(dtype),
             gate=r(B, T, C).to(dtype), conv_weight=(r(3 * C, W) * 0.5).to(dtype),
             A_log=torch.rand(H, generator=gen, device=dev).mul(2.7).float(), dt_bias=r(C).float(),
             norm_weight=(1 + 0.1 * r(D)).float())
    S = r(N, H, D, D) * 0.05
    cs = r(N, W - 1, 3 * C).to(dtype)
    idx = torch.randperm(N, generator=gen, device=dev)[:B].to(torch.int32)
    return p, S, cs, idx


def _fla():
    try:
        from fla.ops.kda import fused_recurrent_kda
        return fused_recurrent_kda
    except Exception as e:  # pragma: no cover
        print(f"fla-core not importable ({type(e).__name__}: {e}); anchor columns left empty")
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="k3nn bench kda-decode")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    fr = _fla()
    D, W = 128, 4
    cases = [(1, 1, 96), (8, 1, 96), (64, 1, 96), (256, 1, 96), (64, 1, 32), (1, 4, 96), (16, 4, 96)]
    if args.quick:
        cases = [(1, 1, 96), (64, 1, 96)]
    rows = []
    try:
        _cases(cases, rows, fr, gen, D, W)
    except KeyboardInterrupt:  # `timeout -s INT`: keep what was measured
        print("interrupted: writing the rows measured so far")
    path = write_results(SUITE, rows, {"suite": SUITE})
    print_table(rows, ["case", "k3nn_us", "tbps", "frac_copy_bw", "anchor_ms", "speedup", "err_vs_eager"])
    print(f"wrote {path}")
    return rows


def _cases(cases, rows, fr, gen, D, W):
    for B, T, H in cases:
        gate_kind = "lower_bound"
        N = B + 3
        p, S, cs, idx = _layer(B, T, H, D, W, N, gate_kind, gen)
        kw = dict(gate_kind=gate_kind, lower_bound=-5.0, norm_eps=1e-5)
        S_r, cs_r = S.clone(), cs.clone()
        with backend("eager"):
            y_r = ops.kda_fused_decode(*p.values(), S_r, cs_r, idx, **kw)
        S_t, cs_t = S.clone(), cs.clone()
        with backend("triton"):
            y_t = ops.kda_fused_decode(*p.values(), S_t, cs_t, idx, **kw)
            err = max(rel_err(y_t, y_r), rel_err(S_t, S_r), rel_err(cs_t.float(), cs_r.float()))
            ms = graph_bench_ms(lambda: ops.kda_fused_decode(*p.values(), S_t, cs_t, idx, **kw))
        state_bytes = 2 * B * H * D * D * 4
        row = {"case": f"B{B} T{T} H{H} D{D} W{W} bf16 fp32-state gate={gate_kind}",
               "path": "{}-bv{}-w{}".format(*decode_plan(B, H, D)), "k3nn_ms": round(ms, 5),
               "k3nn_us": round(ms * 1e3, 2), "tbps": round(state_bytes / ms / 1e9, 3), "err_vs_eager": float(f"{err:.3g}")}
        if fr is not None:
            y = p["qkv"].float().reshape(B, T, 3, H, D)
            q, k, v = (y[:, :, i].to(torch.bfloat16).contiguous() for i in range(3))
            g = p["f"].reshape(B, T, H, D).contiguous()
            beta = p["b"].contiguous()
            h0 = S[:B].clone()
            fkw = dict(A_log=p["A_log"], dt_bias=p["dt_bias"], initial_state=h0, output_final_state=True,
                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                       lower_bound=-5.0)
            try:
                fr(q, k, v, g, beta, **fkw)
                row["anchor"] = "fla-core 0.6.0 fused_recurrent_kda (in-kernel gate/beta/l2norm; no conv, no norm)"
                row["anchor_ms"] = round(graph_bench_ms(lambda: fr(q, k, v, g, beta, **fkw)), 5)
                row["anchor_tbps"] = round(state_bytes / row["anchor_ms"] / 1e9, 3)
                row["speedup"] = round(row["anchor_ms"] / row["k3nn_ms"], 3)
            except Exception as e:  # pragma: no cover
                print(f"fla anchor failed on {row['case']}: {type(e).__name__}: {e}")
        rows.append(row)
        print(row, flush=True)


if __name__ == "__main__":
    main()
