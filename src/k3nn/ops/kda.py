"""KDA functional ops: ``kda_chunk`` (prefill / training), ``kda_recurrent`` (token by token) and
``kda_fused_decode`` (one launch per layer for decode and verify windows, updating cache slots in place)."""

from __future__ import annotations

import torch

from ..kernels import kda as _kda  # noqa: F401  (registers the backends)
from ..kernels.kda.api import check_kda_inputs, normalise_checkpoints, seq_lengths
from ..kernels.kda.decode import check_fused_decode
from ..kernels.registry import dispatch, resolve

__all__ = ["kda_chunk", "kda_recurrent", "kda_fused_decode"]


def _validate(q, k, v, g, beta, initial_state, cu_seqlens, checkpoint_positions):
    B, T, H, K, V, N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    normalise_checkpoints(checkpoint_positions, seq_lengths(T, B, cu_seqlens))


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
              checkpoint_positions=None):
    """Chunked KDA forward and backward (eager: autograd through the chunked PyTorch form; triton: Triton
    kernels both ways, or with ``K3NN_KDA_BWD=torch`` autograd through the PyTorch form for the backward).

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
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, checkpoint_positions=checkpoint_positions)
    impl = resolve("kda_chunk", (q, k, v, g, beta), kw)
    if impl.backend == "triton":  # Triton forward; Triton backward unless K3NN_KDA_BWD=torch
        from ..kernels.kda.triton_chunk_bwd import kda_chunk_triton_autograd

        return kda_chunk_triton_autograd(q, k, v, g, beta, **kw)
    return impl.fn(q, k, v, g, beta, **kw)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float | None = None, initial_state: torch.Tensor | None = None,
                  output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                  checkpoint_positions=None):
    """Token-by-token KDA (same arguments and results as :func:`kda_chunk`); the decode-shaped op."""
    _validate(q, k, v, g, beta, initial_state, cu_seqlens, checkpoint_positions)
    return dispatch("kda_recurrent", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                    checkpoint_positions=checkpoint_positions)


def kda_fused_decode(qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor,
                     conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     norm_weight: torch.Tensor, recurrent_state: torch.Tensor, conv_state: torch.Tensor,
                     state_indices: torch.Tensor | None = None, *, gate_kind: str = "softplus",
                     lower_bound: float = -5.0, norm_eps: float = 1e-5, scale: float | None = None) -> torch.Tensor:
    """The whole KDA mixer between the input projections and ``o_proj``, for decode / small verify windows.

    Args:
        qkv: ``[B, T, 3·H·D]`` pre-conv q, k, v projections (channel blocks q | k | v).
        f: ``[B, T, H·D]`` gate projection output (``f_b(f_a(x))``, before ``dt_bias``).
        b: ``[B, T, H]`` beta logits; gate: ``[B, T, H·D]`` output-gate activations (before sigmoid).
        conv_weight: ``[3·H·D, W]`` depthwise kernels; A_log ``[H]``; dt_bias ``[H·D]``; norm_weight ``[D]``.
        recurrent_state: ``[N, H, D, D]`` fp32 cache (K-first), updated in place at the used slots.
        conv_state: ``[N, W−1, 3·H·D]`` last W−1 pre-conv inputs (token-major), updated in place.
        state_indices: ``[B]`` int slot of each request (None: slots 0..B−1).
        gate_kind: ``"softplus"`` (Kimi Linear) or ``"lower_bound"`` (K3, with ``lower_bound``).
        norm_eps: RMSNorm eps (config ``rms_norm_eps``); scale: query scale, default ``D ** -0.5``.
    Returns:
        ``y [B, T, H, D]`` = ``norm_weight · RMSNorm(o) · sigmoid(gate)`` in qkv's dtype.
    """
    check_fused_decode(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, recurrent_state, conv_state,
                       state_indices, gate_kind, lower_bound, norm_eps, scale)
    return dispatch("kda_fused_decode", qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight,
                    recurrent_state, conv_state, state_indices, gate_kind=gate_kind, lower_bound=lower_bound,
                    norm_eps=norm_eps, scale=scale)
