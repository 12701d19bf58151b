"""MLA decode on the GPU: Triton bf16 at K3 dims vs the eager reference, CUDA-graph capture, DCP over NCCL; the
CUDA warp-group kernel (sm_90)."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from k3nn import backend
from k3nn.kernels.mla.reference import mla_decode_reference
from k3nn.ops import mla_decode

pytestmark = pytest.mark.gpu
R, DR = 512, 64


def case(seed, lens, Tq, H, dtype=torch.bfloat16, bs=64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = [-(-n // bs) for n in lens]
    nb = sum(nblk) + 4
    pool = torch.full((nb, bs, R + DR), float("nan"), device="cuda", dtype=dtype)
    perm = torch.randperm(nb, device="cuda", generator=g)
    table = torch.full((len(lens), max(nblk) + 1), 10**6, dtype=torch.int32, device="cuda")
    k = 0
    for b, n in enumerate(lens):
        ids = perm[k:k + nblk[b]]
        k += nblk[b]
        table[b, : nblk[b]] = ids.int()
        rows = torch.randn(n, R + DR, device="cuda", generator=g).to(dtype)
        pool.view(-1, R + DR)[(ids.long()[:, None] * bs + torch.arange(bs, device="cuda")).view(-1)[:n]] = rows
    q = torch.randn(len(lens), Tq, H, R + DR, device="cuda", generator=g).to(dtype)
    return q[..., :R], q[..., R:], pool, table, torch.tensor(lens, dtype=torch.int32, device="cuda")


def _replay_matches_reference(g, out, q_lat, q_rope, pool, table, sl):
    """Replays the captured decode ``g`` into ``out`` (NaN-poisoned first) and checks it against the reference at
    the lengths ``sl`` now holds."""
    out[0].fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    o_ref, lse_ref = mla_decode_reference(q_lat, q_rope, pool, table, sl, 0.0722, out_dtype=torch.float32)
    torch.testing.assert_close(out[0].float(), o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out[1], lse_ref, atol=2e-2, rtol=2e-3)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(2, 3000), min_size=1, max_size=4), Tq=st.integers(1, 2),
       H=st.sampled_from([1, 16, 64, 96, 128]), splits=st.sampled_from([None, 1, 3, 17]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), seed=st.integers(0, 2**31 - 1))
def test_triton_matches_reference(lens, Tq, H, splits, dtype, seed):
    note(f"lens={lens} Tq={Tq} H={H} splits={splits} {dtype}")
    q_lat, q_rope, pool, table, sl = case(seed, lens, Tq, H, dtype)
    out = (torch.full(q_lat.shape, float("nan"), device="cuda", dtype=dtype),
           torch.full(q_lat.shape[:3], float("nan"), device="cuda"))
    with backend("triton"):
        o, lse = mla_decode(q_lat, q_rope, pool, table, sl, 0.0722, num_splits=splits, out=out)
    o_ref, lse_ref = mla_decode_reference(q_lat, q_rope, pool, table, sl, 0.0722, out_dtype=torch.float32)
    torch.testing.assert_close(o.float(), o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_ref, atol=2e-2, rtol=2e-3)


def test_fp32_exact_on_gpu():
    q_lat, q_rope, pool, table, sl = case(1, [700, 5], 2, 8, torch.float32)
    with backend("triton"):
        o, lse = mla_decode(q_lat, q_rope, pool, table, sl, 0.0722, num_splits=4)
    o_ref, lse_ref = mla_decode_reference(q_lat, q_rope, pool, table, sl, 0.0722)
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-4)


def test_cuda_graph_replay_follows_new_lengths():
    q_lat, q_rope, pool, table, sl = case(2, [1000, 300, 64], 1, 64)
    out = (torch.empty_like(q_lat), torch.empty(q_lat.shape[:3], device="cuda"))
    with backend("triton"):
        mla_decode(q_lat, q_rope, pool, table, sl, 0.0722, out=out)  # compile / tune outside capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            mla_decode(q_lat, q_rope, pool, table, sl, 0.0722, out=out, check=False)
    sl.copy_(torch.tensor([999, 17, 1], dtype=torch.int32))
    _replay_matches_reference(g, out, q_lat, q_rope, pool, table, sl)


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DCP over NCCL needs 2 GPUs (nvidia-h200-x2)")
@pytest.mark.parametrize("interleave", [1, 2])
def test_dcp_nccl_two_gpus(interleave):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, ["src", os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                        "k3nn.parallel.dcp", "--interleave", str(interleave), "--backend", "triton", "--tokens", "2"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("rel err") == 4  # 2 ranks × (replicated, sharded heads)


# ---- CUDA kernel (k3nn.kernels.mla.cuda_decode: the warp-group kernel, sm_90) ----

def _poisoned(q_lat, dtype):
    return (torch.full(q_lat.shape, float("nan"), device="cuda", dtype=dtype),
            torch.full(q_lat.shape[:3], float("nan"), device="cuda"))


@pytest.fixture
def cuda_mla(monkeypatch):
    """The registry's CUDA implementation with auto's small-call rule off (sm_90 only)."""
    from k3nn.kernels.mla import cuda_decode
    from k3nn.kernels.registry import get_op

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CUDA MLA decode kernel is built for sm_90 only")
    assert cuda_decode.available() is None, cuda_decode.available()
    monkeypatch.setattr(get_op("mla_decode").impls["cuda"], "auto_skip", None)
    return cuda_decode


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(1, 700), min_size=1, max_size=5), Tq=st.sampled_from([1, 2, 4]),
       H=st.sampled_from([1, 16, 64, 96]), splits=st.sampled_from([None, 1, 2, 5, 33]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), explicit_vis=st.booleans(),
       out_f32=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_cuda_matches_reference(cuda_mla, lens, Tq, H, splits, dtype, explicit_vis, out_f32, seed):
    """Shuffled pages (NaN in every unused pool row), lengths below Tq and rows that see no key (explicit
    visible lengths, zeros forced in), one split and several (more splits than key tiles too)."""
    if not explicit_vis:
        lens = [max(n, Tq) for n in lens]
    note(f"lens={lens} Tq={Tq} H={H} splits={splits} {dtype} vis={explicit_vis} out_f32={out_f32}")
    q_lat, q_rope, pool, table, sl = case(seed, lens, Tq, H, dtype)
    vis = None
    if explicit_vis:
        g = torch.Generator(device="cuda").manual_seed(seed + 1)
        vis = (torch.rand(len(lens), Tq, device="cuda", generator=g) * (sl[:, None] + 1)).int().clamp_max(sl[:, None])
        vis[0, 0] = 0  # a row that sees nothing
        vis[-1, -1] = sl[-1]
    odt = torch.float32 if out_f32 else dtype
    out = _poisoned(q_lat, odt)
    with backend("cuda"):
        o, lse = mla_decode(q_lat, q_rope, pool, table, sl, 0.0722, visible_lens=vis, num_splits=splits,
                            out_dtype=odt, out=out)
    assert o.data_ptr() == out[0].data_ptr()
    o_ref, lse_ref = mla_decode_reference(q_lat, q_rope, pool, table, sl, 0.0722, visible_lens=vis,
                                          out_dtype=torch.float32)
    torch.testing.assert_close(o.float(), o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_ref, atol=2e-2, rtol=2e-3)


def test_cuda_allocating_call_and_auto(cuda_mla):
    q_lat, q_rope, pool, table, sl = case(5, [130, 64, 2], 2, 16)  # every length >= Tq (mla_decode checks it)
    from k3nn.kernels.registry import resolve

    args = (q_lat, q_rope, pool, table, sl, 0.0722)
    assert resolve("mla_decode", args, {}, "auto").backend == "cuda"  # auto tries cuda first
    o, lse = mla_decode(*args)
    o_ref, lse_ref = mla_decode_reference(*args, out_dtype=torch.float32)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(o.float(), o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_ref, atol=2e-2, rtol=2e-3)
    print(f"mla cuda build/load {cuda_mla.last_build_seconds:.1f} s")


def test_cuda_split_counts_agree(cuda_mla):
    """The default split count, one split and six give the same result up to accumulation order (H=96: the second
    row tile is half empty; Tq=2: rows of two positions share a CTA)."""
    q_lat, q_rope, pool, table, sl = case(9, [1500, 33, 700], 2, 96)
    outs = {}
    for splits in (None, 1, 6):
        out = _poisoned(q_lat, torch.float32)
        cuda_mla.mla_decode_cuda(q_lat, q_rope, pool, table, sl, 0.0722, num_splits=splits, out=out)
        outs[splits] = out
    o_ref, lse_ref = mla_decode_reference(q_lat, q_rope, pool, table, sl, 0.0722, out_dtype=torch.float32)
    for splits, (o, lse) in outs.items():
        torch.testing.assert_close(o, o_ref, atol=2e-2, rtol=2e-2, msg=lambda m, s=splits: f"S={s}: {m}")
        torch.testing.assert_close(lse, lse_ref, atol=2e-2, rtol=2e-3)
        torch.testing.assert_close(o, outs[1][0], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("bs", [16, 24, 128])
def test_cuda_page_sizes_and_padded_pool_rows(cuda_mla, bs):
    """Pages other than 64 rows (a key tile then spans several pages, or part of one: one block-table read per
    row) and a pool whose rows are padded (row stride 640 elements), against the reference."""
    q_lat, q_rope, pool, table, sl = case(3, [700, 65, 1], 2, 64, bs=bs)
    padded = torch.full(pool.shape[:2] + (640,), float("nan"), device="cuda", dtype=pool.dtype)
    padded[..., :R + DR] = pool
    padded = padded[..., :R + DR]
    for kv in (pool, padded):
        for splits in (None, 1, 3):
            out = _poisoned(q_lat, q_lat.dtype)
            cuda_mla.mla_decode_cuda(q_lat, q_rope, kv, table, sl, 0.0722, num_splits=splits, out=out)
            o_ref, lse_ref = mla_decode_reference(q_lat, q_rope, kv, table, sl, 0.0722, out_dtype=torch.float32)
            torch.testing.assert_close(out[0].float(), o_ref, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(out[1], lse_ref, atol=2e-2, rtol=2e-3)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="sm_90")
@pytest.mark.parametrize("bs", [16, 64, 128])
def test_wgmma_tma_and_cp_async_loaders_give_the_same_bits(bs):
    """The wgmma kernel's two key-tile loaders (TMA boxes for pages of a multiple of 16 rows, per-thread cp.async
    for 24-row pages) put the same bytes in shared memory, zeros past each split's end included (the pool's unused
    rows are NaN): the same keys paged both ways give the same bits."""
    from k3nn.kernels.mla import cuda_decode

    lens = [1000, 64, 3, 130]
    q_lat, q_rope, pool, table, sl = case(5, lens, 2, 96, bs=bs)
    # the same keys again in 24-row pages (no TMA: the cp.async loader)
    keys = [pool[table[b, : -(-n // bs)].long()].reshape(-1, R + DR)[:n] for b, n in enumerate(lens)]
    nblk24 = [-(-n // 24) for n in lens]
    pool24 = torch.full((sum(nblk24) + 1, 24, R + DR), float("nan"), device="cuda", dtype=pool.dtype)
    table24 = torch.full((len(lens), max(nblk24) + 1), 10**6, dtype=torch.int32, device="cuda")
    k = 0
    for b, n in enumerate(lens):
        table24[b, : nblk24[b]] = torch.arange(k, k + nblk24[b], dtype=torch.int32, device="cuda").flip(0)
        pool24.view(-1, R + DR)[(table24[b, : nblk24[b]].long()[:, None] * 24 + torch.arange(24, device="cuda"))
                               .view(-1)[:n]] = keys[b]
        k += nblk24[b]
    outs = []
    for kv, tab in ((pool, table), (pool24, table24)):
        for splits in (1, 5):
            out = _poisoned(q_lat, torch.float32)
            cuda_decode.mla_decode_cuda(q_lat, q_rope, kv, tab, sl, 0.0722, num_splits=splits, out=out)
            outs.append(out)
    for a, b in zip(outs[:2], outs[2:]):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    o_ref, lse_ref = mla_decode_reference(q_lat, q_rope, pool, table, sl, 0.0722, out_dtype=torch.float32)
    torch.testing.assert_close(outs[0][0], o_ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("splits", [None, 1, 7])
def test_cuda_kernel_graph_replay_follows_new_lengths(cuda_mla, splits):
    q_lat, q_rope, pool, table, sl = case(2, [1000, 300, 64], 1, 64)
    out = _poisoned(q_lat, q_lat.dtype)
    with backend("cuda"):
        mla_decode(q_lat, q_rope, pool, table, sl, 0.0722, num_splits=splits, out=out)  # build outside capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            mla_decode(q_lat, q_rope, pool, table, sl, 0.0722, num_splits=splits, out=out, check=False)
    sl.copy_(torch.tensor([999, 17, 1], dtype=torch.int32))
    _replay_matches_reference(g, out, q_lat, q_rope, pool, table, sl)


@pytest.mark.parametrize("Tq", [1, 2])
def test_cuda_k3_sized(cuda_mla, Tq):
    """B=4 L=4096 H=64 (K3 at TP=1), bf16, default splits, against the reference and the Triton kernel."""
    q_lat, q_rope, pool, table, sl = case(11, [4096] * 4, Tq, 64)
    with backend("cuda"):
        o, lse = mla_decode(q_lat, q_rope, pool, table, sl, 0.0722, out=_poisoned(q_lat, q_lat.dtype))
    with backend("triton"):
        o_tr, lse_tr = mla_decode(q_lat, q_rope, pool, table, sl, 0.0722)
    o_ref, lse_ref = mla_decode_reference(q_lat, q_rope, pool, table, sl, 0.0722, out_dtype=torch.float32)
    torch.testing.assert_close(o.float(), o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_ref, atol=2e-2, rtol=2e-3)
    err = ((o.float() - o_ref).norm() / o_ref.norm()).item()
    err_tr = ((o_tr.float() - o_ref).norm() / o_ref.norm()).item()
    assert err < 2 * err_tr + 1e-3, (err, err_tr)
    torch.testing.assert_close(lse, lse_tr, atol=1e-2, rtol=1e-3)


_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                           reason="the wgmma kernel is built for sm_90 only")


@_sm90
@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.integers(1, 3000), min_size=1, max_size=3), Tq=st.sampled_from([1, 2]),
       H=st.sampled_from([16, 64, 96]), cluster=st.integers(2, 8), mult=st.sampled_from([1, 2, 5]),
       explicit_vis=st.booleans(), out_f32=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_wgmma_cluster_merge_matches_combine(lens, Tq, H, cluster, mult, explicit_vis, out_f32, seed):
    """Splits merged in clusters through distributed shared memory against the same splits merged by the combine
    kernel alone (to fp32 rounding) and the reference: rows that see no key, H=96's half-empty second row tile,
    splits past the keys, and (mult = 1) a cluster holding every split, which writes o and lse itself."""
    from k3nn.kernels.mla import cuda_decode

    lens = lens if explicit_vis else [max(n, Tq) for n in lens]
    note(f"lens={lens} Tq={Tq} H={H} cluster={cluster} splits={cluster * mult} vis={explicit_vis}")
    q_lat, q_rope, pool, table, sl = case(seed, lens, Tq, H)
    vis = None
    if explicit_vis:
        g = torch.Generator(device="cuda").manual_seed(seed + 1)
        vis = (torch.rand(len(lens), Tq, device="cuda", generator=g) * (sl[:, None] + 1)).int().clamp_max(sl[:, None])
        vis[0, 0] = 0
    odt = torch.float32 if out_f32 else q_lat.dtype
    outs = []
    for c in (1, cluster):
        out = _poisoned(q_lat, odt)
        cuda_decode.mla_decode_cuda(q_lat, q_rope, pool, table, sl, 0.0722, visible_lens=vis,
                                    num_splits=cluster * mult, out=out, cluster=c)
        assert cuda_decode.LAST_CALL == (cluster * mult, c)
        outs.append(out)
    (o1, l1), (oc, lc) = outs
    if out_f32:
        torch.testing.assert_close(oc, o1, atol=1e-5, rtol=1e-5)
    else:  # one rounding to 16 bits apart at most
        torch.testing.assert_close(oc.float(), o1.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lc, l1, atol=1e-5, rtol=1e-6)
    o_ref, lse_ref = mla_decode_reference(q_lat, q_rope, pool, table, sl, 0.0722, visible_lens=vis,
                                          out_dtype=torch.float32)
    torch.testing.assert_close(oc.float(), o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lc, lse_ref, atol=2e-2, rtol=2e-3)


@_sm90
@pytest.mark.parametrize("cluster", [2, 3, 4, 7, 8])
def test_wgmma_cluster_default_plan_and_graph_replay(cluster):
    """KernelTuning.mla_cluster picks the cluster size; the default plan (one wave of resident clusters) at B=1
    L=32K H=64, captured in a CUDA graph and replayed with new lengths."""
    from k3nn.kernels.mla import cuda_decode
    from k3nn.kernels.registry import tuning

    q_lat, q_rope, pool, table, sl = case(4, [32768], 1, 64)
    waves = cuda_decode.max_clusters(torch.cuda.current_device(), cluster)
    assert waves * cluster <= torch.cuda.get_device_properties(0).multi_processor_count, waves
    out = _poisoned(q_lat, q_lat.dtype)
    with backend("cuda"), tuning(mla_cluster=cluster):
        mla_decode(q_lat, q_rope, pool, table, sl, 0.0722, out=out)
        S, C = cuda_decode.LAST_CALL
        assert C == cluster and S % C == 0 and S // C <= waves, (S, C, waves)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            mla_decode(q_lat, q_rope, pool, table, sl, 0.0722, out=out, check=False)
    for n in (32768, 5000, 1):
        sl.fill_(n)
        _replay_matches_reference(g, out, q_lat, q_rope, pool, table, sl)
