"""KDA prefill prologue: ``short_conv`` (causal conv + SiLU + L2 norm of q, k) and ``kda_gate``, Triton (under
the interpreter, fp32 / fp16) against the eager references, their argument checks and dispatch, and the layer's
use of them."""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import k3nn
from k3nn import KimiK3Config, ops
from k3nn.kernels.kda.prologue import kda_gate, l2norm, short_conv, short_conv_reference
from k3nn.kernels.kda.triton_prologue import kda_gate_triton, short_conv_triton
from k3nn.kernels.registry import BackendUnavailableError, resolve
from k3nn.layers.kda import KimiDeltaAttention
from conftest import poison

DTYPES = [torch.float32, torch.float16]  # the interpreter mis-computes bf16
# both sides accumulate in fp32 and round at the same points; summation order may move a result by an ulp
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def conv_inputs(B, T, C, W, N, dtype, seed, init=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g).to(dtype)
    w = torch.randn(C, W, generator=g) * 0.6
    h0 = torch.randn(N, W - 1, C, generator=g).to(dtype) if init else None
    return x, w, h0


def conv_triton(x, w, h0, cu=None, n=0, hd=None):
    """The Triton kernel writing into a NaN buffer (an element it skips fails the comparison)."""
    out = poison(*x.shape, dtype=x.dtype)
    y, final = short_conv_triton(x, w, h0, cu, n, hd, out=out)
    assert y is out
    return y, final


def check_conv(x, w, h0, cu=None, n=0, hd=None):
    y_ref, f_ref = short_conv_reference(x, w, h0, cu, n, hd)
    y, final = conv_triton(x, w, h0, cu, n, hd)
    torch.testing.assert_close(y, y_ref, **TOL[x.dtype])
    assert final.dtype == x.dtype and torch.equal(final, f_ref)  # copies of inputs: exact


