"""Verification of a drafted window against the target's logits of the same window.

Window row j (0 ≤ j ≤ n) of the target scores the token after window token j: row 0 scores draft 1, …, row n
gives the bonus distribution. ``limit`` [B] (≤ n) is how many drafts each row verifies (budget, confidence
truncation); drafts past it count as not proposed, so the bonus comes from row ``limit``.

* :func:`greedy_accept`: accept draft k iff it equals the target argmax of row k−1; the next token is the target
  argmax at the first mismatch (or the bonus row).

The functions take the window's *scores*: the target logits after the call's
:class:`~k3nn.logits.LogitsPipeline` (:meth:`~k3nn.logits.LogitsPipeline.window`), so greedy and sampled
verification see the same processors as plain ``generate()``. ``cfg`` (the sampling ones) may instead be a config
with ``temperature`` / ``top_k`` / ``top_p`` whose warpers are applied here, or None when the scores are already
processed.
* :func:`rejection_accept`: lossless speculative sampling — accept draft d_k with probability
  ``min(1, p_k(d_k) / q_k(d_k))`` left → right; at the first rejection sample from ``norm(max(0, p − q))``
  (p if that mass is zero); when all are accepted, sample the bonus from the last row.
* :func:`synthetic_accept`: benchmark mode: accept exactly ``min(limit, L − 1)`` drafts (L = acceptance
  length, bonus included); the next token is the target's choice at that row. Not lossless.
"""

from __future__ import annotations

import torch

from ..logits import LogitsPipeline, sample_from_scores
from ..runtime.rng import GeneratorRNG
from ..runtime.sampling import greedy_accept as _greedy
from ..runtime.sampling import rejection_accept as _rejection

__all__ = ["greedy_accept", "rejection_accept", "synthetic_accept", "target_probs"]


def _scores(logits: torch.Tensor, cfg) -> torch.Tensor:
    """[..., V] → fp32 scores: ``cfg`` None (already processed), a LogitsPipeline (history-free, applied per row)
    or a config with ``temperature`` / ``top_k`` / ``top_p`` (those warpers)."""
    x = logits.float()
    if cfg is None:
        return x
    if not isinstance(cfg, LogitsPipeline):
        cfg = LogitsPipeline.for_sampling(True, cfg.temperature, cfg.top_k or 0, cfg.top_p)
    V = x.shape[-1]
    return cfg(None, x.reshape(-1, V)).view(x.shape)


def target_probs(logits: torch.Tensor, cfg=None) -> torch.Tensor:
    """[B, T, V] target scores (see :func:`_scores` for ``cfg``) → fp32 sampling distributions."""
    return _scores(logits, cfg).softmax(-1)


def greedy_accept(logits: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor):
    """scores [B, n+1, V], drafts [B, n], limit [B] → (accepted drafts m [B], next token [B]) (the acceptance of
    :func:`k3nn.runtime.sampling.greedy_accept`, the Engine's too)."""
    tgt = logits.argmax(-1)  # [B, n+1]
    m = _greedy(tgt, drafts, limit)
    return m, tgt.gather(1, m[:, None])[:, 0]


def rejection_accept(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                     limit: torch.Tensor, cfg=None, generator=None):
    """Lossless rejection sampling. draft_probs [B, n, V] is q (None: one-hot q on the drafts, i.e. greedy
    drafts under exact sampling). Returns (accepted drafts m [B], next token [B]): the Engine's routine
    (:func:`k3nn.runtime.sampling.rejection_accept`) drawing from ``generator``."""
    return _rejection(_scores(logits, cfg), drafts, draft_probs, limit, GeneratorRNG(generator))


def synthetic_accept(logits: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor, length: int, cfg=None,
                     generator=None, do_sample: bool | None = None):
    """Fixed acceptance length ``length`` (bonus included): m = min(limit, length − 1). The next token is the
    target's greedy / sampled choice at row m (the drafts are kept as proposed). ``do_sample`` (default:
    ``cfg.do_sample``) picks sampling."""
    B = drafts.shape[0]
    m = limit.clamp(max=max(0, int(length) - 1))
    row = logits.gather(1, m[:, None, None].expand(B, 1, logits.shape[-1]))[:, 0]
    if do_sample is None:
        do_sample = bool(cfg is not None and getattr(cfg, "do_sample", False))
    if do_sample:
        nxt = sample_from_scores(_scores(row, cfg), generator)
    else:
        nxt = row.argmax(-1)
    return m, nxt
