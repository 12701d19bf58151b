"""The exact fp32 mode on the GPU: fp32 logits of the 4-layer Kimi-Linear slice against fp64, per backend and TF32
setting, with a per-op and per-module breakdown that names any op still off IEEE fp32.

The model is ``k3nn bench prefill``'s: Kimi-Linear-48B dims, 3 KDA + 1 MLA layers (layer 0 dense), 32 experts top-8,
random weights drawn on the device (router bias N(0, 0.1), as there), fp32, and its fp64 copy (same weights). The
fp64 copy runs on the eager backend: the reference. Then for each TF32 setting (off: ``allow_tf32 = False`` for
cuBLAS and cuDNN, the exact mode; on: both True) and each backend (``eager``, ``triton``, ``auto`` = the default
cuda → triton → eager pick):

* logits: a prefill of ``--T`` tokens (batch 1, fresh cache) and ``--decode`` teacher-forced decode steps;
  relative (‖Δ‖/‖ref‖) and max-abs error against fp64, also over the clean prefix (tokens before the first MoE
  routing flip: routing is causal, so no flip can reach them), and the routing flips per MoE layer;
* per op: every ``k3nn.ops`` call of those forwards (short_conv, kda_gate, kda_chunk, kda_fused_decode,
  mla_attention, moe_experts, rms_norm, gated_rmsnorm, ...) is repeated in fp64 on the eager backend from its own
  inputs cast to fp64; its output's relative error isolates that op's own rounding (IEEE fp32 ≈ 1e-7 .. 1e-6,
  TF32 ≈ 1e-4 .. 1e-3). The first op above ``--op-tol`` (1e-5) is named;
* per module (prefill without cache): each decoder layer's norms, token mixer and FFN, the final norm and the
  LM head, repeated by the fp64 model's module from the fp32 module's inputs (catches torch ops outside
  ``k3nn.ops``: projections, rope, router, gates).

Then the kernels alone at Kimi dims (``ops.mla_attention``, ``ops.mla_decode``, ``ops.kda_chunk``,
``ops.moe_experts`` on random fp32 inputs vs fp64 eager, TF32 off and on), and time to first token (fresh cache,
``logits_to_keep=1``, T = ``--T``): bf16 (the production default), fp32 TF32 on (kernels compiled as before the
exact mode existed) and fp32 TF32 off (the exact mode's cost), next to the newest ``bench/results/prefill-*.json``
bf16 row at the same length. Writes ``fp32-exact-<stamp>.json`` to ``$K3NN_RESULTS_DIR``.

    python -m bench.gpu.fp32_exact [--T 2048] [--decode 4] [--reps 5] [--budget 225] [--no-tune]
    python -m bench.gpu.fp32_exact --smoke   # tiny dims, any device (CPU: eager, plus Triton if interpreted)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import time
from pathlib import Path

import torch

from k3nn import ops as kops
from k3nn.config import KimiK3Config
from k3nn.kernels.precision import dot_precision, tf32_allowed
from k3nn.kernels.registry import backend, triton_interpreting, tuning

from bench.common import device_meta, median_call_ms, rel_err, write_results
from bench.models import build_model

SUITE = "fp32-exact"
CONTRACT = 1e-4  # fp32 logits vs fp64 with TF32 off (relative, ‖Δ‖/‖ref‖)
#: the ops the layers call through ``k3nn.ops`` (wrapped while recording)
OPS = ("short_conv", "kda_gate", "kda_chunk", "kda_recurrent", "kda_fused_decode", "mla_attention", "mla_decode",
       "moe_experts", "moe_expert_outputs", "moe_latent_finalize", "rms_norm", "gated_rmsnorm", "attnres_mix")
_T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", flush=True)


def slice_config(smoke: bool, layers: int, experts: int, vocab: int) -> KimiK3Config:
    """``k3nn bench prefill``'s model (Kimi-Linear dims, MLA every 4th layer, layer 0 dense); ``smoke``: tiny."""
    mla = [i for i in range(layers) if (i + 1) % 4 == 0]
    if smoke:
        return KimiK3Config.kimi_linear_48b(
            num_hidden_layers=layers, mla_layers=mla, num_experts=8, num_experts_per_token=2, vocab_size=256,
            hidden_size=64, kda_num_heads=2, kda_head_dim=16, num_attention_heads=2, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, moe_intermediate_size=32)
    return KimiK3Config.kimi_linear_48b(num_hidden_layers=layers, mla_layers=mla, num_experts=experts,
                                        vocab_size=vocab)


