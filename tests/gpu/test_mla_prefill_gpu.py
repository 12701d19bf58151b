"""MLA prefill attention on the GPU: the Triton flash kernel in bf16 (and fp32 with TF32 off) at Kimi and tiny dims
vs the eager masked reference in fp32; the chunked 4-layer Kimi-Linear slice against one-shot prefill."""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from k3nn.kernels.mla.prefill import mla_attention_reference
from k3nn.kernels.mla.triton_prefill import mla_attention_triton

pytestmark = pytest.mark.gpu


def _inputs(g, B, T, L, H, dn, dr, dv, dtype):
    r = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dtype)  # noqa: E731
    return r(B, T, H, dn), (r(B, T, H, dr) if dr else None), r(B, L, H, dn), (r(B, L, dr) if dr else None), r(B, L, H, dv)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@given(B=st.integers(1, 3), T=st.integers(1, 700), ctx=st.integers(0, 900), H=st.sampled_from([1, 4, 32]),
       dims=st.sampled_from([(128, 64, 128), (16, 8, 16), (64, 0, 64), (96, 32, 80)]), masked=st.booleans(),
       per_row=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_triton_prefill_bf16_matches_reference(B, T, ctx, H, dims, masked, per_row, seed):
    note(f"B={B} T={T} ctx={ctx} H={H} dims={dims} masked={masked} per_row={per_row}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    dn, dr, dv = dims
    L = ctx + T
    a = _inputs(g, B, T, L, H, dn, dr, dv, torch.bfloat16)
    km = (torch.rand(B, L, generator=g, device="cuda") > 0.25) if masked else None
    qs = torch.full((B,), ctx, device="cuda", dtype=torch.int32) if per_row else None
    scale = (dn + dr) ** -0.5
    ref, lref = mla_attention_reference(*(t if t is None else t.float() for t in a), scale, q_start=qs, key_mask=km,
                                        return_lse=True)
    o = torch.full((B, T, H, dv), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((B, T, H), float("nan"), device="cuda")
    mla_attention_triton(*a, scale, q_start=qs, key_mask=km, return_lse=True, out=(o, lse))
    assert _rel(o, ref) < 1e-2
    torch.testing.assert_close(lse, lref, atol=2e-2, rtol=1e-3)


@given(lens=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=5),
       seed=st.integers(0, 2**31 - 1))
def test_triton_prefill_varlen_bf16(lens, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu = torch.tensor([0] + [t for t, _ in lens], device="cuda").cumsum(0)
    cuk = torch.tensor([0] + [t + c for t, c in lens], device="cuda").cumsum(0)
    a = _inputs(g, 1, int(cu[-1]), int(cuk[-1]), 4, 128, 64, 128, torch.bfloat16)
    if int(cu[-1]) == 0:
        return
    ref = mla_attention_reference(*(t.float() for t in a), 192 ** -0.5, cu_seqlens=cu, cu_seqlens_k=cuk)
    o = mla_attention_triton(*a, 192 ** -0.5, cu_seqlens=cu, cu_seqlens_k=cuk)
    assert _rel(o, ref) < 1e-2


def test_triton_prefill_fp32_is_ieee_with_tf32_off():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = _inputs(g, 2, 300, 500, 4, 128, 64, 128, torch.float32)
    ref = mla_attention_reference(*(t.double() for t in a), 192 ** -0.5)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        o = mla_attention_triton(*a, 192 ** -0.5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert _rel(o, ref) < 1e-5


def test_chunked_prefill_kimi_linear_slice_matches_one_shot():
    """4-layer Kimi-Linear dims (32 experts) in bf16: a 20K prompt prefilled in chunks of 8K equals one shot (the
    same kernels on the same tokens, only the chunk cuts differ; cuts anywhere are checked in fp64 on the CPU)."""
    from k3nn import KimiK3, KimiK3Config

    cfg = KimiK3Config.kimi_linear_48b(num_hidden_layers=4, mla_layers=[3], num_experts=32, vocab_size=4096)
    m = KimiK3(cfg, device="cuda", dtype=torch.bfloat16, seed=0).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 20000), device="cuda", generator=torch.Generator(device="cuda"))
    with torch.no_grad():
        one = m(ids, cache=m.new_cache(1, 20001), logits_to_keep=1, prefill_chunk_size=1 << 20).logits
        cache = m.new_cache(1, 20001)
        many = m(ids, cache=cache, logits_to_keep=1, prefill_chunk_size=8192).logits
        nxt = m(ids[:, -1:], cache=cache).logits
    assert _rel(many, one) < 2e-2 and torch.isfinite(nxt).all()
