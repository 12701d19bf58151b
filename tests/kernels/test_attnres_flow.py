"""Block AttnRes through a whole K3-wired stack: per-sublayer mixing vs the two-phase form, and bf16 drift.

The stack follows :class:`k3nn.model` (and the released K3 code): layer i mixes before attention (not at
layer 0), pushes the partial every ``block`` layers (mix before push), mixes before the MLP, and the model
mixes once more before the final norm. Sublayers are fixed random maps ``tanh(rmsnorm(h) W)``.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, note
from hypothesis import strategies as st

from k3nn import ops
from k3nn.kernels.registry import backend


def make_stack(L, d, seed, qscale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2 * L + 1, d, generator=g) * qscale / math.sqrt(d) * 3  # attn_i = 2i, mlp_i = 2i+1, out = 2L
    gain = 0.5 + torch.rand(2 * L + 1, d, generator=g)
    W = torch.randn(2 * L, d, d, generator=g) * 0.5 / math.sqrt(d)  # contracting: rounding is not amplified
    return q, gain, W


def sublayer(W, k, h, dtype):
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return (torch.tanh(x @ W[k]) * 0.7).to(dtype)


def flow_mix(emb, q, gain, W, L, block, dtype):
    """Per-sublayer ``attnres_mix``, exactly the model's order."""
    blocks, partial = [], emb.to(dtype)
    for i in range(L):
        h = ops.attnres_mix(blocks + [partial], q[2 * i], gain[2 * i]) if blocks else partial
        if i % block == 0:
            blocks.append(partial)
            partial = None
        a = sublayer(W, 2 * i, h, dtype)
        partial = a if partial is None else partial + a
        h = ops.attnres_mix(blocks + [partial], q[2 * i + 1], gain[2 * i + 1])
        partial = partial + sublayer(W, 2 * i + 1, h, dtype)
    return ops.attnres_mix(blocks + [partial], q[2 * L], gain[2 * L])


def flow_two_phase(emb, q, gain, W, L, block, dtype, state_dtype=torch.float32):
    """Phase 1 once per block (after its push) for every query of the block; phase 2 per sublayer, with the
    residual add fused in (the partial is advanced inside the next phase-2 call)."""
    blocks, partial, pending = [], emb.to(dtype), None
    for start in range(0, L, block):
        if pending is not None:  # the last MLP output of the previous block completes its partial
            partial = partial + pending
        blocks.append(partial)  # layer `start` mixes over the same sources before and after this push
        partial, pending = None, None
        layers = range(start, min(start + block, L))
        qi = [k for i in layers for k in (2 * i, 2 * i + 1)] + ([2 * L] if start + block >= L else [])
        o, m, l = ops.attnres_phase1(blocks, q[qi], gain[qi], 1e-5, state_dtype)
        for j, k in enumerate(qi):
            r = ops.attnres_phase2(o[j], m[j], l[j], partial, q[k], gain[k], update=pending, dtype=dtype)
            partial, h = r.partial, r.mix
            if k == 2 * L:
                return h
            pending = sublayer(W, k, h, dtype)
    raise AssertionError("unreachable")


@given(L=st.integers(1, 14), block=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_two_phase_equals_per_sublayer_mix(L, block, seed):
    d, T = 24, 2
    note(f"L={L} block={block}")
    q, gain, W = make_stack(L, d, seed)
    emb = torch.randn(T, d, generator=torch.Generator().manual_seed(seed + 1))
    ref = flow_mix(emb, q, gain, W, L, block, torch.float32)  # eager
    with backend("triton"):
        two = flow_two_phase(emb, q, gain, W, L, block, torch.float32)
    torch.testing.assert_close(two, ref, rtol=2e-5, atol=2e-5)


def test_two_phase_equals_mix_at_block_boundaries_eager():
    """The eager references agree too (K3 block 12; 26 layers cross the boundaries at 0, 12 and 24)."""
    L, d = 26, 16
    q, gain, W = make_stack(L, d, 11)
    emb = torch.randn(2, d, generator=torch.Generator().manual_seed(12))
    with backend("eager"):
        a = flow_mix(emb, q, gain, W, L, 12, torch.float32)
        b = flow_two_phase(emb, q, gain, W, L, 12, torch.float32)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_k3_depth_bf16_drift():
    """93 layers, block 12, 187 mixes (score spread ~1): the bf16 Triton paths (per-sublayer and two-phase)
    stay within a few percent of the fp32 eager stack, no further from it than the bf16 eager stack is."""
    L, block, d, T = 93, 12, 64, 1
    q, gain, W = make_stack(L, d, 2026, qscale=0.3)
    emb = torch.randn(T, d, generator=torch.Generator().manual_seed(2027))
    with backend("eager"):
        ref = flow_mix(emb, q, gain, W, L, block, torch.float32)
        eager_bf16 = flow_mix(emb, q, gain, W, L, block, torch.bfloat16)
    with backend("triton"):
        mix_bf16 = flow_mix(emb, q, gain, W, L, block, torch.bfloat16)
        two_bf16 = flow_two_phase(emb, q, gain, W, L, block, torch.bfloat16)
    e0 = rel(eager_bf16, ref)
    errs = {"mix": rel(mix_bf16, ref), "two_phase": rel(two_bf16, ref)}
    print(f"relative error vs fp32 eager after 93 layers: eager bf16 {e0:.2e}, {errs}")
    assert e0 < 4e-2, e0
    for name, e in errs.items():
        assert e < max(1.25 * e0, 1e-2), (name, e, e0)
