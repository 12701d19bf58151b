"""Gated RMSNorm: the Triton kernel (under the interpreter, fp32 / fp16) against the eager reference, the checks
and dispatch of ``ops.gated_rmsnorm``, and ``GatedRMSNorm`` running through it."""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import k3nn
from k3nn import ops
from k3nn.kernels.norm.reference import gated_rmsnorm_reference
from k3nn.kernels.norm.triton_gated import gated_rmsnorm_triton
from k3nn.kernels.registry import BackendUnavailableError, resolve
from k3nn.layers.norm import GatedRMSNorm
from conftest import poison

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def inputs(shape, dtype, seed, wdtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    gate = torch.randn(shape, generator=g).to(dtype)
    w = (0.5 + torch.rand(shape[-1], generator=g)).to(wdtype)
    return x, gate, w


@given(lead=st.sampled_from([(1,), (3,), (2, 5), (2, 3, 2), ()]), D=st.sampled_from([1, 7, 16, 24, 96]),
       dtype=st.sampled_from([torch.float32, torch.float16]), wdtype=st.sampled_from([torch.float32, torch.float16]),
       eps=st.sampled_from([1e-5, 1e-2]), seed=st.integers(0, 2**31 - 1))
def test_gated_rmsnorm_matches_eager(lead, D, dtype, wdtype, eps, seed):
    note(f"lead={lead} D={D} {dtype} weight {wdtype} eps={eps}")
    x, gate, w = inputs((*lead, D), dtype, seed, wdtype)
    out = poison(*lead, D, dtype=dtype)
    got = gated_rmsnorm_triton(x, gate, w, eps, out=out)
    assert got is out
    torch.testing.assert_close(got, gated_rmsnorm_reference(x, gate, w, eps), **TOL[dtype])


def test_gated_rmsnorm_strided_views_and_zero_rows():
    """Head views of a [B, T, H·D] projection (rows not contiguous in memory) and all-zero rows (y = 0)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 3, 16, generator=g)
    x[0, 1] = 0
    gate = torch.randn(2, 5, 64, generator=g)[..., 8:56].unflatten(-1, (3, 16))
    w = torch.rand(16, generator=g)
    got = gated_rmsnorm_triton(x, gate, w, 1e-5, out=poison(2, 5, 3, 16))
    torch.testing.assert_close(got, gated_rmsnorm_reference(x, gate, w, 1e-5), rtol=1e-5, atol=1e-6)
    assert (got[0, 1] == 0).all()


def test_module_dispatches_through_the_op():
    norm = GatedRMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, gate, _ = inputs((2, 3, 24), torch.float32, 1)
    with torch.no_grad():
        with k3nn.backend("eager"):
            ref = norm(x, gate)
        with k3nn.backend("triton"):
            got = norm(x, gate)
    torch.testing.assert_close(ref, gated_rmsnorm_reference(x, gate, norm.weight, 1e-5), rtol=0, atol=0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    x64, g64 = x.double(), gate.double()
    out = norm.double()(x64, g64)  # fp64 stays fp64 (eager)
    assert out.dtype == torch.float64


def test_gated_rmsnorm_checks_and_dispatch():
    x, gate, w = inputs((2, 8), torch.float32, 0)
    for args, err, msg in [((x.long(), gate, w, 1e-5), TypeError, "x must be a floating"),
                           ((x, gate[:, :4], w, 1e-5), ValueError, "gate must"),
                           ((x, gate, w[:4], 1e-5), ValueError, "weight must"),
                           ((x, gate, w, -1.0), ValueError, "eps"),
                           ((x[:, :0], gate[:, :0], w[:0], 1e-5), ValueError, "D >= 1"),
                           ((x, "gate", w, 1e-5), TypeError, "gate must be a torch.Tensor")]:
        with pytest.raises(err, match=msg):
            ops.gated_rmsnorm(*args)
    assert resolve("gated_rmsnorm", (x, gate, w, 1e-5)).backend == "eager"  # never an interpreted kernel
    wg = w.clone().requires_grad_()
    with pytest.raises(BackendUnavailableError, match="require grad"), k3nn.backend("triton"):
        ops.gated_rmsnorm(x, gate, wg, 1e-5)
    with pytest.raises(BackendUnavailableError, match="float64"), k3nn.backend("triton"):
        ops.gated_rmsnorm(x.double(), gate, w, 1e-5)
    y = ops.gated_rmsnorm(x, gate, wg, 1e-5)  # eager trains
    y.sum().backward()
    assert wg.grad is not None and torch.isfinite(wg.grad).all()


# -- plain RMSNorm (the model's pre-norms) ------------------------------------------------------------------------
@given(lead=st.sampled_from([(1,), (3,), (2, 5), ()]), D=st.sampled_from([1, 7, 16, 96]),
       dtype=st.sampled_from([torch.float32, torch.float16]), wdtype=st.sampled_from([torch.float32, torch.float16]),
       seed=st.integers(0, 2**31 - 1))
def test_rms_norm_matches_eager(lead, D, dtype, wdtype, seed):
    from k3nn.kernels.norm.reference import rms_norm_reference
    from k3nn.kernels.norm.triton_rms import rms_norm_triton

    note(f"lead={lead} D={D} {dtype} weight {wdtype}")
    x, _, w = inputs((*lead, D), dtype, seed, wdtype)
    ref = rms_norm_reference(x, w, 1e-5)
    out = poison(*lead, D, dtype=ref.dtype)
    got = rms_norm_triton(x, w, 1e-5, out=out)
    assert got is out and got.dtype == torch.promote_types(wdtype, dtype)
    torch.testing.assert_close(got, ref, **TOL[dtype])


def test_rms_norm_layer_dispatch_and_errors():
    from k3nn.layers.norm import RMSNorm

    norm = RMSNorm(24, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), norm.weight * xf)  # fp64: the eager math, exactly
    with k3nn.backend("triton"), torch.no_grad():
        torch.testing.assert_close(norm.float()(x.float()), (norm.weight * xf).float(), rtol=1e-5, atol=1e-5)
    xr = torch.randn(2, 24, requires_grad=True)
    norm.float()(xr).sum().backward()  # autograd runs the eager math whatever the backend
    assert xr.grad is not None
    with pytest.raises(ValueError, match=r"weight must be \[D\]"):
        ops.rms_norm(x, torch.ones(5, dtype=torch.float64))
    with pytest.raises(BackendUnavailableError, match="float64"):
        with k3nn.backend("triton"):
            ops.rms_norm(x, norm.weight.double())