@given(B=st.integers(1, 2), T=st.integers(1, 40), H=st.integers(1, 2), D=st.sampled_from([8, 16, 24]),
       tail=st.sampled_from([0, 5]), W=st.integers(1, 4), init=st.booleans(), norm=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_short_conv_matches_eager(B, T, H, D, tail, W, init, norm, dtype, seed):
    """Channels q | k | v (+ a tail that is not a whole head), L2 norm of q and k or none, with and without
    history, W = 1..4, head dims and channel counts that are not powers of two."""
    C = 3 * H * D + tail
    note(f"B={B} T={T} C={C} W={W} init={init} norm={norm} {dtype}")
    x, w, h0 = conv_inputs(B, T, C, W, B, dtype, seed, init)
    check_conv(x, w, h0, None, 2 * H * D if norm else 0, D if norm else None)


@given(lens=st.lists(st.integers(0, 12), min_size=1, max_size=4), W=st.integers(2, 4), init=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_short_conv_varlen_matches_per_sequence(lens, W, init, dtype, seed):
    """Packed sequences (empty and shorter-than-history ones included) never read each other's tokens."""
    note(f"lens={lens} W={W} init={init} {dtype}")
    H, D = 2, 8
    C = 3 * H * D
    cu = torch.tensor([0] + lens).cumsum(0)
    x, w, h0 = conv_inputs(1, sum(lens), C, W, len(lens), dtype, seed, init)
    check_conv(x, w, h0, cu, 2 * H * D, D)
    y, final = conv_triton(x, w, h0, cu, 2 * H * D, D)
    for i in range(len(lens)):  # the definition: each sequence alone, from its own history
        s, e = cu[i].item(), cu[i + 1].item()
        y_i, f_i = short_conv(x[:, s:e], w, None if h0 is None else h0[i:i + 1])
        q, k, v = y_i.split(H * D, dim=-1)
        y_i = torch.cat([l2norm(q.unflatten(-1, (H, D))).flatten(-2), l2norm(k.unflatten(-1, (H, D))).flatten(-2),
                         v], -1)
        torch.testing.assert_close(y[:, s:e], y_i, **TOL[dtype])
        assert torch.equal(final[i], f_i[0])


@pytest.mark.parametrize("T", [1, 2, 3])
@pytest.mark.parametrize("init", [False, True])
def test_short_conv_short_sequences(T, init):
    """T = 1 and T < W − 1: outputs read history rows; the final state mixes history and the new inputs."""
    W, C = 4, 20
    x, w, h0 = conv_inputs(2, T, C, W, 2, torch.float32, T, init)
    check_conv(x, w, h0, None, 10, 5)
    _, final = short_conv_triton(x, w, h0)
    hist = h0 if init else torch.zeros(2, W - 1, C)
    assert torch.equal(final, torch.cat([hist, x], 1)[:, T:])


@pytest.mark.parametrize("lens", [[3, 0, 1, 5], [0, 6], [2, 1, 0]])
@pytest.mark.parametrize("init", [False, True])
def test_short_conv_varlen_edge_cases(lens, init):
    """Empty sequences first, between and last; sequences shorter than the W − 1 history rows."""
    W, C = 4, 36
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    x, w, h0 = conv_inputs(1, sum(lens), C, W, len(lens), torch.float32, len(lens), init)
    check_conv(x, w, h0, cu, 24, 12)

def test_short_conv_empty_inputs():
    W, C = 4, 12
    x, w, h0 = conv_inputs(2, 0, C, W, 2, torch.float32, 0)
    y, final = short_conv_triton(x, w, h0)
    assert y.shape == (2, 0, C) and torch.equal(final, h0)
    y_ref, f_ref = short_conv_reference(x, w, h0)
    assert y_ref.shape == (2, 0, C) and torch.equal(f_ref, h0)
    cu = torch.tensor([0, 0, 0])  # every packed sequence empty
    x, w, h0 = conv_inputs(1, 0, C, W, 2, torch.float32, 1)
    assert torch.equal(short_conv_triton(x, w, h0, cu)[1], h0)
    assert torch.equal(short_conv_triton(x, w, None, cu)[1], torch.zeros(2, W - 1, C))


def test_short_conv_strided_input_and_cast_state():
    """x a channel slice of a wider buffer (strided rows), history and weight in other dtypes than x."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(2, 9, 40, generator=g).to(torch.float16)
    x = big[..., 4:34]
    w = torch.randn(30, 4, generator=g).double()
    h0 = torch.randn(2, 3, 30, generator=g)
    check_conv(x, w, h0, None, 20, 10)


def test_l2norm_groups_are_heads():
    """With l2norm_channels = 2·H·D, every head of q and k has unit norm and v is the plain SiLU output."""
    H, D, W = 2, 16, 4
    x, w, h0 = conv_inputs(1, 5, 3 * H * D, W, 1, torch.float32, 7)
    y, _ = conv_triton(x, w, h0, None, 2 * H * D, D)
    plain, _ = short_conv(x, w, h0)
    norms = y[..., :2 * H * D].unflatten(-1, (2 * H, D)).norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y[..., 2 * H * D:], plain[..., 2 * H * D:], rtol=1e-5, atol=1e-6)


# -- kda_gate -----------------------------------------------------------------------------------------------------

@given(lead=st.sampled_from([(1,), (2, 3), (1, 17), ()]), H=st.integers(1, 3), D=st.sampled_from([4, 12, 16]),
       kind=st.sampled_from(["softplus", "lower_bound"]), scale=st.sampled_from([1.0, 30.0]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_kda_gate_matches_eager(lead, H, D, kind, scale, dtype, seed):
    """Both gate kinds; ×30 inputs cross the softplus threshold (20) and saturate the sigmoid."""
    note(f"lead={lead} H={H} D={D} {kind} scale={scale} {dtype}")
    g = torch.Generator().manual_seed(seed)
    f = (torch.randn(*lead, H * D, generator=g) * scale).to(dtype)
    A_log, dt_bias = torch.randn(H, generator=g), torch.randn(H * D, generator=g)
    ref = kda_gate(f, A_log, dt_bias, kind, -3.0, D)
    out = poison(*lead, H, D)
    got = kda_gate_triton(f, A_log, dt_bias, kind, -3.0, D, out=out)
    assert got is out and got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_kda_gate_softplus_small_inputs_keep_precision():
    """softplus(x) ≈ eˣ for very negative x: log1p, not log(1 + eˣ), so the decay does not round to 0."""
    f = torch.tensor([[-30.0, -18.0, -5.0, 0.0, 5.0, 19.9, 20.0, 20.1, 60.0]])
    z = torch.zeros(1)
    ref = kda_gate(f, z, torch.zeros(9), "softplus", -5.0, 9)
    got = kda_gate_triton(f, z, torch.zeros(9), "softplus", None, 9)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


# -- ops: checks and dispatch -------------------------------------------------------------------------------------

def test_short_conv_rejects_bad_arguments():
    x, w, h0 = conv_inputs(2, 5, 12, 4, 2, torch.float32, 0)
    cases = [
        (dict(x=x[0]), ValueError, "x must be"),
        (dict(x=x.long()), TypeError, "x must be a floating"),
        (dict(weight=w[:, None]), ValueError, "weight must be"),
        (dict(weight=w[:5]), ValueError, "weight must be"),
        (dict(initial_state=h0[:, :2]), ValueError, "initial_state must be"),
        (dict(initial_state=[1.0]), TypeError, "initial_state must be a torch.Tensor"),
        (dict(cu_seqlens=torch.tensor([0, 5])), ValueError, "B=2"),
        (dict(x=x[:1], initial_state=h0[:1], cu_seqlens=torch.tensor([0.0, 5.0])), TypeError, "cu_seqlens"),
        (dict(x=x[:1], initial_state=h0[:1], cu_seqlens=torch.tensor([0, 4])), ValueError, "cu_seqlens"),
        (dict(x=x[:1], initial_state=h0[:1], cu_seqlens=torch.tensor([0, 3, 5])), ValueError, "initial_state"),
        (dict(l2norm_channels=8), ValueError, "head_dim"),
        (dict(l2norm_channels=8, head_dim=3), ValueError, "l2norm_channels"),
        (dict(l2norm_channels=16, head_dim=4), ValueError, "l2norm_channels"),
        (dict(l2norm_channels=-1), ValueError, "l2norm_channels"),
        (dict(eps=-1.0), ValueError, "eps"),
    ]
    for kw, err, msg in cases:
        args = dict(x=x, weight=w, initial_state=h0) | kw
        with pytest.raises(err, match=msg):
            ops.short_conv(**args)


def test_kda_gate_rejects_bad_arguments():
    f, A, b = torch.randn(3, 8), torch.randn(2), torch.randn(8)
    cases = [
        ((f.int(), A, b, "softplus", -5.0, 4), TypeError, "f must be a floating"),
        ((f, A, b, "tanh", -5.0, 4), ValueError, "kind"),
        ((f, A, b, "lower_bound", None, 4), TypeError, "lower_bound"),
        ((f, A, b, "softplus", -5.0, 0), ValueError, "head_dim"),
        ((f, A, b, "softplus", -5.0, 2), ValueError, "f must be"),
        ((f, A[:, None], b, "softplus", -5.0, 4), ValueError, "A_log"),
        ((f, A, b[:4], "softplus", -5.0, 4), ValueError, "dt_bias"),
    ]
    for args, err, msg in cases:
        with pytest.raises(err, match=msg):
            ops.kda_gate(*args)


def test_dispatch_refuses_triton_for_grad_and_fp64_and_auto_stays_eager():
    x, w, h0 = conv_inputs(1, 4, 8, 4, 1, torch.float32, 0)
    assert resolve("short_conv", (x, w, h0)).backend == "eager"  # auto never picks an interpreted kernel
    assert resolve("short_conv", (x, w, h0), backend_name="triton").backend == "triton"
    wg = w.clone().requires_grad_()
    with pytest.raises(BackendUnavailableError, match="require grad"), k3nn.backend("triton"):
        ops.short_conv(x, wg, h0)
    with torch.no_grad(), k3nn.backend("triton"):
        ops.short_conv(x, wg, h0)
    with pytest.raises(BackendUnavailableError, match="float64"), k3nn.backend("triton"):
        ops.short_conv(x.double(), w, h0)
    f, A, b = torch.randn(2, 8), torch.randn(2, requires_grad=True), torch.randn(8)
    with pytest.raises(BackendUnavailableError, match="require grad"), k3nn.backend("triton"):
        ops.kda_gate(f, A, b, "softplus", -5.0, 4)
    with pytest.raises(BackendUnavailableError, match="float64"), k3nn.backend("triton"):
        ops.kda_gate(f, A.detach().double(), b, "softplus", -5.0, 4)


# -- the layer ----------------------------------------------------------------------------------------------------

def _layer(gate, dtype, seed=0):
    cfg = KimiK3Config.tiny(kda_gate=gate)
    layer = KimiDeltaAttention(cfg).to(dtype)
    layer.reset_gate_parameters(torch.Generator().manual_seed(seed))
    return layer, cfg


def _old_project(layer, x, prev):
    """The layer's math as composed before the fused op (conv, then L2 norm of q and k, then the gate)."""
    B, T, _ = x.shape
    H, D = layer.num_heads, layer.head_dim
    qkv = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)
    qkv, conv_new = short_conv(qkv, layer.conv_weight(), prev)
    q, k, v = (t.reshape(B, T, H, D) for t in qkv.split(H * D, dim=-1))
    g = kda_gate(layer.f_b_proj(layer.f_a_proj(x)), layer.A_log, layer.dt_bias, layer.gate_kind,
                 layer.lower_bound, D)
    return l2norm(q), l2norm(k), v, g, conv_new


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_layer_eager_project_is_the_old_math_in_fp64(gate):
    layer, cfg = _layer(gate, torch.float64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, cfg.hidden_size, dtype=torch.float64, generator=g)
    prev = torch.randn(2, cfg.short_conv_kernel_size - 1, 3 * layer.num_heads * layer.head_dim,
                       dtype=torch.float64, generator=g)
    with k3nn.backend("eager"):
        got = layer.project(x, prev)
    want = _old_project(layer, x, prev)
    for a, b in zip(got[:4] + got[5:], want):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_layer_project_and_norm_on_triton(gate):
    """project (short_conv + kda_gate) and the output norm through the Triton kernels match eager (fp32)."""
    layer, cfg = _layer(gate, torch.float32)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, cfg.hidden_size, generator=g)
    prev = torch.randn(2, cfg.short_conv_kernel_size - 1, 3 * layer.num_heads * layer.head_dim, generator=g)
    o = torch.randn(2, 7, layer.num_heads, layer.head_dim, generator=g)
    gt = torch.randn(2, 7, layer.num_heads, layer.head_dim, generator=g)
    with torch.no_grad():
        with k3nn.backend("eager"):
            ref = layer.project(x, prev) + (layer.o_norm(o, gt),)
        with k3nn.backend("triton"):
            got = layer.project(x, prev) + (layer.o_norm(o, gt),)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)



