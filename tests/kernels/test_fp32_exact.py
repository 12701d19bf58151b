"""The exact fp32 mode on the CPU (Triton interpreter): the product precision follows torch's TF32 setting read at
each launch, every fp32-capable ``tl.dot`` of the kernels takes it, and the launchers pass it (the interpreter
ignores the precision, so the numerics are checked on the GPU: tests/gpu/test_fp32_exact_gpu.py)."""

import ast
import contextlib
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3nn import ops
from k3nn.kernels.precision import DOT_PRECISIONS, dot_precision, tf32_allowed
from k3nn.kernels.registry import backend

KERNELS = Path(__file__).resolve().parents[2] / "src" / "k3nn" / "kernels"
#: modules whose every ``tl.dot`` must name its input precision (DOT_PREC, or pinned "ieee")
DOT_PREC_MODULES = ("kda/triton_chunk.py", "kda/triton_intra_g.py", "kda/triton_common.py",
                    "kda/triton_chunk_bwd.py")


@contextlib.contextmanager
def allow_tf32(on: bool):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_dot_precision_follows_the_flag_at_each_call():
    for _ in range(2):  # read each time, never cached
        with allow_tf32(False):
            assert not tf32_allowed()
            assert dot_precision(torch.float32) == "ieee"
        with allow_tf32(True):
            assert tf32_allowed()
            assert dot_precision(torch.float32) == "tf32"


