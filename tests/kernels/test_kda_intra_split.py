"""Split intra-chunk KDA pipeline (K3NN_KDA_INTRA=split) against the fused ``_kda_intra`` kernel, under the
Triton interpreter: the same qg, kg, w, u, Aqk, e^{G_last} and X = (I + L)⁻¹ to fp32 rounding."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st

import k3nn
from k3nn import ops
from k3nn.kernels.kda import triton_chunk as tc

NAMES = ("qg", "kg", "w", "u", "A", "egl", "X")
R64 = torch.arange(64)
BLOCK_LOWER = (R64[None, :] // 16) <= (R64[:, None] // 16)  # the part of X both pipelines write


def make(T, H, K, V, seed, gate="softplus", decay=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
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


_EMPTY = torch.empty


def run_both(q, k, v, g, beta, cu=None):
    """Both pipelines on the same chunk plan, their output buffers poisoned with NaN before the kernels run."""
    T, K = q.shape[1], q.shape[-1]
    (NC, cs, cl, *_), _, _ = tc.build_chunk_plan(1, T, cu, [], "cpu")
    outs = []
    for mode in ("fused", "split"):
        with mock.patch.object(torch, "empty", _nan_empty), \
                mock.patch.object(torch, "empty_like", lambda x, **kw: _nan_empty(x.shape, dtype=x.dtype)):
            outs.append(tc._intra_launch(q, k, v, g, beta, K ** -0.5, NC, cs, cl, mode=mode, return_x=True))
    return outs


def assert_same(fused, split, rtol=1e-5, atol=1e-5):
    for name, a, b in zip(NAMES, fused, split):
        if name == "X":
            a, b = a[..., BLOCK_LOWER], b[..., BLOCK_LOWER]
        assert torch.isfinite(b).all(), f"{name}: non-finite values in the split output"
        torch.testing.assert_close(b.float(), a.float(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@settings(max_examples=8)
@given(T=st.one_of(st.sampled_from([1, 63, 64, 65, 130]), st.integers(1, 130)), H=st.integers(1, 2),
       K=st.sampled_from([16, 32]), V=st.sampled_from([16, 32]), gate=st.sampled_from(["softplus", "lower_bound"]),
       seed=st.integers(0, 2 ** 16))
def test_split_matches_fused(T, H, K, V, gate, seed):
    note(f"T={T} H={H} K={K} V={V} gate={gate}")
    fused, split = run_both(*make(T, H, K, V, seed, gate))
    assert_same(fused, split)


def test_split_varlen_with_empty_sequence():
    lens = [37, 0, 70, 5]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    fused, split = run_both(*make(sum(lens), 1, 16, 32, 11, "lower_bound"), cu=cu)
    assert fused[0].shape[0] == 4  # 1 + 0 + 2 + 1 chunks
    assert_same(fused, split)


@pytest.mark.parametrize("decay", [3.0, 300.0])
def test_split_large_decay_pairwise(decay):
    # softplus gate scaled: a 16-token strip spans ~30 nats (capped row factor) or thousands (pairwise path),
    # mixed with channels that barely decay (K = 32: two key tiles of the score kernel, each its own path)
    q, k, v, g, beta = make(80, 1, 32, 16, 3, decay=decay)
    g[:, :, 0, :4] = -1e-3
    fused, split = run_both(q, k, v, g, beta)
    assert_same(fused, split)


def test_split_fp16_matches_fused():
    fused, split = run_both(*make(70, 1, 32, 32, 5, "lower_bound", dtype=torch.float16))
    assert_same(fused, split, rtol=2e-3, atol=2e-3)


def test_full_forward_split_equals_default(monkeypatch):
    lens = [50, 0, 90]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, g, beta = make(sum(lens), 2, 16, 16, 7, "softplus")
    h0 = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(1))
    kw = {"initial_state": h0, "output_final_state": True, "cu_seqlens": cu,
          "checkpoint_positions": [[20], [], [64, 70]]}
    with k3nn.backend("triton"):
        monkeypatch.delenv("K3NN_KDA_INTRA", raising=False)
        ref = ops.kda_chunk(q, k, v, g, beta, **kw)
        monkeypatch.setenv("K3NN_KDA_INTRA", "split")
        got = ops.kda_chunk(q, k, v, g, beta, **kw)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_intra_mode_knob(monkeypatch):
    monkeypatch.delenv("K3NN_KDA_INTRA", raising=False)
    assert tc.intra_mode() == "splitg"  # the default (fastest on the H200)
    monkeypatch.setenv("K3NN_KDA_INTRA", "split")
    assert tc.intra_mode() == "split"
    monkeypatch.setenv("K3NN_KDA_INTRA", "fused")
    assert tc.intra_mode() == "fused"
    monkeypatch.setenv("K3NN_KDA_INTRA", "both")
    with pytest.raises(ValueError):
        tc.intra_mode()
