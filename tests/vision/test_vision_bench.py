"""bench/gpu/vision_tower.py on the CPU in tiny mode: transformers' tiny Kimi K2.5 saved and loaded into k3nn, the
parity checks passing, a timed row per case and the result file in bench.records' schema."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "vision_tower.py"


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("transformers", reason="transformers is in the parity extra")
    spec = importlib.util.spec_from_file_location("vision_tower_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_on_cpu_writes_the_result_file(bench, tmp_path):
    rc = bench.main(["--tiny", "--device", "cpu", "--reps", "1", "--warmup", "0", "--out", str(tmp_path),
                     "--mixed", "32x32,20x28,48x16"])
    assert rc == 0
    (path,) = tmp_path.glob("vision-*.json")
    res = json.loads(path.read_text())
    meta, rows = res["meta"], res["rows"]
    for key in ("gpu", "torch", "triton", "commit", "transformers", "vision_config", "inputs", "k3nn_attention",
                "transformers_attention", "checks"):
        assert key in meta, key
    assert meta["checks_ok"] and meta["checks"]["fp32_rel_err"] <= 1e-4 and meta["k3nn_attention"] == "sdpa"
    assert meta["vision_config"]["hidden_size"] == 32 and meta["device"] == "cpu"
    assert [r["case"] for r in rows] == ["32x32 x4", "64x64 x2", "mixed x3"]
    assert [r["images"] for r in rows] == [4, 2, 3]
    # 32×32 px → 8×8 patches of 4 px; 20×28 → padded to 24×32 → 6×8; 48×16 → 12×4
    assert [r["patches"] for r in rows] == [4 * 64, 2 * 256, 64 + 48 + 48]
    for r in rows:
        assert r["k3nn_ms"] > 0 and r["anchor_ms"] > 0 and r["anchor"].startswith("transformers")
        assert r["speedup"] == pytest.approx(r["anchor_ms"] / r["k3nn_ms"], rel=1e-2)
        assert r["k3nn_images_per_s"] == pytest.approx(r["images"] / r["k3nn_ms"] * 1e3, rel=1e-2)
        assert r["tokens"] == r["patches"] // 4 and r["k3nn_peak_mem_gib"] is None


def test_synthetic_inputs_have_the_processor_layout(bench):
    """Without torchvision the script builds the processor's tensors itself: patches in raster order, each side
    padded to a multiple of patch·merge."""
    px, grid, source = bench.make_inputs([(8, 12), (20, 28)], patch=4, merge=2, seed=0)
    if source.startswith("transformers"):
        pytest.skip("the processor ran (torchvision installed): its own layout is what the run uses")
    assert grid.tolist() == [[1, 2, 4], [1, 6, 8]] and px.shape == (8 + 48, 3, 4, 4)
    g = torch.Generator().manual_seed(0)
    img = torch.randint(0, 256, (3, 8, 12), dtype=torch.uint8, generator=g).float() / 127.5 - 1
    # patch (row 1, col 2) of the first image = pixels [4:8, 8:12]
    assert torch.equal(px[1 * 4 + 2], img[:, 4:8, 8:12])
    assert float(px[8:].abs().max()) <= 1.0
