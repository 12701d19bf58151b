"""bench.gpu.decode_host on the CPU: a smoke run on the tiny K3-like preset (CPU times mean nothing)."""

from bench.gpu import decode_host


def test_decode_host_smoke(capsys):
    out = decode_host.main(["--variants", "default,torch-gemm", "--steps", "2", "--top", "3", "--ctx", "8"])
    assert set(out) == {"default", "torch-gemm"}
    for v in out.values():
        assert 0 < v["host_ms"] <= v["step_ms"]
        assert v["calls"]["k3nn::linear"] > 0 and v["registry_us"]["k3nn::linear"] > 0
        assert not any(k.startswith("k3nn::") for k in v["aten_self_us"])
    text = capsys.readouterr().out
    assert "k3_like_tiny B=1 ctx=8 default: host" in text and "registry op calls" in text
