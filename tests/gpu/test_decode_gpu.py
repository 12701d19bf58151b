"""GPU: the decode step replayed from a CUDA graph gives the same tokens as without a graph (standard and
latency-specialized paths), with no capture fallback."""

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


def test_decode_kernels_on_gpu(model, monkeypatch):
    """The latency path's small Triton kernels (opt-in: KernelTuning.decode_kernels) on the GPU: same tokens, and each
    kernel == its eager form."""
    from k3nn.decode import kernels as K

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 1, 7168, device="cuda", generator=g).bfloat16()
    w = torch.randn(7168, device="cuda", generator=g).bfloat16()
    torch.testing.assert_close(K.rmsnorm(x, w, 1e-5, impl="triton"), K.rmsnorm(x, w, 1e-5, impl="eager"))
    gu = torch.randn(3, 2 * 3072, device="cuda", generator=g).bfloat16() * 4
    for act in ("silu", "situ"):
        torch.testing.assert_close(K.glu(gu, act, impl="triton").float(), K.glu(gu, act, impl="eager").float(),
                                   atol=2e-2, rtol=1e-2)
    from k3nn.kernels.registry import tuning

    ids = _prompt(2, 8, 21)[0]
    with tuning(decode_kernels="auto"):
        a = model.generate(ids, max_new_tokens=10, cuda_graph=False)
        b = model.generate(ids, max_new_tokens=10, decode_backend="latency_specialized")
    assert model.last_decode_info["graph"] and torch.equal(a, b)
