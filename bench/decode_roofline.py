"""decode-roofline: where a ``k3_slice`` decode step's time goes against the HBM bound, per kernel class.

For each batch size, the latency-specialised ``generate()`` step (``make_decode_runner(decode_backend=
"latency_specialized")``: prepared decode weights, MLA over the static latent pool, captured in a CUDA graph) is

1. timed: CUDA events around ``--replays`` graph replays (the step's ms);
2. profiled: ``torch.profiler`` (CUDA activity) over a few replays: every kernel (graph node) with its time;
3. labelled: one eager run of the same static step under the profiler with every ``k3nn.ops`` call wrapped in a
   ``record_function`` of its class (and the mixers / MoE modules around the torch ops between them), so each
   launched kernel is tied to a class; the replay's kernel sequence takes the labels of the eager one (aligned by
   kernel name); a kernel left over takes the class its name says;
4. charged bytes: each op call counts the bytes it must move, from the tensors it gets and returns — weights
   touched (every projection's weight; for the routed experts only the experts the router picked in that step:
   distinct ids × one expert's packed MXFP4 weights and scales), activations, the KDA state read and written, the
   MLA latent pages up to each request's length, and the MLA absorb weights (``kv_b``) per MLA layer.

Classes: dense projections, lm_head, MoE routing (router GEMM, top-k, alignment), expert GEMV/GEMM (up, down,
finalisation), KDA decode, MLA decode, norms / AttnRes / elementwise. Each class row has time per step, launches,
bytes, TB/s and the fraction of the copy bandwidth measured in the same run; the step row (``case`` =
``k3_slice B=<b> step``) has the step's ms, its HBM bound (all bytes over the copy bandwidth), ``frac_hbm_bound``
(bound / measured) and ``launches_per_layer`` (graph nodes per step / layers).

``--variants`` runs the same batch under several kernel tunings in one process, side by side on clones of one
prefilled cache: ``default`` (the library's choices), ``torch-gemm`` (``KernelTuning(skinny_linear="never")``:
every projection on torch's GEMM, the map before the skinny GEMM), ``skinny-always`` and ``no-pdl``
(``KernelTuning(pdl=False)``: plain stream order, no programmatic dependent launches). With PDL (the default) a
kernel's profiled span starts when it is launched early and includes its wait for the kernel before it: class times
count each kernel's exposed span (:func:`exposed_spans`: from the later of its start and the previous kernel's end),
so they partition the step's busy time under either variant (``decode-roofline-2026-12-04-211114.json`` and the
results before it sum raw spans: there the default variant's class times overlap).

    k3nn bench decode-roofline [--batches 1,4,16,64] [--ctx 512] [--variants default,torch-gemm]
    k3nn bench decode-roofline --allow-cpu --config tiny      (CPU smoke run: no profile of graphs, not results)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import difflib
import json
import math
import time

import torch

from k3nn.config import KimiK3Config

from bench.common import print_table, sync, write_results

SUITE = "decode-roofline"

DENSE, LM_HEAD, ROUTING, EXPERTS = "dense projections", "lm_head", "moe routing", "expert gemv/gemm"
KDA, MLA, NORMS = "kda decode", "mla decode", "norms / attnres / elementwise"
CLASSES = (DENSE, LM_HEAD, ROUTING, EXPERTS, KDA, MLA, NORMS)

#: registry op -> class (``linear`` is split by its weight: lm_head, the router, the rest)
OP_CLASS = {
    "moe_route": ROUTING, "moe_gate_route": ROUTING, "moe_expert_outputs": EXPERTS, "moe_experts": EXPERTS,
    "moe_latent_finalize": EXPERTS,
    "kda_fused_decode": KDA, "kda_recurrent": KDA, "kda_chunk": KDA, "short_conv": KDA, "kda_gate": KDA,
    "gated_rmsnorm": KDA, "mla_decode": MLA, "mla_attention": MLA, "mla_prefill": MLA,
    "attnres_mix": NORMS, "attnres_phase1": NORMS, "attnres_phase2": NORMS, "rms_norm": NORMS, "glu": NORMS,
    "sigmoid_gate": NORMS,
}

VARIANTS = {"default": {}, "torch-gemm": {"skinny_linear": "never"}, "skinny-always": {"skinny_linear": "always"},
            "no-pdl": {"pdl": False}}
_LABEL = "k3cls:"


# -- bytes -------------------------------------------------------------------------------------------------------
def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
    elif hasattr(obj, "packed") and hasattr(obj, "scale"):  # MXFP4Weight
        yield obj.packed
        yield obj.scale


def _nbytes(obj) -> int:
    seen, n = set(), 0
    for t in _tensors(obj):
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            n += t.numel() * t.element_size()
    return n


def _expert_bytes(w) -> int:
    """One expert's bytes of a stacked weight (MXFP4: packed + scales)."""
    if hasattr(w, "packed"):
        return w.packed[0].numel() * w.packed.element_size() + w.scale[0].numel() * w.scale.element_size()
    return w[0].numel() * w.element_size()