@contextlib.contextmanager
def tf32(on: bool):
    """TF32 for cuBLAS and cuDNN on / off (the legacy flags only: mixing torch's two APIs makes it refuse reads)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- fp64 twins of arguments --------------------------------------------------------------------------------
def to64(x):
    """x with every floating tensor copied to fp64 (ints and bools copied, dtypes fp32 → fp64, containers walked)."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            return x.detach().to(torch.float64, copy=True)
        return x.detach().clone()
    if isinstance(x, torch.dtype):
        return torch.float64 if x.is_floating_point else x
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(to64(v) for v in x)
    if isinstance(x, dict):
        return {k: to64(v) for k, v in x.items()}
    return x


def tensors(x) -> list:
    """The tensors of an output (tensor, tuple / list, dataclass-like with tensor fields), in order; None kept."""
    if x is None or isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in tensors(v)]
    if hasattr(x, "__dict__"):
        return [t for v in vars(x).values() for t in tensors(v)]
    return []


def err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ over the finite entries of ref (non-finite entries must match exactly; else inf)."""
    if out is None or ref is None:
        return 0.0 if out is None and ref is None else math.inf
    if out.shape != ref.shape:
        return math.inf
    o, r = out.detach().double(), ref.detach().double()
    fin = torch.isfinite(r)
    if not bool(torch.equal(torch.isfinite(o), fin)) or not bool((o[~fin] == r[~fin]).all()):
        return math.inf
    d = (o[fin] - r[fin]).norm()
    n = r[fin].norm()
    return float(d / n) if float(n) > 0 else float(d)


def worst(out, ref) -> float:
    a, b = tensors(out), tensors(ref)
    if len(a) != len(b):
        return math.inf
    return max([err(x, y) for x, y in zip(a, b) if x is None or x.is_floating_point()] or [0.0])


# ---- recording: per-op isolation and routing ----------------------------------------------------------------
class Recorder:
    """Wraps the ``k3nn.ops`` functions the layers call and, while ``active``, repeats each call in fp64 on the
    eager backend from its inputs cast to fp64 (before the call: some ops update their state arguments in place),
    recording ``(layer, op, phase, error)``; the error covers the outputs and every floating tensor argument
    (an in-place update of a cache must match too)."""

    def __init__(self):
        self.active, self.inside, self.layer, self.phase = False, False, "-", "prefill"
        self.rows: list[dict] = []
        self._orig = {}

    def __enter__(self):
        for name in OPS:
            fn = getattr(kops, name)
            self._orig[name] = fn
            setattr(kops, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(kops, name, fn)
        self._orig.clear()

    def _wrap(self, name, fn):
        def call(*args, **kw):
            if not self.active or self.inside:
                return fn(*args, **kw)
            a64, k64 = to64(args), to64(kw)
            out = fn(*args, **kw)
            self.inside = True
            try:
                with backend("eager"):
                    ref = fn(*a64, **k64)
            finally:
                self.inside = False
            e = worst(out, ref)
            for x, y in zip(args, a64):  # state arguments updated in place (kda_fused_decode's caches)
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64:
                    e = max(e, err(x, y))
            self.rows.append(dict(layer=self.layer, op=name, phase=self.phase, err=e))
            return out

        return call

    def hook_layers(self, model):
        def pre(mod, args, i):
            self.layer = f"L{i}"

        hs = [layer.register_forward_pre_hook(lambda m, a, i=i: pre(m, a, i))
              for i, layer in enumerate(model.model.layers)]
        hs.append(model.model.norm.register_forward_pre_hook(lambda m, a: setattr(self, "layer", "final")))
        hs.append(model.lm_head.register_forward_pre_hook(lambda m, a: setattr(self, "layer", "head")))
        return hs


def moes(model):
    from k3nn.layers.moe import MoE

    return [(i, layer.ffn) for i, layer in enumerate(model.model.layers) if isinstance(layer.ffn, MoE)]


def routing_of(model) -> dict[int, torch.Tensor]:
    """Sorted top-k expert ids [tokens, k] of each MoE layer's latest call."""
    out = {}
    for i, m in moes(model):
        if m.last_routing is not None:
            out[i] = m.last_routing[1].sort(-1)[0].clone()
    return out


