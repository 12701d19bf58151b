"""Triton backward of the chunked KDA on the GPU: bf16 / fp32 gradients against eager autograd at T = 4096,
H = 4, K = V = 128, varlen, and a timing print of the Triton backward against the PyTorch-autograd backward
(autograd through the chunked PyTorch form). Run: ``K3NN_TEST_GPU=1 pytest -m gpu tests/gpu/test_kda_bwd_gpu.py -s``
(the kernels take their first config: ``KernelTuning.autotune`` is off for this file)."""

import pytest
import torch
import torch.nn.functional as F

import k3nn
from k3nn import ops

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _first_configs():
    from k3nn.kernels.registry import tuning

    with tuning(autotune=False):  # correctness here; tuning belongs to the benchmarks
        yield


DEV = "cuda"
NAMES = ("q", "k", "v", "g", "beta", "h0")


def rms_ratio(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make(B, T, H, K, V, seed, dtype, gate="softplus", n_state=None):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    q = F.normalize(r(B, T, H, K), dim=-1).to(dtype)
    k = F.normalize(r(B, T, H, K), dim=-1).to(dtype)
    v = r(B, T, H, V).to(dtype)
    x = r(B, T, H, K)
    g = (-5 * torch.sigmoid(x) if gate == "lower_bound" else -F.softplus(x)).float()
    beta = torch.sigmoid(r(B, T, H))
    h0 = r(n_state or B, H, K, V) * 0.1
    do = r(B, T, H, V).to(dtype)
    dht = r(n_state or B, H, K, V) * 0.1
    return [q, k, v, g, beta, h0], do, dht


def grads(backend, xs, do, dht, cu=None):
    ins = [t.detach().clone().requires_grad_() for t in xs]
    with k3nn.backend(backend):
        o, ht = ops.kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True, cu_seqlens=cu)
    return torch.autograd.grad([o, ht], ins, [do, dht])


def eager_fp32(xs, do, dht, cu=None):
    """The reference: eager autograd (chunked PyTorch form) on the fp32-upcast inputs."""
    return grads("eager", [x.float() for x in xs], do.float(), dht, cu)


# fp32 inputs: the kernels' dots are TF32 on the GPU (10-bit mantissa), so fp32 is held to TF32 tolerances
# (observed on the H200: ~1.8e-3 for q, k, v, beta, h0 and 3e-3..9e-3 for g, which sums many products)
TF32_TOL, TF32_TOL_GATE = 1e-2, 2e-2


def first_bad_token(a):
    """Token index of the first non-finite element of a [B, T, H, D] / [B, T, H] gradient (None: all finite)."""
    bad = ~torch.isfinite(a.float())
    if not bad.any():
        return None
    return int(bad.reshape(a.shape[0], a.shape[1], -1).any(-1).any(0).nonzero()[0])


@pytest.mark.parametrize("dtype,tol,tol_gate", [(torch.float32, TF32_TOL, TF32_TOL_GATE),
                                                (torch.bfloat16, 1.5e-2, 3e-2)])
@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_bwd_vs_eager_long(dtype, tol, tol_gate, gate):
    xs, do, dht = make(1, 4096, 4, 128, 128, 0, dtype, gate)
    got = grads("triton", xs, do, dht)
    want = eager_fp32(xs, do, dht)
    errs = {n: rms_ratio(a, b) for n, a, b in zip(NAMES, got, want)}
    print(f"\n{dtype} {gate} T=4096 H=4 K=V=128 grad rms ratios:", {n: f"{e:.2e}" for n, e in errs.items()})
    bad = {n: first_bad_token(a) for n, a in zip(NAMES[:5], got)}
    print("first non-finite token per gradient (None: finite):", bad)
    for n, a, x in zip(NAMES, got, xs):
        assert a.dtype == x.dtype and torch.isfinite(a).all(), n
    for n, e in errs.items():
        assert e < (tol_gate if n in ("g", "beta") else tol), (n, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bwd_varlen_with_empty_sequences(dtype):
    cu = torch.tensor([0, 700, 700, 1500, 1501, 2048], device=DEV)
    xs, do, dht = make(1, 2048, 2, 128, 128, 1, dtype, "lower_bound", n_state=5)
    got = grads("triton", xs, do, dht, cu)
    want = eager_fp32(xs, do, dht, cu)
    errs = {n: rms_ratio(a, b) for n, a, b in zip(NAMES, got, want)}
    print(f"\n{dtype} varlen grad rms ratios:", {n: f"{e:.2e}" for n, e in errs.items()})
    if dtype == torch.float32:
        tols = {n: TF32_TOL_GATE if n in ("g", "beta") else TF32_TOL for n in NAMES}
    else:
        tols = {n: 3e-2 for n in NAMES}
    assert all(errs[n] < tols[n] for n in NAMES), errs
    torch.testing.assert_close(got[5][1], dht[1])  # the empty sequence: the final-state gradient passes through


def test_bwd_small_head_dims_fp32():
    """K = 64, V = 100 (a partial value block), T not a multiple of 64."""
    xs, do, dht = make(2, 333, 3, 64, 100, 2, torch.float32)
    got = grads("triton", xs, do, dht)
    want = eager_fp32(xs, do, dht)
    for n, a, b in zip(NAMES, got, want):
        assert rms_ratio(a, b) < (TF32_TOL_GATE if n in ("g", "beta") else TF32_TOL), n


def _time(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bwd_timing_print(dtype):
    """Forward + backward of kda_chunk (triton backend), Triton backward against autograd through the chunked
    PyTorch form (the Triton forward's other backward)."""
    from k3nn.kernels.kda.chunk_torch import kda_chunk_triton

    xs, do, dht = make(1, 4096, 4, 128, 128, 3, dtype)
    ins = [t.detach().clone().requires_grad_() for t in xs]

    def step():
        with k3nn.backend("triton"):
            o, ht = ops.kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True)
        torch.autograd.grad([o, ht], ins, [do, dht])

    def fwd():
        with torch.no_grad(), k3nn.backend("triton"):
            ops.kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True)

    def step_torch():
        o, ht = kda_chunk_triton(*ins[:5], initial_state=ins[5], output_final_state=True)
        torch.autograd.grad([o, ht], ins, [do, dht])

    t_fwd = _time(fwd)
    t_tri = _time(step)
    t_torch = _time(step_torch, reps=2)
    print(f"\nkda_chunk {dtype} B=1 T=4096 H=4 K=V=128: forward {t_fwd:.2f} ms; forward+backward: "
          f"Triton bwd {t_tri:.2f} ms, torch-autograd bwd {t_torch:.2f} ms ({t_torch / t_tri:.1f}x)")
    assert t_tri > 0 and t_torch > 0
