"""Decode paths of generate(): the graph-safe static step and the latency-specialized step (prepared decode
weights, MLA through the pool decode kernel) give the same tokens (and logits up to rounding) as the standard
step; unsupported batches fall back."""

import pytest
import torch
from safetensors.torch import load_file, save_file

import bench.gpu.decode_launches as dl
from k3nn import KimiK3, KimiK3Config
from k3nn.cache.hybrid import HybridCache
from k3nn.decode.runner import DecodeRunner, latency_unsupported, make_decode_runner, standard_step

KIMI_LINEAR_TINY = dict(use_attn_res=False, kda_gate="softplus", use_full_rank_gate=False, moe_kind="standard",
                        routed_expert_hidden_size=None, mla_use_output_gate=False, q_lora_rank=None,
                        mla_use_nope=False, hidden_act="silu")


@pytest.fixture(scope="module")
def k3():
    return KimiK3(KimiK3Config.tiny(), seed=0)


@pytest.fixture(scope="module")
def kimi_linear():
    return KimiK3(KimiK3Config.tiny(**KIMI_LINEAR_TINY), seed=1)


def _prompt(B, T, seed, padded):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if padded:
        for b in range(1, B):
            mask[b, : (b * 2) % T] = 0
    return ids, mask


@pytest.mark.parametrize("B,T,seed,padded", [(1, 5, 0, False), (3, 7, 1, True)])
def test_static_step_same_tokens_as_standard(k3, B, T, seed, padded):
    ids, mask = _prompt(B, T, seed, padded)
    a = k3.generate(ids, attention_mask=mask, max_new_tokens=8, cuda_graph=False)
    assert k3.last_decode_info["mode"] == "standard"
    b = k3.generate(ids, attention_mask=mask, max_new_tokens=8, cuda_graph="static")
    assert k3.last_decode_info["mode"] == "static"
    assert torch.equal(a, b)


def test_static_sampling_same_tokens_as_standard(k3):
    ids, mask = _prompt(2, 6, 3, True)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20, top_p=0.9, seed=7)
    assert torch.equal(k3.generate(ids, cuda_graph=False, **kw), k3.generate(ids, cuda_graph="static", **kw))


def _step_logits(model, cache_kw, runner_kw, ids, n):
    B, T = ids.shape
    cache = HybridCache(model.config, B, T + n + 1, model.dtype, model.device, **cache_kw)
    logits = model(ids, cache=cache).logits[:, -1]
    run = make_decode_runner(model, cache, **runner_kw)
    outs = []
    for _ in range(n):
        nxt = logits.argmax(-1)
        logits = run(nxt[:, None]).clone()
        outs.append(logits)
    run.close()
    return torch.stack(outs), cache, run


@pytest.mark.parametrize("which", ["k3", "kimi_linear"])
def test_latency_specialized_matches_standard(which, request):
    model = request.getfixturevalue(which)
    ids, _ = _prompt(2, 6, 11, False)
    ref, cache_a, _ = _step_logits(model, {}, dict(cuda_graph=False), ids, 5)
    out, cache_b, run = _step_logits(model, dict(mla_pool=True), dict(decode_backend="latency_specialized"), ids, 5)
    assert run.name == "latency_specialized" and run.mode == "static"
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert cache_a.seen_tokens == cache_b.seen_tokens == 11
    assert int(cache_b.write_pos) == 11
    for sa, sb in zip(cache_a.layers, cache_b.layers):  # the caches hold the same state afterwards
        if hasattr(sa, "recurrent"):
            torch.testing.assert_close(sb.recurrent, sa.recurrent, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(sb.conv, sa.conv)
        else:
            torch.testing.assert_close(sb.latent, sa.latent, atol=1e-6, rtol=1e-5)
    a = model.generate(ids, max_new_tokens=6, cuda_graph=False)
    b = model.generate(ids, max_new_tokens=6, decode_backend="latency_specialized")
    assert model.last_decode_info["path"] == "latency_specialized"
    assert torch.equal(a, b)


def test_prepared_weights_follow_their_sources():
    """Packed decode weights are rebuilt when a source changes: in place, or replaced (``assign`` loading)."""
    model = KimiK3(KimiK3Config.tiny(), seed=5)
    other = KimiK3(KimiK3Config.tiny(), seed=6)
    ids, _ = _prompt(2, 6, 13, False)
    model.prepare_decode()
    try:
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)  # in place
        model.load_state_dict({k: v for k, v in other.state_dict().items() if "layers.1." in k}, strict=False,
                              assign=True)  # replaced parameters
        prepared, _, _ = _step_logits(model, {}, dict(cuda_graph=False), ids, 3)
        model.prepare_decode(False)
        plain, _, _ = _step_logits(model, {}, dict(cuda_graph=False), ids, 3)
        torch.testing.assert_close(prepared, plain, atol=2e-5, rtol=1e-4)
    finally:
        model.prepare_decode(False)


