"""Checkpoint key maps, one module per format. Each format turns one source tensor (key + loader) into
native k3nn tensors ``(native_key, expert_index_or_None, tensor)``, and native tensors back into its keys."""

from . import deepseek, k3nn_native, moonshot, transformers_fused

FORMATS = {f.NAME: f for f in (k3nn_native, moonshot, transformers_fused, deepseek)}


def detect(keys) -> str:
    """Pick the format from a checkpoint's key set (most specific first)."""
    keys = set(keys)
    for name in ("transformers", "moonshot", "deepseek", "k3nn"):
        if FORMATS[name].detect(keys):
            return name
    return "k3nn"


__all__ = ["FORMATS", "detect"]

# multimodal layouts are built per config (vision heads, text layout), so they are classes, not FORMATS entries
from .multimodal import LanguageModelOnly, MultimodalFormat, is_multimodal  # noqa: E402

__all__ += ["MultimodalFormat", "LanguageModelOnly", "is_multimodal"]
