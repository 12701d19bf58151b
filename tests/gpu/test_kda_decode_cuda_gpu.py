"""CUDA fused KDA decode (kernels/kda/cuda_decode.py) on the GPU against the eager reference: every variant
(persistent with 8 / 16 warps and 2 / 3 stages, regs with 8 / 16 warps, block), bf16 and fp32 activations,
B in {1, 3, 64, 200}, T in {1, 3}, both gates, shuffled cache slots (slots outside state_indices untouched),
y allocated over NaN-poisoned memory; plus CUDA-graph replay, run-to-run determinism and the auto switch.

    K3NN_TEST_GPU=1 python3 -m pytest -m gpu -q tests/gpu/test_kda_decode_cuda_gpu.py
"""

import contextlib
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import k3nn
from k3nn import ops
from k3nn.kernels.kda import cuda_decode as cd
from k3nn.kernels.registry import resolve

pytestmark = pytest.mark.gpu
DEV = "cuda"
D, W = 128, 4
KNOBS = ("K3NN_KDA_CUDA", "K3NN_KDA_CUDA_AUTO", "K3NN_KDA_CUDA_AUTO_MIN", "K3NN_KDA_CUDA_VARIANT",
         "K3NN_KDA_CUDA_WARPS", "K3NN_KDA_CUDA_STAGES", "K3NN_KDA_CUDA_GRID", "K3NN_KDA_CUDA_ORDER")
# name -> (variant, warps, stages[, order])
VARIANTS = {"persistent16s3": ("persistent", 16, 3), "persistent16s2": ("persistent", 16, 2),
            "persistent8s3": ("persistent", 8, 3), "persistent8s2": ("persistent", 8, 2),
            "regs8": ("regs", 8, 3), "regs16": ("regs", 16, 3), "block": ("block", 8, 3),
            "regs16hb": ("regs", 16, 3, "hb"), "blockhb": ("block", 8, 3, "hb")}
H_OF_B = {1: 96, 3: 12, 64: 96, 200: 12}  # B=200 at H=12: 2400 items, ~18 per persistent CTA (every stage reused)


def rms_ratio(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


@pytest.fixture
def cuda_on(monkeypatch):
    for k in KNOBS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("K3NN_KDA_CUDA", "1")
    cd.available.cache_clear()
    assert cd.available() is None, cd.available()
    yield monkeypatch
    cd.available.cache_clear()


def use(mp, name):
    v, w, s, *o = VARIANTS[name]
    mp.setenv("K3NN_KDA_CUDA_VARIANT", v)
    mp.setenv("K3NN_KDA_CUDA_WARPS", str(w))
    mp.setenv("K3NN_KDA_CUDA_STAGES", str(s))
    mp.setenv("K3NN_KDA_CUDA_ORDER", o[0] if o else "bh")


def inputs(B, T, H, dtype, seed, extra_slots=5):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)
    C, N = H * D, B + extra_slots
    args = [r(B, T, 3 * C).to(dtype), r(B, T, C).to(dtype), r(B, T, H).to(dtype), r(B, T, C).to(dtype),
            (r(3 * C, W) * 0.5).to(dtype), torch.rand(H, generator=gen, device=DEV) * 2.7, r(C), 1 + 0.1 * r(D)]
    S = r(N, H, D, D) * 0.05
    cs = r(N, W - 1, 3 * C).to(dtype)
    idx = torch.randperm(N, generator=gen, device=DEV)[:B]
    return args, S, cs, idx


def poison_allocator(shape, dtype):
    """Fill a block of the caching allocator with NaN and free it: the kernel's own torch.empty of the same size
    gets it back, so an element the kernel does not write fails the comparison."""
    x = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    del x


