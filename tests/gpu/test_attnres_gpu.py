"""AttnRes Triton kernels compiled on the GPU vs the eager references (K3 widths, bf16, CUDA graphs)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from k3nn import ops
from k3nn.kernels.attnres import triton_mix as tm
from k3nn.kernels.attnres.reference import attnres_phase1_reference, attnres_phase2_reference
from k3nn.kernels.registry import backend, resolve
from k3nn.layers.attnres import attnres_mix_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from test_attnres_flow import flow_mix, flow_two_phase, make_stack, rel  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
DTYPES = list(TOL)


def srcs(T, d, S, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [(torch.randn(T, d, device=DEV, generator=g) * (1 + j)).to(dtype) for j in range(S)]


def qn(d, seed, q=None):
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    shape = (d,) if q is None else (q, d)
    return torch.randn(shape, device=DEV, generator=g) * 3 / math.sqrt(d), 0.5 + torch.rand(shape, device=DEV,
                                                                                             generator=g)


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@settings(max_examples=20)  # each new (S, d, dtype) compiles a kernel
@given(T=st.integers(0, 300), d=st.sampled_from([1, 100, 2304, 4095, 7168, 16384]), S=st.sampled_from([1, 2, 5, 9, 16]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_mix_gpu(T, d, S, dtype, seed):
    note(f"T={T} d={d} S={S} {dtype}")
    x = srcs(T, d, S, dtype, seed)
    qw, nw = qn(d, seed)
    with backend("triton"):
        out = ops.attnres_mix(x, qw, nw)
    close(out, attnres_mix_reference(x, qw, nw, 1e-5), dtype)


@settings(max_examples=12)
@given(T=st.integers(1, 64), d=st.sampled_from([64, 2304, 7168]), S=st.sampled_from([1, 4, 8]), Q=st.integers(1, 25),
       dtype=st.sampled_from(DTYPES), state=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_two_phase_gpu(T, d, S, Q, dtype, state, seed):
    note(f"T={T} d={d} S={S} Q={Q} {dtype} state={state}")
    *x, part, upd = srcs(T, d, S + 2, dtype, seed)
    qw, nw = qn(d, seed, Q)
    pw = 0.5 + torch.rand(d, device=DEV)
    ref = attnres_phase1_reference(x, qw, nw, 1e-5, state)
    with backend("triton"):
        o, m, l = ops.attnres_phase1(x, qw, nw, 1e-5, state)
        r = ops.attnres_phase2(o[-1], m[-1], l[-1], part, qw[-1], nw[-1], update=upd, post_norm_weight=pw)
    close(m, ref[1], torch.float32)
    close(l, ref[2], torch.float32)
    close(o, ref[0], state)
    e = attnres_phase2_reference(o[-1], m[-1], l[-1], part, qw[-1], nw[-1], 1e-5, upd, pw)
    assert torch.equal(r.partial, part + upd)
    close(r.mix, e.mix, dtype)
    close(r.normed, e.normed, dtype)
    loose = torch.bfloat16 if torch.bfloat16 in (dtype, state) else dtype
    close(r.mix, attnres_mix_reference(x + [part + upd], qw[-1], nw[-1], 1e-5), loose)


@pytest.mark.parametrize("name", list(tm.MIX_SCHEDULES))
def test_mix_schedules_gpu(name):
    """Every named schedule (row / persistent stream kernel, L2 prefetch kinds, lazy rescale) vs eager at the K3
    width and an odd width (the bulk prefetch falls back to sectors), more rows than programs, and a source
    2 bytes off 16-byte alignment."""
    for T, d, S in ((300, 7168, 9), (1000, 7168, 2), (37, 4099, 5), (1, 7168, 9)):
        x = srcs(T, d, S, torch.bfloat16, T + S)
        qw, nw = qn(d, T)
        ref = attnres_mix_reference(x, qw, nw, 1e-5)
        close(tm.attnres_mix_triton(x, qw, nw, schedule=name), ref, torch.bfloat16)
        if tm.MIX_SCHEDULES[name].get("stream"):
            close(tm.attnres_mix_triton(x, qw, nw, schedule=name, grid=7), ref, torch.bfloat16)
    buf = torch.empty(37 * 7168 + 1, device=DEV, dtype=torch.bfloat16)
    x = srcs(37, 7168, 5, torch.bfloat16, 3)
    x[1] = buf[1:].view(37, 7168).copy_(x[1])
    qw, nw = qn(7168, 3)
    close(tm.attnres_mix_triton(x, qw, nw, schedule=name), attnres_mix_reference(x, qw, nw, 1e-5), torch.bfloat16)


def test_auto_picks_triton_and_graph_capture():
    x = srcs(1, 7168, 9, torch.bfloat16, 0)
    qw, nw = qn(7168, 0)
    assert resolve("attnres_mix", (x, qw, nw, 1e-5)).backend == "triton"
    ops.attnres_mix(x, qw, nw)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.attnres_mix(x, qw, nw)
    g.replay()
    torch.cuda.synchronize()
    close(out, attnres_mix_reference(x, qw, nw, 1e-5), torch.bfloat16)


def test_k3_depth_bf16_drift_gpu():
    L, block, d, T = 93, 12, 1024, 16
    q, gain, W = (t.to(DEV) for t in make_stack(L, d, 7, qscale=0.3))
    emb = torch.randn(T, d, device=DEV)
    with backend("eager"):
        ref = flow_mix(emb, q, gain, W, L, block, torch.float32)
        e0 = rel(flow_mix(emb, q, gain, W, L, block, torch.bfloat16), ref)
    with backend("triton"):
        errs = {"mix": rel(flow_mix(emb, q, gain, W, L, block, torch.bfloat16), ref),
                "two_phase": rel(flow_two_phase(emb, q, gain, W, L, block, torch.bfloat16), ref),
                "two_phase_bf16_state": rel(flow_two_phase(emb, q, gain, W, L, block, torch.bfloat16,
                                                           torch.bfloat16), ref),
                "fp32_two_phase": rel(flow_two_phase(emb, q, gain, W, L, block, torch.float32), ref)}
    print(f"93-layer relative error vs fp32 eager: eager bf16 {e0:.3e} {errs}")
    assert e0 < 4e-2
    assert errs.pop("fp32_two_phase") < 1e-4
    for k, e in errs.items():
        assert e < max(1.25 * e0, 1e-2), (k, e, e0)