def op_bytes(op: str, args: tuple, kwargs: dict, out, info: dict) -> int:
    """Bytes an op call must move through HBM (each input read once, each output written once); see the module
    docstring for the special cases. ``info`` collects per-call facts (distinct experts)."""
    if op == "mla_decode":
        q_lat, q_rope, pool, table, seq_lens = args[:5]
        used = int(seq_lens.sum()) * pool.shape[-1] * pool.element_size()
        return used + _nbytes((q_lat, q_rope, table, seq_lens)) + _nbytes(out)
    if op in ("moe_expert_outputs", "moe_experts"):
        x, w1, w3, w2, ids = args[:5]
        distinct = int(torch.unique(ids).numel())
        info.setdefault("distinct_experts", []).append(distinct)
        return (distinct * sum(_expert_bytes(w) for w in (w1, w3, w2)) + _nbytes((x, ids) + tuple(args[5:6]))
                + _nbytes(out))
    n = _nbytes((args, kwargs)) + _nbytes(out)
    if op == "kda_fused_decode":  # the recurrent and conv states are written back in place
        n += _nbytes(args[8:10])
    return n


def linear_class(weight: torch.Tensor, cfg: KimiK3Config) -> str:
    if weight.shape[0] == cfg.vocab_size:
        return LM_HEAD
    if tuple(weight.shape) == (cfg.num_experts, cfg.hidden_size):
        return ROUTING
    return DENSE


