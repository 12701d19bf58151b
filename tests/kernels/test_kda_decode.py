"""Fused KDA decode (Triton under the interpreter, fp32) against its eager reference, and the layer wiring."""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import k3nn
from k3nn import KimiK3Config, ops
from k3nn.cache.hybrid import KDAState
from k3nn.layers.kda import KimiDeltaAttention


def make(B, T, H, D, W, N, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    C = H * D
    args = [r(B, T, 3 * C).to(dtype), r(B, T, C).to(dtype), r(B, T, H).to(dtype), r(B, T, C).to(dtype),
            (r(3 * C, W) * 0.5).to(dtype), r(H) * 0.5, r(C), r(D)]
    S = r(N, H, D, D) * 0.3
    cs = r(N, W - 1, 3 * C).to(dtype)
    idx = torch.randperm(N, generator=gen)[:B]
    return args, S, cs, idx


def run(backend, args, S, cs, idx, **kw):
    S, cs = S.clone(), cs.clone()
    with k3nn.backend(backend):
        y = ops.kda_fused_decode(*args, S, cs, idx, **kw)
    return y, S, cs


@given(B=st.integers(1, 3), T=st.integers(1, 4), H=st.integers(1, 2), D=st.sampled_from([16, 48, 24, 64]),
       W=st.integers(2, 4), gate=st.sampled_from(["softplus", "lower_bound"]), extra=st.integers(0, 2),
       use_idx=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_fused_decode_matches_eager(B, T, H, D, W, gate, extra, use_idx, seed):
    note(f"B={B} T={T} H={H} D={D} W={W} gate={gate} N={B + extra} idx={use_idx}")
    args, S, cs, idx = make(B, T, H, D, W, B + extra, seed)
    idx = idx.to(torch.int32) if use_idx else None
    kw = dict(gate_kind=gate, lower_bound=-3.0, norm_eps=1e-5)
    y1, S1, c1 = run("eager", args, S, cs, idx, **kw)
    y2, S2, c2 = run("triton", args, S, cs, idx, **kw)
    torch.testing.assert_close(y2, y1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S2, S1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c2, c1)
    used = idx.long() if idx is not None else torch.arange(B)
    unused = torch.ones(B + extra, dtype=torch.bool)
    unused[used] = False
    assert torch.equal(S2[unused], S[unused]) and torch.equal(c2[unused], cs[unused])  # other slots untouched


@given(B=st.integers(1, 3), T=st.integers(1, 4), D=st.sampled_from([16, 48]), W=st.integers(2, 4),
       pad=st.integers(0, 2), seed=st.integers(0, 2 ** 16))
def test_num_tokens_and_padding_rows(B, T, D, W, pad, seed):
    """Row b feeds its first num_tokens[b] tokens (0..T); rows with slot -1 are padding: zero output, no state
    touched; rows with write_state False leave their state as it was. Triton equals eager, and the state equals a
    call over the fed tokens alone."""
    H = 2
    note(f"B={B} T={T} D={D} W={W} pad={pad}")
    args, S, cs, idx = make(B + pad, T, H, D, W, B + 1, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    n = torch.randint(0, T + 1, (B + pad,), generator=gen, dtype=torch.int32)
    idx = torch.cat([torch.randperm(B + 1, generator=gen)[:B], torch.full((pad,), -1)]).to(torch.int32)
    wr = torch.rand(B + pad, generator=gen) < 0.7
    kw = dict(gate_kind="lower_bound", lower_bound=-3.0, num_tokens=n, write_state=wr)
    y1, S1, c1 = run("eager", args, S, cs, idx, **kw)
    y2, S2, c2 = run("triton", args, S, cs, idx, **kw)
    live = idx >= 0
    torch.testing.assert_close(S2, S1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c2, c1)
    fed = (torch.arange(T)[None, :] < n[:, None]) & live[:, None]  # outputs past a row's count are unspecified
    torch.testing.assert_close(y2[fed], y1[fed], rtol=1e-4, atol=1e-5)
    assert torch.equal(y2[~live], torch.zeros_like(y2[~live])) and torch.isfinite(y2).all()
    for b in range(B):  # the state after num_tokens[b] tokens is that of a call fed only those tokens
        k = int(n[b])
        if k == 0 or not wr[b]:
            assert torch.equal(S1[idx[b]], S[idx[b]]) and torch.equal(c1[idx[b]], cs[idx[b]])
            continue
        one = [a[b:b + 1, :k] if a.dim() == 3 and a.shape[1] == T else a for a in args]
        _, Sr, cr = run("eager", one, S, cs, idx[b:b + 1], gate_kind="lower_bound", lower_bound=-3.0)
        torch.testing.assert_close(S1[idx[b]], Sr[idx[b]])
        torch.testing.assert_close(c1[idx[b]], cr[idx[b]])
    untouched = torch.ones(B + 1, dtype=torch.bool)
    untouched[idx[live].long()] = False
    assert torch.equal(S2[untouched], S[untouched]) and torch.equal(c2[untouched], cs[untouched])


@pytest.mark.parametrize("D", [48, 128])
def test_split_heads_finish_in_the_last_program(D):
    """D > 32: each request-head is split over D/32 programs; the last one normalises and rewrites the conv state."""
    args, S, cs, idx = make(2, 2, 1, D, 4, 3, D)
    for _ in range(2):  # twice: the arrival counters must be back at zero after a call
        y1, S1, c1 = run("eager", args, S, cs, idx, gate_kind="lower_bound")
        y2, S2, c2 = run("triton", args, S, cs, idx, gate_kind="lower_bound")
        torch.testing.assert_close(y2, y1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(S2, S1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c2, c1)


def test_large_gate_inputs_stay_finite():
    args, S, cs, idx = make(2, 2, 2, 16, 4, 2, 5)
    args[1] = args[1] * 50  # softplus threshold branch and saturated sigmoid
    for gate in ("softplus", "lower_bound"):
        y1, S1, _ = run("eager", args, S, cs, idx, gate_kind=gate)
        y2, S2, _ = run("triton", args, S, cs, idx, gate_kind=gate)
        assert torch.isfinite(y2).all()
        torch.testing.assert_close(y2, y1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(S2, S1, rtol=1e-4, atol=1e-5)


def test_decode_steps_equal_one_chunked_pass():
    """T steps of fused decode from a state == the chunk op over the same tokens (layer maths, fp64 eager)."""
    cfg = KimiK3Config.tiny()
    layer = KimiDeltaAttention(cfg).double()
    layer.reset_gate_parameters(torch.Generator().manual_seed(0))
    x = torch.randn(2, 7, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    H, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    fresh = lambda: KDAState(torch.zeros(2, H, D, D, dtype=torch.float64),  # noqa: E731
                             torch.zeros(2, W - 1, 3 * H * D, dtype=torch.float64))
    with torch.no_grad(), k3nn.backend("eager"):
        layer.fused_decode_max_tokens = 0
        s_ref = fresh()
        y_ref = layer(x, s_ref)
        layer.fused_decode_max_tokens = 16
        s = fresh()
        ys = [layer(x[:, :3], s)] + [layer(x[:, t:t + 1], s) for t in range(3, 7)]
    torch.testing.assert_close(torch.cat(ys, 1), y_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s.recurrent, s_ref.recurrent, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s.conv, s_ref.conv)


def test_layer_decode_triton_equals_eager():
    cfg = KimiK3Config.tiny()
    layer = KimiDeltaAttention(cfg)
    layer.reset_gate_parameters(torch.Generator().manual_seed(0))
    H, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    x = torch.randn(2, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    st0 = KDAState(torch.randn(2, H, D, D) * 0.1, torch.randn(2, W - 1, 3 * H * D))
    outs = []
    for b in ("eager", "triton"):
        s = KDAState(st0.recurrent.clone(), st0.conv.clone())
        with torch.no_grad(), k3nn.backend(b):
            outs.append((layer(x, s), s))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[1][1].recurrent, outs[0][1].recurrent, rtol=1e-4, atol=1e-5)


def test_bad_inputs_raise_naming_the_argument():
    args, S, cs, idx = make(2, 1, 2, 16, 4, 3, 0)
    with pytest.raises(ValueError, match="qkv"):
        ops.kda_fused_decode(args[0][..., :-1], *args[1:], S, cs, idx)
    with pytest.raises(ValueError, match="dt_bias"):
        ops.kda_fused_decode(*args[:6], args[6][:-1], args[7], S, cs, idx)
    with pytest.raises(ValueError, match="conv_state"):
        ops.kda_fused_decode(*args, S, cs[:, :1], idx)
    with pytest.raises(ValueError, match="recurrent_state"):
        ops.kda_fused_decode(*args, S[:, :1], cs, idx)
    with pytest.raises(ValueError, match="state_indices"):
        ops.kda_fused_decode(*args, S, cs, torch.tensor([0, 3]))
    with pytest.raises(TypeError, match="state_indices"):
        ops.kda_fused_decode(*args, S, cs, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="gate_kind"):
        ops.kda_fused_decode(*args, S, cs, idx, gate_kind="relu")
    with pytest.raises(ValueError, match="N=1 < B=2"):
        ops.kda_fused_decode(*args, S[:1], cs[:1])


def test_cuda_backend_is_not_implemented():
    from k3nn.kernels.registry import BackendUnavailableError, available_backends

    assert available_backends()["kda_fused_decode"]["cuda"] == "not implemented"
    args, S, cs, idx = make(1, 1, 1, 16, 4, 1, 0)
    with pytest.raises(BackendUnavailableError, match="backend 'cuda' is not implemented"), k3nn.backend("cuda"):
        ops.kda_fused_decode(*args, S, cs, idx)


# -- the two Triton paths: one program per request-head (`head`) and split V blocks with an arrival counter ------
def _check_path(B, T, H, D, W, N, seed, gate="lower_bound"):
    args, S, cs, idx = make(B, T, H, D, W, N, seed)
    idx = idx.to(torch.int32)
    kw = dict(gate_kind=gate, lower_bound=-3.0, norm_eps=1e-5)
    y1, S1, c1 = run("eager", args, S, cs, idx, **kw)
    y2, S2, c2 = run("triton", args, S, cs, idx, **kw)
    torch.testing.assert_close(y2, y1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S2, S1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c2, c1)
    unused = torch.ones(N, dtype=torch.bool)
    unused[idx.long()] = False
    assert torch.equal(S2[unused], S[unused]) and torch.equal(c2[unused], cs[unused])


def test_decode_plan_dispatches_on_batch_times_heads():
    from k3nn.kernels.kda.triton_decode import decode_plan
    from k3nn.kernels.registry import current_tuning, tuning

    head_min = current_tuning().kda_decode_head_min
    assert head_min == 256
    assert decode_plan(1, 96, 128) == ("split", 32, 4)
    assert decode_plan(64, 96, 128) == ("head", 64, 4)
    assert decode_plan(head_min, 1, 48) == ("head", 64, 4) and decode_plan(head_min - 1, 1, 48)[0] == "split"
    assert decode_plan(head_min, 1, 16)[1] == 16 and decode_plan(1, 1, 24) == ("split", 32, 4)
    with tuning(kda_decode_head_min=1):
        assert decode_plan(1, 1, 128) == ("head", 64, 4)
    with tuning(kda_decode_head_min=10 ** 9):
        assert decode_plan(1024, 96, 128) == ("split", 32, 4)
    assert current_tuning().kda_decode_head_min == head_min  # restored on exit
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="kda_decode_head_min"):
            with tuning(kda_decode_head_min=bad):
                pass
    with pytest.raises(TypeError, match="unknown field.*kda_decode_path"):
        with tuning(kda_decode_path="head"):
            pass


@pytest.mark.parametrize("T", [1, 3])
def test_head_path_taken_at_large_batch_times_heads(T):
    """B·H >= the threshold: the head kernel (one program per request-head, no counter), shuffled slots,
    T = 1 and 3. The threshold is lowered through the tuning object so that the interpreted grid stays small."""
    from k3nn.kernels.kda.triton_decode import decode_plan
    from k3nn.kernels.registry import tuning

    B, H = 4, 2
    with tuning(kda_decode_head_min=8):
        assert decode_plan(B, H, 32)[0] == "head" and decode_plan(B, 1, 32)[0] == "split"
        _check_path(B, T, H, 32, 4, B + 5, 100 + T, gate="softplus")


def _forced(path):
    from k3nn.kernels.registry import tuning

    return tuning(kda_decode_head_min=0 if path == "head" else 10 ** 9)


@pytest.mark.parametrize("path", ["head", "split"])
@pytest.mark.parametrize("T", [1, 3])
def test_each_path_matches_eager_at_head_dim_128(path, T):
    """D = 128: the head streamed in two [128, 64] chunks, or split into four [128, 32] column blocks."""
    with _forced(path):
        for _ in range(2):  # twice: split-path counters must be back at zero after a call
            _check_path(2, T, 2, 128, 4, 5, T + 7)


@pytest.mark.parametrize("path,D,W", [("head", 48, 4), ("head", 24, 3), ("split", 48, 2), ("split", 24, 4)])
def test_paths_with_head_dim_not_a_power_of_two(path, D, W):
    """Masked heads: one masked [64, 64] / [32, 32] head chunk, or masked split column blocks."""
    with _forced(path):
        for T in (1, 2):
            _check_path(3, T, 2, D, W, 4, D + T, gate="softplus")


def test_default_order_and_cache_hints():
    """Heads of one request launched together; very large batches drop the store hint."""
    from k3nn.kernels.kda.triton_decode import EVICT_LOAD_ONLY_MIN, _order_and_hints

    assert _order_and_hints(64, 96) == (True, dict(LD_EV="evict_first", ST_EV="evict_first"))
    assert _order_and_hints(EVICT_LOAD_ONLY_MIN, 1) == (True, dict(LD_EV="evict_first", ST_EV=""))
    assert not _order_and_hints(65536, 1)[0]  # more requests than the grid's second axis holds: batch first


def test_head_path_with_d32_chunks_matches_eager():
    """D = 32 on the head path: [32, 32] chunks over 4 warps, the tile that gets the register cap on the GPU
    (ignored by the interpreter), whole head in registers."""
    from k3nn.kernels.kda.triton_decode import decode_plan

    assert decode_plan(300, 1, 32) == ("head", 32, 4)
    with _forced("head"):
        _check_path(2, 1, 2, 32, 4, 5, 60)
        _check_path(2, 2, 1, 32, 3, 3, 61, gate="softplus")
