#!/usr/bin/env python3
"""Skinny GEMM (``ops.linear``'s Triton kernel) against torch's GEMM (cuBLAS) on every projection shape of a
``k3_slice`` decode step, at 1-16 rows, one self-contained GPU run.

    python3 -m bench.gpu.skinny_linear [--rows 1,4,16] [--budget 70] [--configs all|default]

For each projection shape [N, K] of the prepared decode path (KDA q|k|v|g|f_a|b, f_b, o; MLA q_a|kv_a|g, q_b, o;
dense MLP gate|up and down; latent MoE down / up; shared experts gate|up and down with the residual add inside; the
router in fp32; lm_head) and each row count:

1. every launch shape is checked against fp64 on the same inputs (rel. Frobenius error; bf16 output rounding
   ≈ 2e-3) before it is timed;
2. torch's ``F.linear`` (``torch.addmm`` with the residual) and each launch shape are timed as a CUDA graph of
   many calls over rotating weight copies (≥ 256 MB, so the weights stream from HBM as in a decode step): µs, TB/s of
   the weight + activation bytes, fraction of the copy bandwidth measured in this process.

Writes ``skinny-linear-<date>.json`` (rows per shape / rows / variant, the best launch shape per shape and row
bucket in ``meta.best``: the data of ``k3nn.kernels.linear.tuned``) and prints the table and the ``TUNED`` /
``TORCH_FASTER`` entries last. Stops starting new shapes after ``--budget`` seconds.
"""

from __future__ import annotations

import argparse
import functools
import time

T0 = time.time()

import torch
import torch.nn.functional as F

from k3nn.config import KimiK3Config
from k3nn.kernels.linear.triton_skinny import SkinnyConfig, default_config, linear_skinny, row_bucket

from bench.common import device_meta, graph_bench_ms, print_table, rel_err, write_results

print = functools.partial(print, flush=True)

SUITE = "skinny-linear"

#: launch shapes timed per row bucket (the default of default_config is added to each)
CONFIGS = {
    1: [SkinnyConfig("fma", 8, 512, 4, 1, 1), SkinnyConfig("fma", 16, 512, 4, 1, 1), SkinnyConfig("fma", 32, 256, 4, 1, 1),
        SkinnyConfig("fma", 16, 512, 8, 1, 1), SkinnyConfig("dot", 64, 128, 4, 4, 1)],
    4: [SkinnyConfig("fma", 16, 128, 4, 1, 1), SkinnyConfig("fma", 8, 256, 4, 1, 1), SkinnyConfig("dot", 32, 256, 4, 4, 1),
        SkinnyConfig("dot", 64, 128, 4, 4, 1), SkinnyConfig("dot", 128, 128, 4, 4, 1)],
    16: [SkinnyConfig("dot", 32, 256, 4, 4, 1), SkinnyConfig("dot", 64, 128, 4, 4, 1), SkinnyConfig("dot", 64, 256, 4, 3, 1),
         SkinnyConfig("dot", 128, 128, 4, 4, 1)],
}
ROUTER_CONFIGS = [SkinnyConfig("fma", 16, 256, 4, 1, 8), SkinnyConfig("fma", 8, 256, 4, 1, 16)]


