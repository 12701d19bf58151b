"""Fused MoE on the GPU: bf16 and MXFP4 vs the eager reference, no host sync, MoE layer parity."""

import pytest
import torch
from hypothesis import given, note, settings, strategies as st

from k3nn import ops
from k3nn.config import KimiK3Config
from k3nn.kernels.moe.reference import moe_experts_reference
from k3nn.kernels.moe.triton_fused import fused_expert_outputs, moe_finalize_triton
from k3nn.kernels.registry import backend, tuning
from k3nn.layers.moe import MoE, route
from k3nn.quant import mxfp4_quantize

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _one_tile_config():
    """One tile config per MoE Triton kernel: correctness here, tuning in the benchmark."""
    with tuning(autotune=False):
        yield


def _rel(a, b):
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _problem(N, D, I, E, k, seed, mx, dtype=torch.bfloat16, skew=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, D, device="cuda", generator=g).to(dtype)
    ws = [torch.randn(E, I, D, device="cuda", generator=g) / D ** 0.5,
          torch.randn(E, I, D, device="cuda", generator=g) / D ** 0.5,
          torch.randn(E, D, I, device="cuda", generator=g) / I ** 0.5]
    ws = [mxfp4_quantize(w) for w in ws] if mx else [w.to(dtype) for w in ws]
    logits = torch.randn(N, E, device="cuda", generator=g)
    if skew:
        logits[:, : E // 4] += 3.0
    ids, w = route(logits, torch.zeros(E, device="cuda"), k, True, 1.0)
    return x, ws, ids, w


@settings(max_examples=8, deadline=None)
@given(N=st.sampled_from([1, 3, 16, 100, 700]), E=st.sampled_from([4, 16, 64]), k=st.sampled_from([1, 4, 8]),
       mx=st.booleans(), act=st.sampled_from(["silu", "situ"]), skew=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_fused_moe_bf16_and_mxfp4_vs_eager(N, E, k, mx, act, skew, seed):
    k = min(k, E)
    note(f"N={N} E={E} k={k} mx={mx} act={act} skew={skew}")
    x, (w1, w3, w2), ids, w = _problem(N, 256, 128, E, k, seed, mx, skew=skew)
    ref = moe_experts_reference(x, w1, w3, w2, ids, w, act, 4.0, 25.0)
    with backend("triton"):
        out = ops.moe_experts(x, w1, w3, w2, ids, w, activation=act)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("mode", ["scaled", "split", "join"])
def test_mxfp4_layouts_fp16_and_topk_eq_E(mode):
    x, (w1, w3, w2), ids, w = _problem(5, 256, 128, 8, 8, 1, True, dtype=torch.float16)
    y = torch.full((5, 8, 256), float("nan"), device="cuda", dtype=torch.float16)
    fused_expert_outputs(x, w1, w3, w2, ids, "situ", 4.0, 25.0, out=y, mx_mode=mode)
    ref = ops.moe_expert_outputs(x, w1, w3, w2, ids, activation="situ")
    assert _rel(y, ref) < 1e-2


def test_no_host_sync_on_the_hot_path():
    x, (w1, w3, w2), ids, w = _problem(32, 256, 128, 16, 4, 2, False)
    logits = torch.randn(32, 16, device="cuda")
    bias = torch.zeros(16, device="cuda")
    gain = torch.ones(256, device="cuda", dtype=torch.bfloat16)

    def layer():
        ids, w = route(logits, bias, 4, True, 1.0)
        return moe_finalize_triton(fused_expert_outputs(x, w1, w3, w2, ids, "situ"), w, gain)

    ref = layer()  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer()  # only the layer runs under the sync check (torch.equal itself syncs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mx", [False, True])
def test_latent_moe_layer_triton_vs_eager(mx):
    cfg = KimiK3Config.tiny(moe_kind="latent", mxfp4_experts=mx, num_experts=16, num_experts_per_token=4,
                            routed_expert_hidden_size=128, moe_intermediate_size=64, hidden_size=256)
    torch.manual_seed(0)
    m = MoE(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    if mx:
        for n in ("w1", "w3", "w2"):
            shape = getattr(m.experts, f"{n}_packed").shape
            q = mxfp4_quantize(torch.randn(*shape[:-1], shape[-1] * 2) * 0.1)
            getattr(m.experts, f"{n}_packed").copy_(q.packed)
            getattr(m.experts, f"{n}_scale").copy_(q.scale)
    m = m.cuda().to(torch.bfloat16)
    m.gate.float()
    x = torch.randn(3, 7, 256, device="cuda", dtype=torch.bfloat16)
    with backend("eager"):
        ref = m(x)
    with backend("triton"):
        out = m(x)
    assert _rel(out, ref) < 2e-2


# --- CUDA MXFP4 GEMV (kernels/moe/cuda_mx_gemv.py, KernelTuning.moe_gemv="cuda") ---------------------------

from k3nn.kernels.moe import cuda_mx_gemv as cmx
from k3nn.kernels.moe.align import align_for
from k3nn.kernels.moe.reference import moe_expert_outputs_reference
from k3nn.quant.mxfp4 import MXFP4Weight, mxfp4_dequantize

# a few launch shapes (one module build for the whole file): the default, 32-row CTAs with e4m3 decode,
# no K split with a deep unroll (no prefetch: 128 registers), four K slices without prefetch, and the weight ring
# (sm_90+): 32-row CTAs with 4 slots of 2 groups, and 4-group slots (partial chunks at most K here) with decode 0
_CUDA_CFGS = (cmx.DEFAULT_CONFIG, cmx.CudaGemvConfig(2, 2, 2, True, 1), cmx.CudaGemvConfig(1, 1, 4, False, 0),
              cmx.CudaGemvConfig(1, 4, 1, False, 0), cmx.CudaGemvConfig(2, 2, 2, False, 1, 4),
              cmx.CudaGemvConfig(1, 2, 4, False, 0, 2))


def _cuda_cfgs():
    why = cmx.available()
    if why:
        pytest.skip(why)
    cap = torch.cuda.get_device_capability()
    cfgs = tuple(dict.fromkeys(c for c in _CUDA_CFGS if (cap >= (8, 9) or c.decode == 0)
                               and (cap >= (9, 0) or c.ring == 0)))
    cmx.build(cfgs)
    return cfgs


def _cuda_outputs(x, w1, w3, w2, ids, act, lin, cfg, configs, bm=None, pdl=None):
    E = w1.shape[0]
    P = ids.numel()
    al = align_for(ids, E, bm or cmx.cuda_block_m(P, E))
    y = torch.full((ids.shape[0], ids.shape[1], x.shape[1]), float("nan"), device="cuda", dtype=x.dtype)
    cmx.mx_gemv_experts_cuda(x, w1, w3, w2, al, y.view(P, -1), P, ids.shape[1], 0 if act == "silu" else 1,
                             lin is not None, 4.0, lin if lin is not None else 1.0, cfg, cfg, configs=configs,
                             pdl=pdl)
    return y


@settings(max_examples=30, deadline=None)
@given(N=st.sampled_from([1, 2, 5, 16]), E=st.sampled_from([4, 16, 64]), k=st.sampled_from([1, 4, 8]),
       D=st.sampled_from([96, 256, 416]), I=st.sampled_from([64, 160, 384]), act=st.sampled_from(["silu", "situ"]),
       cap=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float16]), bm=st.sampled_from([None, 1, 4, 8]),
       ci=st.integers(0, 5), pdl=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_cuda_gemv_vs_eager(N, E, k, D, I, act, cap, dtype, bm, ci, pdl, seed):
    """K (= D, I) not a multiple of the 128-k group or of unroll·k_split, experts without tokens (E=64),
    block sizes 1-8, NaN-poisoned outputs; vs the eager reference in the activation dtype and in fp32."""
    cfgs = _cuda_cfgs()
    cfg = cfgs[ci % len(cfgs)]
    k = min(k, E)
    note(f"N={N} E={E} k={k} D={D} I={I} act={act} cap={cap} dtype={dtype} bm={bm} cfg={cfg} pdl={pdl}")
    x, (w1, w3, w2), ids, _ = _problem(N, D, I, E, k, seed, True, dtype=dtype)
    lin = 25.0 if cap else None
    y = _cuda_outputs(x, w1, w3, w2, ids, act, lin, cfg, cfgs, bm, pdl)
    ref = moe_expert_outputs_reference(x, w1, w3, w2, ids, act, 4.0, lin)
    assert _rel(y, ref) < 1e-2
    ref32 = moe_expert_outputs_reference(x.float(), w1, w3, w2, ids, act, 4.0, lin)
    assert _rel(y, ref32) < 6e-3  # bf16 rounding of h and y only


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [32, 96, 160, 512])
def test_cuda_gemv_decode_is_exact_for_every_scale(dtype, K):
    """Unit-vector activations read every decoded weight back exactly (all nibble positions, E8M0 bytes 0
    (2^-127), 1, 127, 254 and 255 → NaN), matching a @ Wᵀ in fp64 rounded once to the output dtype."""
    cfgs = _cuda_cfgs()
    g = torch.Generator(device="cuda").manual_seed(K)
    Nw = 40
    packed = torch.randint(0, 256, (Nw, K // 2), generator=g, device="cuda", dtype=torch.uint8)
    vals = torch.tensor([0, 1, 2, 100, 127, 128, 200, 240, 241, 250, 253, 254], dtype=torch.uint8, device="cuda")
    scale = vals[torch.randint(0, len(vals), (Nw, K // 32), generator=g, device="cuda")]
    scale[0, 0], scale[1, -1], scale[2, 0] = 0, 254, 255
    w = MXFP4Weight(packed, scale)
    a = torch.eye(K, device="cuda", dtype=dtype)
    want = (a.double() @ mxfp4_dequantize(packed, scale, torch.float64).T).to(dtype)
    for cfg in cfgs:
        for bm in (1, 2, 4, 8):
            got = cmx.mx_gemv_linear_cuda(a, w, cfg, bm, configs=cfgs)
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"{cfg} bm={bm}")
    assert torch.isnan(got[:, 2]).all() and not torch.isnan(got[:, 3]).any()


def test_cuda_gemv_activation_rows_with_inf_nan_and_huge_or_tiny_values():
    """Per-row power-of-two staging: rows at 2^±100 scale keep their accuracy; a row holding Inf/NaN gives NaN."""
    cfgs = _cuda_cfgs()
    g = torch.Generator(device="cuda").manual_seed(3)
    w = mxfp4_quantize(torch.randn(64, 256, device="cuda", generator=g))
    a = torch.randn(4, 256, device="cuda", generator=g)
    a[1] *= 2.0 ** 100
    a[2] *= 2.0 ** -100
    a[3, 7] = float("inf")
    a = a.bfloat16()
    got = cmx.mx_gemv_linear_cuda(a, w, cfgs[0], 4, configs=cfgs).double()
    want = a.double() @ w.dequantize(torch.float64).T
    for r in range(3):
        assert ((got[r] - want[r]).norm() / want[r].norm()).item() < 5e-3
    assert torch.isnan(got[3]).all()


def test_cuda_gemv_dispatch_and_cuda_graph(monkeypatch):
    """KernelTuning.moe_gemv="cuda" routes fused_expert_outputs to the CUDA GEMV (alignment inside the graph too);
    a captured graph replays the same numbers as eager calls; fp32 activations fall back to the Triton GEMV."""
    _cuda_cfgs()
    with tuning(moe_gemv="cuda"):
        _cuda_gemv_dispatch_and_cuda_graph(monkeypatch)


def _cuda_gemv_dispatch_and_cuda_graph(monkeypatch):
    import k3nn.kernels.moe.cuda_mx_gemv as mod

    x, (w1, w3, w2), ids, _ = _problem(4, 256, 128, 16, 4, 11, True)
    calls = []
    orig = mod.mx_gemv_experts_cuda
    monkeypatch.setattr(mod, "mx_gemv_experts_cuda", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    y = torch.full((4, 4, 256), float("nan"), device="cuda", dtype=x.dtype)
    fused_expert_outputs(x, w1, w3, w2, ids, "situ", 4.0, 25.0, out=y)
    assert calls == [1]
    ref = moe_expert_outputs_reference(x, w1, w3, w2, ids, "situ", 4.0, 25.0)
    assert _rel(y, ref) < 1e-2
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    yg = torch.full_like(y, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_expert_outputs(x, w1, w3, w2, ids, "situ", 4.0, 25.0, out=yg)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(s)
    yg.fill_(float("nan"))
    with torch.cuda.graph(g):
        fused_expert_outputs(x, w1, w3, w2, ids, "situ", 4.0, 25.0, out=yg)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)
    calls.clear()
    y32 = fused_expert_outputs(x.float(), w1, w3, w2, ids, "situ", 4.0, 25.0)
    assert calls == [] and _rel(y32, ref.float()) < 1e-2


def test_cuda_gemv_matches_triton_gemv_at_k3_shapes():
    """K3 expert shapes (3584 → 3072 → 3584), 1 and 16 tokens, top-16 of 128: CUDA vs the Triton GEMV."""
    cfgs = _cuda_cfgs()
    from k3nn.kernels.moe.triton_mx_gemv import gemv_block_m, mx_gemv_experts

    E, D, I, k = 128, 3584, 3072, 16
    g = torch.Generator(device="cuda").manual_seed(0)

    def mx(n, kk):
        return MXFP4Weight(torch.randint(0, 256, (E, n, kk // 2), generator=g, device="cuda", dtype=torch.uint8),
                           torch.randint(118, 122, (E, n, kk // 32), generator=g, device="cuda", dtype=torch.uint8))

    w1, w3, w2 = mx(I, D), mx(I, D), mx(D, I)
    for T in (1, 16):
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        ids = torch.randn(T, E, device="cuda", generator=g).topk(k, dim=1).indices
        P = T * k
        yt = torch.empty(P, D, device="cuda", dtype=x.dtype)
        mx_gemv_experts(x, w1, w3, w2, align_for(ids, E, gemv_block_m(P, E)), yt, P, k, 1, True, 4.0, 25.0)
        for cfg in cfgs:
            yc = _cuda_outputs(x, w1, w3, w2, ids, "situ", 25.0, cfg, cfgs).view(P, D)
            assert _rel(yc, yt) < 1e-2, cfg


def _uneven_ids():
    """12 tokens, top-4 of 16 experts (distinct per token): expert 0 in every token (12 pairs: two blocks of 8),
    expert 1 in 5, expert 2 in 3, experts 3 and 4 in 1 and 2, experts 5 and 15 in none."""
    rows = [[0, 1 if n < 5 else 6 + n % 3, 2 if n < 3 else 9 + n % 4, 3 if n == 0 else (4 if n in (1, 2) else
            13 + n % 2)] for n in range(12)]
    return torch.tensor(rows, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_gemv_per_expert_blocks_uneven_loads(dtype):
    """Per-expert blocks with the run-time n8 tile count: uneven loads (1-12 pairs, an expert over 8 pairs, idle
    experts), 1 token, top-k = experts; every block size and config, with and without PDL, vs eager; PDL changes
    no bit."""
    cfgs = _cuda_cfgs()
    D, I = 256, 160
    cases = []
    x, (w1, w3, w2), _, _ = _problem(12, D, I, 16, 4, 21, True, dtype=dtype)
    cases.append((x, w1, w3, w2, _uneven_ids()))
    x1, ws1, _, _ = _problem(1, D, I, 8, 8, 22, True, dtype=dtype)
    cases.append((x1, *ws1, torch.randperm(8, device="cuda")[None]))  # 1 token, top-k = E
    for x, w1, w3, w2, ids in cases:
        ref = moe_expert_outputs_reference(x, w1, w3, w2, ids, "situ", 4.0, 25.0)
        assert cmx.cuda_block_m(ids.numel(), w1.shape[0]) in (2, 4, 8)
        for cfg in cfgs:
            for bm in (None, 2, 4, 8):
                y = _cuda_outputs(x, w1, w3, w2, ids, "situ", 25.0, cfg, cfgs, bm, pdl=False)
                assert _rel(y, ref) < 1e-2, (cfg, bm, ids.shape)
                yp = _cuda_outputs(x, w1, w3, w2, ids, "situ", 25.0, cfg, cfgs, bm, pdl=True)
                assert torch.equal(yp, y), (cfg, bm, ids.shape)


def test_cuda_gemv_pdl_in_a_cuda_graph():
    """Up and down (PDL on) captured back to back three times in one graph: the replay gives the eager bits;
    the h of each call is fully written before its down kernel reads it (a stale h would change y)."""
    cfgs = _cuda_cfgs()
    cfg = cfgs[0]
    x, (w1, w3, w2), _, _ = _problem(12, 256, 160, 16, 4, 23, True)
    ids = _uneven_ids()
    P = ids.numel()
    al = align_for(ids, 16, cmx.cuda_block_m(P, 16))
    xs = [x * (i + 1) for i in range(3)]
    want = [_cuda_outputs(xi, w1, w3, w2, ids, "situ", 25.0, cfg, cfgs, pdl=False) for xi in xs]
    ys = [torch.full_like(want[0], float("nan")) for _ in xs]

    def run():
        for xi, yi in zip(xs, ys, strict=True):
            cmx.mx_gemv_experts_cuda(xi, w1, w3, w2, al, yi.view(P, -1), P, 4, 1, True, 4.0, 25.0, cfg, cfg,
                                     configs=cfgs, pdl=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for yi in ys:
        yi.fill_(float("nan"))
    for _ in range(2):
        g.replay()
    torch.cuda.synchronize()
    for yi, wi in zip(ys, want, strict=True):
        assert torch.equal(yi, wi)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_gemv_rows_keep_their_bits_whatever_shares_their_block(dtype):
    """Batch invariance: a token's expert outputs alone (every block one pair) are bit for bit its outputs among 12
    tokens, where its experts' blocks hold 2-8 pairs (more n8 tiles, other columns of the same mma), so a token
    decoded alone, in a speculative verify or in an engine batch gets the same expert outputs."""
    cfgs = _cuda_cfgs()
    x, (w1, w3, w2), _, _ = _problem(12, 256, 160, 16, 4, 24, True, dtype=dtype)
    ids = _uneven_ids()
    for cfg in cfgs:
        y = _cuda_outputs(x, w1, w3, w2, ids, "situ", 25.0, cfg, cfgs)
        for n in (0, 1, 4, 11):
            alone = _cuda_outputs(x[n:n + 1], w1, w3, w2, ids[n:n + 1], "situ", 25.0, cfg, cfgs)
            assert torch.equal(alone[0], y[n]), (cfg, n)


def test_cuda_gemv_more_rows_than_tokens_allow_give_nan():
    """A ring launch sizes a block for one row per token (each token routes to an expert once): a token that names
    one expert three times overfills the one-token instance, and that block's rows come back NaN, never partial
    sums; blocks with distinct experts are unaffected, and the register loop (sized by block_m) is exact."""
    cfgs = _cuda_cfgs()
    x, (w1, w3, w2), _, _ = _problem(1, 256, 160, 8, 5, 25, True)
    ids = torch.tensor([[2, 2, 2, 5, 6]], device="cuda")
    ref = moe_expert_outputs_reference(x, w1, w3, w2, ids, "situ", 4.0, 25.0)
    for cfg in cfgs:
        y = _cuda_outputs(x, w1, w3, w2, ids, "situ", 25.0, cfg, cfgs, 8)
        if cfg.ring:
            assert torch.isnan(y[0, :3]).all(), cfg
            assert _rel(y[0, 3:], ref[0, 3:]) < 1e-2, cfg
        else:
            assert _rel(y, ref) < 1e-2, cfg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_gemv_auto_launch_shapes_agree_bit_for_bit(dtype):
    """The fused MoE picks ``launch_config``'s shape per step: the ring up to RING_MAX_TOKENS tokens on sm_90+, the
    register loop above. Both run the same group step over the same K slices, so a token decoded alone (ring) gets
    the bits it gets among 12 tokens (register loop), as the engine and speculative decoding need."""
    _cuda_cfgs()
    x, (w1, w3, w2), _, _ = _problem(12, 256, 160, 16, 4, 24, True, dtype=dtype)
    ids = _uneven_ids()
    picks = {t: cmx.launch_config(x, w1, w2, t, 8) for t in (1, cmx.RING_MAX_TOKENS, 12)}
    assert picks[12] == cmx.DEFAULT_CONFIG
    if torch.cuda.get_device_capability() >= (9, 0):
        assert picks[1] == picks[cmx.RING_MAX_TOKENS] == cmx.RING_CONFIG
    with tuning(moe_gemv="cuda"):
        y = fused_expert_outputs(x, w1, w3, w2, ids, "situ", 4.0, 25.0)
        for n in (0, 1, 4, 11):
            alone = fused_expert_outputs(x[n:n + 1], w1, w3, w2, ids[n:n + 1], "situ", 4.0, 25.0)
            assert torch.equal(alone[0], y[n]), n
        four = fused_expert_outputs(x[:4], w1, w3, w2, ids[:4], "situ", 4.0, 25.0)
        assert torch.equal(four, y[:4])
    ref = moe_expert_outputs_reference(x, w1, w3, w2, ids, "situ", 4.0, 25.0)
    assert _rel(y, ref) < 1e-2
