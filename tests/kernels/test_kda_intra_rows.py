"""Row-strip intra-chunk KDA pipeline (K3NN_KDA_INTRA=rows) against the fused ``_kda_intra`` kernel, under the
Triton interpreter: the same qg, kg, w, u, Aqk, e^{G_last} and X = (I + L)⁻¹ to fp32 rounding, and the full
forward (and the backward's recompute) under the new mode."""

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

NAMES = ("qg", "kg", "w", "u", "A", "egl", "X")
R64 = torch.arange(64)
BLOCK_LOWER = (R64[None, :] // 16) <= (R64[:, None] // 16)  # the part of X every pipeline writes
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


def run_modes(q, k, v, g, beta, cu=None, modes=("fused", "rows")):
    """The pipelines on the same chunk plan, their output buffers poisoned with NaN before the kernels run."""
    T, K = q.shape[1], q.shape[-1]
    (NC, cs, cl, *_), _, _ = tc.build_chunk_plan(1, T, cu, [], "cpu")
    outs = []
    for mode in modes:
        with mock.patch.object(torch, "empty", _nan_empty), \
                mock.patch.object(torch, "empty_like", lambda x, **kw: _nan_empty(x.shape, dtype=x.dtype)):
            outs.append(tc._intra_launch(q, k, v, g, beta, K ** -0.5, NC, cs, cl, mode=mode, return_x=True))
    return outs


def assert_same(ref, got, rtol=1e-5, atol=1e-5):
    for name, a, b in zip(NAMES, ref, got):
        if name == "X":
            a, b = a[..., BLOCK_LOWER], b[..., BLOCK_LOWER]
        assert torch.isfinite(b).all(), f"{name}: non-finite values in the rows output"
        torch.testing.assert_close(b.float(), a.float(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@settings(max_examples=8, deadline=None)
@given(T=st.one_of(st.sampled_from([1, 63, 64, 65, 130]), st.integers(1, 130)), H=st.integers(1, 2),
       K=st.sampled_from([16, 32]), V=st.sampled_from([16, 32]), gate=st.sampled_from(["softplus", "lower_bound"]),
       seed=st.integers(0, 2 ** 16))
def test_rows_matches_fused(T, H, K, V, gate, seed):
    note(f"T={T} H={H} K={K} V={V} gate={gate}")
    fused, rows = run_modes(*make(T, H, K, V, seed, gate))
    assert_same(fused, rows)


def test_rows_varlen_with_empty_sequence():
    lens = [37, 0, 70, 5]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    fused, rows = run_modes(*make(sum(lens), 1, 16, 32, 11, "lower_bound"), cu=cu)
    assert fused[0].shape[0] == 4  # 1 + 0 + 2 + 1 chunks
    assert_same(fused, rows)


@pytest.mark.parametrize("decay", [3.0, 300.0])
def test_rows_large_decay_pairwise(decay):
    # softplus gate scaled: a 16-token strip spans ~30 nats (capped diagonal factor) or thousands (pairwise
    # fallback), mixed with channels that barely decay (K = 32: two key tiles, each its own path)
    q, k, v, g, beta = make(80, 1, 32, 16, 3, decay=decay)
    g[:, :, 0, :4] = -1e-3
    fused, rows = run_modes(q, k, v, g, beta)
    assert_same(fused, rows)


def test_rows_fallback_one_strip_one_tile():
    # one strip of one key tile past the span (the pairwise path), the rest bounded: only that block changes path
    q, k, v, g, beta = make(64, 1, 32, 16, 9, "lower_bound")
    g[:, 32:48, :, 20:] = -40.0
    fused, rows = run_modes(q, k, v, g, beta)
    assert_same(fused, rows)


def test_rows_fp16_matches_fused():
    fused, rows = run_modes(*make(70, 1, 32, 32, 5, "lower_bound", dtype=torch.float16))
    assert_same(fused, rows, rtol=2e-3, atol=2e-3)


def test_full_forward_rows_matches_eager(monkeypatch):
    lens = [50, 0, 90]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, g, beta = make(sum(lens), 2, 16, 16, 7, "softplus")
    h0 = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(1))
    kw = {"initial_state": h0, "output_final_state": True, "cu_seqlens": cu,
          "checkpoint_positions": [[20], [], [64, 70]]}
    ref = kda_chunk_eager(q, k, v, g, beta, **kw)
    with k3nn.backend("triton"):
        monkeypatch.delenv("K3NN_KDA_INTRA", raising=False)
        fused = ops.kda_chunk(q, k, v, g, beta, **kw)
        monkeypatch.setenv("K3NN_KDA_INTRA", "rows")
        got = ops.kda_chunk(q, k, v, g, beta, **kw)
    for a, b, c in zip(ref, got, fused):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-5)


def test_backward_recompute_under_rows(monkeypatch):
    # the backward's intra recompute follows K3NN_KDA_INTRA: same gradients as with the fused kernel
    q, k, v, g, beta = make(70, 1, 16, 16, 13, "lower_bound")
    do = torch.randn(1, 70, 1, 16, generator=torch.Generator().manual_seed(2))
    from k3nn.kernels.kda import triton_intra_rows

    res, calls = [], []
    real = triton_intra_rows.intra_rows_launch
    spy = lambda *a, **kw: calls.append(1) or real(*a, **kw)  # noqa: E731
    for mode in ("fused", "rows"):
        monkeypatch.setenv("K3NN_KDA_INTRA", mode)
        ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        with k3nn.backend("triton"), mock.patch.object(triton_intra_rows, "intra_rows_launch", spy):
            o, _ = ops.kda_chunk(*ins)
            res.append(torch.autograd.grad(o, ins, do))
    assert len(calls) == 2  # the rows forward and the backward's recompute
    for a, b in zip(*res):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_intra_mode_knob_rows(monkeypatch):
    monkeypatch.setenv("K3NN_KDA_INTRA", "rows")
    assert tc.intra_mode() == "rows"
    monkeypatch.setenv("K3NN_KDA_INTRA", "row")
    with pytest.raises(ValueError):
        tc.intra_mode()
