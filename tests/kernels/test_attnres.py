"""AttnRes kernels vs the eager references: fused mix, phase 1, phase 2 (Triton under the interpreter on CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from k3nn import ops
from k3nn.kernels.attnres import triton_mix
from k3nn.kernels.attnres.reference import attnres_phase1_reference, attnres_phase2_reference
from k3nn.kernels.registry import BackendUnavailableError, backend, get_op
from k3nn.layers.attnres import attnres_mix_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Both sides compute in fp32 and round once; a different summation order can move a result by one ulp.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every buffer the Triton wrappers allocate starts as NaN: an element the kernel fails to write shows."""
    def alloc(*shape, dtype=torch.float32, device="cpu"):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_mix, "_alloc", alloc)


def make(shape, dtype, seed, n, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    # Per-source magnitudes differ (as real blocks do): the RMS in the key must cancel them.
    return [(torch.randn(shape, generator=g) * scale * (1 + 3 * torch.rand((), generator=g))).to(dtype)
            for _ in range(n)]


def weights(d, seed, q=None, qscale=1.0):
    g = torch.Generator().manual_seed(seed + 7)
    shape = (d,) if q is None else (q, d)
    return torch.randn(shape, generator=g) * qscale / math.sqrt(d) * 3, 0.5 + torch.rand(shape, generator=g)


shapes = st.tuples(st.lists(st.integers(1, 5), min_size=0, max_size=2), st.integers(1, 200))


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


# ------------------------------------------------------------------------------------------------ fused mix


@given(shp=shapes, S=st.integers(1, 9), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       qscale=st.sampled_from([0.0, 1.0, 10.0]))
def test_mix_matches_eager(shp, S, dtype, seed, qscale):
    lead, d = shp
    note(f"lead={lead} d={d} S={S} dtype={dtype} qscale={qscale}")
    src = make((*lead, d), dtype, seed, S)
    qw, nw = weights(d, seed, qscale=qscale)
    ref = attnres_mix_reference(src, qw, nw, 1e-5)
    with backend("triton"):
        out = ops.attnres_mix(src, qw, nw, 1e-5)
    assert out.dtype == dtype and out.shape == src[0].shape
    close(out, ref, dtype)


def test_mix_single_source_is_identity():
    for dtype in DTYPES:
        (x,) = make((3, 50), dtype, 1, 1)
        qw, nw = weights(50, 1)
        with backend("triton"):
            assert torch.equal(ops.attnres_mix([x], qw, nw), x)


def test_mix_zero_query_is_mean():
    src = make((4, 33), torch.float32, 2, 5)
    with backend("triton"):
        out = ops.attnres_mix(src, torch.zeros(33), torch.ones(33))
    close(out, torch.stack(src).mean(0), torch.float32)


def test_mix_extremes_stay_finite():
    """Huge score spreads (near one-hot softmax), an all-zero source (RMS only from eps), a d=1 row."""
    d = 64
    src = make((2, d), torch.float32, 3, 6, scale=100.0)
    src[2] = torch.zeros(2, d)
    qw, nw = weights(d, 3, qscale=1000.0)
    ref = attnres_mix_reference(src, qw, nw, 1e-5)
    with backend("triton"):
        out = ops.attnres_mix(src, qw, nw)
        one = ops.attnres_mix(make((3, 1), torch.float32, 4, 3), torch.ones(1), torch.ones(1))
    assert torch.isfinite(out).all() and torch.isfinite(one).all()
    close(out, ref, torch.float32)


def test_mix_many_sources_noncontiguous_and_empty():
    d = 40
    base = make((6, 2 * d), torch.float16, 5, 16)
    src = [b[:, ::2] for b in base]  # strided views
    qw, nw = weights(d, 5)
    with backend("triton"):
        out = ops.attnres_mix(src, qw, nw)
        empty = ops.attnres_mix([torch.zeros(0, d)] * 3, qw, nw)
    close(out, attnres_mix_reference(src, qw, nw, 1e-5), torch.float16)
    assert empty.shape == (0, d)


def test_mix_kernel_variants_agree():
    """The tuning knobs (warps, load ring depth, query reload, joined reduction, eviction hint, pinned load
    order, accumulate fence) change the schedule, never the result: bit-identical outputs."""
    for S, d in ((5, 96), (9, 75), (2, 33)):
        src = make((3, d), torch.bfloat16, 8 + S, S)
        qw, nw = weights(d, 8 + S)
        ref = triton_mix.attnres_mix_triton(src, qw, nw)
        for w, pf, rl, jn, od, fn in ((1, 0, False, False, False, 0), (2, 2, True, False, True, 1),
                                       (4, 1, False, True, False, 1), (2, 8, True, True, True, 2),
                                       (2, 3, False, True, True, 1), (1, 4, False, False, False, 2)):
            out = triton_mix.attnres_mix_triton(src, qw, nw, num_warps=w, prefetch=pf, qv_reload=rl, join=jn,
                                                ordered=od, fence=fn, evict=pf % 2 == 0)
            assert torch.equal(out, ref), (S, d, w, pf, rl, jn, od, fn)


@given(S=st.integers(1, 6), d=st.integers(1, 48), n=st.integers(1, 5), grid=st.integers(1, 3),
       prefetch=st.integers(0, 8), warps=st.sampled_from([1, 2]), flags=st.integers(0, 31),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_mix_stream_kernel_matches_row_kernel(S, d, n, grid, prefetch, warps, flags, dtype, seed):
    """The persistent kernel (rows p, p + G, ...; the load ring and the L2 window cross rows) computes the same
    operations as the one-row kernel: bit-identical to it, for any grid, ring depth and knob set (lazy rescale
    included), and close to eager."""
    qv_reload, join, ordered, lazy, store_evict = (bool(flags >> i & 1) for i in range(5))
    note(f"S={S} d={d} n={n} grid={grid} prefetch={prefetch} warps={warps} flags={flags:05b} {dtype}")
    src = make((n, d), dtype, seed, S)
    qw, nw = weights(d, seed)
    ref = triton_mix.attnres_mix_triton(src, qw, nw, join=join)  # (the interpreter sums a joined pair apart)
    out = triton_mix.attnres_mix_triton(src, qw, nw, stream=True, grid=grid, prefetch=prefetch, num_warps=warps,
                                        qv_reload=qv_reload, join=join, ordered=ordered, fence=1 + (flags & 1),
                                        lazy=lazy, store_evict=store_evict, l2_ahead=4)
    assert torch.equal(out, ref)
    close(out, attnres_mix_reference(src, qw, nw, 1e-5), dtype)


def test_mix_named_schedules_agree():
    """Every entry of MIX_SCHEDULES (what bench/gpu/attnres.py times) gives the default's bits, and so does the
    op through the registry; unknown names and knobs are refused."""
    for S, d, n in ((5, 72, 5), (2, 33, 4)):
        src = make((n, d), torch.bfloat16, 20 + S, S)
        qw, nw = weights(d, 20 + S)
        ref = triton_mix.attnres_mix_triton(src, qw, nw)
        for name in triton_mix.MIX_SCHEDULES:
            out = triton_mix.attnres_mix_triton(src, qw, nw, schedule=name, num_warps=2)
            assert torch.equal(out, ref), (S, name)
        with backend("triton"):
            assert torch.equal(ops.attnres_mix(src, qw, nw), ref)
    with pytest.raises(TypeError, match="lazy"):
        triton_mix.attnres_mix_triton(src, qw, nw, lazy=True)  # a stream-kernel knob on the row kernel
    with pytest.raises(KeyError):
        triton_mix.attnres_mix_triton(src, qw, nw, schedule="no-such-schedule")


def test_mix_bf16_weights_and_k3_width_row():
    """bf16 query/gain (as loaded from a checkpoint) at the K3 width 7168 (one padded 8192-lane row)."""
    d = 7168
    src = make((1, d), torch.bfloat16, 6, 3)
    qw, nw = (w.to(torch.bfloat16) for w in weights(d, 6))
    with backend("triton"):
        out = ops.attnres_mix(src, qw, nw)
    close(out, attnres_mix_reference(src, qw, nw, 1e-5), torch.bfloat16)


# ------------------------------------------------------------------------------------------------ phase 1 / 2


@given(shp=shapes, S=st.integers(1, 9), Q=st.integers(1, 5), dtype=st.sampled_from(DTYPES),
       out_dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_phase1_matches_eager(shp, S, Q, dtype, out_dtype, seed):
    lead, d = shp
    note(f"lead={lead} d={d} S={S} Q={Q} dtype={dtype} out_dtype={out_dtype}")
    src = make((*lead, d), dtype, seed, S)
    qw, nw = weights(d, seed, q=Q)
    ref = attnres_phase1_reference(src, qw, nw, 1e-5, out_dtype)
    with backend("triton"):
        o, m, l = ops.attnres_phase1(src, qw, nw, 1e-5, out_dtype)
    assert o.shape == (Q, *lead, d) and o.dtype == out_dtype and m.shape == l.shape == (Q, *lead)
    close(m, ref[1], torch.float32)
    close(l, ref[2], torch.float32)
    close(o, ref[0], out_dtype)
    assert (l >= 1 - 1e-6).all() and (l <= S + 1e-4).all()
    loose = torch.bfloat16 if torch.bfloat16 in (dtype, out_dtype) else dtype
    for q in range(Q):  # o / l is the mix over the stored sources
        close((o[q].float() / l[q, ..., None]).to(dtype), attnres_mix_reference(src, qw[q], nw[q], 1e-5), loose)


@given(shp=shapes, S=st.integers(1, 8), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       has_partial=st.booleans(), has_update=st.booleans(), post=st.booleans(), qscale=st.sampled_from([1.0, 30.0]))
def test_phase2_matches_eager_and_one_softmax(shp, S, dtype, seed, has_partial, has_update, post, qscale):
    lead, d = shp
    note(f"lead={lead} d={d} S={S} dtype={dtype} partial={has_partial} update={has_update} post={post}")
    *stored, partial, update = make((*lead, d), dtype, seed, S + 2)
    partial = partial if has_partial else None
    update = update if has_update else None
    qw, nw = weights(d, seed, q=2, qscale=qscale)
    pw = (0.5 + torch.rand(d, generator=torch.Generator().manual_seed(seed))) if post else None
    o, m, l = attnres_phase1_reference(stored, qw, nw, 1e-5)
    args = (o[1], m[1], l[1], partial, qw[1], nw[1], 1e-5)
    kw = dict(update=update, post_norm_weight=pw, dtype=dtype)
    ref = attnres_phase2_reference(*args, **kw)
    with backend("triton"):
        out = ops.attnres_phase2(*args, **kw)
    assert out.mix.dtype == dtype and out.mix.shape == (*lead, d)
    close(out.mix, ref.mix, dtype)
    if post:
        assert out.normed.dtype == ref.normed.dtype
        close(out.normed, ref.normed, dtype)
    else:
        assert out.normed is None
    if ref.partial is None:
        assert out.partial is None
    else:
        assert torch.equal(out.partial, ref.partial)  # the residual add rounds exactly like torch's
    # Two-phase == one softmax over every source.
    srcs = stored + ([ref.partial] if ref.partial is not None else [])
    close(out.mix, attnres_mix_reference(srcs, qw[1], nw[1], 1e-5), dtype)


def test_phase2_first_sublayer_exact_state():
    """No partial: h = o / l; with one stored source that is the source itself, bit for bit."""
    (x,) = make((3, 20), torch.bfloat16, 9, 1)
    qw, nw = weights(20, 9, q=1)
    with backend("triton"):
        o, m, l = ops.attnres_phase1([x], qw, nw)
        h = ops.attnres_phase2(o[0], m[0], l[0], None, qw[0], nw[0], dtype=torch.bfloat16).mix
    assert torch.equal(h, x) and torch.equal(l[0], torch.ones(3)) and torch.equal(o[0], x.float())


# ------------------------------------------------------------------------------------------------ errors


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(2, 8)
    w = torch.randn(8)
    with pytest.raises(ValueError, match="non-empty"):
        ops.attnres_mix([], w, w)
    with pytest.raises(ValueError, match=r"sources\[1\]"):
        ops.attnres_mix([x, torch.randn(2, 9)], w, w)
    with pytest.raises(ValueError, match=r"sources\[1\]"):
        ops.attnres_mix([x, x.half()], w, w)
    with pytest.raises(TypeError, match="floating"):
        ops.attnres_mix([x.long()], w, w)
    with pytest.raises(TypeError, match=r"sources\[0\]"):
        ops.attnres_mix([x.numpy()], w, w)
    with pytest.raises(ValueError, match="query_weight"):
        ops.attnres_mix([x], torch.randn(7), w)
    with pytest.raises(ValueError, match="eps"):
        ops.attnres_mix([x], w, w, eps=-1.0)
    with pytest.raises(ValueError, match=r"query_weight must be a \[Q, d\]"):
        ops.attnres_phase1([x], w, w)
    with pytest.raises(ValueError, match="norm_weight"):
        ops.attnres_phase1([x], torch.randn(3, 8), torch.randn(2, 8))
    with pytest.raises(TypeError, match="out_dtype"):
        ops.attnres_phase1([x], torch.randn(3, 8), torch.randn(3, 8), out_dtype=torch.int32)
    o, m, l = ops.attnres_phase1([x], torch.randn(3, 8), torch.randn(3, 8))
    with pytest.raises(ValueError, match="m must be float32"):
        ops.attnres_phase2(o[0], m[0].double(), l[0], x, w, w)
    with pytest.raises(ValueError, match="partial"):
        ops.attnres_phase2(o[0], m[0], l[0], torch.randn(3, 8), w, w)
    with pytest.raises(ValueError, match="update dtype"):
        ops.attnres_phase2(o[0], m[0], l[0], x, w, w, update=x.half())
    with pytest.raises(ValueError, match="post_norm_weight"):
        ops.attnres_phase2(o[0], m[0], l[0], x, w, w, post_norm_weight=torch.ones(3))


def test_triton_refusals_list_reasons():
    big = torch.randn(1, triton_mix.MAX_D + 1)
    wb = torch.randn(triton_mix.MAX_D + 1)
    with backend("triton"), pytest.raises(BackendUnavailableError, match="registers"):
        ops.attnres_mix([big], wb, wb)
    x = torch.randn(1, 8)
    w = torch.randn(8)
    with backend("triton"), pytest.raises(BackendUnavailableError, match="sources"):
        ops.attnres_mix([x] * (triton_mix.MAX_SOURCES + 1), w, w)
    with backend("triton"), pytest.raises(BackendUnavailableError, match="float64"):
        ops.attnres_mix([x.double()], w, w)
    # eager still serves every one of them; auto never picks the interpreter
    assert ops.attnres_mix([big], wb, wb).shape == big.shape
    for op in ("attnres_mix", "attnres_phase1", "attnres_phase2"):
        assert {"eager", "triton"} <= set(get_op(op).impls)


def test_stack_queries_feeds_phase1():
    from k3nn.layers.attnres import AttnResQuery, stack_queries

    torch.manual_seed(0)
    mods = [AttnResQuery(16, 1e-5) for _ in range(3)]
    for mo in mods:
        torch.nn.init.normal_(mo.proj.weight)
        torch.nn.init.uniform_(mo.norm.weight, 0.5, 1.5)
    src = make((2, 16), torch.float32, 10, 4)
    w, g, eps = stack_queries(mods)
    with torch.no_grad(), backend("triton"):
        o, m, l = ops.attnres_phase1(src, w, g, eps)
        for i, mo in enumerate(mods):
            close(o[i] / l[i, :, None], mo(src), torch.float32)
    mods[1].norm.eps = 1e-6
    with pytest.raises(ValueError, match="eps"):
        stack_queries(mods)


def test_measured_default_schedules_apply_at_prefill_sizes():
    """Prefill-sized mixes take the stream schedules measured on the H200; decode sizes keep the row kernel;
    MIX_SCHEDULES holds exactly the schedules the default takes."""
    from k3nn.kernels.attnres import triton_mix as tm

    for S, name in ((2, "stream-8w-pf1-l2x4-2cta"), (5, "stream-16w-pf2-l2x4-sec"), (9, "stream-16w-pf2-l2x4-lazy")):
        cfg = tm._mix_schedule(8192, S, {}, 8192)
        assert cfg["stream"] and all(cfg[k] == v for k, v in tm.MIX_SCHEDULES[name].items()), (S, cfg)
        assert not tm._mix_schedule(8192, S, {}, tm.STREAM_MIN_ROWS - 1)["stream"]
    assert not tm._mix_schedule(8192, 65, {}, 8192)["stream"]  # past the last entry: the row kernel
    assert set(tm.MIX_SCHEDULES) == {"default"} | {name for _, name in tm.DEFAULT_SCHEDULES}
