"""MLA functional ops: ``mla_decode`` (absorbed attention over the paged latent cache) and ``mla_attention``
(causal prefill attention on decompressed K/V)."""

from __future__ import annotations

import torch

from ..kernels import mla as _mla  # noqa: F401  (registers the backends)
from ..kernels.mla.api import check_mla_decode_inputs
from ..kernels.mla.prefill import check_mla_attention_inputs, mla_prefill
from ..kernels.registry import dispatch

__all__ = ["mla_attention", "mla_decode", "mla_prefill"]


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor | None, k_nope: torch.Tensor,
                  k_rope: torch.Tensor | None, v: torch.Tensor, scale: float, *, q_start: int | torch.Tensor | None = None,
                  key_mask: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                  cu_seqlens_k: torch.Tensor | None = None, max_seqlen: int | None = None,
                  return_lse: bool = False):
    """Causal attention on MLA's decompressed K/V, without a ``[T, L]`` mask or score matrix.

    For query t of a row (at key index ``q_start + t``) and head h::

        s_j = scale · (q_nope·k_nope_j + q_rope·k_rope_j),  j ≤ q_start + t, and key_mask_j or j = q_start + t
        o   = Σ_j softmax(s)_j v_j,  lse = log Σ_j exp(s_j)

    Args:
        q_nope: [B, T, H, dn]; q_rope: [B, T, H, dr] or None (rotated by the caller, or NoPE).
        k_nope: [B, L, H, dn]; k_rope: [B, L, dr] or None: one rope key per token, shared by every head.
        v: [B, L, H, dv]. Strided views are fine (e.g. the halves of one ``kv_b_proj`` output) while the last
            dim is contiguous. All of one dtype (fp16 / bf16 / fp32 on the Triton path; fp64 eager).
        scale: softmax scale, (dn + dr)^-0.5 for Kimi.
        q_start: key index of the first query, an int or an int [B] tensor (per row, read on the device: no host
            sync, graph-safe); default ``L - T`` (causal aligned to the end of the keys: chunked prefill, prefix
            hits, verify windows). A value ≥ L makes every key visible.
        key_mask: bool [B, L]; False hides a key (left padding, holes) from every query but its own.
        cu_seqlens: int [N + 1], sequences packed along T of one row (B = 1), each causal within itself;
            cu_seqlens_k: int [N + 1] when sequence i has more keys than queries (its queries are the last ones).
            max_seqlen: the longest query run (saves a host read).
        return_lse: also return the natural-log LSE (for exact merges: DCP, cached-context chunks).
    Returns:
        o [B, T, H, dv] in v's dtype (and lse [B, T, H] fp32, fp64 for fp64 inputs). A query that sees no key
        gets o = 0 and lse = −inf.
    """
    check_mla_attention_inputs(q_nope, q_rope, k_nope, k_rope, v, scale, q_start, key_mask, cu_seqlens,
                               cu_seqlens_k, max_seqlen)
    return dispatch("mla_attention", q_nope, q_rope, k_nope, k_rope, v, float(scale), q_start=q_start,
                    key_mask=key_mask, cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k, max_seqlen=max_seqlen,
                    return_lse=return_lse)


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, *, visible_lens: torch.Tensor | None = None,
               num_splits: int | None = None, out_dtype: torch.dtype | None = None,
               out: tuple[torch.Tensor, torch.Tensor] | None = None,
               check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode (MQA over one latent row per token) on a paged cache, with LSE.

    For query token t of request b and head h::

        s_j = scale · (q_lat·c_j + q_rope·k_rope_j),  j < visible_lens[b, t]
        o   = Σ_j softmax(s)_j c_j   (latent space; apply W_UV after),  lse = log Σ_j exp(s_j)

    Args:
        q_lat: [B, Tq, H, r] absorbed queries ``W_UKᵀ q_nope`` (r = kv_lora_rank, 512 for K3).
        q_rope: [B, Tq, H, dr] rope part of the queries (rotated by the caller, or unrotated for NoPE;
            dr may be 0). Same dtype as q_lat and kv_pool.
        kv_pool: [num_blocks, block_size, r + dr] one layer's pool of :class:`k3nn.cache.pages.PagedLatentCache`.
        block_table: int32/int64 [B, max_blocks]; seq_lens: int [B] cached tokens per request (the Tq query
            tokens included: they were written before the call).
        scale: softmax scale, (qk_nope + qk_rope)^-0.5 (0.0722 for Kimi), not (r + dr)^-0.5.
        visible_lens: int [B, Tq] keys visible to each query; default ``seq_lens - Tq + t + 1`` (a verify
            window: query t of Tq sees keys up to position seq_len - Tq + t). DCP passes rank-local bounds.
        num_splits: KV splits per request (Triton; default from the device and the batch).
        out_dtype: dtype of o (default q_lat.dtype). out: preallocated ``(o, lse)`` to write into.
        check: validate index values (a host sync; pass False inside CUDA-graph capture once the inputs are
            known good).
    Returns:
        ``(o [B, Tq, H, r], lse [B, Tq, H] fp32)``, natural-log LSE; a query that sees no key (possible on
        a DCP shard) gets o = 0 and lse = −inf.
    """
    check_mla_decode_inputs(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens, check_values=check)
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype, got {type(out_dtype).__name__}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if out is not None:
        B, Tq, H, r = q_lat.shape
        if (not isinstance(out, (tuple, list)) or len(out) != 2 or tuple(out[0].shape) != (B, Tq, H, r)
                or tuple(out[1].shape) != (B, Tq, H) or out[1].dtype != torch.float32):
            raise ValueError(f"out must be (o [{B}, {Tq}, {H}, {r}], lse [{B}, {Tq}, {H}] fp32)")
        if out_dtype is not None and out[0].dtype != out_dtype:
            raise TypeError(f"out[0] has dtype {out[0].dtype} but out_dtype is {out_dtype}")
    return dispatch("mla_decode", q_lat, q_rope, kv_pool, block_table, seq_lens, float(scale),
                    visible_lens=visible_lens, num_splits=num_splits, out_dtype=out_dtype, out=out)
