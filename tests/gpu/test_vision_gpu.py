"""GPU: the vision tower's SDPA path on CUDA against the eager reference on the CPU, and generate() with images on the
GPU (CUDA-graph decode and the fused latency_specialized decode) against the same model's uncaptured decode."""

import sys
from pathlib import Path

import pytest
import torch

from k3nn import KimiK3ForConditionalGeneration, MultimodalConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vision import processor_fixture as pf  # noqa: E402

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


def test_tower_on_cuda_matches_the_cpu_reference():
    m = KimiK3ForConditionalGeneration(MultimodalConfig.tiny(), seed=0).eval()
    x = pf.load()["batch"]
    with torch.no_grad():
        m.vision_tower.attn_backend = "eager"
        ref = m.image_features(x["pixel_values"], x["image_grid_thw"])
        m.vision_tower.attn_backend = "sdpa"
        m = m.to("cuda")
        out = m.image_features(x["pixel_values"].cuda(), x["image_grid_thw"])
        assert _rel(out, ref) < 1e-4
        bf = m.to(torch.bfloat16).image_features(x["pixel_values"].cuda(), x["image_grid_thw"])
        assert _rel(bf.float(), ref) < 3e-2


@pytest.mark.parametrize("decode_backend", ["auto", "latency_specialized"])
def test_generate_with_images_on_cuda(decode_backend):
    m = KimiK3ForConditionalGeneration(MultimodalConfig.tiny(), seed=1).to("cuda").eval()
    x = {k: v.cuda() for k, v in pf.load()["one"].items()}
    ref = m.generate(**x, max_new_tokens=8, eos_token_id=[], cuda_graph=False)
    out = m.generate(**x, max_new_tokens=8, eos_token_id=[], decode_backend=decode_backend)
    assert torch.equal(out, ref)
    assert m.last_decode_info["path"] == ("latency_specialized" if decode_backend == "latency_specialized"
                                          else "standard")
