"""The split intra-chunk KDA pipelines (``K3NN_KDA_INTRA=split``: three launches rebuilding the cumulative decay
from g; ``splitg``, the default: the chunk-local cumulative decay G once, then the same three stages reading it)
against the fused ``_kda_intra`` kernel under the Triton interpreter: the same qg, kg, w, u, Aqk, e^{G_last} and
X = (I + L)⁻¹ to fp32 rounding (chunks cut by sequence starts and checkpoints included), and the full forward and
backward under each mode against the eager form."""

import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st

import k3nn
from k3nn import ops
from k3nn.kernels.kda import triton_chunk as tc
from k3nn.kernels.kda import triton_chunk_bwd, triton_intra_g
from k3nn.kernels.kda.chunk_torch import kda_chunk_eager

MODES = ("split", "splitg")
#: the intra pipelines compared with the fused kernel: splitg (row-strip score kernel, the default) and
#: splitg-pairs (one program per block pair)
VARIANTS = ("split", "splitg", "splitg-pairs")
NAMES = ("qg", "kg", "w", "u", "A", "egl", "X")
R64 = torch.arange(64)
BLOCK_LOWER = (R64[None, :] // 16) <= (R64[:, None] // 16)  # the part of X every pipeline writes
_EMPTY = torch.empty


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


def run_both(mode, q, k, v, g, beta, cu=None, cuts=()):
    """The fused kernel and ``mode`` (one of VARIANTS) on the same chunk plan (``cuts``: (sequence, position)
    checkpoint pairs, which split chunks), every buffer (temporaries included) poisoned with NaN before the
    kernels write it."""
    T, K = q.shape[1], q.shape[-1]
    (NC, cs, cl, *_), _, _ = tc.build_chunk_plan(1, T, cu, list(cuts), "cpu")
    scores = "pairs" if mode == "splitg-pairs" else "rows"
    outs = []
    for m in ("fused", mode.split("-")[0]):
        with mock.patch.object(torch, "empty", _nan_empty), \
                mock.patch.object(torch, "empty_like", lambda x, **kw: _nan_empty(x.shape, dtype=x.dtype)), \
                mock.patch.dict(os.environ, {"K3NN_KDA_SPLITG_SCORES": scores}):
            outs.append(tc._intra_launch(q, k, v, g, beta, K ** -0.5, NC, cs, cl, mode=m, return_x=True))
    return outs


def assert_same(fused, got, rtol=1e-5, atol=1e-5):
    for name, a, b in zip(NAMES, fused, got):
        if name == "X":
            a, b = a[..., BLOCK_LOWER], b[..., BLOCK_LOWER]
        assert torch.isfinite(b).all(), f"{name}: non-finite values"
        torch.testing.assert_close(b.float(), a.float(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mode", VARIANTS)
@settings(max_examples=8, deadline=None)
@given(T=st.one_of(st.sampled_from([1, 63, 64, 65, 130]), st.integers(1, 130)), H=st.integers(1, 2),
       K=st.sampled_from([16, 32]), V=st.sampled_from([16, 32]), gate=st.sampled_from(["softplus", "lower_bound"]),
       seed=st.integers(0, 2 ** 16))
def test_matches_fused(mode, T, H, K, V, gate, seed):
    note(f"T={T} H={H} K={K} V={V} gate={gate}")
    assert_same(*run_both(mode, *make(T, H, K, V, seed, gate)))


@pytest.mark.parametrize("mode,qk", [("split", None), ("splitg", "wu"), ("splitg", "cumsum"), ("splitg-pairs", "wu")])
def test_varlen_empty_sequence_and_checkpoint_cuts(mode, qk, monkeypatch):
    if qk:
        monkeypatch.setenv("K3NN_KDA_SPLITG_QK", qk)  # which splitg kernel writes qg / kg
    lens = [37, 0, 100, 5]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    # cuts at 20 (sequence 0) and 30, 70 (sequence 2): chunks 0-20, 20-37 | 0-30, 30-64, 64-70, 70-100 | 0-5
    fused, got = run_both(mode, *make(sum(lens), 1, 16, 32, 11, "lower_bound"), cu=cu,
                          cuts=[(0, 20), (2, 30), (2, 70)])
    assert fused[0].shape[0] == 7
    assert_same(fused, got)


@pytest.mark.parametrize("mode", VARIANTS)
@pytest.mark.parametrize("decay", [3.0, 300.0])
def test_large_decay(mode, decay):
    # softplus gate scaled: a 16-token strip spans ~30 nats (capped row factor) or thousands (pairwise path),
    # mixed with channels that barely decay (K = 32: two key tiles of the score kernel, each its own path)
    q, k, v, g, beta = make(80, 1, 32, 16, 3, decay=decay)
    g[:, :, 0, :4] = -1e-3
    assert_same(*run_both(mode, q, k, v, g, beta))


@pytest.mark.parametrize("mode", VARIANTS)
def test_fp16_matches_fused(mode):
    assert_same(*run_both(mode, *make(70, 1, 32, 32, 5, "lower_bound", dtype=torch.float16)),
                rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("mode", MODES)
def test_forward_backward_matches_eager(mode, monkeypatch):
    lens = [50, 0, 90]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, g, beta = make(sum(lens), 1, 16, 16, 7, "softplus")
    gen = torch.Generator().manual_seed(1)
    h0 = torch.randn(3, 1, 16, 16, generator=gen)
    do = torch.randn(1, sum(lens), 1, 16, generator=gen)
    kw = {"output_final_state": True, "cu_seqlens": cu, "checkpoint_positions": [[20], [], [64, 70]]}
    calls = []
    real = tc.intra_fill
    spy = lambda *a, **k2: calls.append(k2.get("mode") or tc.intra_mode()) or real(*a, **k2)
    monkeypatch.setenv("K3NN_KDA_INTRA", mode)
    res = []
    for eager in (True, False):
        ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
        with k3nn.backend("triton"), mock.patch.object(tc, "intra_fill", spy), \
                mock.patch.object(triton_chunk_bwd, "intra_fill", spy):
            fn = kda_chunk_eager if eager else ops.kda_chunk
            o, ht, ck = fn(*ins[:5], initial_state=ins[5], **kw)
            loss = (o * do).sum() + ht.square().sum() * 0.1
            res.append(((o, ht, ck), torch.autograd.grad(loss, ins)))
    assert calls == [mode, mode]  # the forward and the backward's recompute
    (ref_out, ref_grad), (out, grad) = res
    for name, a, b in zip(("o", "ht", "ckpt"), ref_out, out):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), ref_grad, grad):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_knobs(monkeypatch):
    monkeypatch.delenv("K3NN_KDA_INTRA", raising=False)
    assert tc.intra_mode() == "splitg"  # the default (H200: 2.16 ms intra against 2.73 for split)
    for m in ("split", "fused", "splitg"):
        monkeypatch.setenv("K3NN_KDA_INTRA", m)
        assert tc.intra_mode() == m
    monkeypatch.setenv("K3NN_KDA_INTRA", "both")
    with pytest.raises(ValueError, match="K3NN_KDA_INTRA"):
        tc.intra_mode()
    assert triton_intra_g.qk_stage() == "wu"
    monkeypatch.setenv("K3NN_KDA_SPLITG_QK", "both")
    with pytest.raises(ValueError):
        triton_intra_g.qk_stage()
    monkeypatch.delenv("K3NN_KDA_SPLITG_SCORES", raising=False)
    assert triton_intra_g.scores_stage() == "rows"  # the default (H200: forward 2.2–2.4% faster than pairs)
    monkeypatch.setenv("K3NN_KDA_SPLITG_SCORES", " Pairs ")
    assert triton_intra_g.scores_stage() == "pairs"
    monkeypatch.setenv("K3NN_KDA_SPLITG_SCORES", "blocks")
    with pytest.raises(ValueError, match="K3NN_KDA_SPLITG_SCORES"):
        triton_intra_g.scores_stage()
