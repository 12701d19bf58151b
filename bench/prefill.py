"""prefill: whole-model time to first token, k3nn vs transformers' ``KimiLinearForCausalLM`` (fla installed), same
weights, side by side.

The model: Kimi-Linear-48B layer dims with ``--layers`` layers (3 KDA + 1 MLA by default, layer 0 dense, then MoE
with ``--experts`` experts top-8), bf16, built in transformers with random weights (a non-trivial router bias),
saved with ``save_pretrained`` and loaded by ``KimiK3.from_pretrained``: the path a user's checkpoint takes.
Agreement is checked first (bf16 logits vs transformers; fp32 k3nn kernels vs k3nn eager on a fp32 copy). Then
TTFT (a forward with a fresh cache allocated inside the timed call and ``logits_to_keep=1``; median and minimum of
``--reps`` calls after a warm-up) at each ``--lengths`` for both (512 tokens up: short prompts must not lose; k3nn
also with its projections packed, ``prepare_decode()``, as the Engine runs them), and at each
``--k3nn-only`` length for k3nn (transformers too with ``--anchor-long``, where it fits), with peak memory. The MLA
attention kernel is timed alone at the longest length against the bf16 matmul ceiling (causal FLOPs).
``--preset k3_slice`` times K3's real dims (8 layers, no transformers counterpart) instead.

    k3nn bench prefill [--lengths 512,2048,8192,32768,131072] [--k3nn-only 524288,1048576] [--chunk N]
"""

from __future__ import annotations

import argparse
import copy
import gc
import tempfile
import time

import torch

from bench.common import device_meta, median_call_ms, print_table, rel_err, write_results

SUITE = "prefill"  # the k3_slice preset writes "prefill-k3" (its own README table)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def hf_config(layers: int, experts: int, vocab: int):
    from transformers import KimiLinearConfig

    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return KimiLinearConfig(
        vocab_size=vocab, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_local_experts=experts,
        num_experts_per_tok=8, n_shared_experts=1, routed_scaling_factor=2.446, max_position_embeddings=1 << 20,
        layer_types=types, mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), linear_num_heads=32,
        linear_head_dim=128, linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_pair(layers: int, experts: int, vocab: int, seed: int = 0):
    """(transformers model, k3nn model) on CUDA in bf16 with the same weights."""
    from transformers import KimiLinearForCausalLM

    from k3nn.model import KimiK3

    torch.manual_seed(seed)
    with torch.device("cuda"):
        hf = KimiLinearForCausalLM(hf_config(layers, experts, vocab))
    hf = hf.to(torch.bfloat16).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0, 0.1)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        k3 = KimiK3.from_pretrained(d, dtype=torch.bfloat16, device="cuda")
    return hf, k3


#: lengths up to this are run once on both sides before the first timed call (the host-bound short prompts)
WARM_ALL_MAX = 8192


