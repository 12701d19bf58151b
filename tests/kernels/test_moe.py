"""Fused Triton MoE (interpreter, fp32) vs the eager reference: align, expert GEMMs, finalization, layer."""

import pytest
import torch
from hypothesis import given, note, settings, strategies as st

from conftest import poison
from k3nn import ops
from k3nn.config import KimiK3Config
from k3nn.kernels.moe.align import max_blocks, moe_align, moe_align_triton
from k3nn.kernels.moe.reference import moe_expert_outputs_reference, moe_experts_reference
from k3nn.kernels.moe.triton_fused import fused_expert_outputs, moe_finalize_triton
from k3nn.kernels.registry import BackendUnavailableError, backend
from k3nn.layers.moe import MoE, route
from k3nn.quant import MXFP4Weight, mxfp4_quantize


def _ids(N, E, k, g, skew):
    """Distinct experts per row; with ``skew`` most rows pick from the first few experts (others get none)."""
    if skew and E > k:
        pool = max(k, E // 3)
        return torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(N)])
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])


def _problem(N, D, I, E, k, seed, skew=False, mx=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    w1, w3 = torch.randn(E, I, D, generator=g) / D ** 0.5, torch.randn(E, I, D, generator=g) / D ** 0.5
    w2 = torch.randn(E, D, I, generator=g) / I ** 0.5
    if mx:
        w1, w3, w2 = (mxfp4_quantize(w) for w in (w1, w3, w2))
    ids = _ids(N, E, k, g, skew)
    wts = torch.rand(N, k, generator=g)
    return x, w1, w3, w2, ids, wts


def _close(a, b, tol=2e-5):
    assert torch.isfinite(a).all()
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
    assert err < tol, err


@given(N=st.integers(1, 6), E=st.integers(1, 6), k=st.integers(1, 4), D=st.sampled_from([32, 64]),
       I=st.sampled_from([32, 64]), act=st.sampled_from(["silu", "situ"]), mx=st.booleans(), skew=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_fused_moe_matches_eager(N, E, k, D, I, act, mx, skew, seed):
    k = min(k, E)
    note(f"N={N} E={E} k={k} D={D} I={I} act={act} mx={mx} skew={skew}")
    x, w1, w3, w2, ids, wts = _problem(N, D, I, E, k, seed, skew, mx)
    ref = moe_experts_reference(x, w1, w3, w2, ids, wts, act, 4.0, 25.0)
    with backend("triton"):
        out = ops.moe_experts(x, w1, w3, w2, ids, wts, activation=act)
    _close(out, ref)


@pytest.mark.parametrize("case", ["topk_eq_E", "single_token", "zero_token_experts", "multi_block", "no_up_cap"])
def test_fused_moe_edge_cases(case):
    N, D, I, E, k, lin = {"topk_eq_E": (3, 32, 32, 4, 4, 25.0), "single_token": (1, 64, 32, 8, 2, 25.0),
                          "zero_token_experts": (5, 32, 32, 8, 2, 25.0), "multi_block": (20, 32, 32, 2, 2, 25.0),
                          "no_up_cap": (4, 32, 32, 3, 2, None)}[case]
    x, w1, w3, w2, ids, wts = _problem(N, D, I, E, k, seed=7)
    if case == "zero_token_experts":
        ids = torch.tensor([[0, 5]] * N)  # experts 1-4, 6, 7 receive nothing
    y = poison(N, k, D)
    fused_expert_outputs(x, w1, w3, w2, ids, "situ", 4.0, lin, out=y)
    _close(y, moe_expert_outputs_reference(x, w1, w3, w2, ids, "situ", 4.0, lin))
    out = poison(N, D)
    moe_finalize_triton(y, wts, out=out)
    _close(out, moe_experts_reference(x, w1, w3, w2, ids, wts, "situ", 4.0, lin))


@pytest.mark.parametrize("mode", ["split", "join", "scaled"])
@pytest.mark.parametrize("N,E,k", [(3, 4, 2), (18, 2, 1)])
def test_mxfp4_decode_layouts(mode, N, E, k):
    x, w1, w3, w2, ids, wts = _problem(N, 64, 32, E, k, seed=11, mx=True)
    ref = moe_expert_outputs_reference(x, w1, w3, w2, ids, "situ", 4.0, 25.0)
    y = poison(N, k, 64)
    fused_expert_outputs(x, w1, w3, w2, ids, "situ", 4.0, 25.0, out=y, mx_mode=mode)  # fp32: "scaled" → split
    _close(y, ref)
    yh = poison(N, k, 64, dtype=torch.float16)  # fp16 activations: tl.dot_scaled takes them
    fused_expert_outputs(x.half(), w1, w3, w2, ids, "situ", 4.0, 25.0, out=yh, mx_mode=mode)
    _close(yh.float(), ref, 3e-3)


def test_mxfp4_nan_scale_propagates():
    x, w1, w3, w2, ids, wts = _problem(2, 32, 32, 2, 1, seed=3, mx=True)
    ids = torch.tensor([[0], [1]])
    s = w2.scale.clone()
    s[1, 0, 0] = 255  # expert 1, output row 0 is NaN
    w2 = MXFP4Weight(w2.packed, s)
    y = fused_expert_outputs(x, w1, w3, w2, ids, "silu", 4.0, None)
    assert torch.isfinite(y[0]).all() and y[1, 0, 0].isnan() and torch.isfinite(y[1, 0, 1:]).all()


@given(N=st.integers(1, 40), E=st.integers(1, 9), k=st.integers(1, 4), bm=st.sampled_from([4, 16]),
       seed=st.integers(0, 2**31 - 1))
@pytest.mark.parametrize("one_launch", [False, True])
def test_align_invariants(one_launch, N, E, k, bm, seed):
    k = min(k, E)
    note(f"N={N} E={E} k={k} bm={bm}")
    g = torch.Generator().manual_seed(seed)
    ids = _ids(N, E, k, g, skew=bool(seed % 2))
    al = (moe_align_triton if one_launch else moe_align)(ids, E, bm)
    P = N * k
    flat = ids.reshape(-1)
    assert al.sorted_ids.numel() == max_blocks(P, E, bm) * bm
    used = int(al.num_rows.item())
    assert used % bm == 0 and used <= al.sorted_ids.numel()
    real = al.sorted_ids[al.sorted_ids < P]
    assert sorted(real.tolist()) == list(range(P))  # every pair exactly once
    for b in range(al.expert_ids.numel()):
        rows = al.sorted_ids[b * bm:(b + 1) * bm]
        e = al.expert_ids[b].item()
        if b * bm >= used:
            assert e == -1 and (rows == P).all()
        else:
            r = rows[rows < P].long()
            assert r.numel() > 0 and (flat[r] == e).all()
            if not one_launch:  # the torch path is stable; the one-launch kernel orders by atomics
                assert (r.diff() > 0).all()


@given(N=st.integers(1, 5), k=st.integers(1, 4), D=st.sampled_from([32, 48, 96]), norm=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_latent_finalize_matches_eager(N, k, D, norm, seed):
    note(f"N={N} k={k} D={D} norm={norm}")
    g = torch.Generator().manual_seed(seed)
    y, w = torch.randn(N, k, D, generator=g), torch.rand(N, k, generator=g)
    gain = torch.randn(D, generator=g) if norm else None
    ref = ops.moe_latent_finalize(y, w, gain, 1e-5)
    u = (y * w[..., None]).sum(1)
    if norm:
        u = u / (u.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * gain
    _close(ref, u, 1e-5)
    out = poison(N, D)
    with backend("triton"):
        moe_finalize_triton(y, w, gain, 1e-5, out=out)
        _close(out, ref, 1e-5)
        _close(ops.moe_latent_finalize(y, w, gain, 1e-5), ref, 1e-5)


def test_latent_finalize_reads_weights_of_any_float_dtype_and_stride():
    """fp16 routing weights (cast to fp32 in the kernel, no extra cast launch) and a strided weight view."""
    g = torch.Generator().manual_seed(3)
    y = torch.randn(3, 4, 48, generator=g)
    w16 = torch.rand(3, 4, generator=g).half()
    wide = torch.rand(3, 8, generator=g)[:, ::2]  # last-dim stride 2
    for w in (w16, wide):
        ref = ops.moe_latent_finalize(y, w.float(), None, 1e-5)
        out = poison(3, 48)
        with backend("triton"):
            moe_finalize_triton(y, w, None, 1e-5, out=out)
        _close(out, ref, 1e-5)


@pytest.mark.parametrize("kind,mx", [("latent", False), ("latent", True), ("standard", False)])
def test_moe_layer_triton_matches_eager(kind, mx):
    cfg = KimiK3Config.tiny(moe_kind=kind, mxfp4_experts=mx, num_experts=6, num_experts_per_token=3)
    torch.manual_seed(0)
    m = MoE(cfg)
    for name, p in m.named_parameters():
        torch.nn.init.normal_(p, std=0.2)
    if mx:
        g = torch.Generator().manual_seed(1)
        for n in ("w1", "w3", "w2"):
            shape = getattr(m.experts, f"{n}_packed").shape
            q = mxfp4_quantize(torch.randn(*shape[:-1], shape[-1] * 2, generator=g) * 0.2)
            getattr(m.experts, f"{n}_packed").copy_(q.packed)
            getattr(m.experts, f"{n}_scale").copy_(q.scale)
    x = torch.randn(2, 3, cfg.hidden_size)
    with backend("eager"):
        ref = m(x)
    with backend("triton"):
        out = m(x)
    _close(out, ref, 1e-4)
    if kind == "latent":  # deferred finalization == weighted sum then the RMSNorm module
        xf = x.reshape(-1, cfg.hidden_size)
        ids, w = m.gate(xf)
        z = m.routed_expert_down_proj(xf)
        with backend("eager"):
            u = m.routed_expert_norm(m.experts(z, ids, w))
        want = m.routed_expert_up_proj(u) + m.shared_experts(xf)
        _close(out.reshape(-1, cfg.hidden_size), want, 1e-4)


def test_bad_inputs_raise_clear_errors():
    x, w1, w3, w2, ids, wts = _problem(3, 64, 32, 4, 2, seed=0, mx=True)
    with pytest.raises(ValueError, match="disagree"):  # scales that don't match the packed weights
        ops.moe_experts(x, MXFP4Weight(w1.packed, w1.scale[..., :1]), w3, w2, ids, wts)
    with pytest.raises(ValueError, match="w1 has shape"):  # packing along the wrong dim / wrong width
        ops.moe_experts(x, mxfp4_quantize(torch.randn(4, 64, 32)), w3, w2, ids, wts)
    big = torch.tensor([[0, 1, 2, 3, 0]] * 3)
    with pytest.raises(ValueError, match="exceeds the number of experts"):
        ops.moe_experts(x, w1, w3, w2, big, torch.ones(3, 5))
    with pytest.raises(ValueError, match=r"lie in \[0, 4\)"):
        ops.moe_experts(x, w1, w3, w2, ids + 3, wts)
    with pytest.raises(TypeError, match="int32/int64"):
        ops.moe_experts(x, w1, w3, w2, ids.float(), wts)
    with pytest.raises(ValueError, match="NaN or Inf"):
        route(torch.tensor([[0.1, float("nan"), 0.3]]), torch.zeros(3), 2, True, 1.0)
    with pytest.raises(ValueError, match="top_k=4"):
        route(torch.randn(2, 3), torch.zeros(3), 4, True, 1.0)
    with pytest.raises(BackendUnavailableError, match="bf16"), backend("triton"):
        xb = x.bfloat16()
        d = [torch.randn(4, 32, 64).bfloat16(), torch.randn(4, 32, 64).bfloat16(), torch.randn(4, 64, 32).bfloat16()]
        ops.moe_experts(xb, *d, ids, wts)


# --- MXFP4 decode GEMV (triton_mx_gemv): the weight-streaming path used at decode batch sizes ---------------

_GEMV_CFGS = [(16, 64, 16, 4, True, 0, False), (8, 32, 8, 2, False, 0, True), (32, 128, 4, 4, True, 1, False),
              (16, 64, 8, 4, False, 1, True)]
# DECODE=2: 32-bit word decode (two fp16 patterns per lane), both activation loads, tails, block sizes 1/2/4
_GEMV_WORD_CFGS = [(16, 64, 16, 4, True, 2, False), (8, 32, 8, 2, False, 2, True), (32, 128, 4, 4, True, 2, True),
                   (4, 128, 16, 1, False, 2, False)]


@settings(max_examples=16)  # byte (DECODE 0/1) and word (DECODE 2) decode configs share the draws
@given(N=st.integers(1, 6), E=st.integers(1, 6), k=st.integers(1, 4), D=st.sampled_from([32, 64, 96]),
       I=st.sampled_from([32, 96]), act=st.sampled_from(["silu", "situ"]), cap=st.booleans(), skew=st.booleans(),
       cfg=st.sampled_from(_GEMV_CFGS + _GEMV_WORD_CFGS), seed=st.integers(0, 2**31 - 1))
def test_mx_gemv_matches_eager(N, E, k, D, I, act, cap, skew, cfg, seed):
    from k3nn.kernels.moe.triton_mx_gemv import GemvConfig

    k = min(k, E)
    note(f"N={N} E={E} k={k} D={D} I={I} act={act} cap={cap} skew={skew} cfg={cfg}")
    x, w1, w3, w2, ids, _ = _problem(N, D, I, E, k, seed, skew, mx=True)
    lin = 25.0 if cap else None
    ref = moe_expert_outputs_reference(x, w1, w3, w2, ids, act, 4.0, lin)
    y = poison(N, k, D)
    c = GemvConfig(*cfg)
    fused_expert_outputs(x, w1, w3, w2, ids, act, 4.0, lin, out=y, mx_mode="gemv", gemv_cfg=(c, c))
    _close(y, ref)


@pytest.mark.parametrize("case", ["one_token", "zero_token_experts", "rows_per_expert_4", "many_rows_one_expert"])
def test_mx_gemv_edge_cases(case):
    """Block sizes 1/2/4 (picked from pairs per touched expert), experts without tokens, partial blocks."""
    from k3nn.kernels.moe.triton_mx_gemv import gemv_block_m

    N, E, k = {"one_token": (1, 8, 3), "zero_token_experts": (5, 8, 2), "rows_per_expert_4": (8, 4, 2),
               "many_rows_one_expert": (7, 3, 1)}[case]
    x, w1, w3, w2, ids, wts = _problem(N, 64, 32, E, k, seed=5, mx=True)
    if case == "zero_token_experts":
        ids = torch.tensor([[1, 6]] * 3 + [[6, 2]] * 2)  # experts 0, 3, 4, 5, 7 get nothing; expert 6 gets 5 rows
    if case == "many_rows_one_expert":
        ids = torch.tensor([[2]] * 6 + [[0]])  # 6 rows on expert 2 (a partial second block), 1 on expert 0
    assert gemv_block_m(ids.numel(), E) == {"one_token": 1, "zero_token_experts": 1, "rows_per_expert_4": 4,
                                            "many_rows_one_expert": 2}[case]
    y = poison(N, k, 64)
    fused_expert_outputs(x, w1, w3, w2, ids, "situ", 4.0, 25.0, out=y, mx_mode="gemv")
    _close(y, moe_expert_outputs_reference(x, w1, w3, w2, ids, "situ", 4.0, 25.0))
    out = poison(N, 64)
    moe_finalize_triton(y, wts, out=out)
    _close(out, moe_experts_reference(x, w1, w3, w2, ids, wts, "situ", 4.0, 25.0))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # 6·2^126 overflows fp32, as in mxfp4_dequantize
@pytest.mark.parametrize("bm,cfg", [(1, (16, 64, 16, 4, True, 0, True)), (2, (8, 32, 8, 2, False, 1, False)),
                                    (4, (16, 64, 4, 4, True, 0, True))])
def test_mx_gemv_decode_is_exact_for_every_scale(bm, cfg):
    """Unit-vector activations read the decoded weights back: bit-exact vs mxfp4_dequantize, E8M0 byte 0 = 2^-127
    (fp32 subnormal products) and the largest finite scales (no overflow in the 2^14 fold)."""
    from k3nn.kernels.moe.triton_mx_gemv import GemvConfig, mx_gemv_linear
    from k3nn.quant.mxfp4 import mxfp4_dequantize

    g = torch.Generator().manual_seed(bm)
    N, K = 12, 64
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    vals = torch.tensor([0, 1, 2, 100, 127, 200, 240, 241, 250, 253], dtype=torch.uint8)
    scale = vals[torch.randint(0, len(vals), (N, K // 32), generator=g)]
    scale[0, 0] = 0
    got = mx_gemv_linear(torch.eye(K), MXFP4Weight(packed, scale), GemvConfig(*cfg), bm)
    want = mxfp4_dequantize(packed, scale).T
    assert torch.equal(got, want)
    nz = want[:32, 0][want[:32, 0] != 0].abs()
    assert nz.numel() == 0 or nz.max() <= 6 * 2.0 ** -127  # the byte-0 group really decodes at 2^-127






@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("bm,cfg", [(1, (16, 64, 16, 4, True, 2, False)), (2, (8, 32, 8, 2, False, 2, True)),
                                    (4, (16, 64, 4, 4, True, 2, True)), (1, (4, 128, 16, 1, False, 2, True))])
@pytest.mark.parametrize("K", [32, 64, 96])
def test_mx_gemv_word_decode_is_exact_for_every_scale(bm, cfg, K):
    """DECODE=2 reads back exactly what mxfp4_dequantize gives (every nibble position of a word, scale bytes
    0..253, K tails shorter than BLOCK_K); a row stride that is not a multiple of 4 bytes takes the byte
    fallback with the same result."""
    from k3nn.kernels.moe.triton_mx_gemv import GemvConfig, _word_aligned, mx_gemv_linear
    from k3nn.quant.mxfp4 import mxfp4_dequantize

    g = torch.Generator().manual_seed(bm + K)
    N = 12
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    vals = torch.tensor([0, 1, 2, 100, 127, 200, 240, 241, 250, 253], dtype=torch.uint8)
    scale = vals[torch.randint(0, len(vals), (N, K // 32), generator=g)]
    scale[0, 0] = 0
    assert _word_aligned(packed[None])
    want = mxfp4_dequantize(packed, scale).T
    got = mx_gemv_linear(torch.eye(K), MXFP4Weight(packed, scale), GemvConfig(*cfg), bm)
    assert torch.equal(got, want)
    odd = torch.zeros(N, K // 2 + 1, dtype=torch.uint8)
    odd[:, :K // 2] = packed
    view = odd[:, :K // 2]
    assert not _word_aligned(view[None])
    assert torch.equal(mx_gemv_linear(torch.eye(K), MXFP4Weight(view, scale), GemvConfig(*cfg), bm), want)


def test_mx_gemv_word_decode_needs_vec4():
    from k3nn.kernels.moe.triton_mx_gemv import GemvConfig, mx_gemv_linear

    w = mxfp4_quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="DECODE"):
        mx_gemv_linear(torch.randn(1, 64), w, GemvConfig(8, 64, 2, 1, False, 2))


def test_mx_gemv_dispatch_at_decode_sizes(monkeypatch):
    """At most KernelTuning.moe_gemv_pairs pairs and no mx_mode → the GEMV; an explicit grouped-GEMM mode keeps
    the old path (same numbers)."""
    import k3nn.kernels.moe.triton_mx_gemv as gm

    x, w1, w3, w2, ids, _ = _problem(2, 64, 32, 6, 3, seed=9, mx=True)
    calls = []
    orig = gm.mx_gemv_experts
    monkeypatch.setattr(gm, "mx_gemv_experts", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    y = fused_expert_outputs(x, w1, w3, w2, ids, "situ", 4.0, 25.0)
    assert calls == [1]
    y2 = fused_expert_outputs(x, w1, w3, w2, ids, "situ", 4.0, 25.0, mx_mode="split")
    assert calls == [1]
    _close(y, y2)


def test_grouped_gemms_autotune_through_the_tuning():
    """Every grouped-GEMM kernel prunes its tile configs through KernelTuning.autotune (no environment switch):
    all candidates by default, the first one with autotune off."""
    import k3nn.kernels.moe.triton_fused as tf
    from k3nn.kernels.registry import autotune_prune, tuning

    for kernels in (tf._UP, tf._DOWN):
        assert set(kernels) == {"small", "mid", "large"}
        for fn in kernels.values():
            assert fn.early_config_prune is autotune_prune
            assert fn.early_config_prune(fn.configs, {}) == fn.configs
            with tuning(autotune=False):
                assert fn.early_config_prune(fn.configs, {}) == fn.configs[:1]
    assert all(len(c) == 3 for c in tf._CONFIGS.values())  # the GPU candidates (the interpreter builds one)