@torch.no_grad()
def run_cached(model, ids, steps, rec: Recorder | None = None):
    """Prefill ``ids`` into a fresh cache, then one forward per token of ``steps`` (teacher forcing). Returns
    (prefill logits [T, V], [decode logits [V]], routing per call {layer: ids})."""
    for _, m in moes(model):
        m.record_routing = True
    cache = model.new_cache(1, ids.shape[1] + len(steps) + 1)
    if rec is not None:
        rec.phase = "prefill"
    pre = model(ids, cache=cache).logits[0]
    routes = [routing_of(model)]
    dec = []
    for j, t in enumerate(steps):
        if rec is not None:
            rec.phase = f"decode{j}"
        dec.append(model(t.view(1, 1), cache=cache).logits[0, -1])
        routes.append(routing_of(model))
    for _, m in moes(model):
        m.record_routing, m.last_routing = False, None
    sync()
    return pre, dec, routes


def flips(routes, ref_routes) -> tuple[dict, int]:
    """Tokens whose expert set differs from the reference, per MoE layer (prefill), and the first such prefill
    position (T when none)."""
    per, first = {}, None
    for i, r in ref_routes[0].items():
        bad = (routes[0][i] != r).any(-1).nonzero().flatten()
        per[f"L{i}"] = int(bad.numel())
        if bad.numel():
            first = int(bad[0]) if first is None else min(first, int(bad[0]))
    dec = sum(int((a[i] != b[i]).any()) for a, b in zip(routes[1:], ref_routes[1:]) for i in b)
    per["decode_steps"] = dec
    return per, first


def logit_errors(pre, dec, ref_pre, ref_dec, first_flip) -> dict:
    T = ref_pre.shape[0]
    p = T if first_flip is None else first_flip
    row = dict(prefill_rel=rel_err(pre, ref_pre),
               prefill_max_abs=float((pre.double() - ref_pre).abs().max()),
               prefill_max_abs_over_max_ref=float((pre.double() - ref_pre).abs().max() / ref_pre.abs().max()),
               clean_prefix=p,
               clean_prefix_rel=rel_err(pre[:p], ref_pre[:p]) if p > 0 else None)
    if ref_dec:
        row["decode_rel"] = max(rel_err(a, b) for a, b in zip(dec, ref_dec))
        row["decode_max_abs"] = max(float((a.double() - b).abs().max()) for a, b in zip(dec, ref_dec))
    return row


def op_summary(rows: list[dict], tol: float) -> tuple[dict, str | None]:
    """Max error per (layer.op.phase kind) and the first call above ``tol``."""
    summ: dict[str, float] = {}
    first = None
    for r in rows:
        kind = "decode" if r["phase"].startswith("decode") else "prefill"
        key = f"{r['layer']}.{r['op']}.{kind}"
        summ[key] = max(summ.get(key, 0.0), r["err"])
        if first is None and r["err"] > tol:
            first = f"{r['layer']}.{r['op']} ({r['phase']}) {r['err']:.2e}"
    return {k: float(f"{v:.3e}") for k, v in summ.items()}, first


# ---- per-module isolation (prefill, no cache) -----------------------------------------------------------------
def module_targets(model) -> list[tuple[str, torch.nn.Module]]:
    out = []
    for i, layer in enumerate(model.model.layers):
        for name in ("input_layernorm", "self_attn", "post_attention_layernorm"):
            out.append((f"model.layers.{i}.{name}", getattr(layer, name)))
        ffn = "block_sparse_moe" if layer.is_moe else "mlp"
        out.append((f"model.layers.{i}.{ffn}", layer.ffn))
    out.append(("model.norm", model.model.norm))
    out.append(("lm_head", model.lm_head))
    return out


@torch.no_grad()
def module_isolation(m32, m64, ids, rec: Recorder, tol: float) -> tuple[dict, str | None]:
    twins = dict(m64.named_modules())
    res: dict[str, float] = {}
    order: list[str] = []

    def hook(mod, args, kwargs, out, name):
        twin = twins[name]
        rec.inside = True  # the twin's ops run plain (no per-op recording)
        try:
            with backend("eager"):
                ref = twin(*to64(args), **to64(kwargs))
        finally:
            rec.inside = False
        res[name] = max(res.get(name, 0.0), worst(out, ref))
        order.append(name)

    hs = [mod.register_forward_hook(lambda m, a, k, o, n=name: hook(m, a, k, o, n), with_kwargs=True)
          for name, mod in module_targets(m32)]
    try:
        m32(ids)
    finally:
        for h in hs:
            h.remove()
    first = next((f"{n} {res[n]:.2e}" for n in order if res[n] > tol), None)
    return {k: float(f"{v:.3e}") for k, v in res.items()}, first


