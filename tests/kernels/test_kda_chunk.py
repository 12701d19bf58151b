"""KDA chunk kernels (Triton under the interpreter, fp32) against the eager token-by-token reference."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note
from hypothesis import strategies as st

import k3nn
from k3nn import ops
from k3nn.kernels.kda.chunk_torch import kda_chunk_torch
from k3nn.kernels.kda.reference import kda_recurrent_reference
from k3nn.kernels.kda.triton_chunk import build_chunk_plan
from k3nn.kernels.registry import BackendUnavailableError

TOL = dict(rtol=2e-4, atol=2e-5)


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
    return q, k, v, g, beta, h0


def triton_chunk(*a, **kw):
    with k3nn.backend("triton"):
        return ops.kda_chunk(*a, **kw)


@given(B=st.integers(1, 2), T=st.integers(1, 130), H=st.integers(1, 2), K=st.sampled_from([16, 32, 24, 48]),
       V=st.sampled_from([16, 32, 20, 48]), gate=st.sampled_from(["softplus", "lower_bound"]),
       with_h0=st.booleans(), data=st.data(), seed=st.integers(0, 2 ** 16))
def test_chunk_fwd_matches_reference(B, T, H, K, V, gate, with_h0, data, seed):
    cps = [sorted(data.draw(st.lists(st.integers(0, T), max_size=3))) for _ in range(B)]
    note(f"B={B} T={T} H={H} K={K} V={V} gate={gate} h0={with_h0} ckpts={cps}")
    q, k, v, g, beta, h0 = make(B, T, H, K, V, seed, gate)
    h0 = h0 if with_h0 else None
    o, ht, ck = triton_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, checkpoint_positions=cps)
    ro, rht, rck = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           checkpoint_positions=cps)
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(ht, rht, **TOL)
    torch.testing.assert_close(ck, rck, **TOL)


@given(B=st.integers(1, 2), T=st.integers(1, 100), H=st.integers(1, 3), K=st.sampled_from([16, 24]),
       V=st.sampled_from([16, 20]), seed=st.integers(0, 2 ** 16))
def test_chunk_reads_q_k_v_in_place_from_one_qkv_buffer(B, T, H, K, V, seed):
    """q, k, v as slices of one [B, T, H·(2K + V)] buffer (what the short conv writes) run without copies and
    give the bits of contiguous inputs; a layout the kernels cannot read (heads not contiguous) is copied."""
    from k3nn.kernels.kda import triton_intra_g as tig

    q, k, v, g, beta, h0 = make(B, T, H, K, V, seed)
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1)
    qs, ks, vs = (t.unflatten(-1, (H, -1)) for t in qkv.split([H * K, H * K, H * V], -1))
    assert all(a is b for a, b in zip(tig.token_rows(qs, ks), (qs, ks)))  # no copies
    assert B * T == 1 or tig.token_stride(qs, ks, vs) == H * (2 * K + V)
    want = triton_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    got = triton_chunk(qs, ks, vs, g, beta, initial_state=h0, output_final_state=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, H, K] with the heads outermost in memory
    if H > 1 and T > 1:
        with pytest.raises(ValueError, match="token_rows"):
            tig.token_stride(qt)
        assert tig.token_rows(qt)[0].is_contiguous()
    assert torch.equal(triton_chunk(qt, k, v, g, beta, initial_state=h0)[0], want[0])


@given(lens=st.lists(st.integers(0, 70), min_size=1, max_size=4).filter(lambda x: 0 < sum(x) <= 140),
       data=st.data(), seed=st.integers(0, 2 ** 16))
def test_chunk_varlen_with_empty_sequences(lens, data, seed):
    cps = [sorted(data.draw(st.lists(st.integers(0, n), max_size=2))) for n in lens]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    note(f"cu={cu.tolist()} ckpts={cps}")
    q, k, v, g, beta, h0 = make(1, sum(lens), 2, 16, 16, seed, "lower_bound", n_state=len(lens))
    o, ht, ck = triton_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                             checkpoint_positions=cps)
    ro, rht, rck = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           cu_seqlens=cu, checkpoint_positions=cps)
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(ht, rht, **TOL)
    torch.testing.assert_close(ck, rck, **TOL)


@given(T=st.integers(1, 70), K=st.sampled_from([16, 24]), gate=st.sampled_from(["softplus", "lower_bound"]),
       varlen=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_chunk_gradients_match_eager_autograd(T, K, gate, varlen, seed):
    note(f"T={T} K={K} gate={gate} varlen={varlen}")
    cu = torch.tensor([0, T // 2, T]) if varlen else None
    q, k, v, g, beta, h0 = make(1, T, 2, K, 16, seed, gate, n_state=2 if varlen else 1)
    ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(1, T, 2, 16, generator=gen)
    dht = torch.randn(h0.shape, generator=gen)
    o, ht = triton_chunk(*ins[:5], initial_state=ins[5], output_final_state=True, cu_seqlens=cu)
    got = torch.autograd.grad([o, ht], ins, [do, dht])
    ro, rht = kda_recurrent_reference(*ins[:5], initial_state=ins[5], output_final_state=True, cu_seqlens=cu)
    want = torch.autograd.grad([ro, rht], ins, [do, dht])
    for name, a, b in zip("q k v g beta h0".split(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=lambda m: f"d{name}: {m}")


def test_gradient_without_initial_state_and_without_final_state():
    q, k, v, g, beta, _ = make(2, 40, 1, 16, 16, 7)
    ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    o, ht = triton_chunk(*ins)
    assert ht is None
    got = torch.autograd.grad(o.sum(), ins)
    want = torch.autograd.grad(kda_recurrent_reference(*ins)[0].sum(), ins)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("decay,K", [(30.0, 16), (300.0, 16), (30.0, 64)])
def test_unbounded_gate_large_decay_is_finite_and_exact(decay, K):
    # softplus gate scaled so that a 16-token block spans hundreds of nats: the pairwise diagonal path
    # (K = 64: two key-channel blocks, each deciding its own path)
    q, k, v, g, beta, h0 = make(1, 80, 2, K, 16, 3, decay=decay)
    g[:, :, 0, :4] = -1e-3  # and some channels that barely decay, mixed with the fast ones
    o, ht = triton_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ro, rht = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(ht, rht, **TOL)


def test_several_key_and_value_blocks():
    """K = V = 80: three key blocks and three value blocks of 32 in the intra kernel, the last one partial."""
    q, k, v, g, beta, h0 = make(1, 100, 1, 80, 80, 4, gate="lower_bound")
    o, ht, ck = triton_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, checkpoint_positions=[50])
    ro, rht, rck = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           checkpoint_positions=[50])
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(ht, rht, **TOL)
    torch.testing.assert_close(ck, rck, **TOL)


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_half_precision_inputs_use_low_precision_dots(gate):
    """fp16 q/k/v: the off-diagonal intra blocks and X·z, X·(βv) run on fp16 operands (bf16 on the GPU; bf16
    dots are not exact under the interpreter). Compared with the reference on the same rounded inputs."""
    q, k, v, g, beta, h0 = make(1, 150, 2, 32, 16, 5, gate, dtype=torch.float16)
    cps = [37, 128]
    o, ht, ck = triton_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, checkpoint_positions=cps)
    ro, rht, rck = kda_recurrent_reference(q.float(), k.float(), v.float(), g, beta, initial_state=h0,
                                           output_final_state=True, checkpoint_positions=cps)
    assert o.dtype == torch.float16
    for a, b in ((o, ro), (ht, rht), (ck, rck)):
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err < 3e-3, err


def test_length_one_and_empty():
    q, k, v, g, beta, h0 = make(3, 1, 1, 16, 16, 1)
    o, ht = triton_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ro, rht = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(ht, rht, **TOL)
    q, k, v, g, beta, h0 = make(2, 0, 1, 16, 16, 1)
    o, ht, ck = triton_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                             checkpoint_positions=[[0], [0, 0]])
    assert o.shape == (2, 0, 1, 16)
    torch.testing.assert_close(ht, h0)
    torch.testing.assert_close(ck, torch.stack([h0[0], h0[1], h0[1]]))


def test_duplicate_and_unordered_checkpoints_keep_the_order_given():
    q, k, v, g, beta, h0 = make(1, 100, 1, 16, 16, 2)
    cps = [90, 10, 90, 64, 100, 0]
    _, _, ck = triton_chunk(q, k, v, g, beta, initial_state=h0, checkpoint_positions=cps)
    _, _, rck = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, checkpoint_positions=cps)
    torch.testing.assert_close(ck, rck, **TOL)


def test_chunk_plan_cuts_at_checkpoints():
    (NC, start, length, lo, hi, slot), lengths, uniq = build_chunk_plan(
        1, 0, torch.tensor([0, 130, 130, 200]), [(0, 70), (2, 64), (0, 70), (0, 130)], "cpu")
    assert lengths == [130, 0, 70]
    assert start.tolist() == [0, 64, 70, 128, 130, 194]
    assert length.tolist() == [64, 6, 58, 2, 64, 6]
    assert lo.tolist() == [0, 4, 4] and hi.tolist() == [4, 4, 6]
    assert slot.tolist() == [-1, -1, uniq[(0, 70)], -1, -1, uniq[(2, 64)]]


def test_chunk_torch_formulation_matches_reference_fp64():
    q, k, v, g, beta, h0 = make(2, 75, 2, 16, 24, 9, dtype=torch.float64)
    g, beta, h0 = g.double(), beta.double(), h0.double()
    o, ht = kda_chunk_torch(q, k, v, g, beta, initial_state=h0)
    ro, rht = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ht, rht, rtol=1e-10, atol=1e-12)


def test_explicit_triton_refuses_bf16_on_cpu_with_reasons():
    q, k, v, g, beta, _ = make(1, 8, 1, 16, 16, 0, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match="bfloat16"):
        triton_chunk(q, k, v, g, beta)


def test_bad_inputs_raise_naming_the_argument():
    q, k, v, g, beta, h0 = make(1, 8, 1, 16, 16, 0)
    with pytest.raises(ValueError, match="g must be"):
        ops.kda_chunk(q, k, v, g[..., :8], beta)
    with pytest.raises(ValueError, match="initial_state"):
        ops.kda_chunk(q, k, v, g, beta, initial_state=h0[:, :, :8])
    with pytest.raises(TypeError, match="initial_state"):
        ops.kda_chunk(q, k, v, g, beta, initial_state=h0.half())
    with pytest.raises(ValueError, match="checkpoint_positions"):
        ops.kda_chunk(q, k, v, g, beta, checkpoint_positions=[9])
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.kda_chunk(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5]))