def _time(fn, reps: int) -> tuple[float, float, float]:
    """(median ms over ``reps`` calls after two warm-up calls, peak GB of one call, minimum ms): the minimum is what
    an independent harness reports (a fresh cache allocated inside every timed call, the best of a few warm runs)."""
    fn()  # a first call of a length: compilation, autotuning, allocator growth
    ms, peak = median_call_ms(fn, 1, warmup=1)
    times = [ms]
    for _ in range(reps - 1):
        times.append(median_call_ms(fn, 1, warmup=0)[0])
    times.sort()
    return times[len(times) // 2], peak / 1e9, times[0]


def _once(fn) -> tuple[float, float, float]:
    """One timed call (no warm-up: the lengths too long to repeat; kernels were compiled at a shorter length)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    return ms, (torch.cuda.max_memory_allocated() - base) / 1e9, ms


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def attention_row(T: int, H: int, meta: dict) -> dict:
    """``ops.mla_attention`` alone at T (causal, one sequence, Kimi dims) in TFLOP/s of the causal product."""
    from k3nn import ops

    g = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, kv, kr = r(1, T, H, 192), r(1, T, H, 256), r(1, T, 64)
    fn = lambda: ops.mla_attention(q[..., :128], q[..., 128:], kv[..., :128], kr, kv[..., 128:], 192 ** -0.5)  # noqa: E731
    ms = _time(fn, 3)[0] if T <= 1 << 17 else _once(fn)[0]
    flops = T * T * H * (192 + 128)  # 2 · (T² / 2) · H · (dq + dv)
    tf = flops / ms / 1e9
    return dict(case=f"mla_attention causal T={T} H={H} dq=192 dv=128 bf16", k3nn_ms=round(ms, 3),
                tflops=round(tf, 1), frac_bf16_peak=round(tf / meta["bf16_tflops"], 3))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="k3nn bench prefill")
    ap.add_argument("--lengths", type=_ints, default=[512, 2048, 8192, 32768, 131072])
    ap.add_argument("--k3nn-only", type=_ints, default=[524288, 1048576])
    ap.add_argument("--anchor-long", action="store_true", help="try transformers at the --k3nn-only lengths too")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--chunk", type=int, default=None, help="k3nn prefill_chunk_size (default: the model's)")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per length (median and minimum reported)")
    ap.add_argument("--preset", default="kimi_linear", choices=["kimi_linear", "k3_slice"])
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--suite", default=None, help="results file prefix (default: prefill, prefill-k3 for k3_slice); "
                                                  "e.g. prefill-short for a run of the short lengths alone")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    meta = device_meta()
    rows: list[dict] = []
    if args.preset == "k3_slice":
        from bench.models import bench_model

        cfg, k3 = bench_model("k3_slice", "cuda")
        hf = None
        name = "k3_slice bf16"
    else:
        import transformers

        hf, k3 = build_pair(args.layers, args.experts, args.vocab)
        cfg = k3.config
        from transformers.models.kimi_linear import modeling_kimi_linear as mkl

        meta.update(transformers=transformers.__version__,
                    anchor_kda=getattr(mkl.chunk_kimi_delta_attention, "__module__", "?"))
        try:
            import fla

            meta["fla"] = fla.__version__
        except ImportError:
            meta["fla"] = None
        name = f"kimi_linear L{args.layers} E{args.experts} bf16"
    if args.chunk is not None:
        k3.prefill_chunk_size = args.chunk
    meta.update(prefill_chunk_size=k3.prefill_chunk_size, layers=cfg.num_hidden_layers)
    print(f"# ({time.perf_counter() - t_start:.0f} s) {meta}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def ids_of(T):
        return torch.randint(0, cfg.vocab_size, (1, T), generator=gen, device="cuda")

    def k3_call(ids):
        with torch.no_grad():
            return k3(ids, cache=k3.new_cache(1, ids.shape[1]), logits_to_keep=1).logits

    def hf_call(ids):
        with torch.no_grad():
            return hf(ids, use_cache=True, logits_to_keep=1).logits

    if hf is not None and not args.no_check:
        # bf16 logits of both against transformers' fp32 copy of the model: MoE routing flips under bf16 rounding, so
        # each side's distance to the fp32 model is the fair comparison
        ids = ids_of(2048)
        from k3nn.kernels.registry import backend

        with torch.no_grad():
            k3_bf16, hf_bf16 = k3(ids).logits, hf(ids).logits
            hf32 = copy.deepcopy(hf).float()
            ref = hf32(ids).logits
            del hf32
            _free()
            k64 = copy.deepcopy(k3).double()
            with backend("eager"):
                ref64 = k64(ids[:, :512]).logits
            del k64
            k32 = copy.deepcopy(k3).float()
            tf32 = torch.backends.cuda.matmul.allow_tf32
            try:
                torch.backends.cuda.matmul.allow_tf32 = False  # the exact fp32 mode
                fp32_ieee = k32(ids[:, :512]).logits
                torch.backends.cuda.matmul.allow_tf32 = True
                fp32_tf32 = k32(ids[:, :512]).logits
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32
            del k32
        checks = dict(check_k3nn_bf16_vs_transformers_fp32=rel_err(k3_bf16, ref),
                      check_transformers_bf16_vs_transformers_fp32=rel_err(hf_bf16, ref),
                      check_k3nn_bf16_vs_transformers_bf16=rel_err(k3_bf16, hf_bf16),
                      check_k3nn_fp32_tf32_off_vs_fp64=rel_err(fp32_ieee, ref64),
                      check_k3nn_fp32_tf32_on_vs_fp64=rel_err(fp32_tf32, ref64))
        meta.update({k: round(v, 6) for k, v in checks.items()})
        print(f"# agreement ({time.perf_counter() - t_start:.0f} s): {checks}", flush=True)
        del ref, k3_bf16, hf_bf16
        _free()

    suite = args.suite or (SUITE if args.preset == "kimi_linear" else "prefill-k3")
    path = None
    anchor = f"transformers {meta.get('transformers')} KimiLinearForCausalLM + fla {meta.get('fla')}"
    # every short length once on both sides before any is timed: the first length timed had taken up to 30% longer
    # on both sides (its calls came first after the build: clocks, allocator, lazy initialisation)
    for T in (t for t in args.lengths if t <= WARM_ALL_MAX):
        ids = ids_of(T)
        for call in (k3_call, hf_call) if hf is not None else (k3_call,):
            call(ids)
    torch.cuda.synchronize()
    todo = [(T, False) for T in args.lengths]
    if args.lengths:
        todo.append((None, False))  # the attention kernel alone, before the long lengths
    todo += [(T, True) for T in args.k3nn_only]
    for T, long in todo:
        if T is None:
            rows.append(attention_row(max(args.lengths), cfg.num_attention_heads, meta))
            path = write_results(suite, rows, meta, path=path)
            print(f"({time.perf_counter() - t_start:.0f} s) {rows[-1]}", flush=True)
            continue
        ids = ids_of(T)
        row = dict(case=f"{name} T={T}")
        timer = _once if long else (lambda f: _time(f, args.reps))
        try:
            ms, gb, best = timer(lambda: k3_call(ids))
            row.update(k3nn_ms=round(ms, 2), k3nn_min_ms=round(best, 2), k3nn_peak_gb=round(gb, 2))
            if not long:  # the packed projections (what the Engine runs; no memory of their own)
                k3.prepare_decode()
                try:
                    ms, gb, best = timer(lambda: k3_call(ids))
                finally:
                    k3.prepare_decode(False)
                row.update(k3nn_prepared_ms=round(ms, 2), k3nn_prepared_min_ms=round(best, 2))
        except torch.OutOfMemoryError as e:
            row.update(k3nn_error=f"out of memory: {str(e)[:120]}")
        _free()
        if hf is not None and (not long or args.anchor_long):
            try:
                ms, gb, best = timer(lambda: hf_call(ids))
                row.update(anchor=anchor, anchor_ms=round(ms, 2), anchor_min_ms=round(best, 2),
                           anchor_peak_gb=round(gb, 2))
                if row.get("k3nn_ms"):
                    row["speedup"] = round(row["anchor_ms"] / row["k3nn_ms"], 3)
                    row["speedup_min"] = round(row["anchor_min_ms"] / row["k3nn_min_ms"], 3)
                if row.get("k3nn_prepared_ms"):
                    row["speedup_prepared_min"] = round(row["anchor_min_ms"] / row["k3nn_prepared_min_ms"], 3)
            except torch.OutOfMemoryError as e:
                row.update(anchor=anchor, anchor_error=f"out of memory: {str(e)[:120]}")
            _free()
        rows.append(row)
        path = write_results(suite, rows, meta, path=path)  # saved after every row: the long lengths take minutes
        print(f"({time.perf_counter() - t_start:.0f} s) {row}", flush=True)
    path = write_results(suite, rows, meta, path=path)
    print_table(rows, ["case", "k3nn_ms", "k3nn_prepared_ms", "anchor_ms", "speedup", "speedup_min",
                       "speedup_prepared_min", "k3nn_peak_gb", "anchor_peak_gb", "tflops"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
