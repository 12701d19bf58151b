"""Quantile Balancing (QB): the auxiliary-loss-free router-bias update of Kimi K3 (Su, "MoE环游记 6"; K3 §2.3.3).

For a batch of router scores s [m, n] (sigmoid, fp32), top-k routing and the bias b used to route it::

    α_i  = (k+1)-th largest of (s_i + b)                (each token's cutoff; the old bias enters only here)
    M_ij = s_ij − α_i                                   (margins)
    q    = round(m·k/n)                                 (balanced load per expert)
    b̂_j  = −[(q+1)-th largest of M_:,j]                 (the (1 − k/n) quantile of expert j's margins)
    b'   = b̂ − mean(b̂)                                  (a common shift changes no top-k)

With the cutoffs fixed, expert j would then receive exactly q tokens (no ties). The batch is always routed
with the **old** bias; the new one applies from the next step. At inference the bias is frozen.

Two estimators of the per-expert quantile:

* ``exact``: a top-(q+1) over the local batch (per rank; no communication);
* ``histogram``: per-expert counts of margins in ``n_bins`` fixed bins, summed over ranks by ONE integer
  all-reduce; b̂_j = −(right edge of the first bin whose ascending cumulative count reaches m_total − q),
  so the error is at most one bin width. The bin range [−(1 + max b), 1 − min b] contains every margin of
  sigmoid scores and is identical on all ranks (the bias is replicated).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["topk_cutoffs", "qb_bias_exact", "qb_bias_histogram", "margin_histogram", "QuantileBalancer"]


def topk_cutoffs(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [m, n] fp32, bias [n] → (routes [m, k] int64, cutoff α [m]: the (k+1)-th largest biased score)."""
    m, n = scores.shape
    if not 1 <= top_k < n:
        raise ValueError(f"quantile balancing needs 1 <= top_k < num_experts, got top_k={top_k}, n={n}")
    vals, idx = (scores.float() + bias.float()).topk(top_k + 1, dim=-1)
    return idx[:, :top_k], vals[:, top_k]


def _margins(scores, bias, top_k):
    _, alpha = topk_cutoffs(scores, bias, top_k)
    return scores.float() - alpha[:, None]


def _centre(b_hat: torch.Tensor) -> torch.Tensor:
    return b_hat - b_hat.mean()


def qb_bias_exact(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """New mean-centred bias [n] from this batch's scores [m, n] (routed with ``bias``), exact quantiles."""
    M = _margins(scores, bias, top_k)
    m, n = M.shape
    q = min(round(m * top_k / n), m - 1)
    b_hat = -M.topk(q + 1, dim=0).values[q]
    return _centre(b_hat)


def _hist_range(bias: torch.Tensor) -> tuple[float, float]:
    b = bias.float()
    return -(1.0 + b.max().item()) - 1e-6, 1.0 - b.min().item() + 1e-6


def margin_histogram(scores: torch.Tensor, bias: torch.Tensor, top_k: int, n_bins: int,
                     lo: float, hi: float) -> torch.Tensor:
    """int64 [n, n_bins] counts of each expert's margins in ``n_bins`` equal bins over [lo, hi] (clamped)."""
    M = _margins(scores, bias, top_k)
    m, n = M.shape
    idx = ((M - lo) * (n_bins / (hi - lo))).floor().clamp_(0, n_bins - 1).long()
    flat = idx + torch.arange(n, device=M.device)[None, :] * n_bins
    counts = torch.zeros(n * n_bins, dtype=torch.int64, device=M.device)
    counts.scatter_add_(0, flat.reshape(-1), torch.ones_like(flat.reshape(-1)))
    return counts.view(n, n_bins)


def qb_bias_histogram(scores: torch.Tensor, bias: torch.Tensor, top_k: int, n_bins: int = 1000,
                      value_range: tuple[float, float] | None = None,
                      group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """New mean-centred bias [n] from histogrammed margins; with torch.distributed initialised, the counts of
    every rank in ``group`` are summed by one integer all-reduce (whole-batch quantiles, any sharding)."""
    lo, hi = value_range if value_range is not None else _hist_range(bias)
    counts = margin_histogram(scores, bias, top_k, n_bins, lo, hi)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    n = counts.shape[0]
    m_total = counts[0].sum()
    q = torch.clamp(torch.round(m_total.double() * top_k / n).long(), max=m_total - 1)
    need = m_total - q  # the (q+1)-th largest is the (m − q)-th smallest
    first = (counts.cumsum(1) >= need).int().argmax(1)  # first bin reaching it
    right_edge = lo + (first.double() + 1) * ((hi - lo) / n_bins)
    return _centre(-right_edge.float())


class QuantileBalancer:
    """Applies QB to MoE layers (:class:`k3nn.layers.moe.MoE`) after each training step.

    Usage: ``qb = QuantileBalancer(model.moe_layers())``; every step: forward/backward/optimizer, then
    ``qb.step()``. The layers record their router logits while the balancer is attached (``record_routing``);
    the forward always used the old bias, the new one applies from the next step.
    """

    def __init__(self, layers: Iterable[torch.nn.Module], mode: str = "exact", n_bins: int = 1000,
                 group: dist.ProcessGroup | None = None):
        if mode not in ("exact", "histogram"):
            raise ValueError(f"QuantileBalancer: mode must be 'exact' or 'histogram', got {mode!r}")
        self.layers = list(layers)
        self.mode, self.n_bins, self.group = mode, n_bins, group
        for layer in self.layers:
            layer.record_routing = True

    def detach(self) -> None:
        """Stop recording router logits in the layers (and drop the last recorded ones); call when training ends."""
        for layer in self.layers:
            layer.record_routing = False
            layer.last_routing = None

    @torch.no_grad()
    def update_layer(self, layer) -> torch.Tensor | None:
        """Set ``layer``'s router correction bias from the logits its last forward recorded
        (:func:`qb_bias_exact`, or :func:`qb_bias_histogram` with one all-reduce over ``group``). Returns the new
        bias [E] fp32, or None when the layer recorded nothing since the last update."""
        if layer.last_routing is None:
            return None
        logits = layer.last_routing[0]
        gate = layer.gate
        scores = logits.float().sigmoid() if gate.score_func == "sigmoid" else logits.float().softmax(-1)
        bias = gate.e_score_correction_bias
        if self.mode == "exact":
            new = qb_bias_exact(scores, bias, gate.top_k)
        else:
            new = qb_bias_histogram(scores, bias, gate.top_k, self.n_bins, group=self.group)
        bias.copy_(new)
        layer.last_routing = None
        return new

    def step(self) -> None:
        """:meth:`update_layer` for every attached layer (after the optimizer step)."""
        for layer in self.layers:
            self.update_layer(layer)