# -- labels ------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def labelled(model, records: list):
    """Wrap every public ``k3nn.ops`` op in a ``record_function`` of its class (recording its bytes into
    ``records``), and the KDA / MLA / MoE modules in ranges of theirs for the torch ops between op calls."""
    import k3nn.ops as ops_pkg
    from k3nn.kernels import registry
    from k3nn.layers.kda import KimiDeltaAttention
    from k3nn.layers.mla import MultiHeadLatentAttention
    from k3nn.layers.moe import MoE

    cfg = model.config

    def wrap(name, fn):
        def g(*args, **kwargs):
            cls = linear_class(args[1], cfg) if name == "linear" else OP_CLASS.get(name, NORMS)
            with torch.profiler.record_function(f"{_LABEL}{cls}|{name}"):
                out = fn(*args, **kwargs)
            info: dict = {}
            records.append(dict(cls=cls, op=name, bytes=op_bytes(name, args, kwargs, out, info), **info))
            return out
        return g

    saved = {n: getattr(ops_pkg, n) for n in registry.ops() if callable(getattr(ops_pkg, n, None))}
    handles, stack = [], []

    def pre(cls):
        def hook(mod, args):
            r = torch.profiler.record_function(f"{_LABEL}{cls}|{type(mod).__name__}")
            r.__enter__()
            stack.append(r)
        return hook

    def post(cls):
        def hook(mod, args, out):
            stack.pop().__exit__(None, None, None)
            if isinstance(mod, MultiHeadLatentAttention):  # the absorb einsums read kv_b (W_UK, W_UV)
                w = mod.kv_b_proj.weight
                records.append(dict(cls=MLA, op="mla absorb (kv_b)", bytes=w.numel() * w.element_size()))
        return hook

    for mod in model.modules():
        cls = {KimiDeltaAttention: KDA, MultiHeadLatentAttention: MLA, MoE: ROUTING}.get(type(mod))
        if cls is not None:
            handles += [mod.register_forward_pre_hook(pre(cls)), mod.register_forward_hook(post(cls))]
    for n, f in saved.items():
        setattr(ops_pkg, n, wrap(n, f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(ops_pkg, n, f)
        for h in handles:
            h.remove()


def class_by_name(name: str) -> str:
    """A kernel's class from its name alone (kernels the labelled run did not tie to a class)."""
    n = name.lower()
    if "mx_gemv" in n or "_moe_up" in n or "_moe_down" in n or "finalize" in n:
        return EXPERTS
    if "route" in n or "align" in n:
        return ROUTING
    if "kda" in n:
        return KDA
    if "mla" in n or "splitkv" in n:
        return MLA
    if any(s in n for s in ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitkreduce", "skinny", "splitk")):
        return DENSE
    return NORMS


def exposed_spans(spans: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """(name, start, end) device spans → (name, µs each adds to the timeline), in start order: a kernel's end minus
    the later of its start and every earlier kernel's end, at least 0. Without overlap that is the kernel's
    duration; a programmatic dependent launched early (``KernelTuning.pdl``) counts only from where the kernel
    before it ended, so the spans partition the busy time and their sum never passes the step."""
    out, reach = [], -math.inf
    for name, start, end in sorted(spans, key=lambda s: s[1]):
        out.append((name, max(0.0, end - max(start, reach))))
        reach = max(reach, end)
    return out


def _device_events(prof):
    from torch.autograd import DeviceType

    return exposed_spans([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                          if e.device_type == DeviceType.CUDA])


def _class_of(fe) -> str | None:
    while fe is not None:
        if fe.name.startswith(_LABEL):
            return fe.name[len(_LABEL):].split("|")[0]
        fe = fe.cpu_parent
    return None


_RUNTIME = ("LaunchKernel", "cuLaunch", "Memcpy", "Memset")


def labelled_kernels(prof) -> list[tuple[str, float, str | None]]:
    """(kernel name, µs, class) of an eager profiled step, in execution order. A kernel's class is the innermost
    labelled range around the host call that launched it: the runtime event with the kernel's correlation id
    (its start time inside the ranges), else the event the profiler links the kernel to and that event's parents;
    None when neither says (the caller classifies by name)."""
    import bisect

    from torch.autograd import DeviceType

    evs = list(prof.events())
    cpu = [e for e in evs if e.device_type == DeviceType.CPU]
    labels = sorted((e.time_range.start, e.time_range.end, e.name[len(_LABEL):].split("|")[0])
                    for e in cpu if e.name.startswith(_LABEL))
    starts = [lab[0] for lab in labels]
    launch_at = {e.id: e.time_range.start for e in cpu if any(r in e.name for r in _RUNTIME)}
    by_id = {e.id: e for e in cpu if not getattr(e, "linked_correlation_id", 0)}

    def inside(t):
        for i in range(bisect.bisect_right(starts, t) - 1, -1, -1):  # the latest-starting range that holds t
            s0, e0, cls = labels[i]
            if s0 <= t <= e0:
                return cls
        return None

    out = []
    dev = sorted((e for e in evs if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    for e in dev:
        cls = inside(launch_at[e.id]) if e.id in launch_at else None
        if cls is None:
            cls = _class_of(by_id.get(getattr(e, "linked_correlation_id", 0) or -1))
        out.append((e.name, float(e.time_range.end - e.time_range.start), cls))
    return out


def align_classes(replay: list[str], eager: list[tuple[str, float, str | None]]) -> list[str]:
    """Classes for the replay's kernels: the eager run's labels where the name sequences align, else by name."""
    names = [k[0] for k in eager]
    out = [None] * len(replay)
    sm = difflib.SequenceMatcher(None, names, replay, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
            for a, b in zip(range(i1, i2), range(j1, j2)):
                out[b] = eager[a][2]
    return [c or class_by_name(n) for c, n in zip(out, replay)]


def lm_head_tail(names: list[str], classes: list[str]) -> list[str]:
    """The projection kernels after the step's last norm kernel are the LM head (the final norm is the last op
    before it): the class when the labels did not reach those kernels."""
    if LM_HEAD in classes:
        return classes
    last = max((i for i, n in enumerate(names) if "attnres" in n.lower() or "rms" in n.lower()), default=None)
    if last is None:
        return classes
    return [LM_HEAD if i > last and class_by_name(n) == DENSE else c for i, (n, c) in enumerate(zip(names, classes))]


# -- one case ----------------------------------------------------------------------------------------------------
def measure(model, base, first, variant: str, replays: int, profile_replays: int, copy_tbps: float, dev,
            name: str = "k3_slice"):
    """The step of one variant on a clone of ``base``: returns (step row, class rows, extra)."""
    from torch.profiler import ProfilerActivity, profile

    from k3nn.decode.runner import make_decode_runner
    from k3nn.kernels.registry import tuning

    from bench.e2e import clone_cache

    cfg = model.config
    L = cfg.num_hidden_layers
    B = base.batch_size
    with tuning(**VARIANTS[variant]):
        cache = clone_cache(base)
        runner = make_decode_runner(model, cache, cuda_graph=True, decode_backend="latency_specialized")
        nxt = first[:, None]
        for _ in range(3):  # warm-up, capture, first replay
            nxt = runner(nxt).argmax(-1)[:, None]
        graph = runner.uses_graph
        sync(dev)
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        for _ in range(replays):
            nxt = runner(nxt).argmax(-1)[:, None]
        if dev.type == "cuda":
            b.record()
            b.synchronize()
            step_ms = a.elapsed_time(b) / replays
        else:
            step_ms = (time.perf_counter() - t0) * 1e3 / replays
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        replay_k: list[tuple[str, float]] = []
        if dev.type == "cuda" and runner.graph is not None:
            sync(dev)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(profile_replays):  # the graph's nodes only (no ids copy, no argmax)
                    runner.graph.replay()
                    cache.advance_host(1)
                sync(dev)
            replay_k = _device_events(prof)
        # the same step eagerly (static cache, pages in place), every op labelled, bytes charged
        records: list[dict] = []
        sync(dev)
        with labelled(model, records), profile(activities=acts) as prof:
            logits = runner.fn(nxt)
            sync(dev)
        eager_k = labelled_kernels(prof) if dev.type == "cuda" else []
        del logits
        runner.close()
    per = len(replay_k) // profile_replays if replay_k else 0  # graph nodes per step
    one = replay_k[:per]
    seq = [n for n, _ in one]
    classes: list[str] = []
    if seq:
        classes = lm_head_tail(seq, align_classes(seq, eager_k))
        times = {c: 0.0 for c in CLASSES}
        counts = {c: 0 for c in CLASSES}
        # every replay's kernels: classes repeat with the sequence
        for i, (n, us) in enumerate(replay_k[: per * profile_replays]):
            c = classes[i % per]
            times[c] += us / profile_replays
            counts[c] += 1
        counts = {c: v // profile_replays for c, v in counts.items()}
        source = "graph replay"
    else:  # no device trace of the replays (CPU smoke run, or a profiler that drops graph nodes): the eager step
        times = {c: 0.0 for c in CLASSES}
        counts = {c: 0 for c in CLASSES}
        for n, us, c in eager_k:
            c = c or class_by_name(n)
            times[c] += us
            counts[c] += 1
        source = "eager step" if eager_k else "none"
    nbytes = collections.Counter()
    for r in records:
        nbytes[r["cls"]] += r["bytes"]
    distinct = [d for r in records for d in r.get("distinct_experts", [])]
    total_bytes = sum(nbytes.values())
    bound_ms = total_bytes / (copy_tbps * 1e9) if copy_tbps else float("nan")
    kernel_ms = sum(times.values()) / 1e3
    launches = sum(counts.values())
    tag = "" if variant == "default" else f" [{variant}]"
    E, k = cfg.num_experts, cfg.num_experts_per_token
    step = {"case": f"{name} B={B} step{tag}", "variant": variant, "batch": B, "k3nn_ms": round(step_ms, 4),
            "kernel_ms": round(kernel_ms, 4), "bytes": int(total_bytes), "hbm_bound_ms": round(bound_ms, 4),
            "frac_hbm_bound": round(bound_ms / step_ms, 3) if step_ms else None,
            "tbps": round(total_bytes / step_ms / 1e9, 3) if step_ms else None,
            "launches_per_step": launches, "launches_per_layer": round(launches / L, 1), "graph": graph,
            "kernel_source": source, "distinct_experts_per_moe_layer": distinct,
            "expected_distinct_experts": round(E * (1 - (1 - k / E) ** B), 1)}
    rows = []
    for c in CLASSES:
        ms = times[c] / 1e3
        row = {"case": f"{name} B={B} {c}{tag}", "variant": variant, "batch": B, "class": c,
               "k3nn_ms": round(ms, 4), "launches": counts[c], "bytes": int(nbytes[c]),
               "share_of_kernel_time": round(ms / kernel_ms, 3) if kernel_ms else None}
        if ms > 0 and nbytes[c]:
            row["tbps"] = round(nbytes[c] / ms / 1e9, 3)
        rows.append(row)
    kernels = collections.OrderedDict()
    for i, (n, us) in enumerate(replay_k[: per * profile_replays]):
        kernels.setdefault(n[:110], [0, 0.0, classes[i % per]])
        kernels[n[:110]][0] += 1
        kernels[n[:110]][1] += us
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    step["top_kernels"] = [{"kernel": n, "count": v[0] // profile_replays, "device_us": round(v[1] / profile_replays, 1),
                            "class": v[2]} for n, v in top]
    step["kernel_sequence"] = [[n[:90], round(us, 2), c] for (n, us), c in zip(one, classes)] if seq else []
    return step, rows


@torch.no_grad()
def main(argv=None):
    ap = argparse.ArgumentParser(prog="k3nn bench decode-roofline")
    ap.add_argument("--config", default="k3_slice", help="preset (k3_slice; tiny for a CPU smoke run)")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--ctx", type=int, default=512, help="prompt tokens prefilled before decoding")
    ap.add_argument("--variants", default="default,torch-gemm", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--replays", type=int, default=20, help="timed graph replays per case")
    ap.add_argument("--profile-replays", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this long")
    ap.add_argument("--skinny-table", default=None,
                    help="a skinny-linear result file of this run (bench.gpu.skinny_linear): its best launch shapes "
                         "and measured torch-faster shapes replace k3nn.kernels.linear.tuned's for this process")
    ap.add_argument("--allow-cpu", action="store_true")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.allow_cpu:
        raise SystemExit("decode-roofline times GPU kernels: run it on a CUDA device (or --allow-cpu for a smoke run)")
    if args.skinny_table:
        from k3nn.kernels.linear import tuned

        data = json.load(open(args.skinny_table))["meta"]
        for key, val in data.get("best", {}).items():
            dt, n, k, m = key.split(",")
            tuned.TUNED[(dt, int(n), int(k), int(m))] = tuple(val)
        for key in data.get("torch_faster", []):
            dt, n, k, m = key.split(",")
            tuned.TORCH_FASTER.add((dt, int(n), int(k), int(m)))
    from bench.common import device_meta
    from bench.models import bench_model
    from k3nn.cache.hybrid import HybridCache
    from k3nn.kernels.registry import tuning

    meta = device_meta()
    copy = meta.get("copy_tbps") or float("nan")
    cfg, model = bench_model(args.config, dev)
    print(f"built {args.config} on {dev} in {time.perf_counter() - t_start:.1f}s; copy {copy} TB/s", flush=True)
    rows: list[dict] = []
    path = None
    try:
        for B in [int(b) for b in args.batches.split(",")]:
            if time.perf_counter() - t_start > args.budget_s:
                print(f"budget reached: skipping B={B}", flush=True)
                continue
            gen = torch.Generator(device=dev).manual_seed(B)
            ids = torch.randint(0, cfg.vocab_size, (B, args.ctx), generator=gen, device=dev)
            base = HybridCache(cfg, B, args.ctx + 16 + (args.replays + args.profile_replays + 8) * len(variants),
                               model.dtype, dev, mla_pool=True)
            with tuning(autotune=False):  # the prefill only fills the cache
                first = model(ids, cache=base, logits_to_keep=1).logits[:, -1].argmax(-1)
            for v in variants:
                if time.perf_counter() - t_start > args.budget_s:
                    print(f"budget reached: skipping B={B} {v}", flush=True)
                    continue
                t0 = time.perf_counter()
                try:
                    step, cls_rows = measure(model, base, first, v, args.replays, args.profile_replays, copy, dev,
                                             args.config)
                except Exception as e:  # record and go on: one failing case must not lose the others
                    rows.append({"case": f"{args.config} B={B} step [{v}]", "error": f"{type(e).__name__}: {e}"[:400]})
                    print(rows[-1], flush=True)
                    continue
                step["wall_s"] = round(time.perf_counter() - t0, 1)
                rows += [step] + cls_rows
                print({k: v for k, v in step.items() if k not in ("top_kernels", "kernel_sequence")}, flush=True)
                print_table(cls_rows, ["case", "k3nn_ms", "launches", "bytes", "tbps"])
                path = write_results(SUITE, rows, _meta(args, cfg), path=path)
            del base
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if rows:
            path = write_results(SUITE, rows, _meta(args, cfg), path=path)
            steps = [r for r in rows if " step" in r["case"]]
            print_table(steps, ["case", "k3nn_ms", "kernel_ms", "hbm_bound_ms", "frac_hbm_bound", "launches_per_layer"])
            print(f"wrote {path}")
    return rows


def _meta(args, cfg) -> dict:
    return {"suite": SUITE, "config": args.config, "layers": cfg.num_hidden_layers, "ctx": args.ctx,
            "replays": args.replays, "variants": args.variants,
            "note": "step = latency_specialized generate() decode step replayed in a CUDA graph (class times and "
                    "launches: the graph's nodes; k3nn_ms: a generate() step, ids copy + replay + argmax); bytes = what each op call must move (weights "
                    "touched, distinct routed experts, KDA state r+w, MLA pages up to each length, activations); "
                    "HBM bound = bytes / copy_tbps; torch ops outside k3nn.ops are timed and counted, their bytes "
                    "(activations) not; class and kernel times are exposed spans (a kernel's end minus the later "
                    "of its start and the previous kernel's end), so a programmatic dependent launched early "
                    "(KernelTuning.pdl) counts only past the kernel before it"}


if __name__ == "__main__":
    main()
