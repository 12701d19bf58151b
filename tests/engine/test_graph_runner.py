"""GraphRunner's bookkeeping, with CUDA graphs replaced by a recorder (no GPU here): a step's first call runs
eagerly, the second captures and replays, later ones replay; a failed capture is remembered with its reason, its key
runs eagerly from then on, and the next capture starts a new memory pool (an aborted capture can leave its pool
marked as recording, which on the H200 failed every capture after it)."""

import contextlib
import logging

import pytest
import torch

import k3nn.runtime.graphs as graphs_mod
from k3nn.runtime.graphs import GraphRunner


class _Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's graph API as a recorder: pools handed out, the pool of each capture, the failing keys."""
    state = {"pools": 0, "captured_with": [], "fail": set(), "key": None}

    def pool_handle():
        state["pools"] += 1
        return ("pool", state["pools"])

    @contextlib.contextmanager
    def graph(g, pool=None):
        state["captured_with"].append(pool)
        if state["key"] in state["fail"]:
            raise RuntimeError("operation failed due to a previous error during capture")
        yield

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", pool_handle)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(GraphRunner, "_side_stream", lambda self, fn: fn())
    return state


def _runner():
    r = GraphRunner("cpu")
    r.enabled = True  # the recorder stands in for the device
    return r


def test_first_call_eager_second_captures_then_replays(fake_cuda):
    r, calls = _runner(), []
    step = lambda: calls.append(1) or "out"  # noqa: E731
    assert r.run("a", step) == "out" and len(calls) == 1  # eager
    assert r.run("a", step) == "out" and len(calls) == 2  # captured (the body runs once while recording)
    assert r.run("a", step) == "out" and len(calls) == 2  # replayed
    g = r.graphs["a"][0]
    assert g.replays == 2 and "a" in r and not r.failed


def test_a_failed_capture_runs_eagerly_and_the_next_capture_gets_a_new_pool(fake_cuda, caplog):
    r = _runner()
    fake_cuda["fail"] = {"bad"}
    fake_cuda["key"] = "good"
    assert r.capture("good", lambda: "g")
    fake_cuda["key"] = "bad"
    with caplog.at_level(logging.WARNING, logger=graphs_mod.__name__):
        assert not r.capture("bad", lambda: "b")
    assert "bad" in r.failed and "previous error" in r.failed["bad"] and "capture of 'bad' failed" in caplog.text
    assert r.run("bad", lambda: "eager") == "eager"  # that key runs eagerly from now on, never captured again
    fake_cuda["key"] = "next"
    assert r.capture("next", lambda: "n")
    first, failed_in, after = fake_cuda["captured_with"]
    assert first == failed_in == ("pool", 1) and after == ("pool", 2)  # a fresh pool after the failure
    assert r.run("good", lambda: "x") == "g"  # graphs captured before the failure still replay


def test_no_garbage_collection_while_recording(fake_cuda):
    """A collection during a capture could free an unreachable engine's graphs, which CUDA refuses while recording
    (it failed a capture on the H200): the collector is paused for the capture and resumed after, also when the
    capture fails."""
    import gc

    r, seen = _runner(), []
    step = lambda: seen.append(gc.isenabled()) or "out"  # noqa: E731
    r.run("a", step)
    r.run("a", step)
    fake_cuda["fail"].add("b")
    fake_cuda["key"] = "b"
    r.run("b", step)
    r.run("b", step)
    assert seen[0] and not seen[1] and gc.isenabled()
    assert "b" in r.failed


def test_only_the_steps_that_stay_eager_run_as_uncaptured(fake_cuda):
    """A step that runs eagerly for good (runner disabled, or its capture failed) runs under
    ``KernelTuning.uncaptured`` (host-bound kernel choices); the warm-up before a capture and the capture do not:
    they must build and record the kernels the graph replays."""
    from k3nn.kernels.registry import current_tuning

    r, seen = _runner(), []
    step = lambda: seen.append(current_tuning().uncaptured) or "out"  # noqa: E731
    r.run("a", step)  # warm-up
    r.run("a", step)  # capture
    fake_cuda["fail"].add("b")
    fake_cuda["key"] = "b"
    r.run("b", step)  # warm-up
    r.run("b", step)  # failed capture, then the eager run of this call
    r.run("b", step)  # eager from now on
    off = GraphRunner("cpu", enabled=False)
    off.run("c", step)
    assert seen == [False, False, False, True, True, True]
    assert not current_tuning().uncaptured
