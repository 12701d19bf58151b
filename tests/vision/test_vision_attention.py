"""The vision tower's fast paths against their references on the CPU: the complex-product rotation against
``apply_rope_2d``, SDPA over equal-length images (no gather) and over mixed lengths against the eager attention, the
flash backend's call into the varlen kernel (arguments checked against a stand-in for the kernel that computes the
reference), ``"auto"`` falling back off CUDA, and the whole tower with every backend on several images of different
grid sizes."""

from unittest import mock

import pytest
import torch
from hypothesis import given, strategies as st

from k3nn import KimiK3ForConditionalGeneration, MultimodalConfig
from k3nn.vision import Segments, apply_rope_2d, flash_unsupported, rope_2d_angles, rope_2d_cis, rotate_pairs
from k3nn.vision import attention as attn
from k3nn.vision.attention import resolve_backend, varlen_attention

from .helpers import rel

grids = st.lists(st.tuples(st.integers(1, 2), st.integers(1, 5).map(lambda x: 2 * x),
                           st.integers(1, 5).map(lambda x: 2 * x)), min_size=1, max_size=4)


def _qkv(g, L, H, D, dtype=torch.float32):
    """q, k, v as the tower makes them: strided views into one [L, 3, H, D] projection."""
    qkv = torch.randn(L, 3, H, D, generator=g).to(dtype)
    return qkv[:, 0], qkv[:, 1], qkv[:, 2]


@given(grid=grids, heads=st.integers(1, 4), dim=st.sampled_from([8, 16, 72]), seed=st.integers(0, 2**16))
def test_rotate_pairs_equals_the_reference_rotation(grid, heads, dim, seed):
    g = torch.Generator().manual_seed(seed)
    grid_t = torch.tensor(grid)
    ang = rope_2d_angles(grid_t, dim, theta=10000.0)
    L = ang.shape[0]
    qkv = torch.randn(L, 3, heads, dim, generator=g)
    qk = qkv[:, :2].transpose(0, 1)  # [2, L, H, D] strided, as in the tower
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 8e-3)):  # bf16: ≤ 1 ulp after the same fp32 math
        x = qk.to(dtype)
        q, k = rotate_pairs(x, rope_2d_cis(ang))
        assert q.dtype == dtype and q.is_contiguous() and k.is_contiguous()
        torch.testing.assert_close(q, apply_rope_2d(x[0], ang), atol=tol, rtol=tol)
        torch.testing.assert_close(k, apply_rope_2d(x[1], ang), atol=tol, rtol=tol)
    one = qkv[:, 1]  # a single [L, H, D] view
    torch.testing.assert_close(rotate_pairs(one, rope_2d_cis(ang)), apply_rope_2d(one, ang), atol=2e-6, rtol=2e-6)


@given(n=st.integers(1, 30), count=st.integers(1, 4), empties=st.integers(0, 2), heads=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_sdpa_over_equal_length_images_matches_eager(n, count, empties, heads, seed):
    """Every image the same length (zero-length segments around them): SDPA reads the packed tensors as a batch."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(g, n * count, heads, 16)
    bounds = [0] * (1 + empties) + [n * (i + 1) for i in range(count)]
    seg = Segments.from_bounds(bounds)
    ref = varlen_attention(q, k, v, seg, backend="eager")
    out = varlen_attention(q, k, v, seg, backend="sdpa")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_segments_and_cu_seqlens_give_the_same_attention(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths)
    q, k, v = _qkv(g, L, 2, 8)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    seg = Segments.from_bounds(bounds)
    assert seg.max_len == max(lengths) and seg.cu_seqlens.dtype == torch.int32 and seg.total == L
    for backend in ("eager", "sdpa", "auto"):
        a = varlen_attention(q, k, v, seg, backend=backend)
        b = varlen_attention(q, k, v, torch.tensor(bounds), backend=backend)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _stand_in_flash(calls):
    """The varlen kernel's contract written out: (q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, scale)
    → (out, lse, ...), bidirectional attention within each cu_q / cu_k segment."""

    def op(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None):
        calls.append(dict(cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, dropout_p=dropout_p, is_causal=is_causal,
                          debug=return_debug_mask, scale=scale, strides=(q.stride(), k.stride(), v.stride())))
        seg = Segments(tuple(cu_q.tolist()), cu_q, max_q)
        return attn._eager(q, k, v, seg, scale), None, None, None, None

    return op


@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=5), scale=st.sampled_from([None, 0.3]),
       seed=st.integers(0, 2**16))
def test_flash_backend_calls_the_varlen_kernel_once_over_the_packed_batch(lengths, scale, seed):
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths)
    q, k, v = _qkv(g, L, 2, 16)
    seg = Segments.from_bounds([0, *torch.tensor(lengths).cumsum(0).tolist()])
    calls = []
    with mock.patch.object(attn, "_flash_op", lambda: _stand_in_flash(calls)), \
            mock.patch.object(attn, "flash_unsupported", lambda q, k, v: None):
        out = varlen_attention(q, k, v, seg, scale, backend="flash")
    ref = varlen_attention(q, k, v, seg, scale, backend="eager")
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    if max(lengths) == 0:
        assert calls == []
        return
    (c,) = calls
    assert c["cu_q"] is c["cu_k"] and c["cu_q"].dtype == torch.int32 and c["cu_q"].tolist() == list(seg.bounds)
    assert (c["max_q"], c["max_k"]) == (max(lengths), max(lengths))
    assert (c["dropout_p"], c["is_causal"], c["debug"]) == (0.0, False, False)
    assert c["scale"] == (16 ** -0.5 if scale is None else scale)
    assert all(st == (16 * 2, 16, 1) for st in c["strides"])  # dense [L, H, D] rows go to the kernel


def test_flash_is_refused_off_cuda_and_auto_falls_back():
    q = torch.randn(10, 2, 8)
    assert "cpu" in flash_unsupported(q, q, q)
    assert resolve_backend("auto", q, q, q) == "sdpa"
    with pytest.raises(ValueError, match="backend 'flash' cannot run here: the inputs are on cpu"):
        varlen_attention(q, q, q, torch.tensor([0, 10]), backend="flash")
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'eager', 'sdpa', 'flash'\)"):
        varlen_attention(q, q, q, torch.tensor([0, 10]), backend="cudnn")
    with pytest.raises(ValueError, match="end at the token count 10"):
        varlen_attention(q, q, q, Segments.from_bounds([0, 4, 9]))
    with pytest.raises(ValueError, match="start at 0"):
        Segments.from_bounds([2, 10])


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    m = KimiK3ForConditionalGeneration(MultimodalConfig.tiny(), seed=3).eval()
    return m.vision_tower


@given(grid=grids, seed=st.integers(0, 2**16))
def test_tower_backends_agree_on_images_of_different_sizes(tower, grid, seed):
    grid_t = torch.tensor(grid)
    px = torch.randn(int(grid_t.prod(-1).sum()), 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    out = {}
    with torch.no_grad():
        for backend in ("eager", "sdpa", "auto"):
            tower.attn_backend = backend
            out[backend] = tower(px, grid_t)
    tower.attn_backend = "auto"
    assert rel(out["sdpa"], out["eager"]) < 1e-5 and rel(out["auto"], out["eager"]) < 1e-5
    with pytest.raises(ValueError, match="attn_backend must be one of"):
        tower.attn_backend = "fast"
