"""Loading compressed-tensors MXFP4 experts into the stacked expert buffers, one key at a time."""

import pytest
import torch

from k3nn.layers.moe import Experts
from k3nn.quant import compressed_expert_keys, load_compressed_experts, mxfp4_quantize


def _checkpoint(E, I, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd, logical = {}, {}
    for j in range(E):
        for p, shape in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            w = torch.randn(*shape, generator=g)
            q = mxfp4_quantize(w)
            sd[f"model.layers.1.mlp.experts.{j}.{p}.weight_packed"] = q.packed
            sd[f"model.layers.1.mlp.experts.{j}.{p}.weight_scale"] = q.scale
            logical[(j, p)] = q.dequantize()
    return sd, logical


def test_load_into_mxfp4_buffers_reads_each_key_once():
    E, I, D = 3, 32, 64
    sd, logical = _checkpoint(E, I, D)
    seen = []

    def get(k):
        seen.append(k)
        return sd[k]

    ex = Experts(E, D, I, "situ", 4.0, 25.0, mxfp4=True)
    read = load_compressed_experts(ex, get, prefix="model.layers.1.mlp")
    assert sorted(read) == sorted(sd) == sorted(compressed_expert_keys("model.layers.1.mlp", E))
    assert len(seen) == len(set(seen)) == len(sd)
    for j in range(E):
        for p in ("w1", "w3", "w2"):
            assert torch.equal(ex.weight(p)[j].dequantize(), logical[(j, p)])


def test_load_dequantizes_into_dense_params_and_ep_offset():
    E, I, D = 4, 32, 32
    sd, logical = _checkpoint(E, I, D, seed=1)
    ex = Experts(2, D, I, "silu", 4.0, None, mxfp4=False).to(torch.bfloat16)
    load_compressed_experts(ex, sd.__getitem__, prefix="model.layers.1.mlp", local_offset=2)
    assert torch.equal(ex.w2[0].float(), logical[(2, "w2")]) and torch.equal(ex.w1[1].float(), logical[(3, "w1")])


def test_shape_mismatch_names_the_key():
    sd, _ = _checkpoint(2, 32, 64)
    ex = Experts(2, 64, 64, "silu", 4.0, None, mxfp4=True)  # wrong intermediate width
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight_packed"):
        load_compressed_experts(ex, sd.__getitem__, prefix="model.layers.1.mlp")
    bad = dict(sd)
    bad["model.layers.1.mlp.experts.0.w1.weight_scale"] = torch.zeros(32, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="disagree"):
        load_compressed_experts(Experts(2, 64, 32, "silu", 4.0, None, mxfp4=True), bad.__getitem__,
                                prefix="model.layers.1.mlp")
