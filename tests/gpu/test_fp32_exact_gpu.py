"""The exact fp32 mode on the GPU: with TF32 off, fp32 logits of a small Kimi-Linear slice (4 layers: 3 KDA + 1 MLA,
32 experts top-8) within 1e-4 of the fp64 eager model, per backend; the KDA chunk kernel alone IEEE with TF32 off
and still TF32 (the fast path) with it on. The full-size run, with a per-op breakdown: python -m bench.gpu.fp32_exact."""

import contextlib
import copy

import pytest
import torch

from k3nn import ops
from k3nn.config import KimiK3Config
from k3nn.kernels.registry import backend

from bench.models import build_model

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def tf32(on: bool):
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _moes(model):
    return [layer.ffn for layer in model.model.layers if layer.is_moe]


@torch.no_grad()
def _run(model, ids, steps):
    """Prefill logits [T, V], decode logits [steps, V] (teacher forced), and the routing (sorted top-k ids per MoE
    layer) of the prefill and of each decode step."""
    for m in _moes(model):
        m.record_routing = True
    cache = model.new_cache(1, ids.shape[1] + steps.numel())
    pre = model(ids, cache=cache).logits[0]
    routes = [[m.last_routing[1].sort(-1)[0] for m in _moes(model)]]
    dec = []
    for t in steps:
        dec.append(model(t.view(1, 1), cache=cache).logits[0, -1])
        routes.append([m.last_routing[1].sort(-1)[0] for m in _moes(model)])
    dec = torch.stack(dec)
    for m in _moes(model):
        m.record_routing, m.last_routing = False, None
    return pre, dec, routes


@pytest.fixture(scope="module")
def slice_models():
    cfg = KimiK3Config.kimi_linear_48b(num_hidden_layers=4, mla_layers=[3], num_experts=32, vocab_size=4096)
    m32 = build_model(cfg, "cuda", torch.float32, seed=0)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for m in _moes(m32):
            m.gate.e_score_correction_bias.normal_(0, 0.1, generator=g)
    m64 = copy.deepcopy(m32).double()
    m64.backend = "eager"
    ids = torch.randint(0, cfg.vocab_size, (1, 512), generator=g, device="cuda")
    steps = torch.randint(0, cfg.vocab_size, (3,), generator=g, device="cuda")
    ref = _run(m64, ids, steps)
    del m64
    torch.cuda.empty_cache()
    return m32, ids, steps, ref


@pytest.mark.parametrize("name", ["auto", "triton", "eager"])
def test_fp32_logits_match_fp64_with_tf32_off(slice_models, name):
    m32, ids, steps, (ref_pre, ref_dec, ref_routes) = slice_models
    m32.backend = name
    try:
        with tf32(False):
            pre, dec, routes = _run(m32, ids, steps)
    finally:
        m32.backend = None
    # routing is causal: tokens before the first top-k flip (a near tie decided differently by fp32 rounding)
    # see exactly the reference's experts everywhere
    flips = [int((a != b).any(-1).nonzero().flatten()[0]) for a, b in zip(routes[0], ref_routes[0])
             if (a != b).any()]
    clean = min(flips, default=ids.shape[1])
    assert clean >= ids.shape[1] // 2, f"routing flips from token {clean}"
    assert _rel(pre[:clean], ref_pre[:clean]) <= 1e-4
    if not flips:
        assert _rel(pre, ref_pre) <= 1e-4
        if all(torch.equal(a, b) for r, rr in zip(routes[1:], ref_routes[1:]) for a, b in zip(r, rr)):
            assert _rel(dec, ref_dec) <= 1e-4


@pytest.mark.parametrize("T", [64, 1000])
def test_kda_chunk_fp32_ieee_with_tf32_off_and_tf32_with_it_on(T):
    g = torch.Generator(device="cuda").manual_seed(T)
    H, D = 8, 128
    nrm = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    q = nrm(torch.randn(1, T, H, D, generator=g, device="cuda"))
    k = nrm(torch.randn(1, T, H, D, generator=g, device="cuda"))
    v = torch.randn(1, T, H, D, generator=g, device="cuda")
    gate = -torch.rand(1, T, H, D, generator=g, device="cuda") * 0.3
    beta = torch.rand(1, T, H, generator=g, device="cuda")
    with backend("eager"):
        ref, ref_h = ops.kda_chunk(*(t.double() for t in (q, k, v, gate, beta)), output_final_state=True)
    errs = {}
    for on in (False, True):
        with tf32(on), backend("triton"):
            o, h = ops.kda_chunk(q, k, v, gate, beta, output_final_state=True)
        errs[on] = max(_rel(o, ref), _rel(h, ref_h))
    assert errs[False] <= 1e-5, errs
    assert errs[True] > 1e-5, f"TF32 on should use TF32 tensor cores (the fast path): {errs}"
