"""DCP merge kernels (Triton, interpreted on CPU) vs their eager references; references vs merge_attn_states."""

import torch
from hypothesis import given, note
from hypothesis import strategies as st

from k3nn.cache.pages import local_seq_lens
from k3nn.kernels.mla.api import default_visible_lens, merge_attn_states
from k3nn.kernels.mla.merge import (dcp_lens, dcp_lens_reference, merge_scale, merge_scale_reference, merge_states,
                                    merge_states_reference)

from conftest import poison


def make_lses(seed, S, B, Tq, H, r, p_empty=0.3):
    """Random partial (o, lse): some entries −inf (empty shard, o NaN garbage there), row (0, 0, 0) empty
    on every part, one NaN lse."""
    g = torch.Generator().manual_seed(seed)
    lses = torch.randn(S, B, Tq, H, generator=g) * 4
    empty = torch.rand(S, B, Tq, H, generator=g) < p_empty
    empty[:, 0, 0, 0] = True
    lses[empty] = float("-inf")
    if S > 1 and H > 1:
        lses[S - 1, B - 1, Tq - 1, H - 1] = float("nan")
        empty[S - 1, B - 1, Tq - 1, H - 1] = True
    outs = torch.randn(S, B, Tq, H, r, generator=g)
    outs[empty] = float("nan")
    return outs, lses


@given(S=st.integers(1, 4), B=st.integers(1, 3), Tq=st.integers(1, 3), H=st.sampled_from([1, 2, 4, 8]),
       r=st.sampled_from([8, 16, 40]), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_merge_scale_matches_reference(S, B, Tq, H, r, seed, data):
    groups = data.draw(st.sampled_from([d for d in (1, 2, 4) if H % d == 0]))
    index = data.draw(st.integers(0, S - 1))
    lse_group = data.draw(st.integers(0, groups - 1))
    note(f"S={S} B={B} Tq={Tq} H={H} r={r} groups={groups} index={index} lse_group={lse_group}")
    outs, lses = make_lses(seed, S, B, Tq, H, r)
    o = outs[index]
    want_p, want_l = merge_scale_reference(lses, o, index, groups, lse_group)
    out = (poison(groups, B, Tq, H // groups, r), poison(B, Tq, H // groups))
    got_p, got_l = merge_scale(lses, o, index, groups, lse_group, out=out)
    assert got_p is out[0] and got_l is out[1]
    assert not got_p.isnan().any() and not got_l.isnan().any()
    torch.testing.assert_close(got_p, want_p, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_l, want_l, atol=1e-5, rtol=1e-5)
    # summing every rank's scaled part gives merge_attn_states (the DCP reduce-scatter)
    full = sum(merge_scale_reference(lses, outs[s], s, 1, 0)[0][0] for s in range(S))
    o_ref, lse_ref = merge_attn_states(outs, lses)
    torch.testing.assert_close(full, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merge_scale_reference(lses, o, index)[1], lse_ref, atol=1e-6, rtol=1e-6)


@given(S=st.integers(1, 4), B=st.integers(1, 3), Tq=st.integers(1, 3), H=st.sampled_from([1, 3, 8]),
       r=st.sampled_from([8, 16, 40]), seed=st.integers(0, 2**31 - 1))
def test_merge_states_matches_reference(S, B, Tq, H, r, seed):
    note(f"S={S} B={B} Tq={Tq} H={H} r={r}")
    outs, lses = make_lses(seed, S, B, Tq, H, r)
    want_o, want_l = merge_states_reference(outs, lses)
    out = (poison(B, Tq, H, r), poison(B, Tq, H))
    got_o, got_l = merge_states(outs, lses, out=out)
    assert got_o is out[0] and not got_o.isnan().any() and not got_l.isnan().any()
    torch.testing.assert_close(got_o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_l, want_l, atol=1e-5, rtol=1e-5)
    o_ref, lse_ref = merge_attn_states(outs, lses)
    torch.testing.assert_close(want_o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(want_l, lse_ref, atol=1e-6, rtol=1e-6)


def test_merge_all_empty_and_fp16():
    """Every part empty: o = 0, lse = −inf, no NaN; fp16 partial outputs are read as fp32."""
    lses = torch.full((3, 1, 1, 2), float("-inf"))
    outs = torch.full((3, 1, 1, 2, 16), float("nan"))
    p, l = merge_scale(lses, outs[1], 1, 2, 1)
    assert torch.equal(p, torch.zeros_like(p)) and torch.isneginf(l).all()
    o, l = merge_states(outs, lses)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(l).all()
    outs16, lses = make_lses(3, 2, 2, 1, 4, 16)
    torch.testing.assert_close(merge_states(outs16.half(), lses)[0],
                               merge_states_reference(outs16.half(), lses)[0], atol=1e-5, rtol=1e-5)


@given(W=st.integers(1, 4), I=st.sampled_from([1, 2, 3]), Tq=st.integers(1, 4),
       lens=st.lists(st.integers(0, 200), min_size=1, max_size=5), data=st.data())
def test_dcp_lens(W, I, Tq, lens, data):
    rank = data.draw(st.integers(0, W - 1))
    sl = torch.tensor(lens, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    want_local = local_seq_lens(sl, W, rank, I).to(torch.int32)
    want_vis = local_seq_lens(default_visible_lens(sl, Tq), W, rank, I).to(torch.int32)
    loc, vis = dcp_lens_reference(sl, Tq, W, rank, I)
    assert torch.equal(loc, want_local) and torch.equal(vis, want_vis)
    out = (torch.full((len(lens),), -7, dtype=torch.int32), torch.full((len(lens), Tq), -7, dtype=torch.int32))
    loc, vis = dcp_lens(sl, Tq, W, rank, I, out=out)
    assert loc is out[0] and torch.equal(loc, want_local) and torch.equal(vis, want_vis)