# ---- the kernels alone at Kimi dims ---------------------------------------------------------------------------
@torch.no_grad()
def kernel_checks(cfg: KimiK3Config, dev: str, T: int, gen: torch.Generator, names: list[str]) -> list[dict]:
    """Each op on random fp32 inputs (Kimi dims) under each backend in ``names`` vs fp64 eager, TF32 off and on."""
    H, D = cfg.kda_num_heads, cfg.kda_head_dim
    Hm, dn, dr, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, \
        cfg.kv_lora_rank
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    nrm = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    kda = (nrm(rnd(1, T, H, D)), nrm(rnd(1, T, H, D)), rnd(1, T, H, D),
           -torch.rand(1, T, H, D, generator=gen, device=dev) * 0.3,
           torch.rand(1, T, H, generator=gen, device=dev))
    mla = (rnd(1, T, Hm, dn), rnd(1, T, Hm, dr), rnd(1, T, Hm, dn), rnd(1, T, dr), rnd(1, T, Hm, dv))
    L = T
    nb = -(-L // 64)
    pool = rnd(nb, 64, r + dr)
    table = torch.arange(nb, device=dev, dtype=torch.int32)[None]
    dec = (rnd(1, 1, Hm, r), rnd(1, 1, Hm, dr), pool, table, torch.tensor([L], device=dev, dtype=torch.int32))
    E, I, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    N = min(T, 512)
    x = rnd(N, d)
    ws = (rnd(E, I, d) * d ** -0.5, rnd(E, I, d) * d ** -0.5, rnd(E, d, I) * I ** -0.5)
    ids = torch.stack([torch.randperm(E, generator=gen, device=dev)[:cfg.num_experts_per_token] for _ in range(N)])
    wts = torch.rand(N, cfg.num_experts_per_token, generator=gen, device=dev)
    cases = [("kda_chunk", lambda *a: kops.kda_chunk(*a)[0], kda),
             ("mla_attention", lambda *a: kops.mla_attention(*a, (dn + dr) ** -0.5), mla),
             ("mla_decode", lambda *a: kops.mla_decode(*a, (dn + dr) ** -0.5)[0], dec),
             ("moe_experts", lambda *a: kops.moe_experts(*a), (x, *ws, ids, wts))]
    rows = []
    for op, fn, args in cases:
        with backend("eager"):
            ref = fn(*to64(args))
        for name in names:
            for on in (False, True):
                with tf32(on), backend(name):
                    try:
                        e = worst(fn(*args), ref)
                    except Exception as ex:  # a backend that refuses the call
                        rows.append(dict(case=f"kernel {op} {name} tf32={'on' if on else 'off'}",
                                         error=f"{type(ex).__name__}: {str(ex).splitlines()[0][:160]}"))
                        continue
                rows.append(dict(case=f"kernel {op} {name} tf32={'on' if on else 'off'}", op=op, backend=name,
                                 tf32=on, rel=float(f"{e:.3e}")))
                say(f"  {rows[-1]['case']}: rel err {e:.2e}")
    return rows


# ---- timing ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def ttft_ms(model, ids, reps: int) -> float:
    def call():
        model(ids, cache=model.new_cache(1, ids.shape[1]), logits_to_keep=1)

    return median_call_ms(call, reps, warmup=2)[0]  # warm-up: compilation, autotuning


def recorded_bf16_ms(T: int, layers: int, experts: int) -> tuple[float | None, str | None]:
    """k3nn_ms of the newest ``bench/results/prefill-*.json`` row for this model at T (bf16), with its file."""
    d = Path(__file__).resolve().parents[1] / "results"
    for f in sorted(d.glob("prefill-2*.json"), reverse=True):
        try:
            rows = json.loads(f.read_text())["rows"]
        except Exception:
            continue
        for r in rows:
            if r.get("case") == f"kimi_linear L{layers} E{experts} bf16 T={T}" and r.get("k3nn_ms"):
                return float(r["k3nn_ms"]), f.name
    return None, None


def backends_here(dev: str) -> list[str]:
    """The default first (it carries the verdict), then Triton alone, then eager (the control)."""
    if dev == "cuda":
        return ["auto", "triton", "eager"]
    return ["triton", "eager"] if triton_interpreting() else ["eager"]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="fp32_exact")
    ap.add_argument("--T", type=int, default=2048, help="prefill length (batch 1)")
    ap.add_argument("--decode", type=int, default=4, help="teacher-forced decode steps after the prefill")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--reps", type=int, default=5, help="timed prefills per setting")
    ap.add_argument("--op-tol", type=float, default=1e-5, help="an op's isolated relative error above this is named")
    ap.add_argument("--smoke", action="store_true", help="tiny dims (any device): checks the script itself")
    ap.add_argument("--backends", default=None, help="comma list (default: eager,triton,auto on CUDA)")
    ap.add_argument("--no-modules", action="store_true", help="skip the per-module isolation")
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernels-alone checks")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--out-dir", default=None, help="results folder (default $K3NN_RESULTS_DIR or bench/results)")
    ap.add_argument("--no-tune", action="store_true",
                    help="first tuning config only (KernelTuning(autotune=False)): less compile time, slower kernels")
    ap.add_argument("--budget", type=float, default=225.0,
                    help="seconds: later settings and stages are skipped (and listed) once the run passes this")
    args = ap.parse_args(argv)
    with tuning(autotune=not args.no_tune):
        return _run(args)


