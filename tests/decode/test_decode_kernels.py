"""The latency-specialized path's small Triton kernels (under TRITON_INTERPRET on CPU) == their eager forms."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3nn.config import KimiK3Config
from k3nn.decode import kernels as K
from k3nn.layers.moe import Router
from k3nn.layers.norm import RMSNorm

pytestmark = pytest.mark.filterwarnings("ignore")


@given(n=st.integers(1, 3), d=st.sampled_from([16, 40, 96]), seed=st.integers(0, 2 ** 16),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_rmsnorm(n, d, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, 1, d, generator=g) * 3).to(dtype)
    norm = RMSNorm(d, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g))
        ref = norm(x)
    torch.testing.assert_close(K.rmsnorm(x, norm.weight.detach(), 1e-5, impl="triton"), ref)
    torch.testing.assert_close(K.rmsnorm(x, norm.weight.detach(), 1e-5, impl="eager"), ref, rtol=0, atol=0)


@given(n=st.integers(1, 3), i=st.sampled_from([8, 24, 64]), seed=st.integers(0, 2 ** 16),
       act=st.sampled_from(["silu", "situ"]), cap=st.sampled_from([25.0, None]))
def test_glu(n, i, seed, act, cap):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(n, 2 * i, generator=g) * 6
    ref = K.glu(gu, act, 4.0, cap, impl="eager")
    torch.testing.assert_close(K.glu(gu, act, 4.0, cap, impl="triton"), ref, atol=1e-5, rtol=1e-5)


def test_sigmoid_gate():
    g = torch.Generator().manual_seed(0)
    o, gate = torch.randn(2, 1, 300, generator=g), torch.randn(2, 1, 300, generator=g) * 4
    torch.testing.assert_close(K.sigmoid_gate(o, gate, impl="triton"), K.sigmoid_gate(o, gate, impl="eager"))
    with pytest.raises(ValueError, match="impl"):
        K.sigmoid_gate(o, gate, impl="cuda")


@given(n=st.integers(1, 4), e_k=st.sampled_from([(8, 2), (32, 4), (128, 16), (12, 3)]), seed=st.integers(0, 2 ** 16),
       renorm=st.booleans())
def test_route(n, e_k, seed, renorm):
    E, k = e_k
    cfg = KimiK3Config.tiny(num_experts=E, num_experts_per_token=k, moe_renormalize=renorm, routed_scaling_factor=2.5)
    r = Router(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        r.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
    logits = torch.randn(n, E, generator=g) * 2
    ids_r, w_r = K.route(logits, r, impl="eager")
    ids_t, w_t = K.route(logits, r, impl="triton")
    # same selected set per row (top-k order is unspecified), same weight per expert
    for b in range(n):
        a, c = dict(zip(ids_r[b].tolist(), w_r[b].tolist())), dict(zip(ids_t[b].tolist(), w_t[b].tolist()))
        assert a.keys() == c.keys()
        for e in a:
            assert abs(a[e] - c[e]) < 1e-5


@given(n=st.integers(1, 4), e_k=st.sampled_from([(8, 2), (32, 4), (128, 16), (12, 1)]), seed=st.integers(0, 2 ** 16),
       renorm=st.booleans(), scaling=st.sampled_from([1.0, 2.5]))
def test_route_eager_equals_reference(n, e_k, seed, renorm, scaling):
    """The path's eager router (no finite check, unsorted top-k) == layers.moe.route, bit for bit per expert."""
    from k3nn.layers.moe import route

    E, k = e_k
    cfg = KimiK3Config.tiny(num_experts=E, num_experts_per_token=k, moe_renormalize=renorm,
                            routed_scaling_factor=scaling)
    r = Router(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        r.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
    logits = torch.randn(n, E, generator=g) * 2
    ids_r, w_r = route(logits, r.e_score_correction_bias, k, renorm, scaling)
    ids_e, w_e = K.route(logits, r, impl="eager")
    for b in range(n):
        a, c = dict(zip(ids_r[b].tolist(), w_r[b].tolist())), dict(zip(ids_e[b].tolist(), w_e[b].tolist()))
        assert a == c
