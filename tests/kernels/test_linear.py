"""``ops.linear`` and its Triton skinny GEMM (interpreted on CPU): equal to the eager reference on hypothesis-drawn
shapes and launch shapes, the registry's reasons and the ``auto`` rule, and the ``Linear`` seam the layers use
(state dict, autograd, hooks, LoRA-style wrapping, packed decode projections, the MLP's residual add)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from k3nn import ops
from k3nn.kernels import registry
from k3nn.kernels.linear import linear_reference, tuned
from k3nn.kernels.linear.triton_skinny import (SkinnyConfig, auto_skip_skinny, config_for, default_config,
                                               linear_skinny, row_bucket, supports_skinny)
from k3nn.kernels.registry import backend, tuning, uncaptured_step
from k3nn.layers.linear import Linear

pytestmark = pytest.mark.filterwarnings("ignore")


def _ref64(x, w, b=None, r=None):
    y = x.double() @ w.double().t()
    if b is not None:
        y = y + b.double()
    if r is not None:
        y = y + r.double()
    return y


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


configs = st.one_of(
    st.none(),
    st.builds(SkinnyConfig, st.just("fma"), st.sampled_from([4, 8, 16, 32]), st.sampled_from([16, 32, 64]),
              st.just(1), st.just(1), st.integers(1, 3)),
    st.builds(SkinnyConfig, st.just("dot"), st.sampled_from([16, 32]), st.sampled_from([16, 32, 64]),
              st.just(1), st.just(1), st.integers(1, 3)),
)


@settings(deadline=None, max_examples=30)
@given(m=st.integers(1, 16), n=st.integers(1, 70), k=st.integers(1, 130), lead=st.sampled_from([(), (1,), (2,)]),
       dtype=st.sampled_from([torch.float32, torch.float16]), bias=st.booleans(), res=st.booleans(),
       cfg=configs, seed=st.integers(0, 2 ** 16))
def test_skinny_matches_reference(m, n, k, lead, dtype, bias, res, cfg, seed):
    """Every launch shape (FMA / swapped dot, split-K with its fixed-order reduction, ragged K and N) computes
    x Wᵀ + b + r like the fp64 reference: fp32 to rounding, fp16 to its output rounding."""
    g = torch.Generator().manual_seed(seed)
    rows = max(1, m // (lead[0] if lead else 1))
    x = torch.randn(*lead, rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    r = torch.randn(*lead, rows, n, generator=g).to(dtype) if res else None
    y = linear_skinny(x, w, b, r, config=cfg)
    assert y.shape == (*lead, rows, n) and y.dtype == dtype
    ref = _ref64(x, w, b, r)
    assert _rel(y, ref) < (1e-6 if dtype == torch.float32 else 2e-3)
    with backend("triton"):  # the registry path: supports() takes it, the same numbers
        torch.testing.assert_close(ops.linear(x, w, b, residual=r).double(), ref, rtol=1e-2, atol=1e-2)


def test_skinny_takes_views_and_empty_rows():
    """x as a column slice of a packed projection's output (row stride > K), a row-strided weight, zero rows."""
    g = torch.Generator().manual_seed(0)
    packed = torch.randn(3, 1, 96, generator=g)
    x = packed[..., 16:56]  # [3, 1, 40], row stride 96
    w_full = torch.randn(50, 64, generator=g)
    w = w_full[:, :40]  # unit stride along K, row stride 64
    with backend("triton"):
        assert supports_skinny(x, w) is None
        y = ops.linear(x, w)
        assert _rel(y, _ref64(x, w)) < 1e-6
        assert ops.linear(torch.randn(0, 40), w).shape == (0, 50)


def test_supports_reasons():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert "rows above 16" in supports_skinny(torch.randn(17, 8), w)
    assert "unit stride" in supports_skinny(x, torch.randn(8, 4).t())
    assert "empty weight" in supports_skinny(torch.randn(2, 0), torch.randn(4, 0))
    assert "dtype" in supports_skinny(x.double(), w.double())
    wg = w.clone().requires_grad_()
    assert "forward only" in supports_skinny(x, wg)
    with torch.no_grad():
        assert supports_skinny(x, wg) is None