def test_layer_trains_under_an_explicit_triton_backend():
    """The prologue kernels are forward only: with autograd recording the layer runs their eager math, so a
    model trained with backend("triton") still gets the eager gradients (and the ops alone refuse)."""
    layer, cfg = _layer("lower_bound", torch.float32)
    x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    grads = []
    for name in ("eager", "triton"):
        layer.zero_grad()
        with k3nn.backend(name):
            q, k, v, g, beta, _ = layer.project(x, None)
            o = layer.o_norm(q + v, k)
        (o.square().sum() + g.sum()).backward()
        grads.append([p.grad.clone() for p in (layer.q_conv1d.weight, layer.A_log, layer.o_norm.weight)])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=0, atol=0)

# -- sm_90 compile (ptxas, no GPU) ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("varlen,h0,norm", [(True, True, True), (False, False, False)])
def test_short_conv_compiles_for_sm90(varlen, h0, norm):
    from test_triton_compile_sm90 import _compile

    _compile("k3nn.kernels.kda.triton_prologue", "_short_conv_fwd",
             {"X": "*bf16", "Wt": "*bf16", "H0": "*bf16", "Y": "*bf16", "SEQ": "*i32", "CU": "*i32", "eps": "fp32"},
             {"W": 4, "GROUP": 128, "BT": 64, "BC": 128, "HAS_H0": h0, "VARLEN": varlen, "NORM": norm}, warps=8)


@pytest.mark.slow
def test_gate_and_norm_compile_for_sm90():
    from test_triton_compile_sm90 import _compile

    _compile("k3nn.kernels.kda.triton_prologue", "_kda_gate_fwd",
             {"Fp": "*bf16", "A": "*fp32", "DTB": "*fp32", "G": "*fp32", "lower_bound": "fp32"},
             {"BR": 4, "BC": 1024, "SOFTPLUS": True})
    _compile("k3nn.kernels.norm.triton_gated", "_gated_rmsnorm_fwd",
             {"X": "*bf16", "Gt": "*bf16", "Wt": "*bf16", "Y": "*bf16", "eps": "fp32"},
             {"D": 128, "BD": 128, "BR": 32})
