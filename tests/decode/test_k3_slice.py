"""The k3_slice preset builds on the meta device with K3's layer dims."""

import torch

from k3nn import KimiK3, KimiK3Config
from k3nn.layers.kda import KimiDeltaAttention
from k3nn.layers.mla import MultiHeadLatentAttention


def test_k3_slice_shapes_on_meta():
    cfg = KimiK3Config.k3_slice()
    k3 = KimiK3Config.k3()
    assert cfg.num_hidden_layers == 8 and cfg.mla_layers == [3, 7]
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.mxfp4_experts) == (128, 16, True)
    for f in ("hidden_size", "kda_num_heads", "kda_head_dim", "num_attention_heads", "q_lora_rank",
              "kv_lora_rank", "moe_intermediate_size", "routed_expert_hidden_size", "intermediate_size",
              "vocab_size"):
        assert getattr(cfg, f) == getattr(k3, f), f
    m = KimiK3(cfg, device="meta")
    assert m.device.type == "meta"
    kinds = [type(layer.self_attn) for layer in m.model.layers]
    assert kinds == [KimiDeltaAttention] * 3 + [MultiHeadLatentAttention] + [KimiDeltaAttention] * 3 + [
        MultiHeadLatentAttention]
    kda = m.model.layers[0].self_attn
    assert tuple(kda.q_proj.weight.shape) == (96 * 128, 7168)
    assert tuple(kda.g_proj.weight.shape) == (96 * 128, 7168)  # full-rank output gate
    mla = m.model.layers[3].self_attn
    assert tuple(mla.q_b_proj.weight.shape) == (96 * (128 + 64), 1536)
    assert tuple(mla.kv_a_proj_with_mqa.weight.shape) == (512 + 64, 7168)
    assert tuple(mla.g_proj.weight.shape) == (96 * 128, 7168)
    assert not m.model.layers[0].is_moe and all(l.is_moe for l in m.model.layers[1:])
    ex = m.model.layers[1].block_sparse_moe.experts
    assert tuple(ex.w1_packed.shape) == (128, 3072, 3584 // 2) and ex.w1_packed.dtype == torch.uint8
    assert tuple(ex.w2_scale.shape) == (128, 3584, 3072 // 32)
    # fits one H200 in bf16 (params) with room for caches and activations
    nbytes = 2 * sum(p.numel() for p in m.parameters()) + sum(b.numel() for b in m.buffers() if b.dtype == torch.uint8)
    assert 15e9 < nbytes < 40e9, nbytes
    assert KimiK3Config.k3_slice(num_hidden_layers=4, mla_layers=[3]).num_hidden_layers == 4