def test_check_linear_names_the_argument():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        ops.linear(x, torch.randn(8))
    with pytest.raises(ValueError, match="expects 8"):
        ops.linear(torch.randn(2, 7), w)
    with pytest.raises(TypeError, match="one floating dtype"):
        ops.linear(x.half(), w)
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.linear(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="residual must have shape"):
        ops.linear(x, w, residual=torch.randn(2, 5))
    with pytest.raises(TypeError, match="residual is"):
        ops.linear(x, w, residual=torch.randn(2, 4).half())


def test_many_rows_run_torch_gemm_under_any_backend():
    """More than 16 rows is a compute-bound GEMM: torch's, also under an explicit Triton backend (no error)."""
    x, w = torch.randn(3, 9, 8), torch.randn(4, 8)
    with backend("triton"):
        torch.testing.assert_close(ops.linear(x, w), F.linear(x, w))
        r = torch.randn(3, 9, 4)
        torch.testing.assert_close(ops.linear(x, w, residual=r), F.linear(x, w) + r)


def test_auto_never_runs_the_interpreter_and_follows_the_rule(monkeypatch):
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    assert registry.resolve("linear", (x, w, None, None), {}).backend == "eager"
    with tuning(skinny_linear="never"):
        assert "never" in auto_skip_skinny(x, w)
    with tuning(skinny_linear="always"):
        assert auto_skip_skinny(x, w) is None
    assert "float32" in auto_skip_skinny(x, w)  # fp32: torch's GEMM unless measured
    xb, wb = x.bfloat16(), w.bfloat16()
    assert "below" in auto_skip_skinny(xb, wb)  # 4 KB of weight
    big = torch.empty(4096, 1024, dtype=torch.bfloat16)
    assert auto_skip_skinny(xb[:, :1].expand(1, 1024), big) is None
    with uncaptured_step():  # a step without a CUDA graph: torch's GEMM launches cheaper on the host
        assert "CUDA graph" in auto_skip_skinny(xb[:, :1].expand(1, 1024), big)
        with tuning(skinny_linear="always"):
            assert auto_skip_skinny(xb[:, :1].expand(1, 1024), big) is None
    key = ("bfloat16", 4096, 1024, 1)
    monkeypatch.setattr(tuned, "TORCH_FASTER", {key})
    assert "measured faster" in auto_skip_skinny(xb[:, :1].expand(1, 1024), big)
    monkeypatch.setattr(tuned, "TORCH_FASTER", set())
    monkeypatch.setattr(tuned, "TUNED", {("float32", 32, 64, 1): ("fma", 8, 64, 4, 1, 2)})
    assert auto_skip_skinny(x, w) is None  # a measured fp32 shape
    with pytest.raises(ValueError, match="skinny_linear"):
        tuning(skinny_linear="sometimes").__enter__()


def test_config_choice():
    assert row_bucket(1) == 1 and row_bucket(3) == 4 and row_bucket(16) == 16
    c = default_config(1, 7168, 12288, torch.bfloat16, 132)
    assert c.kind == "fma" and c.split_k == 1
    c = default_config(16, 7168, 12288, torch.bfloat16, 132)
    assert c.kind == "dot"
    assert default_config(1, 128, 7168, torch.float32, 132).split_k > 1  # few rows: split K to fill the GPU
    assert config_for(2, 32, 64, torch.float32, torch.device("cpu")).kind == "fma"


