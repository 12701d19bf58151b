"""k3nn: the Kimi K3 model family in PyTorch (KDA, MLA + DCP, AttnRes, Stable LatentMoE, MXFP4, DSpark)."""

from __future__ import annotations

import logging

from . import ops
from .config import KimiK3Config
from .hf import register_transformers
from .kernels.registry import BackendUnavailableError, available_backends, backend, current_backend

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str):
    # model-level names import torch.nn modules lazily, so `import k3nn.ops` stays light
    if name in ("KimiK3", "KimiK3Output"):
        from . import model

        return getattr(model, name)
    if name in ("KimiK3ForConditionalGeneration",):
        from . import multimodal

        return getattr(multimodal, name)
    if name in ("MultimodalConfig", "VisionConfig"):
        from .vision import config

        return getattr(config, name)
    if name in ("GenerationConfig",):
        from . import generation

        return getattr(generation, name)
    raise AttributeError(f"module 'k3nn' has no attribute {name!r}")


__all__ = ["KimiK3", "KimiK3Config", "KimiK3ForConditionalGeneration", "MultimodalConfig", "VisionConfig",
           "GenerationConfig", "BackendUnavailableError", "available_backends",
           "backend", "current_backend", "ops", "register_transformers", "__version__"]

# transformers' Auto classes learn model_type "kimi_k3" once they are imported (now, or at their first import);
# transformers itself is never imported here (see k3nn.hf)
from .hf import _install as _install_transformers_hook  # noqa: E402

_install_transformers_hook()