def _run(args):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.T, args.decode = min(args.T, 40), min(args.decode, 2)
    names = args.backends.split(",") if args.backends else backends_here(dev)
    left = lambda: args.budget - (time.perf_counter() - _T0)  # noqa: E731
    skipped: list[str] = []
    cfg = slice_config(args.smoke, args.layers, args.experts, args.vocab)
    meta = device_meta() if dev == "cuda" else {"gpu": "none", "torch": torch.__version__}
    meta["autotune"] = not args.no_tune
    meta.update(model=f"kimi_linear L{cfg.num_hidden_layers} E{cfg.num_experts} top{cfg.num_experts_per_token}"
                + (" smoke" if args.smoke else ""), T=args.T, decode_steps=args.decode, contract_rel=CONTRACT,
                op_tol=args.op_tol, backends=names)
    say(f"{meta}")

    m32 = build_model(cfg, dev, torch.float32, seed=0)
    gen = torch.Generator(device=dev).manual_seed(1)
    with torch.no_grad():
        for _, m in moes(m32):
            m.gate.e_score_correction_bias.normal_(0, 0.1, generator=gen)
    m64 = copy.deepcopy(m32).double()
    m64.backend = "eager"
    ids = torch.randint(0, cfg.vocab_size, (1, args.T), generator=gen, device=dev)
    steps = torch.randint(0, cfg.vocab_size, (args.decode,), generator=gen, device=dev)
    with tf32(False):
        ref_pre, ref_dec, ref_routes = run_cached(m64, ids, steps)
    ref_pre, ref_dec = ref_pre.double(), [t.double() for t in ref_dec]
    say(f"fp64 eager reference: logits {tuple(ref_pre.shape)}, |ref| max {float(ref_pre.abs().max()):.3f}")

    rows: list[dict] = []
    path = None
    verdict = None
    with Recorder() as rec:
        hooks = rec.hook_layers(m32)
        try:
            for on in (False, True):
                for name in names:
                    case = f"model fp32 {name} tf32={'on' if on else 'off'}"
                    if left() < 20:
                        skipped.append(case)
                        continue
                    row = dict(case=case, backend=name, tf32=on)
                    m32.backend = name
                    rec.rows, rec.active = [], True
                    try:
                        with tf32(on):
                            row["dot_precision"] = dot_precision(torch.float32)
                            row["torch_tf32"] = tf32_allowed()
                            pre, dec, routes = run_cached(m32, ids, steps, rec)
                    except Exception as ex:  # a backend that cannot run here: say why, go on
                        rec.active = False
                        row["error"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:200]}"
                        rows.append(row)
                        say(f"{case}: {row['error']}")
                        continue
                    rec.active = False
                    per, first_flip = flips(routes, ref_routes)
                    row.update(logit_errors(pre, dec, ref_pre, ref_dec, first_flip))
                    row["routing_flips"] = per
                    row["ops"], row["first_op_over_tol"] = op_summary(rec.rows, args.op_tol)
                    row["ops_max"] = max([r["err"] for r in rec.rows] or [0.0])
                    del pre, dec
                    if not args.no_modules and (not on or name == names[0]) and left() > 30:
                        with tf32(on):
                            row["modules"], row["first_module_over_tol"] = module_isolation(
                                m32, m64, ids, rec, args.op_tol)
                    if not on and name == names[0]:
                        ok = row["prefill_rel"] <= CONTRACT and row.get("decode_rel", 0.0) <= CONTRACT
                        clean = (row["clean_prefix_rel"] or 0.0) <= CONTRACT
                        verdict = (f"{'PASS' if ok else ('PASS on the clean prefix' if clean else 'FAIL')}: "
                                   f"{case} prefill rel {row['prefill_rel']:.2e}, decode rel "
                                   f"{row.get('decode_rel', 0.0):.2e} (contract {CONTRACT:g}; flips {per})")
                        row["verdict"] = verdict
                    rows.append(row)
                    path = write_results(SUITE, rows, meta, out_dir=args.out_dir, path=path)
                    say(f"{case}: prefill rel {row['prefill_rel']:.2e} max-abs {row['prefill_max_abs']:.2e}, "
                        f"clean prefix {row['clean_prefix']} rel {row['clean_prefix_rel'] or 0:.2e}, decode rel "
                        f"{row.get('decode_rel', 0):.2e}; flips {per}; worst op {row['ops_max']:.2e}; first op > "
                        f"{args.op_tol:g}: {row['first_op_over_tol']}; first module > {args.op_tol:g}: "
                        f"{row.get('first_module_over_tol', '-')}")
        finally:
            for h in hooks:
                h.remove()
            m32.backend = None
    del m64, ref_pre, ref_dec
    if dev == "cuda":
        torch.cuda.empty_cache()

    if dev == "cuda" and not args.no_timing and left() < 40:
        skipped.append("timing")
    elif dev == "cuda" and not args.no_timing:
        T = args.T
        rec_ms, rec_file = recorded_bf16_ms(T, cfg.num_hidden_layers, cfg.num_experts)
        mb = build_model(cfg, dev, torch.bfloat16, seed=0)  # the benchmarks' bf16 model (weights drawn the same way)
        tb = ttft_ms(mb, ids, args.reps)
        del mb
        torch.cuda.empty_cache()
        rows.append(dict(case=f"ttft bf16 default T={T}", k3nn_ms=round(tb, 3), recorded_bf16_ms=rec_ms,
                         recorded_file=rec_file))
        say(f"TTFT bf16 (default): {tb:.2f} ms (recorded {rec_ms} ms in {rec_file})")
        for on in (True, False):
            with tf32(on):
                t = ttft_ms(m32, ids, args.reps)
            rows.append(dict(case=f"ttft fp32 tf32={'on' if on else 'off'} T={T}", k3nn_ms=round(t, 3),
                             vs_bf16=round(t / tb, 3)))
            say(f"TTFT fp32 TF32 {'on' if on else 'off'}: {t:.2f} ms ({t / tb:.2f}x bf16)")
        path = write_results(SUITE, rows, meta, out_dir=args.out_dir, path=path)

    if not args.no_kernels and left() < 30:
        skipped.append("kernels alone")
    elif not args.no_kernels:
        say("kernels alone (random fp32 inputs, Kimi dims) vs fp64 eager:")
        rows += kernel_checks(cfg, dev, min(args.T, 1024), torch.Generator(device=dev).manual_seed(2), names)
        path = write_results(SUITE, rows, meta, out_dir=args.out_dir, path=path)

    meta["skipped_for_time"] = skipped
    meta["seconds"] = round(time.perf_counter() - _T0, 1)
    path = write_results(SUITE, rows, meta, out_dir=args.out_dir, path=path)
    print("case | prefill_rel | clean_prefix_rel | decode_rel | ops_max | first_op_over_tol | k3nn_ms")
    for r in rows:
        print(" | ".join(str(r.get(c, "")) if not isinstance(r.get(c), float) else f"{r[c]:.3g}"
                         for c in ("case", "prefill_rel", "clean_prefix_rel", "decode_rel", "ops_max",
                                   "first_op_over_tol", "k3nn_ms")) + (f" | {r['error']}" if "error" in r else "")
              + (f" | rel {r['rel']:.2e}" if "rel" in r else ""))
    if verdict:
        print(verdict)
    if skipped:
        print(f"skipped (over --budget {args.budget:g} s): {', '.join(skipped)}")
    say(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