def test_linear_layer_is_an_nn_linear():
    """The seam keeps nn.Linear's contract: type checks, state-dict keys, autograd, hooks, LoRA-style wrapping."""
    torch.manual_seed(0)
    lin = Linear(8, 5, bias=True)
    ref = nn.Linear(8, 5, bias=True)
    ref.load_state_dict(lin.state_dict())
    assert isinstance(lin, nn.Linear) and list(lin.state_dict()) == ["weight", "bias"]
    x = torch.randn(2, 3, 8, requires_grad=True)
    lin(x).sum().backward()  # autograd: F.linear
    assert lin.weight.grad is not None and x.grad is not None
    with torch.no_grad(), backend("triton"):
        torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)
    seen = []
    lin.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    with torch.no_grad():
        lin(torch.randn(1, 8))
    assert seen == [torch.Size([1, 5])]

    class LoRA(nn.Module):  # the shape of peft's LoRA layer: the original linear as base_layer, plus B·A
        def __init__(self, base: nn.Linear, r: int = 2):
            super().__init__()
            assert isinstance(base, nn.Linear)
            self.base_layer = base
            self.A = nn.Linear(base.in_features, r, bias=False)
            self.B = nn.Linear(r, base.out_features, bias=False)

        def forward(self, x):
            return self.base_layer(x) + self.B(self.A(x))

    wrapped = LoRA(Linear(8, 5, bias=False))
    nn.init.normal_(wrapped.B.weight)
    with torch.no_grad(), backend("triton"):
        xx = torch.randn(2, 8)
        want = F.linear(xx, wrapped.base_layer.weight) + wrapped.B(wrapped.A(xx))
        torch.testing.assert_close(wrapped(xx), want, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: F.linear casts the operands
        assert Linear(8, 5)(torch.randn(2, 8)).dtype == torch.bfloat16


def test_packed_split_and_mlp_residual_use_the_op():
    """The prepared decode projections (one packed GEMM split per group) and the MLP's add inside the down GEMM
    give what the separate projections give, on the Triton path."""
    from k3nn.layers.mlp import MLP
    from k3nn.layers.packed import pack_linears

    torch.manual_seed(0)
    a, b = Linear(16, 6, bias=False), Linear(16, 10, bias=False)
    p = pack_linears([[a], [b]])
    x = torch.randn(2, 1, 16)
    with torch.no_grad(), backend("triton"):
        ya, yb = p.split(x)
        torch.testing.assert_close(ya, F.linear(x, a.weight), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(yb, F.linear(x, b.weight), rtol=1e-5, atol=1e-5)
    mlp = MLP(16, 24, "situ")
    add = torch.randn(2, 16)
    xx = torch.randn(2, 16)
    with torch.no_grad():
        want = mlp(xx, add_to=add)
        mlp.prepare_decode()
        with backend("triton"):
            got = mlp(xx, add_to=add)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_project_onto_adds_inside_the_gemm_unless_the_module_needs_its_own_forward(monkeypatch):
    """``project_onto(proj, x, r)`` == ``r + proj(x)``: one GEMM with the residual for a plain Linear; the module's own
    forward then the add with a bias, a hook (a tensor-parallel all-reduce must see the projection alone) or a
    wrapper."""
    from k3nn.layers.linear import project_onto

    torch.manual_seed(0)
    x, r = torch.randn(2, 3, 8), torch.randn(2, 3, 5)
    plain, biased = Linear(8, 5, bias=False), Linear(8, 5, bias=True)
    hooked = Linear(8, 5, bias=False)
    hooked.register_forward_hook(lambda m, a, out: out * 2)
    fused = []  # the GEMM calls that take the residual
    linear = ops.linear
    monkeypatch.setattr(ops, "linear", lambda *a, **kw: (fused.append(kw.get("residual") is not None)
                                                          or linear(*a, **kw)))
    for proj, inside in ((plain, True), (biased, False), (hooked, False), (nn.Sequential(plain), False)):
        fused.clear()
        with torch.no_grad():
            got = project_onto(proj, x, r)
        assert fused[:1] == [inside], proj
        with torch.no_grad():
            torch.testing.assert_close(got, r + proj(x), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(project_onto(plain, x, None), plain(x), rtol=0, atol=0)
    calls = []
    plain.register_forward_pre_hook(lambda m, a: calls.append(1))  # a hook: the module runs
    with torch.no_grad():
        project_onto(plain, x, r)
    assert calls == [1]
    x.requires_grad_(True)  # autograd: the addmm trains
    project_onto(Linear(8, 5, bias=False), x, r).sum().backward()
    assert x.grad is not None


def test_reference_residual_is_one_addmm():
    x, w, r, b = torch.randn(3, 8), torch.randn(4, 8), torch.randn(3, 4), torch.randn(4)
    torch.testing.assert_close(linear_reference(x, w, b, r), torch.addmm(r + b, x, w.t()))
    torch.testing.assert_close(linear_reference(x, w, b), F.linear(x, w, b))


def test_model_decode_on_the_skinny_path_equals_full_forward(monkeypatch):
    """Incremental decode with every projection of the step on the Triton path (prepared packed projections
    included, interpreted) == the full forward on torch's GEMMs, fp32."""
    from k3nn import KimiK3, KimiK3Config

    m = KimiK3(KimiK3Config.tiny(), seed=0).eval()
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    impl = registry.get_op("linear").impls["triton"]
    calls, run = [], impl.fn
    monkeypatch.setattr(impl, "fn", lambda *a, **k: calls.append(a[1].shape) or run(*a, **k))
    with torch.no_grad():
        full = m(ids).logits
        m.prepare_decode()
        cache = m.new_cache(2, 12)
        steps = [m(ids[:, :10], cache=cache).logits]
        with backend("triton"):
            steps.append(m(ids[:, 10:], cache=cache).logits)
    assert (m.config.vocab_size, m.config.hidden_size) in calls  # lm_head, the packed projections, ...
    assert len(calls) > 3 * m.config.num_hidden_layers
    assert _rel(torch.cat(steps, 1), full.double()) < 1e-5


def test_tuned_lookup_serves_unmeasured_buckets(monkeypatch):
    monkeypatch.setattr(tuned, "TUNED", {("bfloat16", 64, 32, 1): ("fma", 8, 64, 4, 1, 1),
                                         ("bfloat16", 64, 32, 16): ("dot", 64, 32, 4, 3, 1)})
    monkeypatch.setattr(tuned, "TORCH_FASTER", {("bfloat16", 64, 32, 16)})
    assert tuned.lookup("bfloat16", 64, 32, 2) == (("fma", 8, 64, 4, 1, 1), False)  # fma: up to twice its rows
    assert tuned.lookup("bfloat16", 64, 32, 8) == (("dot", 64, 32, 4, 3, 1), True)  # dot serves any rows
    assert tuned.lookup("bfloat16", 64, 32, 4)[0][0] == "dot"
    assert tuned.lookup("bfloat16", 65, 32, 1) == (None, False)


@settings(deadline=None, max_examples=10)
@given(m=st.integers(1, 16), res=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_out_dtype_computes_as_if_cast_first(m, res, seed):
    """fp16 operands, fp32 output (the router's logits): the reference casts first; the kernel converts on load."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, 40, generator=g).half(), torch.randn(24, 40, generator=g).half()
    r = torch.randn(m, 24, generator=g) if res else None
    ref = linear_reference(x, w, None, r, torch.float32)
    torch.testing.assert_close(ref, torch.addmm(r, x.float(), w.float().t()) if res else x.float() @ w.float().t())
    with backend("triton"):
        y = ops.linear(x, w, residual=r, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="residual is"):
        ops.linear(x, w, residual=torch.zeros(m, 24).half(), out_dtype=torch.float32)
    with pytest.raises(TypeError, match="out_dtype"):
        ops.linear(x, w, out_dtype=torch.int32)


def test_router_logits_half_inputs_equal_the_upcast_product():
    from k3nn import KimiK3Config
    from k3nn.layers.moe import Router

    r = Router(KimiK3Config.tiny(num_experts=8)).bfloat16()
    nn.init.normal_(r.weight)
    x = torch.randn(3, r.weight.shape[1]).bfloat16()
    with torch.no_grad():
        got = r.logits(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.float() @ r.weight.float().t(), rtol=1e-6, atol=1e-6)


def test_autograd_runs_torch_gemm_under_an_explicit_backend():
    x, w = torch.randn(2, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    with backend("triton"):
        ops.linear(x, w).sum().backward()
    assert x.grad is not None and w.grad is not None
