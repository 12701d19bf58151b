"""The multimodal projector: merged patch features [N, kh·kw, D] → text embeddings [N, d_text].

``patchmerger`` (Kimi K2.5)::      y = W2 · GELU(W1 · flatten(LayerNorm(x)) + b1) + b2      (LayerNorm per patch, D wide)
``patchmergerv2`` (Kimi K3)::      y = RMSNorm(W2 · GELU(W1 · flatten(x)))                    (no biases; RMSNorm d_text wide)

W1: kh·kw·D → kh·kw·D, W2: kh·kw·D → d_text. Parameter names follow Moonshot's checkpoints (``mm_projector.pre_norm``,
``mm_projector.proj.0``, ``mm_projector.proj.2``, ``mm_projector.post_norm``); matches transformers'
``Kimi_K25MultimodalProjection`` (``in_proj`` / ``out_proj``) for ``patchmerger``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig
from .init import init_standard_

__all__ = ["PatchMergerProjector"]


class _GELU(nn.Module):
    def __init__(self, approximate: str):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)


class PatchMergerProjector(nn.Module):
    """Merged patches → the text model's width: ``forward(x [N, kh·kw, D]) → [N, d_text]``.

    "patchmerger" (Kimi K2.5): LayerNorm over D, then Linear(kh·kw·D → kh·kw·D) → GELU → Linear(→ d_text), with
    biases. "patchmergerv2" (Kimi K3): the same MLP without biases, then RMSNorm over d_text."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.kind = cfg.projector_type
        D, k = cfg.hidden_size, cfg.merge_size
        bias = self.kind == "patchmerger"
        if self.kind == "patchmerger":
            self.pre_norm = nn.LayerNorm(D, eps=cfg.projector_eps)
        approx = "tanh" if cfg.projector_hidden_act == "gelu_pytorch_tanh" else "none"
        self.proj = nn.Sequential(nn.Linear(k * D, k * D, bias=bias), _GELU(approx),
                                  nn.Linear(k * D, cfg.text_hidden_size, bias=bias))
        if self.kind == "patchmergerv2":
            self.post_norm = nn.RMSNorm(cfg.text_hidden_size, eps=cfg.projector_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, kh·kw, D] → [N, d_text]."""
        if self.kind == "patchmerger":
            x = self.pre_norm(x)
        y = self.proj(x.flatten(1))
        return self.post_norm(y) if self.kind == "patchmergerv2" else y

    @torch.no_grad()
    def init_weights(self, gen: torch.Generator, std: float = 0.02) -> None:
        """normal(0, std) weights from ``gen``, zero biases, unit norms."""
        for mod in self.modules():
            init_standard_(mod, gen, std)
