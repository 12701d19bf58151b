"""The small decode-path ops (the GLU over a fused gate|up projection, MLA's sigmoid gate, the router): their
Triton kernels (interpreted on CPU) == the eager references on hypothesis-drawn shapes, plus fixed edge cases."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3nn import ops
from k3nn.kernels.glu import glu_packed_reference, sigmoid_gate_reference
from k3nn.kernels.moe.routing import route_reference
from k3nn.kernels.registry import backend

pytestmark = pytest.mark.filterwarnings("ignore")


@settings(deadline=None, max_examples=12)
@given(n=st.integers(1, 3), i=st.sampled_from([8, 24, 64, 1100]), seed=st.integers(0, 2 ** 16),
       act=st.sampled_from(["silu", "situ"]), cap=st.sampled_from([25.0, None]),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_glu_triton_matches_reference(n, i, seed, act, cap, dtype):
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(n, 2 * i, generator=g) * 6).to(dtype)
    ref = glu_packed_reference(gu.float(), act, 4.0, cap).to(dtype)
    with backend("triton"):
        out = ops.glu(gu, act, 4.0, cap)
    assert out.dtype == dtype and out.shape == (n, i)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out, ref, **tol)


def test_glu_arguments():
    with pytest.raises(ValueError, match="gate_up"):
        ops.glu(torch.randn(2, 5), "silu")
    with pytest.raises(ValueError, match="activation"):
        ops.glu(torch.randn(2, 4), "gelu")
    with backend("triton"):
        assert ops.glu(torch.randn(0, 8), "silu").shape == (0, 4)


@settings(deadline=None, max_examples=8)
@given(shape=st.sampled_from([(1, 1, 300), (2, 3, 64), (5, 1, 1025)]), seed=st.integers(0, 2 ** 16))
def test_sigmoid_gate_triton_matches_reference(shape, seed):
    g = torch.Generator().manual_seed(seed)
    o, gate = torch.randn(shape, generator=g), torch.randn(shape, generator=g) * 4
    with backend("triton"):
        out = ops.sigmoid_gate(o, gate)
    torch.testing.assert_close(out, sigmoid_gate_reference(o, gate))
    with pytest.raises(ValueError, match="one shape"):
        ops.sigmoid_gate(o, gate[..., :-1])


def _as_dict(ids, w):
    return [dict(zip(a.tolist(), b.tolist())) for a, b in zip(ids, w)]


@settings(deadline=None, max_examples=12)
@given(n=st.integers(1, 4), e_k=st.sampled_from([(8, 2), (32, 4), (128, 16), (12, 3), (5, 1)]),
       seed=st.integers(0, 2 ** 16), renorm=st.booleans(), scaling=st.sampled_from([1.0, 2.5]))
def test_route_triton_matches_reference(n, e_k, seed, renorm, scaling):
    E, k = e_k
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(E, generator=g) * 0.1
    logits = torch.randn(n, E, generator=g) * 2
    ids_r, w_r = route_reference(logits, bias, k, renorm, scaling)
    with backend("triton"):
        ids_t, w_t = ops.moe_route(logits, bias, k, renorm, scaling)
    assert ids_t.dtype == torch.int64 and w_t.dtype == torch.float32 and ids_t.shape == (n, k)
    # the same experts per row (the top-k order is unspecified) with the same weight each
    for a, b in zip(_as_dict(ids_r, w_r), _as_dict(ids_t, w_t)):
        assert a.keys() == b.keys()
        for e in a:
            assert abs(a[e] - b[e]) <= 1e-6 * max(1.0, abs(a[e]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("be", ["eager", "triton"])
def test_route_non_finite_logits_raise_on_every_backend(bad, be):
    """The eager backend checks the logits; the route kernel flags each row it reads (no launches of its own)."""
    logits = torch.randn(3, 8)
    with backend(be):
        ops.moe_route(logits, torch.zeros(8), 2, True, 1.0)  # finite: no error
        logits[2, 5] = bad
        with pytest.raises(ValueError, match="router logits contains NaN or Inf"):
            ops.moe_route(logits, torch.zeros(8), 2, True, 1.0)


def test_gate_route_flags_a_non_finite_sum_of_partials():
    """The fused router (skinny GEMM partials summed by the route kernel) checks the summed logits: a row whose
    product overflows fp32 raises, finite rows do not."""
    from k3nn.kernels.linear import triton_skinny

    x, w = torch.ones(2, 64), torch.ones(8, 64)
    x[1] *= 1e37  # row 1's dot product overflows fp32 in the partial sums
    cfg = triton_skinny.SkinnyConfig("fma", 16, 64, 4, 1, 2)
    saved, triton_skinny.config_for = triton_skinny.config_for, lambda *a, **kw: cfg
    try:
        with backend("triton"):
            ops.moe_gate_route(x[:1], w, torch.zeros(8), 2, True, 1.0)
            with pytest.raises(ValueError, match="router logits contains NaN or Inf"):
                ops.moe_gate_route(x, w, torch.zeros(8), 2, True, 1.0)
    finally:
        triton_skinny.config_for = saved


def test_route_edge_cases():
    with pytest.raises(ValueError, match="NaN"):
        ops.moe_route(torch.tensor([[0.1, float("nan"), 0.3]]), torch.zeros(3), 2, True, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_route(torch.randn(2, 3), torch.zeros(3), 4, True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        ops.moe_route(torch.randn(2, 3), torch.zeros(4), 1, True, 1.0)
    # grouped routing runs its eager form under any backend (the kernel covers ungrouped sigmoid routing)
    logits, bias = torch.randn(3, 16), torch.zeros(16)
    with backend("triton"):
        ids, w = ops.moe_route(logits, bias, 4, True, 1.0, num_group=4, topk_group=2)
    ids_r, w_r = route_reference(logits, bias, 4, True, 1.0, 4, 2)
    assert _as_dict(ids, w) == _as_dict(ids_r, w_r)
    # ties: the lowest expert index wins
    with backend("triton"):
        ids, _ = ops.moe_route(torch.zeros(1, 8), torch.zeros(8), 3, True, 1.0)
    assert sorted(ids[0].tolist()) == [0, 1, 2]
    # negative and mixed-sign biased scores keep the float order (the kernel compares integer keys)
    bias = torch.tensor([-5.0, -3.0, 0.25, -1.0, -4.0, -0.5, -3.0, 2.0])
    with backend("triton"):
        ids, w = ops.moe_route(torch.zeros(2, 8), bias, 5, False, 1.0)
    assert ids[0].tolist() == [7, 2, 5, 3, 1] and ids[1].tolist() == [7, 2, 5, 3, 1]  # by score, ties: lowest
    assert torch.equal(w, torch.full((2, 5), 0.5))


@settings(deadline=None, max_examples=8)
@given(n=st.integers(1, 5), e_k=st.sampled_from([(8, 2), (32, 4), (130, 16)]), d=st.sampled_from([64, 256, 288]),
       split=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2 ** 16), renorm=st.booleans())
def test_gate_route_adds_the_split_k_partials_like_the_reduce_launch(n, e_k, d, split, seed, renorm):
    """ops.moe_gate_route on the Triton path (the route kernel sums the skinny GEMM's split-K partials) == the two
    ops it replaces, linear(out fp32) + moe_route, bit for bit (fp16 under the interpreter), and == the reference's
    experts; each split count a fixed skinny config."""
    from k3nn.kernels.linear import triton_skinny

    E, k = e_k
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).half()
    w = (torch.randn(E, d, generator=g) * d ** -0.5).half()
    bias = torch.randn(E, generator=g) * 0.1
    cfg = triton_skinny.SkinnyConfig("fma", 16, 64, 4, 1, split)
    saved, triton_skinny.config_for = triton_skinny.config_for, lambda *a, **kw: cfg
    try:
        with backend("triton"):
            ids_f, w_f = ops.moe_gate_route(x, w, bias, k, renorm, 2.5)
            ids_t, w_t = ops.moe_route(ops.linear(x, w, out_dtype=torch.float32), bias, k, renorm, 2.5)
    finally:
        triton_skinny.config_for = saved
    assert torch.equal(ids_f, ids_t) and torch.equal(w_f, w_t)
    ids_r, w_r = route_reference(x.float() @ w.float().T, bias, k, renorm, 2.5)
    for a, b in zip(_as_dict(ids_r, w_r), _as_dict(ids_f, w_f)):
        assert a.keys() == b.keys()


def test_gate_route_falls_back_to_the_two_ops():
    """Rows above the skinny limit, grouped routing, the eager backend: the same result as linear + moe_route."""
    g = torch.Generator().manual_seed(1)
    x, w, bias = torch.randn(20, 64, generator=g).half(), torch.randn(16, 64, generator=g).half(), torch.zeros(16)
    want = route_reference(ops.linear(x, w, out_dtype=torch.float32), bias, 4, True, 1.0)
    assert _as_dict(*ops.moe_gate_route(x, w, bias, 4, True, 1.0)) == _as_dict(*want)
    with backend("triton"):
        want = route_reference(ops.linear(x[:2], w, out_dtype=torch.float32), bias, 4, True, 1.0, 4, 2)
        got = ops.moe_gate_route(x[:2], w, bias, 4, True, 1.0, num_group=4, topk_group=2)
    assert _as_dict(*got) == _as_dict(*want)
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_gate_route(x[:2], w, bias, 17, True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        ops.moe_gate_route(x[:2], w, torch.zeros(3), 2, True, 1.0)
    with pytest.raises(ValueError, match="x must be"):
        ops.moe_gate_route(x[None], w, bias, 2, True, 1.0)
    # fp32 / fp64 inputs: logits in their dtype (fp64 checks stay fp64), the same routing as the two ops
    for dt in (torch.float32, torch.float64):
        x2, w2 = x[:3].to(dt), w.to(dt)
        want = route_reference(ops.linear(x2, w2), bias, 4, True, 1.0)
        assert _as_dict(*ops.moe_gate_route(x2, w2, bias, 4, True, 1.0)) == _as_dict(*want)