def k3_slice_shapes(cfg: KimiK3Config) -> list[tuple[str, int, int, torch.dtype, bool]]:
    """(name, N, K, dtype, residual) of every projection a prepared decode step runs (one entry per distinct use)."""
    d, H, D = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    C = H * D
    gate = C if cfg.use_full_rank_gate else D
    Hm, dq = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    qa = cfg.q_lora_rank or Hm * dq
    mla_in = qa + cfg.kv_lora_rank + cfg.qk_rope_head_dim + (Hm * cfg.v_head_dim if cfg.mla_use_output_gate else 0)
    si = cfg.shared_expert_intermediate_size
    bf = torch.bfloat16
    out = [("kda q|k|v|g|f_a|b", 3 * C + gate + D + H, d, bf, False), ("kda f_b", C, D, bf, False),
           ("kda/mla o_proj", d, C, bf, False), ("mla q_a|kv_a|g", mla_in, d, bf, False)]
    if cfg.q_lora_rank:
        out.append(("mla q_b", Hm * dq, cfg.q_lora_rank, bf, False))
    out += [("mlp gate|up", 2 * cfg.intermediate_size, d, bf, False), ("mlp down", d, cfg.intermediate_size, bf, False)]
    if cfg.moe_kind == "latent":
        out += [("moe latent down", cfg.expert_input_size, d, bf, False),
                ("moe latent up", d, cfg.expert_input_size, bf, False)]
    if si:
        out += [("shared gate|up", 2 * si, d, bf, False), ("shared down (+routed)", d, si, bf, True)]
    out += [("router (fp32)", cfg.num_experts, d, torch.float32, False), ("lm_head", cfg.vocab_size, d, bf, False)]
    return sorted(out, key=lambda s: -s[1] * s[2] * (s[3] == bf))  # the largest weights first, the router last


