"""KDA state after a rolled-back verify window == the state of never having seen the rejected tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3nn import ops
from k3nn.cache.hybrid import KDAState
from k3nn.config import KimiK3Config
from k3nn.model import KimiK3
from k3nn.spec import WindowRollback, rollback_memory_bytes

from .helpers import tiny_target


def _dyadic_kda_model(dtype=torch.float32) -> KimiK3:
    """One KDA layer whose input projections and conv kernels are multiples of 1/16: with inputs on a 1/4 grid
    every projection and conv sum is exact in fp32, so results cannot depend on how many rows a kernel
    processes."""
    cfg = KimiK3Config.tiny(num_hidden_layers=1, mla_layers=[], use_attn_res=False)
    model = KimiK3(cfg, dtype=dtype, backend="eager", seed=0)
    kda = model.model.layers[0].self_attn
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj"):
            w = getattr(kda, name).weight
            w.copy_((w * 64).round() / 16)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            w = getattr(kda, name).weight
            w.copy_((w * 16).round() / 16)
    return model


def _dyadic(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4).round().div(4).to(dtype)


def _run_window(model, strategy, B, P, T, acc, seed):
    """Prefill P inputs, run a T-token window through the KDA layer with ``strategy``, commit ``acc``."""
    kda = model.model.layers[0].self_attn
    d = model.config.hidden_size
    x_pre, x_win = _dyadic((B, P, d), seed), _dyadic((B, T, d), seed + 1)
    cache = model.new_cache(B, P + T + 1)
    with WindowRollback(model, cache, strategy) as rb:
        state = cache.layers[0]
        cache.begin(P, None)
        kda(x_pre, state)
        cache.commit(P, None)
        before = (state.recurrent.clone(), state.conv.clone())
        rb.begin()
        cache.begin(T, None)
        kda(x_win, state, checkpoint_positions=rb.checkpoint_positions(T))
        cache.commit(T, None)
        rb.commit(torch.tensor(acc))
    return cache, before, x_win


@pytest.mark.parametrize("strategy", ["replay", "slots"])
@given(data=st.data())
def test_window_rollback_bit_exact_per_row(strategy, data):
    """Rows accepting different counts: each row's state equals the state of having seen only its accepted
    prefix.

    slots: the exported state equals the KDA op over the window's own inputs truncated to the prefix, and the
    conv state equals the last W−1 pre-conv inputs of [history; prefix] (exact: dyadic projections).
    replay: equals running the layer on the accepted prefix from the committed state, rows batched by accepted
    count as the rebuild does (L2-norm reductions may round differently for other row counts)."""
    B = data.draw(st.integers(1, 3), label="B")
    T = data.draw(st.integers(1, 5), label="T")
    P = data.draw(st.integers(1, 6), label="P")
    acc = data.draw(st.lists(st.integers(1, T), min_size=B, max_size=B), label="acc")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    model = _dyadic_kda_model()
    kda = model.model.layers[0].self_attn
    cache, (rec0, conv0), x_win = _run_window(model, strategy, B, P, T, acc, seed)
    state = cache.layers[0]
    if strategy == "slots":
        q, k, v, g, beta, _ = kda.project(x_win, conv0)  # what the verify pass fed the KDA op
        raw = torch.cat([kda.q_proj(x_win), kda.k_proj(x_win), kda.v_proj(x_win)], -1)
        for b, a in enumerate(acc):
            r = slice(b, b + 1)
            # the op over the truncated inputs, exporting at the same positions as the verify pass (so the
            # chunked eager form cuts its segments at the same places: bit-exact, not just close)
            fn = ops.kda_recurrent if T == 1 else ops.kda_chunk  # the op the layer used for this window
            want = fn(q[r, :a], k[r, :a], v[r, :a], g[r, :a], beta[r, :a], initial_state=rec0[r],
                      output_final_state=True, checkpoint_positions=[list(range(1, a + 1))])[1]
            assert torch.equal(state.recurrent[b], want[0]), (b, a)
            conv = torch.cat([conv0[b], raw[b, :a]], 0)[-conv0.shape[1]:]
            assert torch.equal(state.conv[b], conv), (b, a)
    else:
        for a in set(acc):
            rows = [b for b in range(B) if acc[b] == a]
            run = list(range(B)) if a == T else rows  # fully accepted rows keep the window pass's own state
            fresh = KDAState(rec0[run].clone(), conv0[run].clone())
            kda(x_win[run, :a], fresh)
            sel = [run.index(b) for b in rows]
            assert torch.equal(state.recurrent[rows], fresh.recurrent[sel]), (rows, a)
            assert torch.equal(state.conv[rows], fresh.conv[sel]), (rows, a)
    assert cache.seen_tokens == P + max(acc)
    assert cache.valid_counts.tolist() == [P + a for a in acc]


@given(T=st.integers(1, 5), a=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_replay_bit_exact_with_generic_weights(T, a, seed):
    """ReplaySSM rebuilds with the layer itself on the same rows: bit-exact without any special weights."""
    _replay_generic(T, min(a, T), seed)


@pytest.mark.parametrize("a", [1, 9, 18])
def test_replay_long_window_chunk_path(a):
    """A window longer than the fused decode limit goes through the chunked op (not in place)."""
    _replay_generic(18, a, 7)


def _replay_generic(T, a, seed):
    cfg = KimiK3Config.tiny(num_hidden_layers=1, mla_layers=[], use_attn_res=False)
    model = KimiK3(cfg, backend="eager", seed=1)
    kda = model.model.layers[0].self_attn
    B, P, d = 2, 3, cfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    x_pre, x_win = torch.randn(B, P, d, generator=g), torch.randn(B, T, d, generator=g)
    cache = model.new_cache(B, P + T)
    with WindowRollback(model, cache, "replay") as rb:
        state = cache.layers[0]
        cache.begin(P, None)
        kda(x_pre, state)
        cache.commit(P, None)
        fresh = KDAState(state.recurrent.clone(), state.conv.clone())
        rb.begin()
        cache.begin(T, None)
        kda(x_win, state)
        cache.commit(T, None)
        rb.commit(torch.tensor([a, a]))
    kda(x_win[:, :a], fresh)
    assert torch.equal(state.recurrent, fresh.recurrent) and torch.equal(state.conv, fresh.conv)


@pytest.mark.parametrize("strategy", ["replay", "slots"])
def test_rejected_window_leaves_no_trace_in_the_model(strategy):
    """Whole model: a window whose drafts are all rejected, then the next token, gives the logits of a cache
    that only ever saw the pending token (KDA state rolled back, MLA entries masked, positions kept)."""
    model = tiny_target()
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 255, (2, 5), generator=g)
    window = torch.randint(0, 255, (2, 4), generator=g)
    nxt = torch.randint(0, 255, (2, 1), generator=g)
    c1 = model.new_cache(2, 16)
    with WindowRollback(model, c1, strategy) as rb:
        model(prompt, cache=c1)
        rb.begin()
        model(window, cache=c1, checkpoint_positions=rb.checkpoint_positions(4))
        rb.commit(torch.tensor([1, 3]))
        # row 0 kept only window[0]; row 1 kept window[:3]; feed each row's next token
        la = model(nxt, cache=c1).logits[:, -1]
    for b, keep in enumerate([1, 3]):
        c = model.new_cache(1, 16)
        model(prompt[b:b + 1], cache=c)
        lb = model(torch.cat([window[b:b + 1, :keep], nxt[b:b + 1]], 1), cache=c).logits[:, -1]
        torch.testing.assert_close(la[b:b + 1], lb, rtol=1e-4, atol=1e-5)
    assert c1.key_mask[0, 5:9].tolist() == [True, False, False, True]  # hole where row 0 rejected, then nxt


def test_memory_accounting():
    cfg = KimiK3Config.k3()
    n_kda, H, D = len(cfg.kda_layers), cfg.kda_num_heads, cfg.kda_head_dim
    state = H * D * D * 4
    slots = rollback_memory_bytes(cfg, 7, strategy="slots")
    replay = rollback_memory_bytes(cfg, 7, strategy="replay")
    assert slots["committed"] == replay["committed"] == n_kda * (state + 3 * 3 * H * D * 2)
    assert slots["extra"] == n_kda * (9 * state + 8 * cfg.hidden_size * 2)
    assert replay["extra"] == n_kda * (state + 8 * cfg.hidden_size * 2)
    assert slots["extra"] > 7 * replay["extra"]
    assert rollback_memory_bytes(cfg, 7, batch_size=4)["extra"] == 4 * replay["extra"]
    with pytest.raises(ValueError, match="strategy"):
        rollback_memory_bytes(cfg, 7, strategy="copy")


def test_commit_rejects_bad_counts():
    model = tiny_target()
    cache = model.new_cache(1, 8)
    with WindowRollback(model, cache) as rb:
        model(torch.tensor([[1, 2]]), cache=cache)
        rb.begin()
        model(torch.tensor([[3, 4, 5]]), cache=cache)
        with pytest.raises(ValueError, match="accepted"):
            rb.commit(torch.tensor([4]))
    with pytest.raises(ValueError, match="strategy"):
        WindowRollback(model, model.new_cache(1, 4), "snapshot")


@given(B=st.integers(1, 3), T=st.integers(1, 5), data=st.data(), seed=st.integers(0, 2**16))
def test_read_only_window_fused_commit_equals_forward_over_kept_tokens(B, T, data, seed):
    """The graph-safe window of the static speculative round: the fused op reads the committed state without
    writing it, then :meth:`WindowRollback.fused_commit` folds each row's kept prefix (0 = row left alone) into it.
    Every row ends where a forward over its kept tokens alone ends (the fused op in both, so close to rounding)."""
    keep = data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B), label="keep")
    cfg = KimiK3Config.tiny(num_hidden_layers=1, mla_layers=[], use_attn_res=False)
    model = KimiK3(cfg, backend="eager", seed=1)
    kda = model.model.layers[0].self_attn
    P, d = 3, cfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    x_pre, x_win = torch.randn(B, P, d, generator=g), torch.randn(B, T, d, generator=g)
    cache = model.new_cache(B, P + T)
    with WindowRollback(model, cache, "replay") as rb:
        assert rb.fused_window(T)
        state = cache.layers[0]
        cache.begin(P, None)
        kda(x_pre, state)
        cache.commit(P, None)
        rec0, conv0 = state.recurrent.clone(), state.conv.clone()
        rb.begin_static(fused=True)
        y = kda(x_win, state)
        assert torch.equal(state.recurrent, rec0) and torch.equal(state.conv, conv0)  # read, not written
        refs = rb.end_static()
        rb.fused_commit(torch.tensor(keep), refs)
    for b, a in enumerate(keep):
        if a == 0:
            assert torch.equal(state.recurrent[b], rec0[b]) and torch.equal(state.conv[b], conv0[b])
            continue
        fresh = KDAState(rec0[b:b + 1].clone(), conv0[b:b + 1].clone())
        y_ref = kda(x_win[b:b + 1, :a], fresh)
        torch.testing.assert_close(state.recurrent[b:b + 1], fresh.recurrent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state.conv[b:b + 1], fresh.conv, rtol=1e-5, atol=1e-5)  # projections of 1 vs B rows
        torch.testing.assert_close(y[b:b + 1, :a], y_ref, rtol=1e-5, atol=1e-5)
