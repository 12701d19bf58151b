"""Kernel launches per layer of one latency-specialised decode step (issue 9), with a per-op table.

On CUDA: the CUDA kernels (and memcpy / memset) of one non-graph step, counted by ``torch.profiler`` (as
``bench.e2e.count_launches``). On CPU (a proxy): the aten ops of one step that would launch a device
kernel — leaf ops (no aten child) that are not views / metadata / allocation.

    python -m bench.gpu.decode_launches                      # CPU proxy, k3_slice structure at tiny widths
    python -m bench.gpu.decode_launches --config k3_slice    # on the H200 (bf16, random MXFP4 experts)
    python -m bench.gpu.decode_launches --path standard      # the standard (graph-safe static) step instead
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3nn import KimiK3, KimiK3Config
from k3nn.cache.hybrid import HybridCache
from k3nn.decode.runner import make_decode_runner

#: aten ops that launch nothing on a device (views, metadata, allocation, host-side bookkeeping)
NO_LAUNCH = {
    "view", "reshape", "_reshape_alias", "as_strided", "slice", "select", "t", "transpose", "permute",
    "expand", "expand_as", "unsqueeze", "squeeze", "detach", "alias", "empty", "empty_like", "empty_strided",
    "split", "split_with_sizes", "unbind", "chunk", "narrow", "view_as", "unflatten", "flatten", "lift_fresh",
    "_unsafe_view", "resize_", "set_", "item", "_local_scalar_dense", "is_nonzero", "numpy_T", "result_type",
    "_to_copy_noop", "size", "stride", "dim", "is_same_size", "broadcast_tensors",
    "diagonal", "movedim", "swapaxes", "view_as_real", "view_as_complex", "unfold", "_unsafe_split",
    "clone_noop", "new_empty", "new_empty_strided", "type_as", "align_as", "refine_names",
    "_has_compatible_shallow_copy_type",
    "record_stream", "_nested_tensor_size",
}


def k3_like_tiny(**kw) -> KimiK3Config:
    """K3's structure (k3_slice: 8 layers, MLA at 3 and 7, AttnRes block 4, latent MoE with MXFP4 experts,
    top-k of many, shared experts, dense first layer) at tiny widths."""
    base = dict(num_hidden_layers=8, mla_layers=[3, 7], attn_res_block_size=4, num_experts=32,
                num_experts_per_token=8, mxfp4_experts=True, latent_moe_use_norm=True, num_shared_experts=2)
    base.update(kw)
    return KimiK3Config.tiny(**base)


#: composite aten ops: no kernel of their own, what they call below is counted instead
COMPOSITE = {
    "linear", "matmul", "einsum", "_to_copy", "clone", "contiguous", "to", "reshape", "flatten", "tensordot",
    "softmax", "log_softmax", "dropout", "index", "index_put", "index_put_", "repeat_interleave", "float",
    "type_as", "where", "rms_norm", "_fused_rms_norm", "layer_norm", "__and__", "__or__", "stack", "lerp",
}


def _walk(ev, cnt):
    name = ev.name
    if name.startswith("k3nn::"):  # a registry op: its Triton / CUDA kernel on a GPU (one launch here)
        cnt[name] += 1
        return
    if name.startswith("aten::"):
        op = name[len("aten::"):]
        if op in NO_LAUNCH:
            return
        if op not in COMPOSITE:
            cnt[op] += 1  # one device kernel; what the CPU implementation calls below it is not counted
            return
    for c in ev.cpu_children:  # (a composite without children, e.g. a same-dtype .to(), launches nothing)
        _walk(c, cnt)


def _cpu_launch_ops(prof) -> collections.Counter:
    """The ops of the step that would launch a device kernel: top-down, the first non-composite aten op of
    each call tree (views / metadata / allocation excluded) and each registry op as one launch."""
    cnt = collections.Counter()
    for e in prof.events():
        if e.cpu_parent is None:
            _walk(e, cnt)
    return cnt


@contextlib.contextmanager
def _label_registry_ops():
    """Wrap every registry dispatch in a ``k3nn::<op>`` profiler range (the CPU proxy counts it as one
    launch: on a GPU the op is one Triton / CUDA kernel, on CPU its eager reference is many ops)."""
    from k3nn.kernels import registry

    orig = registry.resolve

    def resolve(op, *a, **kw):
        impl = orig(op, *a, **kw)

        def fn(*args, **kwargs):
            with torch.profiler.record_function(f"k3nn::{op}"):
                return impl.fn(*args, **kwargs)

        return types.SimpleNamespace(fn=fn, impl=impl)

    def op_label(name, f):
        def g(*args, **kwargs):  # the public op with its argument checks (CPU-only checks launch nothing on GPU)
            with torch.profiler.record_function(f"k3nn::{name}"):
                return f(*args, **kwargs)
        return g

    import k3nn.ops as ops_pkg

    saved_ops = {n: getattr(ops_pkg, n) for n in registry.ops() if callable(getattr(ops_pkg, n, None))}
    registry.resolve = resolve
    for n, f in saved_ops.items():
        setattr(ops_pkg, n, op_label(n, f))
    try:
        yield
    finally:
        registry.resolve = orig
        for n, f in saved_ops.items():
            setattr(ops_pkg, n, f)


class AtenOps(TorchDispatchMode):
    """Every aten op run inside it, by name (``.n``): views and allocations included, registry ops by what their
    implementation runs. ``with AtenOps() as ops: ...``."""

    def __init__(self):
        super().__init__()
        self.n = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count(fn, dev) -> collections.Counter:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    if dev.type == "cuda":
        torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            fn()
            torch.cuda.synchronize()
        from torch.autograd import DeviceType

        return collections.Counter({e.key[:100]: e.count for e in prof.key_averages()
                                    if e.device_type == DeviceType.CUDA})
    with _label_registry_ops(), profile(activities=acts) as prof:
        fn()
    return _cpu_launch_ops(prof)


@torch.no_grad()
def launches(model, B: int = 1, ctx: int = 8, path: str = "latency_specialized") -> collections.Counter:
    """Per-op launch counts of one decode step (after two warm-up steps) of ``path``."""
    dev = model.device
    cache = HybridCache(model.config, B, ctx + 8, model.dtype, dev, mla_pool=path == "latency_specialized")
    ids = torch.randint(0, model.config.vocab_size, (B, ctx), generator=torch.Generator().manual_seed(0)).to(dev)
    logits = model(ids, cache=cache).logits[:, -1]
    kw = dict(decode_backend="latency_specialized") if path == "latency_specialized" else dict(cuda_graph="static")
    run = make_decode_runner(model, cache, **kw)
    nxt = logits.argmax(-1)[:, None]
    for _ in range(2):
        nxt = run(nxt).argmax(-1)[:, None]
    step = run.fn  # the step itself (no graph capture / replay): every launch shows
    try:
        return count(lambda: step(nxt), dev)
    finally:
        run.close()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="k3_like_tiny", help="k3_like_tiny (default), tiny, small or k3_slice")
    ap.add_argument("--path", default="latency_specialized", choices=["latency_specialized", "standard"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", help="model dtype of the small configs (k3_slice: bf16)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.config == "k3_slice":
        from bench.models import build_model

        model = build_model(KimiK3Config.k3_slice(), str(dev), torch.bfloat16)
    else:
        cfg = k3_like_tiny() if args.config == "k3_like_tiny" else getattr(KimiK3Config, args.config)()
        model = KimiK3(cfg, seed=0).to(dev, getattr(torch, args.dtype)).eval()
    cnt = launches(model, args.batch, path=args.path)
    L = model.config.num_hidden_layers
    n = sum(cnt.values())
    print(f"{'op' if dev.type == 'cpu' else 'kernel':<60} {'count':>6} {'/layer':>7}")
    for k, v in cnt.most_common():
        print(f"{k:<60} {v:>6} {v / L:>7.2f}")
    kind = "aten launch ops (CPU proxy)" if dev.type == "cpu" else "CUDA kernels"
    print(f"total {kind}: {n} per step, {n / L:.2f} per layer ({L} layers, path {args.path}, B={args.batch})")
    return n


if __name__ == "__main__":
    main()
