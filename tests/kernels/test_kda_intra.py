"""The intra-chunk stage of the Triton chunked KDA forward (the ``triton_intra_g`` pipeline: the chunk-local
cumulative decay G once, then score blocks, the inverse and w / u reading it) under the Triton interpreter, against
its eager fp64 reference (:func:`k3nn.kernels.kda.reference.kda_intra_reference`): qg, kg, w, u, Aqk, e^{G_last}
and X = (I + L)⁻¹, every buffer poisoned with NaN before the kernels write it, chunks cut by sequence starts and
checkpoints; and the forward and backward (whose recompute runs the same stage) against the eager form."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st

import k3nn
from k3nn import ops
from k3nn.kernels.kda import triton_chunk as tc
from k3nn.kernels.kda.chunk_torch import kda_chunk_eager
from k3nn.kernels.kda.reference import kda_intra_reference

NAMES = ("qg", "kg", "w", "u", "A", "egl", "X")
R64 = torch.arange(64)
BLOCK_LOWER = (R64[None, :] // 16) <= (R64[:, None] // 16)  # the part of X the kernels write
_EMPTY = torch.empty


def make(T, H, K, V, seed, gate="softplus", decay=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).to(dtype)
    k = F.normalize(r(1, T, H, K), dim=-1).to(dtype)
    v = r(1, T, H, V).to(dtype)
    x = r(1, T, H, K)
    g = (-5 * torch.sigmoid(x) if gate == "lower_bound" else -decay * F.softplus(x)).float()
    beta = torch.rand(1, T, H, generator=gen)
    return q, k, v, g, beta


def _nan_empty(*a, **kw):
    t = _EMPTY(*a, **kw)
    return t.fill_(float("nan")) if t.is_floating_point() else t


def run_both(q, k, v, g, beta, cu=None, cuts=()):
    """The kernels (every buffer, temporaries included, NaN before they write it) and the reference on the same
    chunk plan (``cuts``: (sequence, position) checkpoint pairs, which split chunks)."""
    T, K = q.shape[1], q.shape[-1]
    (NC, cs, cl, *_), _, _ = tc.build_chunk_plan(1, T, cu, list(cuts), "cpu")
    with mock.patch.object(torch, "empty", _nan_empty), \
            mock.patch.object(torch, "empty_like", lambda x, **kw: _nan_empty(x.shape, dtype=x.dtype)):
        got = tc._intra_launch(q, k, v, g, beta, K ** -0.5, NC, cs, cl, return_x=True)
    return kda_intra_reference(q, k, v, g, beta, K ** -0.5, cs, cl), got


def assert_close(ref, got, rtol=1e-4, atol=2e-5):
    for name, a, b in zip(NAMES, ref, got):
        if name == "X":
            a, b = a[..., BLOCK_LOWER], b[..., BLOCK_LOWER]
        assert torch.isfinite(b).all(), f"{name}: non-finite values"
        torch.testing.assert_close(b.double(), a, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@settings(max_examples=6, deadline=None)
@given(T=st.one_of(st.sampled_from([1, 63, 64, 65, 130]), st.integers(1, 130)), H=st.integers(1, 2),
       K=st.sampled_from([16, 32]), V=st.sampled_from([16, 32]), gate=st.sampled_from(["softplus", "lower_bound"]),
       seed=st.integers(0, 2 ** 16))
def test_matches_reference(T, H, K, V, gate, seed):
    note(f"T={T} H={H} K={K} V={V} gate={gate}")
    assert_close(*run_both(*make(T, H, K, V, seed, gate)))


def test_varlen_empty_sequence_and_checkpoint_cuts():
    lens = [37, 0, 100, 5]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    # cuts at 20 (sequence 0) and 30, 70 (sequence 2): chunks 0-20, 20-37 | 0-30, 30-64, 64-70, 70-100 | 0-5
    ref, got = run_both(*make(sum(lens), 1, 16, 32, 11, "lower_bound"), cu=cu, cuts=[(0, 20), (2, 30), (2, 70)])
    assert got[0].shape[0] == 7
    assert_close(ref, got)


@pytest.mark.parametrize("decay", [3.0, 300.0])
def test_large_decay(decay):
    # softplus gate scaled: a 16-token strip spans ~30 nats (capped row factor) or thousands (pairwise path),
    # mixed with channels that barely decay (K = 32: two key tiles of the score kernel, each its own path)
    q, k, v, g, beta = make(80, 1, 32, 16, 3, decay=decay)
    g[:, :, 0, :4] = -1e-3
    assert_close(*run_both(q, k, v, g, beta))


def test_fp16_matches_reference():
    # the off-diagonal score blocks and X z / X (β v) take fp16 operands (tensor-core dots on the GPU)
    assert_close(*run_both(*make(70, 1, 32, 32, 5, "lower_bound", dtype=torch.float16)), rtol=1e-2, atol=5e-3)


def test_forward_backward_matches_eager():
    lens = [50, 0, 90]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, g, beta = make(sum(lens), 1, 16, 16, 7, "softplus")
    gen = torch.Generator().manual_seed(1)
    h0 = torch.randn(3, 1, 16, 16, generator=gen)
    do = torch.randn(1, sum(lens), 1, 16, generator=gen)
    kw = {"output_final_state": True, "cu_seqlens": cu, "checkpoint_positions": [[20], [], [64, 70]]}
    res = []
    for eager in (True, False):
        ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
        with k3nn.backend("triton"):
            fn = kda_chunk_eager if eager else ops.kda_chunk
            o, ht, ck = fn(*ins[:5], initial_state=ins[5], **kw)
            loss = (o * do).sum() + ht.square().sum() * 0.1
            res.append(((o, ht, ck), torch.autograd.grad(loss, ins)))
    (ref_out, ref_grad), (out, grad) = res
    for name, a, b in zip(("o", "ht", "ckpt"), ref_out, out):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), ref_grad, grad):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