@given(on=st.booleans(), dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_half_precision_kernels_keep_tf32(on, dtype):
    with allow_tf32(on):
        assert dot_precision(dtype) == "tf32"
        assert dot_precision(dtype) in DOT_PRECISIONS


def test_dot_precision_rejects_a_non_dtype():
    with pytest.raises(TypeError, match="dtype"):
        dot_precision("float32")


def test_torch_new_precision_api_is_read():
    """torch ≥ 2.9's ``fp32_precision`` (per backend, or global): run apart, since mixing torch's two APIs in one
    process makes torch refuse some later reads."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision API")
    code = ("import torch; from k3nn.kernels.precision import dot_precision as d; m = torch.backends.cuda.matmul\n"
            "r = [d(torch.float32)]\n"
            "m.fp32_precision = 'tf32'; r.append(d(torch.float32))\n"
            "m.fp32_precision = 'ieee'; r.append(d(torch.float32))\n"
            "m.fp32_precision = 'none'; torch.backends.fp32_precision = 'tf32'; r.append(d(torch.float32))\n"
            "torch.backends.fp32_precision = 'ieee'; r.append(d(torch.float32))\n"
            "print(','.join(r))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ieee,tf32,ieee,tf32,ieee"


def _dots(tree):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dot"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "tl"):
            yield node


@pytest.mark.parametrize("rel", DOT_PREC_MODULES)
def test_every_kda_dot_names_its_precision(rel):
    tree = ast.parse((KERNELS / rel).read_text())
    dots = list(_dots(tree))
    assert dots, f"{rel} has no tl.dot"
    for node in dots:
        kw = {k.arg: k.value for k in node.keywords}
        assert "input_precision" in kw, f"{rel}:{node.lineno}: tl.dot without input_precision"
        v = kw["input_precision"]
        ok = (isinstance(v, ast.Name) and v.id == "DOT_PREC") or (isinstance(v, ast.Constant) and v.value == "ieee")
        assert ok, f"{rel}:{node.lineno}: input_precision must be DOT_PREC or 'ieee'"


@pytest.mark.parametrize("module,names", [
    ("k3nn.kernels.kda.triton_chunk", ("_kda_recur", "_kda_recur_f32")),
    ("k3nn.kernels.kda.triton_intra_g", ("_g_scores_rows", "_g_wu")),
    ("k3nn.kernels.kda.triton_chunk_bwd", ("_kda_bwd_states", "_kda_bwd_dh", "_kda_bwd_chunk")),
])
def test_kernels_take_dot_prec_and_tune_per_precision(module, names):
    mod = importlib.import_module(module)
    for n in names:
        kern = getattr(mod, n)
        assert "DOT_PREC" in kern.arg_names, f"{module}.{n} has no DOT_PREC argument"
        assert "DOT_PREC" in kern.keys, f"{module}.{n}: an IEEE run must not pick the TF32 run's tiles"


class _Spy:
    """Records the DOT_PREC / IEEE launch arguments of interpreted kernels (their ``run`` wrapped)."""

    def __init__(self, monkeypatch, kernels):
        self.seen: list[tuple[str, str, object]] = []
        for name, k in kernels:
            inner = k.fn if hasattr(k, "configs") else k  # autotuner → the interpreted function
            orig = inner.run

            def run(*a, _orig=orig, _name=name, **kw):
                for key in ("DOT_PREC", "IEEE"):
                    if key in kw:
                        self.seen.append((_name, key, kw[key]))
                return _orig(*a, **kw)

            monkeypatch.setattr(inner, "run", run)


def _kda_inputs(dtype, T=20, H=1, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    nrm = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    q = nrm(torch.randn(1, T, H, D, generator=g)).to(dtype)
    k = nrm(torch.randn(1, T, H, D, generator=g)).to(dtype)
    v = torch.randn(1, T, H, D, generator=g).to(dtype)
    return q, k, v, -torch.rand(1, T, H, D, generator=g) * 0.3, torch.rand(1, T, H, generator=g)


@pytest.mark.parametrize("on", [False, True])
def test_kda_chunk_launches_with_the_flag(monkeypatch, on):
    from k3nn.kernels.kda import triton_chunk as tc
    from k3nn.kernels.kda import triton_intra_g as tg

    spy = _Spy(monkeypatch, [("recur", tc._kda_recur_f32), ("scores", tg._g_scores_rows), ("wu", tg._g_wu)])
    q, k, v, g, beta = _kda_inputs(torch.float32)
    with allow_tf32(on), backend("triton"):
        o, _ = ops.kda_chunk(q, k, v, g, beta)
    with backend("eager"):
        ref, _ = ops.kda_chunk(q, k, v, g, beta)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
    want = "tf32" if on else "ieee"
    names = {n for n, _, _ in spy.seen}
    assert names == {"scores", "wu", "recur"}
    assert all(key == "DOT_PREC" and val == want for _, key, val in spy.seen), spy.seen


def test_kda_chunk_fp16_keeps_tf32_with_tf32_off(monkeypatch):
    from k3nn.kernels.kda import triton_chunk as tc

    spy = _Spy(monkeypatch, [("recur", tc._kda_recur)])
    q, k, v, g, beta = _kda_inputs(torch.float16)
    with allow_tf32(False), backend("triton"):
        ops.kda_chunk(q, k, v, g, beta)
    assert spy.seen and all(val == "tf32" for _, _, val in spy.seen)


@pytest.mark.parametrize("on", [False, True])
def test_mla_prefill_launch_follows_the_flag(monkeypatch, on):
    from k3nn.kernels.mla import triton_prefill as tp

    spy = _Spy(monkeypatch, [("mla", tp._mla_attn_fwd)])
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    a = (r(1, 9, 2, 16), r(1, 9, 2, 16), r(1, 9, 2, 16), r(1, 9, 16), r(1, 9, 2, 16))
    with allow_tf32(on), backend("triton"):
        o = ops.mla_attention(*a, 32 ** -0.5)
    with backend("eager"):
        ref = ops.mla_attention(*(t.double() for t in a), 32 ** -0.5)
    torch.testing.assert_close(o.double(), ref, atol=1e-5, rtol=1e-5)
    assert spy.seen == [("mla", "IEEE", not on)]


def _compile_sm90(module, name, constexprs, warps, stages):
    """Compile one kernel for sm_90 with fp32 pointers (no GPU needed; the harness of
    test_triton_compile_sm90.py: a fresh process without TRITON_INTERPRET)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_triton_compile_sm90 import _compile

    ints = {"chunk_start": "*i32", "chunk_len": "*i32", "seq_lo": "*i32", "seq_hi": "*i32", "export_slot": "*i32"}
    strides = {"SQK": "i32", "SV": "i32"}  # token strides of q / k and v (views of a packed projection)
    _compile(module, name, {**ints, **strides, "scale": "fp32", "H": "i32"}, constexprs, default="*fp32",
             warps=warps, stages=stages)


@pytest.mark.slow
@pytest.mark.parametrize("module,name,constexprs,warps,stages", [
    ("k3nn.kernels.kda.triton_intra_g", "_g_scores_rows_kernel", {"K": 128, "BK": 32, "SPAN": 80.0}, 2, 2),
    ("k3nn.kernels.kda.triton_intra_g", "_g_wu_kernel", {"K": 128, "V": 128, "BD": 64, "QK": True}, 4, 1),
    ("k3nn.kernels.kda.triton_chunk", "_kda_recur_kernel",
     {"K": 128, "V": 128, "BK": 128, "BV": 32, "HAS_INIT": True, "STORE_FINAL": True, "HAS_CKPT": False}, 4, 1),
])
def test_fp32_ieee_kernels_compile_for_sm90(module, name, constexprs, warps, stages):
    """The IEEE variants with fp32 operands (new with the exact mode) compile for Hopper (first tuning configs)."""
    _compile_sm90(module, name, {**constexprs, "DOT_PREC": "ieee"}, warps, stages)


def _bench_script():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "fp32_exact.py"
    spec = importlib.util.spec_from_file_location("fp32_exact_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_script_helpers():
    b = _bench_script()
    x = torch.randn(3, 4)
    y = b.to64((x, [torch.arange(3)], {"d": torch.float32}, 2.0))
    assert y[0].dtype == torch.float64 and y[0].data_ptr() != x.data_ptr()
    assert y[1][0].dtype == torch.int64 and y[2]["d"] == torch.float64 and y[3] == 2.0
    assert b.err(x, x.double()) == 0.0
    assert b.err(x * (1 + 1e-3), x.double()) == pytest.approx(1e-3, rel=1e-3)
    assert b.err(torch.tensor([float("-inf"), 1.0]), torch.tensor([float("-inf"), 1.0])) == 0.0
    assert b.err(torch.tensor([0.0, 1.0]), torch.tensor([float("-inf"), 1.0])) == float("inf")
    assert b.worst((x, None), (x.double(), None)) == 0.0
    ref = [{1: torch.tensor([[0, 1], [2, 3], [1, 2]])}, {1: torch.tensor([[0, 1]])}]
    got = [{1: torch.tensor([[0, 1], [2, 4], [1, 3]])}, {1: torch.tensor([[0, 2]])}]
    per, first = b.flips(got, ref)
    assert per == {"L1": 2, "decode_steps": 1} and first == 1
    summ, first_op = b.op_summary([dict(layer="L0", op="kda_chunk", phase="prefill", err=1e-7),
                                   dict(layer="L3", op="mla_attention", phase="prefill", err=3e-4),
                                   dict(layer="L1", op="moe_experts", phase="decode0", err=2e-3)], 1e-5)
    assert first_op.startswith("L3.mla_attention (prefill)")
    assert summ["L1.moe_experts.decode"] == 2e-3


@pytest.mark.slow
def test_bench_script_smoke_runs_on_cpu(tmp_path):
    rows = _bench_script().main(["--smoke", "--no-kernels", "--decode", "1", "--backends", "eager",
                                 "--out-dir", str(tmp_path)])
    by_case = {r["case"]: r for r in rows}
    row = by_case["model fp32 eager tf32=off"]
    assert row["prefill_rel"] < 1e-5 and row["ops_max"] < 1e-5 and row["first_op_over_tol"] is None
    assert row["first_module_over_tol"] is None and row["verdict"].startswith("PASS")
    assert list(tmp_path.glob("fp32-exact-*.json"))
