"""Triton backward of the chunked KDA (under the interpreter, fp32) against eager autograd through the per-token
reference: gradients of q, k, v, g, beta and the initial state, with losses on the output and the final state."""

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st

import k3nn
from k3nn import ops
from k3nn.config import KimiK3Config
from k3nn.kernels.kda import triton_chunk_bwd
from k3nn.kernels.kda.reference import kda_recurrent_reference
from k3nn.layers.kda import KimiDeltaAttention

NAMES = ("q", "k", "v", "g", "beta", "h0")
TOL = dict(rtol=1e-3, atol=1e-4)


def make(B, T, H, K, V, seed, gate="softplus", n_state=None, dtype=torch.float32, decay=1.0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = F.normalize(r(B, T, H, K), dim=-1).to(dtype)
    k = F.normalize(r(B, T, H, K), dim=-1).to(dtype)
    v = r(B, T, H, V).to(dtype)
    x = r(B, T, H, K)
    g = (-5 * torch.sigmoid(x) if gate == "lower_bound" else -decay * F.softplus(x)).float()
    beta = torch.rand(B, T, H, generator=gen)
    h0 = r(n_state or B, H, K, V)
    do = r(B, T, H, V).to(dtype)
    dht = r(n_state or B, H, K, V)
    return [q, k, v, g, beta, h0], do, dht


@contextlib.contextmanager
def spying():
    """Counts calls of the Triton backward (so that a test cannot pass through another backward)."""
    calls = []
    real = triton_chunk_bwd.kda_chunk_triton_bwd

    def wrapped(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    with mock.patch.object(triton_chunk_bwd, "kda_chunk_triton_bwd", wrapped):
        yield calls


@pytest.fixture
def spy():
    with spying() as calls:
        yield calls


def grads(fn, xs, do, dht, with_h0=True, final=True, cu=None):
    """Gradients of ``<o, do> + <final, dht>`` w.r.t. xs (h0 last when given) through ``fn``."""
    ins = [t.clone().requires_grad_() for t in (xs if with_h0 else xs[:5])]
    h0 = ins[5] if with_h0 else None
    o, ht = fn(*ins[:5], initial_state=h0, output_final_state=final, cu_seqlens=cu)[:2]
    outs, gs = [o], [do]
    if final:
        outs.append(ht)
        gs.append(dht)
    return torch.autograd.grad(outs, ins, gs)


def triton_chunk(*a, **kw):
    with k3nn.backend("triton"):
        return ops.kda_chunk(*a, **kw)


def check(xs, do, dht, with_h0=True, final=True, cu=None, tol=TOL):
    got = grads(triton_chunk, xs, do, dht, with_h0, final, cu)
    want = grads(kda_recurrent_reference, xs, do, dht, with_h0, final, cu)
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype and torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"d{name}: {m}")


@settings(max_examples=5)
@given(BH=st.sampled_from([(1, 1), (1, 2), (2, 1)]), T=st.integers(1, 150), K=st.sampled_from([16, 32]),
       V=st.sampled_from([16, 32]), gate=st.sampled_from(["softplus", "lower_bound"]), with_h0=st.booleans(),
       final=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_bwd_matches_eager_autograd(BH, T, K, V, gate, with_h0, final, seed):
    B, H = BH  # at most two (sequence, head) pairs: interpreted programs are slow
    note(f"B={B} T={T} H={H} K={K} V={V} gate={gate} h0={with_h0} final={final}")
    xs, do, dht = make(B, T, H, K, V, seed, gate)
    with spying() as calls:
        check(xs, do, dht, with_h0, final)
    assert calls


@settings(max_examples=4)
@given(lens=st.lists(st.integers(0, 70), min_size=1, max_size=4).filter(lambda x: 0 < sum(x) <= 140),
       seed=st.integers(0, 2 ** 16))
def test_bwd_varlen_with_empty_sequences(lens, seed):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    note(f"cu={cu.tolist()}")
    xs, do, dht = make(1, sum(lens), 1, 16, 16, seed, "lower_bound", n_state=len(lens))
    with spying() as calls:
        check(xs, do, dht, cu=cu)
    assert calls


@pytest.mark.parametrize("T", [1, 64, 65])
def test_bwd_chunk_edges(spy, T):
    xs, do, dht = make(1, T, 2, 32, 16, T)
    check(xs, do, dht)
    assert spy


def test_bwd_empty_sequence_passes_the_final_state_gradient_to_the_initial_state(spy):
    cu = torch.tensor([0, 0, 40, 40])  # sequences 0 and 2 are empty: their final state is their initial state
    xs, do, dht = make(1, 40, 1, 16, 16, 3, n_state=3)
    check(xs, do, dht, cu=cu)
    dh0 = grads(triton_chunk, xs, do, dht, cu=cu)[5]
    torch.testing.assert_close(dh0[0], dht[0])
    torch.testing.assert_close(dh0[2], dht[2])


def test_bwd_loss_on_final_state_only(spy):
    """Only the final state enters the loss (do is None inside the backward); initial state with grad."""
    xs, _, dht = make(2, 70, 1, 16, 32, 5)
    ins = [t.clone().requires_grad_() for t in xs]
    _, ht = triton_chunk(*ins[:5], initial_state=ins[5], output_final_state=True)
    got = torch.autograd.grad((ht * dht).sum(), ins)
    _, rht = kda_recurrent_reference(*ins[:5], initial_state=ins[5], output_final_state=True)
    want = torch.autograd.grad((rht * dht).sum(), ins, allow_unused=True)
    assert want[0] is None  # q does not reach the state
    torch.testing.assert_close(got[0], torch.zeros_like(got[0]))
    for name, a, b in list(zip(NAMES, got, want))[1:]:
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"d{name}: {m}")
    assert spy


def test_bwd_with_checkpoints_requested(spy):
    """Checkpoint exports cut the forward's chunks; they carry no gradient and leave the others unchanged."""
    xs, do, dht = make(1, 100, 1, 16, 16, 8)
    ins = [t.clone().requires_grad_() for t in xs]
    o, ht, ck = triton_chunk(*ins[:5], initial_state=ins[5], output_final_state=True, checkpoint_positions=[30])
    assert not ck.requires_grad
    got = torch.autograd.grad([o, ht], ins, [do, dht])
    want = grads(kda_recurrent_reference, xs, do, dht)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"d{name}: {m}")


