"""GPU: the skinny GEMM (``ops.linear``'s Triton kernel) against the fp64 reference in bf16 / fp32 on
hypothesis-drawn shapes and on every ``k3_slice`` projection shape, under CUDA-graph capture, and the model
invariants with the kernel forced on every projection (``KernelTuning(skinny_linear="always")``): incremental
decode == full forward, graph == no graph, speculative greedy == plain greedy, engine == generate(), fp32 with
TF32 off within 1e-4 of fp64."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from k3nn import KimiK3, KimiK3Config, ops
from k3nn.kernels.linear.triton_skinny import SkinnyConfig, config_for, linear_skinny
from k3nn.kernels.registry import backend, tuning

pytestmark = pytest.mark.gpu


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


@contextlib.contextmanager
def ieee():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


cfgs = st.one_of(st.none(),
                 st.builds(SkinnyConfig, st.just("fma"), st.sampled_from([8, 16, 32]),
                           st.sampled_from([64, 128, 256, 512]), st.sampled_from([4, 8]), st.just(1),
                           st.sampled_from([1, 2, 4])),
                 st.builds(SkinnyConfig, st.just("dot"), st.sampled_from([16, 32, 64]), st.sampled_from([64, 128]),
                           st.just(4), st.sampled_from([1, 3]), st.sampled_from([1, 2, 4])))


@settings(deadline=None, max_examples=25)
@given(m=st.integers(1, 16), n=st.integers(1, 3000), k=st.integers(1, 3000), cfg=cfgs,
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), bias=st.booleans(), res=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_skinny_matches_fp64(m, n, k, cfg, dtype, bias, res, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    r = torch.randn(m, n, device="cuda", generator=g).to(dtype) if res else None
    ref = x.double() @ w.double().t() + (b.double() if bias else 0) + (r.double() if res else 0)
    with ieee():
        y = linear_skinny(x, w, b, r, config=cfg)
    assert _rel(y, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


K3_SHAPES = [(49376, 7168), (12288, 128), (7168, 12288), (14400, 7168), (18432, 1536), (67584, 7168),
             (7168, 33792), (3584, 7168), (7168, 3584), (12288, 7168), (7168, 6144), (163840, 7168)]


@pytest.mark.parametrize("n,k", K3_SHAPES)
def test_k3_slice_shapes(n, k):
    """The launch shape dispatch picks for each k3_slice projection at 1, 4 and 16 rows == torch's GEMM."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    for m in (1, 4, 16):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        ref = x.double() @ w.double().t()
        with backend("triton"):
            y = ops.linear(x, w)
        assert _rel(y, ref) < 1e-2, (m, config_for(m, n, k, x.dtype, x.device))
        assert _rel(F.linear(x, w), ref) < 1e-2


def test_capture_and_replay_with_split_k():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 4096, device="cuda", generator=g).bfloat16()
    w = torch.randn(256, 4096, device="cuda", generator=g).bfloat16()
    r = torch.randn(3, 256, device="cuda", generator=g).bfloat16()
    cfg = SkinnyConfig("fma", 16, 256, 4, 1, 4)
    want = linear_skinny(x, w, None, r, config=cfg)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        linear_skinny(x, w, None, r, config=cfg)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_skinny(x, w, None, r, config=cfg)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ref = x.double() @ w.double().t() + r.double()
    assert _rel(out, ref) < 1e-2 and not torch.equal(out, want)


def test_programmatic_dependent_chain_equals_plain_stream_order():
    """Skinny GEMMs launched as programmatic dependents (``KernelTuning.pdl``) behind kernels that release them
    early (RMSNorm, GLU, the split-K reduce), eagerly and replayed from a CUDA graph: bit-identical to plain stream
    order, every kernel reading the previous one's output, the weights large enough that the prefetches overlap."""
    from k3nn.kernels.pdl import pdl_on

    g = torch.Generator(device="cuda").manual_seed(3)
    d, i = 4096, 8192
    w_up = (torch.randn(2 * i, d, device="cuda", generator=g) / d ** 0.5).bfloat16()
    w_down = (torch.randn(d, i, device="cuda", generator=g) / i ** 0.5).bfloat16()
    w_mix = (torch.randn(d, d, device="cuda", generator=g) / d ** 0.5).bfloat16()
    gain = torch.rand(d, device="cuda", generator=g).bfloat16()

    def chain(x):
        h = ops.rms_norm(x, gain, 1e-6)
        h = ops.glu(ops.linear(h, w_up), "silu")
        h = ops.linear(h, w_down, residual=x)
        return ops.linear(linear_skinny(h, w_mix, config=SkinnyConfig("fma", 16, 256, 4, 1, 4)), w_mix)

    xs = [torch.randn(1, d, device="cuda", generator=g).bfloat16() for _ in range(4)]
    with torch.no_grad(), backend("triton"):
        with tuning(pdl=False):
            assert not pdl_on(xs[0])
            want = [chain(x) for x in xs]
        with tuning(pdl=True):
            assert pdl_on(xs[0])
            assert all(torch.equal(chain(x), w) for x, w in zip(xs, want))
            inp = xs[0].clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                chain(inp)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(inp)
    for _ in range(5):
        for x, w in zip(xs, want):
            inp.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, w)


