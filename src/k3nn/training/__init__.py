"""Training utilities: Quantile Balancing of the MoE router bias."""

from .qb import QuantileBalancer, margin_histogram, qb_bias_exact, qb_bias_histogram, topk_cutoffs

__all__ = ["QuantileBalancer", "margin_histogram", "qb_bias_exact", "qb_bias_histogram", "topk_cutoffs"]
