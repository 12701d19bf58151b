"""GPU: the decode step replayed from a CUDA graph gives the same tokens as without a graph (standard and
latency-specialized paths), with no capture fallback; the small decode kernels == their references."""

import pytest
import torch

from k3nn import KimiK3, KimiK3Config

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    # built on the CPU then moved: KimiK3(device="cuda") draws the KDA gate init from a CPU generator
    return KimiK3(KimiK3Config.tiny(), seed=0).to("cuda")


def _prompt(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1:, :2] = 0
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("B", [1, 4])
def test_graph_replay_equals_no_graph(model, B):
    ids, mask = _prompt(B, 9, B)
    a = model.generate(ids, attention_mask=mask, max_new_tokens=12, cuda_graph=False)
    b = model.generate(ids, attention_mask=mask, max_new_tokens=12, cuda_graph=True)
    info = model.last_decode_info
    assert info["graph"] and info["fallback"] is None, info
    assert torch.equal(a, b)


def test_graph_replay_sampling(model):
    ids, mask = _prompt(3, 7, 5)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, top_k=30, top_p=0.95, seed=3)
    assert torch.equal(model.generate(ids, cuda_graph=False, **kw), model.generate(ids, cuda_graph=True, **kw))
    assert model.last_decode_info["graph"]


@pytest.mark.parametrize("B", [1, 3])
def test_latency_specialized_graph_equals_standard(model, B):
    ids = _prompt(B, 8, 10 + B)[0]
    a = model.generate(ids, max_new_tokens=12, cuda_graph=False)
    b = model.generate(ids, max_new_tokens=12, decode_backend="latency_specialized")
    info = model.last_decode_info
    assert info["path"] == "latency_specialized" and info["graph"] and info["fallback"] is None, info
    assert torch.equal(a, b)


def test_small_decode_kernels_on_gpu(model):
    """The GLU, sigmoid-gate and router Triton kernels on the GPU (bf16 / fp32) == their eager references, and the
    prepared (packed-projection) decode under graphs gives the standard tokens with them picked by ``auto``."""
    from k3nn import ops
    from k3nn.kernels.glu import glu_packed_reference, sigmoid_gate_reference
    from k3nn.kernels.moe.routing import route_reference
    from k3nn.kernels.registry import backend, resolve

    g = torch.Generator(device="cuda").manual_seed(0)
    gu = torch.randn(3, 2 * 3072, device="cuda", generator=g).bfloat16() * 4
    assert resolve("glu", (gu, "silu", 4.0, 25.0)).backend == "triton"
    for act in ("silu", "situ"):
        ref = glu_packed_reference(gu.float(), act).bfloat16()
        torch.testing.assert_close(ops.glu(gu, act).float(), ref.float(), atol=2e-2, rtol=1e-2)
    o, gate = torch.randn(2, 1, 4096, device="cuda", generator=g).bfloat16(), torch.randn(2, 1, 4096, device="cuda").bfloat16()
    torch.testing.assert_close(ops.sigmoid_gate(o, gate), sigmoid_gate_reference(o, gate))
    logits, bias = torch.randn(64, 896, device="cuda", generator=g), torch.randn(896, device="cuda") * 0.1
    ids_t, w_t = ops.moe_route(logits, bias, 16, True, 2.5)
    with backend("eager"):
        ids_r, w_r = route_reference(logits, bias, 16, True, 2.5)
    order_t, order_r = ids_t.sort(-1), ids_r.sort(-1)
    assert torch.equal(order_t.values, order_r.values)
    torch.testing.assert_close(w_t.gather(1, order_t.indices), w_r.gather(1, order_r.indices))

    ids = _prompt(2, 8, 21)[0]
    a = model.generate(ids, max_new_tokens=10, cuda_graph=False)
    b = model.generate(ids, max_new_tokens=10, decode_backend="latency_specialized")
    assert model.last_decode_info["graph"] and torch.equal(a, b)


def test_prepared_prefill_on_gpu():
    """Packed projections in a bf16 prompt forward on the GPU kernels (the short conv and MLA read the packed GEMM's
    output in place, as strided views) == the plain layers, up to bf16 rounding of the GEMMs."""
    m = KimiK3(KimiK3Config.tiny(), seed=2).to("cuda", torch.bfloat16)
    ids = _prompt(2, 96, 4)[0]
    with torch.no_grad():
        plain = m(ids, cache=m.new_cache(2, 100)).logits.float()
        m.prepare_decode()
        prepared = m(ids, cache=m.new_cache(2, 100)).logits.float()
    assert (prepared - plain).norm() / plain.norm() < 2e-2
