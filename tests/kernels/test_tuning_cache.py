"""Tuning choices persist on disk across processes (per GPU and versions), and a bad file only costs a retune."""

import torch

from k3nn.kernels import tuning_cache as tc


def test_tuning_cache_round_trip_across_instances(tmp_path, monkeypatch):
    monkeypatch.setenv("K3NN_HOME", str(tmp_path))
    monkeypatch.setattr(tc, "device_tag", lambda device: "GPU-sm90-torchX-tritonY")
    dev = torch.device("cuda", 0)
    a = tc.TuningCache("plan")
    assert a.get(dev, (1, 2, "x")) is None
    a.put(dev, (1, 2, "x"), [64, 32, 4, 2, True])
    b = tc.TuningCache("plan")  # a new process reads the file
    assert b.get(dev, (1, 2, "x")) == [64, 32, 4, 2, True]
    path = tmp_path / "tuning" / "plan-GPU-sm90-torchX-tritonY.json"
    path.write_text("{not json")
    assert tc.TuningCache("plan").get(dev, (1, 2, "x")) is None


def test_autotune_keeps_results_where_triton_can():
    import inspect

    import triton

    want = "cache_results" in inspect.signature(triton.autotune).parameters
    assert tc.AUTOTUNE_KW == ({"cache_results": True} if want else {})