def _host_ms(fn, inner: int = 4, rep: int = 3, indexed: bool = False) -> float:
    """Host-timed calls (the CPU smoke run: no graphs, no meaning as a result)."""
    t = time.perf_counter()
    for i in range(inner):
        fn(i)
    return (time.perf_counter() - t) * 1e3 / inner


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.skinny_linear")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--budget", type=float, default=70.0, help="stop starting new shapes after this many seconds")
    ap.add_argument("--configs", default="all", choices=["all", "default"])
    ap.add_argument("--config", default="k3_slice", help="preset whose projection shapes are timed (tiny: CPU smoke "
                                                          "run under TRITON_INTERPRET=1; timings are not results)")
    args = ap.parse_args(argv)
    meta = device_meta()
    copy = meta.get("copy_tbps") or float("nan")  # no GPU: the fractions are NaN
    print(f"copy {copy} TB/s, bf16 {meta.get('bf16_tflops')} TFLOP/s; setup {time.time() - T0:.1f}s")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    timer = graph_bench_ms if dev.type == "cuda" else _host_ms
    rows_list = [int(r) for r in args.rows.split(",")]
    rows: list[dict] = []
    best: dict[str, list] = {}
    torch_faster: list = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, N, K, dt, res in k3_slice_shapes(getattr(KimiK3Config, args.config)()):
        if time.time() - T0 > args.budget:
            print(f"budget reached: skipping {name}")
            continue
        es = torch.finfo(dt).bits // 8
        wbytes = N * K * es
        copies = max(1, -(-(256 << 20) // wbytes)) if dev.type == "cuda" else 1
        ws = [torch.randn(N, K, device=dev, dtype=dt, generator=gen) * 0.02 for _ in range(copies)]
        for M in rows_list:
            x = torch.randn(M, K, device=dev, dtype=dt, generator=gen)
            r = torch.randn(M, N, device=dev, dtype=dt, generator=gen) if res else None
            ref = (x.double() @ ws[0].double().t() + (r.double() if res else 0)).float()
            nbytes = wbytes + (M * K + M * N * (2 if res else 1)) * es

            def torch_call(i, x=x, r=r):
                w = ws[i % copies]
                return torch.addmm(r, x, w.t()) if r is not None else F.linear(x, w)

            t_ms = timer(torch_call, inner=max(4, min(40, copies)), rep=15, indexed=True)
            case = f"{name} [{N}x{K}] {str(dt)[6:]} M={M}"
            base = dict(case=case, shape=[N, K], rows=M, dtype=str(dt)[6:], anchor="torch F.linear (cuBLAS)",
                        anchor_ms=round(t_ms, 5), anchor_tbps=round(nbytes / t_ms / 1e9, 3))
            rows.append(dict(base, variant="torch", k3nn_ms=round(t_ms, 5), tbps=round(nbytes / t_ms / 1e9, 3),
                             err=float(f"{rel_err(torch_call(0).float(), ref):.3g}")))
            cands = list(ROUTER_CONFIGS if dt == torch.float32 else CONFIGS[row_bucket(M)]) if args.configs == "all" else []
            dflt = default_config(M, N, K, dt, sms)
            if dflt not in cands:
                cands.append(dflt)
            winner = None
            for cfg in cands:
                try:
                    out = linear_skinny(x, ws[0], None, r, config=cfg)
                    err = rel_err(out.float(), ref)
                    if not err < (1e-5 if dt == torch.float32 else 1e-2):
                        rows.append(dict(base, variant=cfg.name(), error=f"rel err {err:.3g}"))
                        print(rows[-1])
                        continue
                    ms = timer(lambda i, cfg=cfg: linear_skinny(x, ws[i % copies], None, r, config=cfg),
                                        inner=max(4, min(40, copies)), rep=15, indexed=True)
                except Exception as e:  # a launch shape the compiler refuses: record and go on
                    rows.append(dict(base, variant=cfg.name(), error=f"{type(e).__name__}: {e}"[:300]))
                    print(rows[-1])
                    continue
                row = dict(base, variant=cfg.name(), config=list(cfg), k3nn_ms=round(ms, 5),
                           tbps=round(nbytes / ms / 1e9, 3), err=float(f"{err:.3g}"), default=cfg == dflt)
                rows.append(row)
                if winner is None or ms < winner[0]:
                    winner = (ms, cfg)
            if winner is not None:
                key = f"{str(dt)[6:]},{N},{K},{row_bucket(M)}"
                best[key] = list(winner[1])
                if winner[0] > t_ms:
                    torch_faster.append(key)
                print(f"{case}: torch {t_ms * 1e3:.1f} us ({nbytes / t_ms / 1e9:.2f} TB/s) | best {winner[1].name()} "
                      f"{winner[0] * 1e3:.1f} us ({nbytes / winner[0] / 1e9:.2f} TB/s, "
                      f"{nbytes / winner[0] / 1e9 / copy:.0%} of copy) x{t_ms / winner[0]:.2f}")
        del ws
        torch.cuda.empty_cache()
    path = write_results(SUITE, rows, {"suite": SUITE, "config": "k3_slice", "best": best, "torch_faster": torch_faster,
                                        "note": "graph-replayed calls over rotating weight copies >= 256 MB; bytes = "
                                                "weight + x + y (+ residual)"})
    summary = [r for r in rows if r.get("variant") == "torch" or (r.get("k3nn_ms") and r.get("variant") != "torch")]
    bestrows = {}
    for r in summary:
        if r["variant"] == "torch":
            continue
        k = r["case"]
        if k not in bestrows or r["k3nn_ms"] < bestrows[k]["k3nn_ms"]:
            bestrows[k] = r
    table = [dict(case=k, torch_us=round(v["anchor_ms"] * 1e3, 1), torch_frac=round(v["anchor_tbps"] / copy, 3),
                  best_us=round(v["k3nn_ms"] * 1e3, 1), best_frac=round(v["tbps"] / copy, 3), variant=v["variant"],
                  speedup=round(v["anchor_ms"] / v["k3nn_ms"], 3)) for k, v in bestrows.items()]
    print_table(table, ["case", "torch_us", "torch_frac", "best_us", "best_frac", "speedup", "variant"])
    print("TUNED = {" + ", ".join(f"({k.split(',')[0]!r}, {k.split(',')[1]}, {k.split(',')[2]}, {k.split(',')[3]}): "
                                  f"{tuple(v)!r}" for k, v in best.items()) + "}")
    print(f"TORCH_FASTER = {torch_faster!r}")
    print(f"wrote {path} in {time.time() - T0:.1f}s")
    return rows


if __name__ == "__main__":
    main()