# -- the model with the skinny GEMM on every projection -------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return KimiK3(KimiK3Config.tiny(), seed=0).to("cuda").eval()


def test_incremental_decode_equals_full_forward(model):
    ids = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad(), ieee(), tuning(skinny_linear="always"):
        full = model(ids).logits
        cache = model.new_cache(2, 16)
        steps = [model(ids[:, :8], cache=cache).logits]
        for t in range(8, 14):
            steps.append(model(ids[:, t:t + 1], cache=cache).logits)
    inc = torch.cat(steps, 1)
    assert _rel(inc, full.double()) < 1e-4


def test_graph_decode_equals_no_graph_and_fp64(model):
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2)).cuda()
    with ieee(), tuning(skinny_linear="always"):
        a = model.generate(ids, max_new_tokens=10, cuda_graph=False)
        b = model.generate(ids, max_new_tokens=10, cuda_graph=True)
        c = model.generate(ids, max_new_tokens=10, decode_backend="latency_specialized")
    assert model.last_decode_info["graph"]
    assert torch.equal(a, b) and torch.equal(a, c)
    m64 = KimiK3(KimiK3Config.tiny(), seed=0, dtype=torch.float64).to("cuda").eval()
    seq = a[:, :14]
    with torch.no_grad(), ieee(), tuning(skinny_linear="always"):
        cache = model.new_cache(2, 16)
        model(seq[:, :12], cache=cache)
        step32 = torch.cat([model(seq[:, t:t + 1], cache=cache).logits for t in (12, 13)], 1)
        with backend("eager"):
            cache64 = m64.new_cache(2, 16)
            m64(seq[:, :12], cache=cache64)
            step64 = torch.cat([m64(seq[:, t:t + 1], cache=cache64).logits for t in (12, 13)], 1)
    assert _rel(step32, step64) < 1e-4


def test_speculative_greedy_equals_plain():
    from k3nn.layers.dspark import DSparkConfig, DSparkDrafter

    target = KimiK3(KimiK3Config.tiny(), seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a head tilted towards a token permutation: the untrained drafter gets some right
        V, d = target.config.vocab_size, target.config.hidden_size
        E = torch.randn(V, d, generator=g)
        target.model.embed_tokens.weight.copy_(E)
        target.lm_head.weight.copy_(0.25 * E[torch.randperm(V, generator=g)] + 0.5 * torch.randn(V, d, generator=g))
    target = target.to("cuda").eval()
    drafter = DSparkDrafter(DSparkConfig.for_target(target.config, num_layers=1, num_heads=2, block_size=5,
                                                    markov_rank=16), target, device="cuda").eval()
    ids = torch.randint(0, 255, (2, 6), generator=torch.Generator().manual_seed(8)).cuda()
    with ieee(), tuning(skinny_linear="always"):
        ref = target.generate(ids, max_new_tokens=14)
        out = target.generate(ids, max_new_tokens=14, drafter=drafter, num_assistant_tokens=5)
    assert torch.equal(out, ref)


def test_engine_equals_generate(model):
    from k3nn.engine import Engine, EngineConfig

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 40, 17)]
    with ieee(), tuning(skinny_linear="always"):
        eng = Engine(model, EngineConfig(max_num_seqs=4, num_pages=64, num_snapshots=4))
        ids = [eng.add_request(p, max_new_tokens=6) for p in prompts]
        while eng.has_unfinished():
            eng.step()
        ref = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=6, cuda_graph=False)[0, len(p):].tolist()
               for p in prompts]
    assert [eng.requests[i].output for i in ids] == ref


def test_bf16_model_skinny_vs_torch_gemm():
    cfg = KimiK3Config.tiny(hidden_size=512, intermediate_size=1024)
    m = KimiK3(cfg, seed=0, dtype=torch.bfloat16).to("cuda").eval()
    ids = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(3)).cuda()
    outs = []
    for mode in ("never", "always"):
        with torch.no_grad(), tuning(skinny_linear=mode):
            cache = m.new_cache(3, 12)
            m(ids[:, :8], cache=cache)
            outs.append(torch.cat([m(ids[:, t:t + 1], cache=cache).logits for t in (8, 9)], 1).float())
    assert _rel(outs[1], outs[0].double()) < 3e-2


def test_router_logits_out_dtype():
    """bf16 operands, fp32 logits (the router): the kernel equals the fp32 product of the upcast operands."""
    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(128, 7168, device="cuda", generator=g).bfloat16() * 0.02
    for m in (1, 4, 16):
        x = torch.randn(m, 7168, device="cuda", generator=g).bfloat16()
        with ieee(), backend("triton"):
            y = ops.linear(x, w, out_dtype=torch.float32)
        assert y.dtype == torch.float32
        assert _rel(y, x.double() @ w.double().t()) < 1e-6
