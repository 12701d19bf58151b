"""Fused MoE on the GPU: bf16 and MXFP4 vs the eager reference, no host sync, MoE layer parity."""

import os

os.environ.setdefault("K3NN_MOE_TUNE", "0")  # one tile config: correctness here, tuning in the benchmark

import pytest
import torch
from hypothesis import given, note, settings, strategies as st

from k3nn import ops
from k3nn.config import KimiK3Config
from k3nn.kernels.moe.reference import moe_experts_reference
from k3nn.kernels.moe.triton_fused import fused_expert_outputs, moe_finalize_triton
from k3nn.kernels.registry import backend
from k3nn.layers.moe import MoE, route
from k3nn.quant import mxfp4_quantize

pytestmark = pytest.mark.gpu


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
