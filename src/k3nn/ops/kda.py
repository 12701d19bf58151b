"""KDA functional ops: ``kda_chunk`` (prefill / training) and ``kda_recurrent`` (decode, verify windows)."""

from __future__ import annotations

import torch

from ..kernels import kda as _kda  # noqa: F401  (registers the backends)
from ..kernels.kda.api import check_kda_inputs, normalise_checkpoints, seq_lengths
from ..kernels.registry import dispatch

__all__ = ["kda_chunk", "kda_recurrent"]


def _validate(q, k, v, g, beta, initial_state, cu_seqlens, checkpoint_positions):
    B, T, H, K, V, N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    normalise_checkpoints(checkpoint_positions, seq_lengths(T, B, cu_seqlens))


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
              checkpoint_positions=None):
    """Chunked KDA forward (and backward where the backend has one).

    Args:
        q, k: ``[B, T, H, K]`` (already L2-normalised); v: ``[B, T, H, V]``.
        g: ``[B, T, H, K]`` log-space per-channel decay (fp32 recommended); beta: ``[B, T, H]`` in (0, 1).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32, N = B, or the number of sequences with ``cu_seqlens``.
        output_final_state: return the state after the last token of each sequence.
        cu_seqlens: int ``[N + 1]`` packed-sequence offsets (then B must be 1).
        checkpoint_positions: per sequence, positions p at which the state after the first p tokens is
            exported from the same pass (list of lists; a flat list when N = 1).
    Returns:
        ``(o [B, T, H, V], final_state [N, H, K, V] fp32 or None)``, plus ``checkpoints [M, H, K, V]`` fp32
        (in the order given) when ``checkpoint_positions`` is not None.
    """
    _validate(q, k, v, g, beta, initial_state, cu_seqlens, checkpoint_positions)
    return dispatch("kda_chunk", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                    checkpoint_positions=checkpoint_positions)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float | None = None, initial_state: torch.Tensor | None = None,
                  output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                  checkpoint_positions=None):
    """Token-by-token KDA (same arguments and results as :func:`kda_chunk`); the decode-shaped op."""
    _validate(q, k, v, g, beta, initial_state, cu_seqlens, checkpoint_positions)
    return dispatch("kda_recurrent", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                    checkpoint_positions=checkpoint_positions)
