"""Public API: backend selection and errors on bad input."""

import pytest
import torch

import k3nn
from k3nn import BackendUnavailableError, KimiK3, KimiK3Config, ops
from k3nn.kernels import registry


@pytest.fixture(scope="module")
def model():
    return KimiK3(KimiK3Config.tiny(), seed=0).eval()


def test_backend_context_manager_nests_and_restores(monkeypatch):
    monkeypatch.delenv("K3NN_BACKEND", raising=False)
    assert k3nn.current_backend() == "auto"
    with k3nn.backend("eager"):
        assert k3nn.current_backend() == "eager"
        with k3nn.backend("triton"):
            assert k3nn.current_backend() == "triton"
        assert k3nn.current_backend() == "eager"
    assert k3nn.current_backend() == "auto"
    monkeypatch.setenv("K3NN_BACKEND", "eager")
    assert k3nn.current_backend() == "eager"
    monkeypatch.setenv("K3NN_BACKEND", "tpu")
    with pytest.raises(ValueError, match="K3NN_BACKEND"):
        k3nn.current_backend()


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        with k3nn.backend("fast"):
            pass
    with pytest.raises(ValueError, match="unknown backend"):
        KimiK3(KimiK3Config.tiny(), backend="fast")


def test_explicit_backend_that_cannot_run_lists_reasons(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = [torch.randn(2, 8) for _ in range(3)]
    w = torch.randn(8)
    with k3nn.backend("cuda"):
        with pytest.raises(BackendUnavailableError) as e:
            ops.attnres_mix(x, w, w)
    msg = str(e.value)
    assert "attnres_mix" in msg and "eager: ok" in msg
    with k3nn.backend("triton"):
        with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
            ops.attnres_mix(x, w, w)


def test_auto_falls_back_to_eager_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    impl = registry.resolve("kda_chunk", (torch.randn(1, 2, 1, 4),) * 3, {})
    assert impl.backend == "eager"


def test_available_backends_reports_every_op():
    av = k3nn.available_backends()
    for op in ("kda_chunk", "kda_recurrent", "attnres_mix", "moe_experts"):
        assert av[op]["eager"] == "ok"
        assert set(av[op]) == {"eager", "triton", "cuda"}


def test_every_backend_shares_the_reference_signature():
    import inspect

    for name, op in registry.ops().items():
        ref = op.impls.get("eager")
        for b, impl in op.impls.items():
            if b == "eager":
                continue
            p_ref = list(inspect.signature(ref.fn).parameters)
            sig = inspect.signature(impl.fn).parameters
            p_impl = list(sig)
            # same parameters in the same order; a backend may add trailing tuning knobs with defaults
            assert p_impl[: len(p_ref)] == p_ref, (name, b, p_impl, p_ref)
            extra = [p for p in p_impl[len(p_ref):] if sig[p].default is inspect.Parameter.empty
                     and sig[p].kind is not inspect.Parameter.VAR_KEYWORD]
            assert not extra, (name, b, extra)


def test_per_model_backend(model):
    m = KimiK3(KimiK3Config.tiny(), backend="eager", seed=0)
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad(), k3nn.backend("cuda"):  # the model's own choice wins inside its forward
        out = m(ids).logits
    assert out.shape == (1, 5, 256)


@pytest.mark.parametrize("bad, err, match", [
    (torch.zeros(5, dtype=torch.long), ValueError, r"\[batch, seq_len\]"),
    (torch.zeros(1, 5), TypeError, "int64"),
    (torch.full((1, 3), 256), ValueError, "vocab_size"),
    (torch.full((1, 3), -1), ValueError, "vocab_size"),
    (torch.zeros(1, 0, dtype=torch.long), ValueError, "empty"),
])
def test_bad_input_ids(model, bad, err, match):
    with pytest.raises(err, match=match):
        model(bad)


def test_generate_bad_arguments(model):
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="empty"):
        model.generate(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(ids, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(ids, top_p=1.5)
    with pytest.raises(ValueError, match="left padding"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0]]))
    with pytest.raises(TypeError, match="unknown generation argument"):
        model.generate(ids, num_beam=4)
    with pytest.raises(NotImplementedError, match="beam search"):
        model.generate(ids, num_beams=4)


def test_cache_errors(model):
    cache = model.new_cache(1, 4)
    model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="cache exhausted"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="batch_size"):
        model(torch.zeros(2, 1, dtype=torch.long), cache=model.new_cache(1, 4))
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4))


def test_kda_op_bad_inputs():
    q = torch.randn(1, 4, 2, 8)
    v = torch.randn(1, 4, 2, 8)
    g = -torch.rand(1, 4, 2, 8)
    b = torch.rand(1, 4, 2)
    with pytest.raises(ValueError, match="initial_state"):
        ops.kda_chunk(q, q, v, g, b, initial_state=torch.zeros(1, 2, 8, 4))
    with pytest.raises(TypeError, match="float32"):
        ops.kda_chunk(q, q, v, g, b, initial_state=torch.zeros(1, 2, 8, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="start at 0"):
        ops.kda_chunk(q, q, v, g, b, cu_seqlens=torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="end at T"):
        ops.kda_chunk(q, q, v, g, b, cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="non-decreasing"):
        ops.kda_chunk(q, q, v, g, b, cu_seqlens=torch.tensor([0, 3, 2, 4]))
    with pytest.raises(ValueError, match="outside sequence"):
        ops.kda_chunk(q, q, v, g, b, checkpoint_positions=[5])
    with pytest.raises(ValueError, match="K must be <= 256"):
        z = torch.randn(1, 1, 1, 257)
        ops.kda_chunk(z, z, z, z, torch.rand(1, 1, 1))
    with pytest.raises(ValueError, match="beta"):
        ops.kda_chunk(q, q, v, g, torch.rand(1, 4, 3))