def test_bwd_large_decay_pairwise_diagonal(spy):
    """An unbounded gate decaying by hundreds of nats per 16 tokens: the pairwise diagonal blocks."""
    xs, do, dht = make(1, 80, 1, 16, 16, 3, decay=30.0)
    xs[3][:, :, 0, :4] = -1e-3  # channels that barely decay, mixed with the fast ones
    check(xs, do, dht, tol=dict(rtol=2e-3, atol=2e-4))
    assert spy


def test_bwd_half_precision_inputs(spy):
    """fp16 q/k/v: gradients in fp16, close to the reference on the same rounded inputs."""
    xs, do, dht = make(1, 100, 2, 32, 16, 6, "lower_bound", dtype=torch.float16)
    got = grads(triton_chunk, xs, do, dht)
    up = [x.float() for x in xs]
    want = grads(kda_recurrent_reference, up, do.float(), dht)
    for name, a, b, x in zip(NAMES, got, want, xs):
        assert a.dtype == x.dtype
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err < 5e-3, (name, err)


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_bwd_half_precision_full_head_dims(spy, gate):
    """fp16 at K = V = 128 (the model's head dims) over three chunks, the last one partial: several key blocks
    in the chunk kernel and a 128-row state, i.e. the shapes of the GPU runs (the tests above stay at K <= 32).
    Scratch is NaN-poisoned under the interpreter, so any element read before it is written shows here."""
    xs, do, dht = make(1, 150, 1, 128, 128, 11, gate, dtype=torch.float16)
    got = grads(triton_chunk, xs, do, dht)
    want = grads(kda_recurrent_reference, [x.float() for x in xs], do.float(), dht)
    assert spy
    for name, a, b, x in zip(NAMES, got, want, xs):
        assert a.dtype == x.dtype and torch.isfinite(a).all(), name
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err < 3e-3, (name, err)


def test_triton_backward_equals_autograd_through_the_pytorch_form(spy):
    """The Triton backward against the other backward of the same Triton forward: autograd through the chunked
    PyTorch form (what the Triton ``kda_recurrent`` takes under grad)."""
    from k3nn.kernels.kda.chunk_torch import kda_chunk_triton

    xs, do, dht = make(1, 70, 1, 16, 16, 2)
    got = grads(triton_chunk, xs, do, dht)
    assert len(spy) == 1
    alt = grads(kda_chunk_triton, xs, do, dht)
    assert len(spy) == 1  # the PyTorch-autograd backward ran this time
    for a, b in zip(got, alt):
        torch.testing.assert_close(a, b, **TOL)


def test_training_steps_match_eager(spy):
    """A few SGD steps of a tiny KDA layer: the triton backend ends at the eager backend's parameters."""
    cfg = KimiK3Config.tiny(kda_gate="softplus")
    torch.manual_seed(0)
    ref = KimiDeltaAttention(cfg)
    ref.reset_gate_parameters(torch.Generator().manual_seed(1))
    tri = KimiDeltaAttention(cfg)
    tri.load_state_dict(ref.state_dict())
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(1, 50, cfg.hidden_size, generator=gen) for _ in range(3)]
    target = torch.randn(1, 50, cfg.hidden_size, generator=gen)
    for layer, name in ((ref, "eager"), (tri, "triton")):
        opt = torch.optim.SGD(layer.parameters(), lr=0.5)
        with k3nn.backend(name):
            for x in xs:
                opt.zero_grad()
                F.mse_loss(layer(x), target).backward()
                opt.step()
    assert spy
    for (n, a), b in zip(ref.named_parameters(), tri.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    assert not torch.equal(ref.A_log, init["A_log"]) and not torch.equal(ref.q_proj.weight, init["q_proj.weight"])
