"""KDA functional ops: ``kda_chunk`` (prefill / training), ``kda_recurrent`` (token by token),
``kda_fused_decode`` (one launch per layer for decode and verify windows, updating cache slots in place), and the
prefill prologue: ``short_conv`` (causal conv + SiLU + L2 norm of q, k) and ``kda_gate`` (the decay)."""

from __future__ import annotations

import torch

from ..kernels import kda as _kda  # noqa: F401  (registers the backends)
from ..kernels.kda.api import check_kda_inputs, normalise_checkpoints, seq_lengths
from ..kernels.kda.decode import check_fused_decode
from ..kernels.kda.prologue import check_kda_gate, check_short_conv
from ..kernels.registry import dispatch, resolve

__all__ = ["kda_chunk", "kda_recurrent", "kda_fused_decode", "short_conv", "kda_gate"]


def _validate(q, k, v, g, beta, initial_state, cu_seqlens, checkpoint_positions):
    B, T, H, K, V, N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    normalise_checkpoints(checkpoint_positions, seq_lengths(T, B, cu_seqlens))


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
              checkpoint_positions=None):
    """Chunked KDA forward and backward (eager: autograd through the chunked PyTorch form; triton: Triton
    kernels both ways).

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
    if impl.backend == "triton":  # Triton forward and Triton backward
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
                     lower_bound: float = -5.0, norm_eps: float = 1e-5, scale: float | None = None,
                     num_tokens: torch.Tensor | None = None,
                     write_state: torch.Tensor | None = None) -> torch.Tensor:
    """The whole KDA mixer between the input projections and ``o_proj``, for decode / small verify windows.

    Args:
        qkv: ``[B, T, 3·H·D]`` pre-conv q, k, v projections (channel blocks q | k | v).
        f: ``[B, T, H·D]`` gate projection output (``f_b(f_a(x))``, before ``dt_bias``).
        b: ``[B, T, H]`` beta logits; gate: ``[B, T, H·D]`` output-gate activations (before sigmoid).
        conv_weight: ``[3·H·D, W]`` depthwise kernels; A_log ``[H]``; dt_bias ``[H·D]``; norm_weight ``[D]``.
        recurrent_state: ``[N, H, D, D]`` fp32 cache (K-first), updated in place at the used slots.
        conv_state: ``[N, W−1, 3·H·D]`` last W−1 pre-conv inputs (token-major), updated in place.
        state_indices: ``[B]`` int slot of each request (None: slots 0..B−1); −1 marks a padding row (no state
            read or written, zero output): CUDA-graph batches padded to a fixed size.
        gate_kind: ``"softplus"`` (Kimi Linear) or ``"lower_bound"`` (K3, with ``lower_bound``).
        norm_eps: RMSNorm eps (config ``rms_norm_eps``); scale: query scale, default ``D ** -0.5``.
        num_tokens: ``[B]`` int, the tokens row b feeds (0 ≤ n ≤ T; None: all T). The state advances over the
            first ``num_tokens[b]`` tokens only: right-padded rows and partly accepted verify windows end in
            their exact state (the outputs past a row's count are unspecified).
        write_state: ``[B]`` bool (None: all True); False computes row b's outputs from its cached state and
            leaves the cache untouched (a speculative verify window; the accepted prefix is committed later by a
            call with ``num_tokens`` = the accepted count).
    Returns:
        ``y [B, T, H, D]`` = ``norm_weight · RMSNorm(o) · sigmoid(gate)`` in qkv's dtype.
    """
    check_fused_decode(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, recurrent_state, conv_state,
                       state_indices, gate_kind, lower_bound, norm_eps, scale, num_tokens, write_state)
    return dispatch("kda_fused_decode", qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight,
                    recurrent_state, conv_state, state_indices, gate_kind=gate_kind, lower_bound=lower_bound,
                    norm_eps=norm_eps, scale=scale, num_tokens=num_tokens, write_state=write_state)


def short_conv(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None = None,
               cu_seqlens: torch.Tensor | None = None, l2norm_channels: int = 0, head_dim: int | None = None,
               eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise short convolution + SiLU, optionally L2-normalising the leading channels per head::

        y[t, c] = SiLU(Σ_j weight[c, j] · xx[t + j, c]),   xx = [history (W−1 rows) ; x]   (rounded to x's dtype)
        y[t, g] = y[t, g] / sqrt(Σ_{c ∈ g} y[t, c]² + eps)  for the groups g of ``head_dim`` channels below
                                                            ``l2norm_channels`` (fp32 math)

    KDA passes channels q | k | v and ``l2norm_channels = 2·H·D``: L2-normed q, k and plain v in one pass.

    Args:
        x: ``[B, T, C]`` (fp16 / bf16 / fp32 on the Triton path; fp64 eager); with ``cu_seqlens``, ``[1, total, C]``.
        weight: ``[C, W]`` depthwise kernels (cast to x's dtype, as ``F.conv1d`` would need).
        initial_state: ``[N, W−1, C]`` the W−1 inputs before each sequence (None: zeros); N = B, or the number of
            sequences with ``cu_seqlens``.
        cu_seqlens: int ``[N + 1]`` packed-sequence offsets on x's device (B must be 1); no sequence reads
            another's tokens. Its values are checked when it is a CPU tensor.
        l2norm_channels: number of leading channels to L2-normalise (a multiple of ``head_dim``); 0: none.
        head_dim: the normalisation group width (needed when ``l2norm_channels > 0``).
        eps: added to Σ y² inside the square root.
    Returns:
        ``(y [B, T, C] in x's dtype, final_state [N, W−1, C] in x's dtype)``: the last W−1 inputs of each
        sequence, history included (a sequence shorter than W−1 keeps the newest history rows).
    Reference: :func:`k3nn.kernels.kda.prologue.short_conv_reference` (the layer's ``short_conv`` +
    ``l2norm``); the Triton kernel is forward only (eager when an input requires grad).
    """
    check_short_conv(x, weight, initial_state, cu_seqlens, l2norm_channels, head_dim, eps)
    return dispatch("short_conv", x, weight, initial_state, cu_seqlens, l2norm_channels, head_dim, eps)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, kind: str, lower_bound: float,
             head_dim: int) -> torch.Tensor:
    """KDA log-space decay per key channel, from the gate projection output::

        g = −exp(A_log[h]) · softplus(f + dt_bias)                 kind "softplus" (Kimi Linear; threshold 20)
        g = lower_bound · sigmoid(exp(A_log[h]) · (f + dt_bias))   kind "lower_bound" (K3)

    Args:
        f: ``[..., H·D]`` (fp16 / bf16 / fp32 on the Triton path); A_log: ``[H]``; dt_bias: ``[H·D]``.
        lower_bound: the bound of the "lower_bound" gate (ignored by "softplus"); head_dim: D.
    Returns:
        g ``[..., H, D]`` fp32 (fp64 when an input is fp64, eager only).
    Reference: :func:`k3nn.kernels.kda.prologue.kda_gate` (the layer's math).
    """
    check_kda_gate(f, A_log, dt_bias, kind, lower_bound, head_dim)
    return dispatch("kda_gate", f, A_log, dt_bias, kind, lower_bound, head_dim)
