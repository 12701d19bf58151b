"""One behaviour for bad input across the Python API: devices (``from_pretrained(device=)``, ``device_map``, the
shared :func:`k3nn.utils.resolve_device`), ``max_new_tokens=0`` (``generate()`` and the Engine agree), sampling
arguments without ``do_sample`` (one UserWarning, transformers' rule), and CPU threads (chosen by entry points
only: the library never changes torch's thread settings)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from k3nn import KimiK3, KimiK3Config
from k3nn.utils import auto_threads, configure_threads, parse_threads, resolve_device

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny():
    return KimiK3(KimiK3Config.tiny(), seed=0).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny):
    d = tmp_path_factory.mktemp("tiny")
    tiny.save_pretrained(d)
    return d


# ------------------------------------------------------------------------------------------------------ devices
@pytest.mark.parametrize("device,match", [
    ("tpu", "device must be a device such as 'cpu', 'cuda'"),
    ("cuda:x", "got 'cuda:x'"),
    ("", "got ''"),
    pytest.param("cuda", "device='cuda' is not available here", marks=pytest.mark.skipif(not NO_CUDA, reason="GPU")),
    pytest.param("cuda:0", "not available here", marks=pytest.mark.skipif(not NO_CUDA, reason="GPU")),
    pytest.param("mps", "not available here",
                 marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="MPS")),
    ("hpu", "not available here"),
])
def test_resolve_device_refuses_by_name(device, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        resolve_device(device)


def test_resolve_device_accepts_what_exists():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("meta")).type == "meta"
    with pytest.raises(TypeError, match="device must be a torch.device"):
        resolve_device(None)
    with pytest.raises(ValueError, match="index >= 0"):
        resolve_device(-1)
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match="not available here" if NO_CUDA else "does not exist"):
        resolve_device(n + 3, "gpu")


@pytest.mark.parametrize("kw,match", [
    (dict(device="tpu"), "device must be a device"),
    pytest.param(dict(device="cuda"), "device='cuda' is not available here",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="GPU")),
    pytest.param(dict(device_map="cuda:0"), "device_map='cuda:0' is not available here",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="GPU")),
    pytest.param(dict(device_map=0), "device_map=0 is not available here",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="GPU")),
    (dict(device_map="bogus"), "device_map must be a device"),
])
def test_from_pretrained_device_errors(saved, kw, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        KimiK3.from_pretrained(saved, **kw)


def test_a_bad_device_fails_before_any_download(monkeypatch):
    import huggingface_hub

    def no_download(*a, **k):
        raise AssertionError("snapshot_download was called")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    with pytest.raises(ValueError, match="device must be a device"):
        KimiK3.from_pretrained("someone/some-model", device="tpu")


# ------------------------------------------------------------------------------------------- max_new_tokens = 0
def test_zero_new_tokens_is_an_error_in_generate_and_the_engine(tiny):
    from k3nn.engine import Engine, SamplingParams

    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        tiny.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        Engine(tiny, max_num_seqs=1, num_pages=4).add_request([1, 2, 3], SamplingParams(max_new_tokens=0))
    assert tiny.generate(ids, max_new_tokens=1).shape == (1, 4)


# ------------------------------------------------------------------------------ sampling flags without do_sample
def _warnings_of(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in rec if issubclass(w.category, UserWarning) and "generation flags" in str(w.message)]


def test_sampling_flags_without_do_sample_warn_once_per_call(tiny):
    ids = torch.tensor([[1, 2, 3]])
    msgs = _warnings_of(lambda: tiny.generate(ids, max_new_tokens=2, temperature=0.7, top_p=0.9, top_k=5,
                                              min_p=0.1, typical_p=0.5))
    assert len(msgs) == 1
    assert "['min_p', 'temperature', 'top_k', 'top_p', 'typical_p']" in msgs[0] and "do_sample" in msgs[0]
    # the same call twice: one warning each time (Python's default filter then shows it once per place)
    assert len(_warnings_of(lambda: [tiny.generate(ids, max_new_tokens=1, temperature=0.5) for _ in range(2)])) == 2


@pytest.mark.parametrize("kw", [dict(), dict(temperature=1.0, top_p=1.0, top_k=50, typical_p=1.0),
                                dict(do_sample=True, temperature=0.7, top_p=0.9, seed=0)])
def test_no_warning_for_defaults_or_when_sampling(tiny, kw):
    assert _warnings_of(lambda: tiny.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, **kw)) == []


def test_inherited_sampling_fields_follow_transformers_rule():
    from k3nn import GenerationConfig

    cfg = GenerationConfig(temperature=0.6, do_sample=False).resolved()
    assert cfg.ignored_sampling_flags(None) == ["temperature"]  # no provenance: every set field counts
    assert cfg.ignored_sampling_flags({"do_sample"}) == []  # do_sample passed, temperature inherited
    assert cfg.ignored_sampling_flags({"do_sample", "temperature"}) == ["temperature"]
    assert cfg.ignored_sampling_flags({"temperature"}) == ["temperature"]


# ------------------------------------------------------------------------------------------------------ threads
def test_parse_threads():
    assert parse_threads("auto") == "auto" and parse_threads(" AUTO ") == "auto"
    assert parse_threads("3") == 3 and parse_threads(2) == 2
    for bad in ("0", "-1", "x", "1.5", 0, True, None):
        with pytest.raises(ValueError, match="threads must be a positive integer or 'auto'"):
            parse_threads(bad)


def test_auto_threads_honours_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert auto_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS must be a positive integer, got 'zero'"):
        auto_threads()
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert 1 <= auto_threads(max_threads=4) <= 4
    monkeypatch.setattr("os.getloadavg", lambda: (64.0, 64.0, 64.0))  # a machine others keep busy
    assert auto_threads() == 1


def test_configure_threads_sets_and_returns(monkeypatch):
    n = torch.get_num_threads()
    try:
        assert configure_threads(1) == 1 == torch.get_num_threads()
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert configure_threads("auto") == 2
    finally:
        torch.set_num_threads(n)


def test_the_library_leaves_torch_threads_alone(tiny):
    """Only the entry points' configure_threads sets threads; loading, generating and the engine do not."""
    root = Path(__file__).resolve().parents[1] / "src" / "k3nn"
    setters = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if re.search(r"torch\.set_num(_interop)?_threads\(", line)]
    assert len(setters) == 1 and setters[0].startswith("utils.py:"), setters  # configure_threads itself
    n = torch.get_num_threads()
    tiny.generate(torch.tensor([[1, 2]]), max_new_tokens=2)
    assert torch.get_num_threads() == n
