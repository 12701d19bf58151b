"""The kernel tuning object (``k3nn.kernels.registry.KernelTuning`` / ``tuning``) and the registry's ``auto_skip``."""

import threading

import pytest

import k3nn
from k3nn.kernels import registry as reg
from k3nn.kernels.registry import KernelTuning, current_tuning, tuning


def test_defaults_nesting_and_restore():
    base = current_tuning()
    assert base == KernelTuning() and base.autotune and base.kda_decode_head_min == 256
    assert base.mla_decode_tile is None and base.mla_cluster is None
    with tuning(autotune=False) as t1:
        assert current_tuning() is t1 and not t1.autotune
        with tuning(mla_cluster=4) as t2:
            assert t2 == KernelTuning(autotune=False, mla_cluster=4)  # changes stack on the current one
        with tuning(KernelTuning(kda_decode_head_min=1)) as t3:
            assert t3.autotune and t3.kda_decode_head_min == 1  # a whole object replaces it
        assert current_tuning() is t1
    assert current_tuning() == base


def test_frozen_and_checked():
    t = KernelTuning()
    with pytest.raises(AttributeError):
        t.autotune = False  # type: ignore[misc]
    with pytest.raises(TypeError, match="autotune"):
        KernelTuning(autotune=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pdl"):
        KernelTuning(pdl=1)  # type: ignore[arg-type]
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="mla_cluster"):
            KernelTuning(mla_cluster=bad)  # type: ignore[arg-type]
    for bad in ((64, 32, 8), [64, 32, 8, 2], (64, 32, 8, "2"), tuple(range(10))):
        with pytest.raises(ValueError, match="mla_decode_tile"):
            KernelTuning(mla_decode_tile=bad)  # type: ignore[arg-type]
    assert KernelTuning(mla_decode_tile=(64, 32, 8, 2)).mla_decode_tile == (64, 32, 8, 2)
    with pytest.raises(TypeError, match="unknown field"):
        with tuning(autotuning=False):
            pass
    with pytest.raises(TypeError, match="KernelTuning"):
        with tuning({"autotune": False}):  # type: ignore[arg-type]
            pass


def test_other_threads_keep_the_defaults():
    seen = []
    with tuning(autotune=False):
        th = threading.Thread(target=lambda: seen.append(current_tuning().autotune))
        th.start()
        th.join()
    assert seen == [True]


def test_autotune_prune_follows_the_tuning():
    cfgs = ["a", "b", "c"]
    assert reg.autotune_prune(cfgs, {}) == cfgs
    with tuning(autotune=False):
        assert reg.autotune_prune(cfgs, {}) == ["a"]


@pytest.fixture
def fake_op():
    name = "_test_auto_skip_op"
    reg.register(name, "eager")(lambda x: ("eager", x))
    reg.register(name, "cuda", auto_skip=lambda x: "small input: eager is faster" if x < 10 else None)(
        lambda x: ("cuda", x))
    yield name
    reg._OPS.pop(name, None)


def test_auto_skip_applies_to_auto_only(fake_op):
    assert reg.dispatch(fake_op, 50) == ("cuda", 50)
    assert reg.dispatch(fake_op, 3) == ("eager", 3)  # auto passes over cuda for this call
    with k3nn.backend("cuda"):
        assert reg.dispatch(fake_op, 3) == ("cuda", 3)  # an explicit backend still runs it
    assert "auto passes over it: small input" in reg._reasons(reg.get_op(fake_op), (3,), {})


def test_failing_auto_skip_check_is_a_reason(fake_op):
    reg.register(fake_op, "triton", auto_skip=lambda x: 1 / 0)(lambda x: ("triton", x))
    assert reg.dispatch(fake_op, 3) == ("eager", 3)
    assert "auto_skip() check failed: ZeroDivisionError" in reg._reasons(reg.get_op(fake_op), (3,), {})


def test_programmatic_dependent_launch_only_on_sm90_gpus():
    """PDL (``KernelTuning.pdl``) needs a CUDA device of sm_90+ and is never asked of the CPU or the interpreter: the
    kernels then compile without the trigger, the prefetch and the wait."""
    import torch

    from k3nn.kernels.pdl import pdl_on

    x = torch.zeros(2)
    assert not pdl_on(x)
    with tuning(pdl=False):
        assert not pdl_on(x)
