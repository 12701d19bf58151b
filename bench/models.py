"""Seeded benchmark models: random weights drawn on the device at K3 widths, small presets from the CPU init."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from k3nn.config import KimiK3Config

__all__ = ["build_model", "bench_model"]


@torch.no_grad()
def build_model(cfg: KimiK3Config, device: str, dtype: torch.dtype, seed: int = 0):
    """Random weights generated on the device (the CPU init of KimiK3 would take minutes at K3 widths):
    normal(0, initializer_range) projections, random MXFP4 codes with scale 2^-8, fla gate init."""
    from k3nn.model import KimiK3
    from k3nn.layers.kda import KimiDeltaAttention
    from k3nn.layers.moe import Experts, Router
    from k3nn.layers.norm import GatedRMSNorm, RMSNorm

    model = KimiK3(cfg, device="meta")
    model.to(dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = cfg.initializer_range
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
            if name.endswith("_res_proj"):  # small random AttnRes queries: non-uniform depth mixing
                mod.weight.normal_(0, 0.05, generator=gen)
            else:
                mod.weight.normal_(0, std, generator=gen)
        elif isinstance(mod, torch.nn.Conv1d):
            mod.weight.normal_(0, 1 / math.sqrt(mod.weight.shape[-1]), generator=gen)
        elif isinstance(mod, (RMSNorm, GatedRMSNorm)):
            mod.weight.fill_(1.0)
        elif isinstance(mod, Router):
            mod.weight.normal_(0, std, generator=gen)
            mod.e_score_correction_bias.zero_()
        elif isinstance(mod, Experts):
            for w in ("w1", "w3", "w2"):
                if mod.mxfp4:
                    p = getattr(mod, f"{w}_packed")
                    p.copy_(torch.randint(0, 256, p.shape, generator=gen, device=device, dtype=torch.int32).to(torch.uint8))
                    getattr(mod, f"{w}_scale").fill_(127 - 8)
                else:
                    getattr(mod, w).normal_(0, std, generator=gen)
        elif isinstance(mod, KimiDeltaAttention):
            mod.reset_gate_parameters(gen)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    return model


def bench_model(preset: str, device: str | torch.device, dtype_name: str | None = None):
    """A seeded ``KimiK3Config.<preset>()`` model on ``device`` (bf16 on CUDA, fp32 on CPU unless ``dtype_name``);
    ``tiny``/``small`` initialised on the CPU generator then moved, larger presets (``k3_slice``) drawn on the
    device. Returns (config, model)."""
    from k3nn.config import KimiK3Config
    from k3nn.model import KimiK3

    device = torch.device(device)
    dtype = getattr(torch, dtype_name) if dtype_name else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg = getattr(KimiK3Config, preset)()
    if preset in ("tiny", "small"):
        return cfg, KimiK3(cfg, dtype=dtype, seed=0).to(device).eval()
    # K3 widths: random weights drawn on the device (a CPU init takes minutes)
    return cfg, build_model(cfg, str(device), dtype)