def test_prepared_weights_hold_no_copy(tmp_path):
    """Packing re-points the projections' parameters at the packed buffer: no second copy, the same parameter
    objects, in-place updates seen without packing again, a replaced parameter packed again at the next use, and
    a prepared model saves and loads like any other."""
    model = KimiK3(KimiK3Config.tiny(), seed=7)
    attn = model.model.layers[0].self_attn  # KDA
    params = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.b_proj.weight]
    before = [p.detach().clone() for p in params]
    model.prepare_decode()
    packed = attn._decode_in.weight
    assert [p is q for p, q in zip(params, [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                                            attn.b_proj.weight])] == [True] * 4
    for p, b in zip(params, before):
        assert p.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
        assert torch.equal(p, b)
    model.prepare_decode()  # packing again keeps the buffer (graphs captured over it stay valid)
    assert attn._decode_in.weight is packed
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)
    assert attn._decode_in.get() is packed  # an in-place update is an update of the packed buffer
    C = attn.q_proj.weight.shape[0]
    assert torch.equal(packed[C:2 * C], 2 * before[1])

    ids, _ = _prompt(1, 20, 3, False)
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = KimiK3.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref, atol=1e-5, rtol=1e-5)
    _sharded_save_copies_one_shard_at_a_time(model, tmp_path / "sharded", ids, ref)

    model.to(torch.float64)  # every parameter replaced: packed again at the next forward, in the new dtype
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.float(), ref, atol=1e-4, rtol=1e-4)
    assert attn._decode_in.weight.dtype == torch.float64
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn._decode_in.weight.untyped_storage().data_ptr()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # training updates the packed rows through the parameters
    model(ids).logits.float().square().mean().backward()
    opt.step()
    assert attn._decode_in.shared()
    with torch.no_grad():
        assert torch.equal(attn._decode_in.get()[:C], attn.q_proj.weight)

    sd = {k: v.detach() for k, v in model.state_dict().items()}  # packed: rows of one buffer, disjoint
    save_file(sd, str(tmp_path / "packed.safetensors"))  # safetensors' save_file takes disjoint views
    back = load_file(str(tmp_path / "packed.safetensors"))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)

    kept = attn.k_proj.weight.detach().clone()
    model.prepare_decode(False)  # each parameter gets its own storage back
    assert attn.k_proj.weight.untyped_storage().nbytes() == attn.k_proj.weight.nbytes
    assert torch.equal(attn.k_proj.weight, kept)
    save_file({k: v.detach() for k, v in model.state_dict().items()}, str(tmp_path / "plain.safetensors"))


