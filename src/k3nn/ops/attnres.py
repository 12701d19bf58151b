"""AttnRes functional op."""

from __future__ import annotations

import torch

from ..kernels import attnres as _attnres  # noqa: F401  (registers the backends)
from ..kernels.registry import dispatch

__all__ = ["attnres_mix"]


def attnres_mix(sources: list[torch.Tensor], query_weight: torch.Tensor, norm_weight: torch.Tensor,
                eps: float = 1e-5) -> torch.Tensor:
    """Softmax-over-depth mix of ``sources`` (S tensors [..., d], same shape/dtype/device).

    keys = RMS-normalised sources; score_j = keys_j · (norm_weight ⊙ query_weight); out = Σ softmax(score)_j
    sources_j, all in fp32, returned in the sources' dtype.
    """
    if not isinstance(sources, (list, tuple)) or len(sources) == 0:
        raise ValueError("attnres_mix: sources must be a non-empty list of tensors")
    shape, dtype, dev = sources[0].shape, sources[0].dtype, sources[0].device
    for i, s in enumerate(sources):
        if s.shape != shape or s.dtype != dtype or s.device != dev:
            raise ValueError(f"attnres_mix: sources[{i}] is {tuple(s.shape)} {s.dtype} {s.device}; "
                             f"expected {tuple(shape)} {dtype} {dev}")
    d = shape[-1]
    for name, w in (("query_weight", query_weight), ("norm_weight", norm_weight)):
        if w.shape != (d,):
            raise ValueError(f"attnres_mix: {name} must be [{d}], got {tuple(w.shape)}")
    return dispatch("attnres_mix", list(sources), query_weight, norm_weight, eps)
