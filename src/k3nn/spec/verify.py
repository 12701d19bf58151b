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

__all__ = ["greedy_accept", "rejection_accept", "synthetic_accept", "target_probs"]


def _leading(ok: torch.Tensor) -> torch.Tensor:
    """ok [B, n] bool → length of the leading run of True [B]."""
    return ok.long().cumprod(1).sum(1)


def _limit_mask(limit: torch.Tensor, n: int) -> torch.Tensor:
    return torch.arange(n, device=limit.device)[None, :] < limit[:, None]


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
    """scores [B, n+1, V], drafts [B, n], limit [B] → (accepted drafts m [B], next token [B])."""
    tgt = logits.argmax(-1)  # [B, n+1]
    n = drafts.shape[1]
    ok = (drafts == tgt[:, :n]) & _limit_mask(limit, n)
    m = _leading(ok)
    return m, tgt.gather(1, m[:, None])[:, 0]


def _sample(probs: torch.Tensor, generator) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(-1)


def rejection_accept(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                     limit: torch.Tensor, cfg=None, generator=None):
    """Lossless rejection sampling. draft_probs [B, n, V] is q (None: one-hot q on the drafts, i.e. greedy
    drafts under exact sampling). Returns (accepted drafts m [B], next token [B])."""
    B, n = drafts.shape
    p = target_probs(logits, cfg)  # [B, n+1, V]
    V = p.shape[-1]
    if n == 0:
        return torch.zeros(B, dtype=torch.long, device=p.device), _sample(p[:, 0], generator)
    if draft_probs is None:
        q = torch.zeros(B, n, V, device=p.device).scatter_(-1, drafts[..., None], 1.0)
    else:
        q = draft_probs.float()
    pd = p[:, :n].gather(-1, drafts[..., None])[..., 0]
    qd = q.gather(-1, drafts[..., None])[..., 0].clamp_min(1e-20)
    u = torch.rand(B, n, device=p.device, generator=generator)
    ok = (u * qd < pd) & _limit_mask(limit, n)  # u < p/q  ⇔  accept with probability min(1, p/q)
    m = _leading(ok)
    pm = p.gather(1, m[:, None, None].expand(B, 1, V))[:, 0]  # target row at the stop
    qm = q.gather(1, m.clamp(max=n - 1)[:, None, None].expand(B, 1, V))[:, 0]
    resid = (pm - qm).clamp_min(0)
    mass = resid.sum(-1, keepdim=True)
    rejected = (m < limit)[:, None]
    use_resid = rejected & (mass > 1e-12)
    dist = torch.where(use_resid, resid / mass.clamp_min(1e-30), pm)
    return m, _sample(dist, generator)


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
