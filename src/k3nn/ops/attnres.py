"""AttnRes functional ops: the fused depth mix and the exact two-phase form (paper Algorithm 1).

Shapes: S sources ``[..., d]`` (stored block representations, then the running partial sum), Q pseudo-queries
``[Q, d]`` (``*_res_proj`` weight row and ``*_res_norm`` gain; the gain is folded into the query), fp32 math.

Two-phase use for one block of layers (see :mod:`k3nn.kernels.attnres.reference` for the equations)::

    o, m, l = attnres_phase1(blocks, Wq, Gq)              # all Q queries of the block, once per block
    h = attnres_phase2(o[i], m[i], l[i], partial, Wq[i], Gq[i]).mix   # per sublayer i, == attnres_mix(...)
"""

from __future__ import annotations

import torch

from ..kernels import attnres as _attnres  # noqa: F401  (registers the backends)
from ..kernels.attnres.reference import AttnResPhase2Output
from ..kernels.registry import dispatch

__all__ = ["attnres_mix", "attnres_phase1", "attnres_phase2", "AttnResPhase2Output"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check_sources(fn: str, sources) -> tuple[torch.Size, torch.dtype, torch.device]:
    if not isinstance(sources, (list, tuple)) or len(sources) == 0:
        raise ValueError(f"{fn}: sources must be a non-empty list of tensors")
    for i, s in enumerate(sources):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{fn}: sources[{i}] is a {type(s).__name__}, expected a torch.Tensor")
    shape, dtype, dev = sources[0].shape, sources[0].dtype, sources[0].device
    if len(shape) == 0:
        raise ValueError(f"{fn}: sources must have a feature dim [..., d], got a 0-dim tensor")
    if not dtype.is_floating_point:
        raise TypeError(f"{fn}: sources must be floating point, got {dtype}")
    for i, s in enumerate(sources):
        if s.shape != shape or s.dtype != dtype or s.device != dev:
            raise ValueError(f"{fn}: sources[{i}] is {tuple(s.shape)} {s.dtype} {s.device}; "
                             f"expected {tuple(shape)} {dtype} {dev}")
    return shape, dtype, dev


def _check_weight(fn: str, name: str, w, shape: tuple[int, ...], dev: torch.device) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(w).__name__}")
    if tuple(w.shape) != shape:
        raise ValueError(f"{fn}: {name} must be {list(shape)}, got {list(w.shape)}")
    if not w.dtype.is_floating_point:
        raise TypeError(f"{fn}: {name} must be floating point, got {w.dtype}")
    if w.device != dev:
        raise ValueError(f"{fn}: {name} is on {w.device}, the sources on {dev}")


def _check_eps(fn: str, name: str, eps) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"{fn}: {name} must be a float >= 0, got {eps!r}")


def attnres_mix(sources: list[torch.Tensor], query_weight: torch.Tensor, norm_weight: torch.Tensor,
                eps: float = 1e-5) -> torch.Tensor:
    """Softmax-over-depth mix of ``sources`` (S tensors [..., d], same shape/dtype/device).

    keys = RMS-normalised sources; score_j = keys_j · (norm_weight ⊙ query_weight); out = Σ softmax(score)_j
    sources_j, all in fp32, returned in the sources' dtype. query_weight, norm_weight: [d].
    The Triton backend reads each source once, without stacking them (up to 32 sources, d ≤ 16384).
    """
    shape, _, dev = _check_sources("attnres_mix", sources)
    d = shape[-1]
    for name, w in (("query_weight", query_weight), ("norm_weight", norm_weight)):
        _check_weight("attnres_mix", name, w, (d,), dev)
    _check_eps("attnres_mix", "eps", eps)
    return dispatch("attnres_mix", list(sources), query_weight, norm_weight, eps)