@pytest.mark.parametrize("which", ["k3", "kimi_linear"])
def test_prepared_weights_serve_the_prefill(which, request):
    """Prepared weights serve prompts too (any length, without autograd): the same logits and cached state as the
    plain layers, one GEMM instead of KDA's six input projections (and no concatenation of q | k | v or of the
    conv kernels) and of MLA's q | kv_a (| gate)."""
    model = request.getfixturevalue(which)
    ids, _ = _prompt(2, 24, 17, False)  # longer than the fused decode paths take: the prefill path

    def prefill():
        cache = model.new_cache(2, 32)
        with torch.no_grad(), dl.AtenOps() as ops_run:
            logits = model(ids, cache=cache).logits
        return logits, cache, ops_run.n

    was = model.decode_prepared  # the module's models may come prepared by an earlier generate()
    try:
        model.prepare_decode(False)
        ref, cache_a, plain = prefill()
        model.prepare_decode()
        out, cache_b, prepared = prefill()
    finally:
        model.prepare_decode(was)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for sa, sb in zip(cache_a.layers, cache_b.layers):
        if hasattr(sa, "recurrent"):
            torch.testing.assert_close(sb.recurrent, sa.recurrent, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(sb.conv, sa.conv, atol=1e-6, rtol=1e-5)
        else:  # one GEMM for q | kv_a: another fp32 summation order (AVX-512 kernels differ by ~1.5e-6 here)
            torch.testing.assert_close(sb.latent, sa.latent, atol=1e-5, rtol=1e-4)
    attn = [layer.self_attn for layer in model.model.layers]
    n_kda = sum(hasattr(a, "q_conv1d") for a in attn)
    n_mla = len(attn) - n_kda
    gemms = lambda n: n["mm"] + n["addmm"]  # noqa: E731
    assert n_kda and n_mla
    assert gemms(plain) - gemms(prepared) >= 5 * n_kda + n_mla
    assert plain["cat"] - prepared["cat"] >= 2 * n_kda


def test_static_step_logits_match_standard(kimi_linear):
    ids, _ = _prompt(2, 4, 5, False)
    ref, _, _ = _step_logits(kimi_linear, {}, dict(cuda_graph=False), ids, 4)
    out, _, _ = _step_logits(kimi_linear, {}, dict(cuda_graph="static"), ids, 4)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_latency_specialized_falls_back(k3):
    ids, mask = _prompt(3, 7, 2, True)
    a = k3.generate(ids, attention_mask=mask, max_new_tokens=4, cuda_graph=False)
    b = k3.generate(ids, attention_mask=mask, max_new_tokens=4, decode_backend="latency_specialized")
    assert k3.last_decode_info["path"] == "standard"
    assert torch.equal(a, b)
    plain = HybridCache(k3.config, 1, 8)
    assert "mla_pool" in latency_unsupported(k3, plain, None)
    assert latency_unsupported(k3, HybridCache(k3.config, 1, 8, mla_pool=True), None) is None


def test_pool_view_shares_memory(k3):
    cache = HybridCache(k3.config, 2, 70, mla_pool=True)
    st = cache.layers[1]
    pool, table = st.pool()
    assert pool.shape == (2 * 2, 64, k3.config.kv_lora_rank + k3.config.qk_rope_head_dim)
    st.latent[1, 65] = 3.0
    assert torch.all(pool[int(table[1, 1]), 1, : k3.config.kv_lora_rank] == 3.0)
    with pytest.raises(ValueError, match="mla_pool"):
        HybridCache(k3.config, 1, 8).layers[1].pool()


def test_runner_arguments(k3):
    cache = k3.new_cache(1, 4)
    with pytest.raises(ValueError, match="mode"):
        DecodeRunner(standard_step(k3, cache), cache, mode="fast")
    with pytest.raises(ValueError, match="decode_backend"):
        make_decode_runner(k3, cache, decode_backend="fastest")
    with pytest.raises(ValueError, match="cuda_graph"):
        make_decode_runner(k3, cache, cuda_graph="yes")
    with pytest.raises(ValueError, match="decode_backend"):
        k3.generate(torch.ones(1, 2, dtype=torch.long), max_new_tokens=2, decode_backend="fastest")
    # graphs requested on CPU: the static step (no capture) runs
    run = make_decode_runner(k3, cache, cuda_graph=True)
    assert run.mode == "static" and cache.static
    assert run.graph is None and not run.uses_graph  # nothing captured (the roofline bench replays run.graph)
    run.close()
    assert not cache.static


def test_latency_specialized_k3_structure_matches_standard():
    """k3_slice's structure at tiny widths (8 layers, two AttnRes blocks, MLA at 3 and 7, MXFP4 latent MoE with
    two shared experts, routed scaling): the fused step (residual adds folded into the AttnRes merges, shared
    experts' down projection accumulated onto the routed output, q rows permuted) == the standard step."""
    model = KimiK3(dl.k3_like_tiny(routed_scaling_factor=2.5), seed=3)
    ids, _ = _prompt(2, 6, 12, False)
    ref, _, _ = _step_logits(model, {}, dict(cuda_graph=False), ids, 4)
    out, _, run = _step_logits(model, dict(mla_pool=True), dict(decode_backend="latency_specialized"), ids, 4)
    assert run.name == "latency_specialized"
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_latency_specialized_launch_count():
    """The CPU proxy of kernel launches per layer (bench/gpu/decode_launches.py): fewer than the standard step,
    and no more than measured after issue 9 (41.5 per layer, eager forms of the small kernels)."""
    model = KimiK3(dl.k3_like_tiny(), seed=0).to(torch.bfloat16)
    L = model.config.num_hidden_layers
    fused = dl.launches(model, path="latency_specialized")
    std = dl.launches(model, path="standard")
    assert sum(fused.values()) < sum(std.values())
    assert sum(fused.values()) / L <= 42
    for op in ("isfinite", "all", "sort", "argsort"):  # no finite check / sort-based routing in the fused step
        assert op not in fused


def test_tensor_subclass_weights_are_not_packed():
    """Weights that are tensor subclasses (DTensor after fully_shard) are left unpacked; a packed weight replaced
    by one later is a clear error, not a silent re-pointing."""

    class Sub(torch.Tensor):
        pass

    model = KimiK3(KimiK3Config.tiny(), seed=8)
    attn = model.model.layers[0].self_attn
    q = attn.q_proj
    q.weight = torch.nn.Parameter(torch.Tensor._make_subclass(Sub, q.weight.detach().clone()))
    model.prepare_decode()
    assert attn._decode_in is None and attn._decode_conv is not None
    ids, _ = _prompt(1, 20, 9, False)
    with torch.no_grad():
        model(ids)  # the plain projections (and the packed conv kernels)

    other = KimiK3(KimiK3Config.tiny(), seed=8).prepare_decode()
    k = other.model.layers[0].self_attn.k_proj
    k.weight = torch.nn.Parameter(torch.Tensor._make_subclass(Sub, k.weight.detach().clone()))
    with torch.no_grad(), pytest.raises(TypeError, match="prepare_decode\\(False\\)"):
        other(ids)


@pytest.mark.parametrize("mode", ["standard", "static"])
def test_steps_without_a_graph_run_as_uncaptured(k3, mode):
    """A decode step that never replays a graph runs under ``KernelTuning.uncaptured``: its time is the host's
    launches, and ``auto`` takes the kernels that launch cheapest (the skinny GEMM steps aside)."""
    from k3nn.kernels.registry import current_tuning

    cache = k3.new_cache(1, 4)
    seen = []
    run = DecodeRunner(lambda ids: seen.append(current_tuning().uncaptured) or ids, cache, mode=mode)
    run(torch.ones(1, 1, dtype=torch.long))
    run.close()
    assert seen == [True] and not current_tuning().uncaptured


def _sharded_save_copies_one_shard_at_a_time(model, path, ids, ref):
    """A prepared model saved in shards: the packed views are copied while their shard is written (never all
    before the first write), and the shards load back to the same logits."""
    import safetensors.torch

    import k3nn.checkpoint.io as io

    events = []
    copy, write = io._own_storage, safetensors.torch.save_file

    def own_storage(t):
        out = copy(t)
        events.append("copy" if out.data_ptr() != t.data_ptr() else "keep")
        return out

    def save_file(tensors, filename, metadata=None):
        events.append(("write", len(tensors)))
        return write(tensors, filename, metadata)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(io, "_own_storage", own_storage)
        mp.setattr(safetensors.torch, "save_file", save_file)
        model.save_pretrained(path, max_shard_size="100KB")
    writes = [e for e in events if isinstance(e, tuple)]
    assert len(writes) > 1 and (path / "model.safetensors.index.json").exists()
    first = events.index(writes[0])
    assert first == writes[0][1]  # before the first write: only that shard's tensors were prepared
    assert "copy" in events  # packed views were copied (per shard)
    loaded = KimiK3.from_pretrained(path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref, atol=1e-5, rtol=1e-5)
    model.save_pretrained(path)  # one file now: the earlier shards and index are gone
    assert sorted(p.name for p in path.glob("model*")) == ["model.safetensors"]