def check(B, T, dtype, gate, seed, idx_dtype=torch.int64, H=None):
    H = H or H_OF_B[B]
    args, S, cs, idx = inputs(B, T, H, dtype, seed)
    idx = idx.to(idx_dtype)
    kw = dict(gate_kind=gate, lower_bound=-5.0, norm_eps=1e-5)
    S1, c1, S2, c2 = S.clone(), cs.clone(), S.clone(), cs.clone()
    with k3nn.backend("eager"):
        y1 = ops.kda_fused_decode(*args, S1, c1, idx, **kw)
    poison_allocator((B, T, H, D), dtype)
    with k3nn.backend("cuda"):
        y2 = ops.kda_fused_decode(*args, S2, c2, idx, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(y2).all()
    tol_y, tol_s = (1e-2, 2e-3) if dtype == torch.bfloat16 else (1e-4, 1e-5)
    assert rms_ratio(y2, y1) < tol_y, rms_ratio(y2, y1)
    assert rms_ratio(S2[idx], S1[idx]) < tol_s, rms_ratio(S2[idx], S1[idx])
    assert torch.equal(c2, c1)
    untouched = torch.ones(S.shape[0], dtype=torch.bool, device=DEV)
    untouched[idx.long()] = False
    assert torch.equal(S2[untouched], S[untouched])


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("B", [1, 3, 64, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_default_variant_matches_eager(cuda_on, dtype, B, T, gate):
    assert cd.plan(B, H_OF_B[B])["variant"] == "persistent"
    check(B, T, dtype, gate, seed=B * 10 + T)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("B", [3, 64, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_match_eager(cuda_on, name, dtype, B, T):
    use(cuda_on, name)
    check(B, T, dtype, "lower_bound" if (B + T) % 2 else "softplus", seed=7 * B + T, idx_dtype=torch.int32)


@contextlib.contextmanager
def env(**kv):
    old = {k: os.environ.get(k) for k in KNOBS}
    for k in KNOBS:
        os.environ.pop(k, None)
    os.environ.update(kv)
    cd.available.cache_clear()
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        cd.available.cache_clear()


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 80), T=st.integers(1, 4), H=st.integers(1, 16), fp32=st.booleans(), softplus=st.booleans(),
       name=st.sampled_from(list(VARIANTS)), grid=st.sampled_from(["", "1", "5"]), seed=st.integers(0, 2 ** 16))
def test_drawn_shapes(B, T, H, fp32, softplus, name, grid, seed):
    v, w, s, *o = VARIANTS[name]
    with env(K3NN_KDA_CUDA="1", K3NN_KDA_CUDA_VARIANT=v, K3NN_KDA_CUDA_WARPS=str(w), K3NN_KDA_CUDA_STAGES=str(s),
             K3NN_KDA_CUDA_GRID=grid, K3NN_KDA_CUDA_ORDER=o[0] if o else "bh"):
        check(B, T, torch.float32 if fp32 else torch.bfloat16, "softplus" if softplus else "lower_bound", seed, H=H)


@pytest.mark.parametrize("grid", ["1", "7", "1000"])
def test_persistent_any_grid(cuda_on, grid):
    """One CTA looping over every item (each stage reused many times), an odd grid, more CTAs than items."""
    cuda_on.setenv("K3NN_KDA_CUDA_GRID", grid)
    check(3, 1, torch.bfloat16, "lower_bound", seed=3)
    check(3, 3, torch.float32, "softplus", seed=4)


def test_no_state_indices(cuda_on):
    H = 8
    args, S, cs, _ = inputs(5, 1, H, torch.bfloat16, seed=9, extra_slots=0)
    S1, c1, S2, c2 = S.clone(), cs.clone(), S.clone(), cs.clone()
    with k3nn.backend("eager"):
        y1 = ops.kda_fused_decode(*args, S1, c1, None)
    with k3nn.backend("cuda"):
        y2 = ops.kda_fused_decode(*args, S2, c2, None)
    assert rms_ratio(y2, y1) < 1e-2 and rms_ratio(S2, S1) < 2e-3 and torch.equal(c2, c1)


@pytest.mark.parametrize("name", ["persistent16s3", "persistent8s2", "regs8", "block"])
def test_cuda_graph_and_determinism(cuda_on, name):
    use(cuda_on, name)
    B, T, H = 64, 1, 96
    args, S, cs, idx = inputs(B, T, H, torch.bfloat16, seed=21)
    kw = dict(gate_kind="lower_bound", lower_bound=-5.0)
    S_ref, c_ref = S.clone(), cs.clone()
    with k3nn.backend("cuda"):
        ops.kda_fused_decode(*args, S.clone(), cs.clone(), idx, **kw)  # build outside the capture
        gph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gph):
            y = ops.kda_fused_decode(*args, S, cs, idx, **kw)
        gph.replay()
        gph.replay()
        for _ in range(2):
            y_ref = ops.kda_fused_decode(*args, S_ref, c_ref, idx, **kw)
    torch.cuda.synchronize()
    assert torch.equal(S, S_ref) and torch.equal(cs, c_ref) and torch.equal(y, y_ref)


def test_auto_switch(monkeypatch):
    for k in KNOBS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("K3NN_KDA_CUDA_AUTO", "1")
    cd.available.cache_clear()
    try:
        for B, H, want in ((64, 96, "cuda"), (1, 96, "triton"), (8, 96, "triton")):
            args, S, cs, idx = inputs(B, 1, H, torch.bfloat16, seed=1, extra_slots=0)
            assert resolve("kda_fused_decode", (*args, S, cs, idx)).backend == want, (B, H)
    finally:
        cd.available.cache_clear()
