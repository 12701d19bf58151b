"""Tiny transformers Kimi K2.5 models for the parity tests (random weights, fp32)."""

from __future__ import annotations

import torch

from .processor_fixture import IMAGE_TOKEN_ID, PAD_ID, PATCH, VIDEO_TOKEN_ID

TEXT = dict(model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2,
            topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=512,
            pad_token_id=PAD_ID, bos_token_id=0, eos_token_id=1,
            rope_parameters={"rope_theta": 1000.0, "rope_type": "default"})
VISION = dict(patch_size=PATCH, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_attention_heads=2,
              num_hidden_layers=2, hidden_size=32, intermediate_size=64, merge_kernel_size=[2, 2])


def hf_k25(seed: int = 0, tie: bool = False, noise: float = 0.2):
    """transformers' ``Kimi_K25ForConditionalGeneration``, weights perturbed so every parameter matters (router
    biases too) and greedy decoding does not collapse onto one token."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Kimi_K25Config(text_config=dict(TEXT), vision_config=dict(VISION), projection_hidden_size=VISION["hidden_size"],
                         image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID, tie_word_embeddings=tie)
    hf = Kimi_K25ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * noise * (0.1 if p.dim() > 1 else 1.0))
        for layer in hf.model.language_model.layers[TEXT["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return hf


def hf_deepseek(seed: int = 0):
    """transformers' ``DeepseekV3ForCausalLM`` (the text model of Kimi K2.5) alone."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in TEXT.items() if k != "model_type"})).eval()
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for layer in hf.model.layers[TEXT["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return hf


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