def attnres_phase1(sources: list[torch.Tensor], query_weight: torch.Tensor, norm_weight: torch.Tensor,
                   eps: float = 1e-5, out_dtype: torch.dtype = torch.float32
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phase 1 of two-phase Block AttnRes: Q pseudo-queries against the stored sources, in one pass.

    sources: S tensors [..., d] (the stored block representations); query_weight, norm_weight: [Q, d]
    (row q = ``*_res_proj`` weight and ``*_res_norm`` gain of query q). Returns, per query q,
    ``o [Q, ..., d]`` (``out_dtype``; the *unnormalised* Σ_j e^{s_qj − m_q} V_j), ``m [Q, ...]`` (max score)
    and ``l [Q, ...]`` (Σ_j e^{s_qj − m_q}), both fp32. ``o[q] / l[q]`` is ``attnres_mix`` over the sources;
    ``out_dtype=torch.bfloat16`` halves the state's memory at one extra rounding of o.
    """
    shape, _, dev = _check_sources("attnres_phase1", sources)
    d = shape[-1]
    if not isinstance(query_weight, torch.Tensor) or query_weight.dim() != 2:
        raise ValueError("attnres_phase1: query_weight must be a [Q, d] tensor, got "
                         f"{getattr(query_weight, 'shape', type(query_weight).__name__)}")
    nq = query_weight.shape[0]
    if nq == 0:
        raise ValueError("attnres_phase1: query_weight has no queries (Q = 0)")
    for name, w in (("query_weight", query_weight), ("norm_weight", norm_weight)):
        _check_weight("attnres_phase1", name, w, (nq, d), dev)
    _check_eps("attnres_phase1", "eps", eps)
    if out_dtype not in _FLOATS:
        raise TypeError(f"attnres_phase1: out_dtype must be one of float32, float16, bfloat16, got {out_dtype}")
    return dispatch("attnres_phase1", list(sources), query_weight, norm_weight, eps, out_dtype)


def attnres_phase2(o: torch.Tensor, m: torch.Tensor, l: torch.Tensor, partial: torch.Tensor | None,
                   query_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5, *,
                   update: torch.Tensor | None = None, post_norm_weight: torch.Tensor | None = None,
                   post_norm_eps: float = 1e-5, dtype: torch.dtype | None = None) -> AttnResPhase2Output:
    """Phase 2 of two-phase Block AttnRes for one sublayer: merge the intra-block partial into one query's state.

    o: [..., d], m, l: [...] fp32 — query q's slice of :func:`attnres_phase1` (``o[q], m[q], l[q]``);
    partial: the running intra-block partial sum [..., d], or None at the first sublayer of a block;
    query_weight, norm_weight: [d] (the same query q). With ``update`` [..., d] (same dtype as partial) the
    partial is first advanced ``partial ← partial + update`` (None + update = update), exactly as an eager add.
    With ``post_norm_weight`` [d] the following RMSNorm is fused: ``normed = w ⊙ rmsnorm(h)`` (eps
    ``post_norm_eps``; the :class:`~k3nn.layers.norm.RMSNorm` rounding order).

    Returns ``AttnResPhase2Output(mix, normed, partial)``: mix = h [..., d] equal to ``attnres_mix(sources +
    [partial])`` up to rounding, in ``dtype`` (default: partial's dtype, else o's); normed or None; the partial
    that was merged (the advanced one when ``update`` was given) or None.
    """
    fn = "attnres_phase2"
    for name, t in (("o", o), ("m", m), ("l", l)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if o.dim() == 0 or not o.dtype.is_floating_point:
        raise ValueError(f"{fn}: o must be a floating [..., d] tensor, got {tuple(o.shape)} {o.dtype}")
    shape, dev, d = o.shape, o.device, o.shape[-1]
    for name, t in (("m", m), ("l", l)):
        if t.shape != shape[:-1] or t.dtype != torch.float32 or t.device != dev:
            raise ValueError(f"{fn}: {name} must be float32 {list(shape[:-1])} on {dev}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")
    for name, t in (("partial", partial), ("update", update)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.shape != shape or t.device != dev or not t.dtype.is_floating_point:
            raise ValueError(f"{fn}: {name} must be a floating {list(shape)} tensor on {dev}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")
    if partial is not None and update is not None and partial.dtype != update.dtype:
        raise ValueError(f"{fn}: update dtype {update.dtype} != partial dtype {partial.dtype}")
    for name, w in (("query_weight", query_weight), ("norm_weight", norm_weight)):
        _check_weight(fn, name, w, (d,), dev)
    if post_norm_weight is not None:
        _check_weight(fn, "post_norm_weight", post_norm_weight, (d,), dev)
    _check_eps(fn, "eps", eps)
    _check_eps(fn, "post_norm_eps", post_norm_eps)
    if dtype is not None and dtype not in _FLOATS:
        raise TypeError(f"{fn}: dtype must be None or one of float32, float16, bfloat16, got {dtype}")
    return dispatch("attnres_phase2", o, m, l, partial, query_weight, norm_weight, eps, update, post_norm_weight,
                    post_norm_eps, dtype)
