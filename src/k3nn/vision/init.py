"""Random initialisation shared by the vision modules (tests and fresh models; checkpoints overwrite it)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_standard_(mod: nn.Module, gen: torch.Generator, std: float = 0.02) -> bool:
    """normal(0, std) weights and zero biases for linear / conv layers, unit norms; True if ``mod`` was one of
    them (its own parameters only)."""
    if isinstance(mod, (nn.Linear, nn.Conv2d)):
        mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * std)
        if mod.bias is not None:
            mod.bias.zero_()
        return True
    if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)):
        mod.weight.fill_(1.0)
        if getattr(mod, "bias", None) is not None:
            mod.bias.zero_()
        return True
    return False
