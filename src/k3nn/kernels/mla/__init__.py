"""MLA kernels: absorbed paged decode (eager reference, Triton split-KV, CUDA split-KV); causal prefill attention
on decompressed K/V (eager masked reference, Triton flash kernel) and the paged-context composite."""

from __future__ import annotations

from ..registry import register, triton_ready
from .api import check_mla_decode_inputs, default_visible_lens, merge_attn_states
from .prefill import mla_attention_reference, mla_prefill
from .reference import mla_decode_reference

register("mla_decode", "eager")(mla_decode_reference)
register("mla_attention", "eager")(mla_attention_reference)


def _prefill_triton_supports(q_nope, q_rope, k_nope, k_rope, v, *args, **kwargs):
    import torch

    ts = [t for t in (q_nope, q_rope, k_nope, k_rope, v) if t is not None]
    why = triton_ready(*ts)
    if why:
        return why
    if q_nope.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q_nope.dtype} (the Triton kernel takes fp16, bf16, fp32)"
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return "forward only: inputs require grad (the eager path trains)"
    dims = (q_nope.shape[-1], v.shape[-1], 0 if q_rope is None else q_rope.shape[-1])
    if max(dims) > 256:
        return f"head dims {dims} above 256"
    if any(t.stride(-1) != 1 for t in ts):
        return "the last dim of every tensor must be contiguous"
    return None


def _prefill_triton(q_nope, q_rope, k_nope, k_rope, v, scale, q_start=None, key_mask=None, cu_seqlens=None,
                    cu_seqlens_k=None, max_seqlen=None, return_lse=False):
    from .triton_prefill import mla_attention_triton  # lazy: importing triton kernels costs time

    return mla_attention_triton(q_nope, q_rope, k_nope, k_rope, v, scale, q_start=q_start, key_mask=key_mask,
                                cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k, max_seqlen=max_seqlen,
                                return_lse=return_lse)


register("mla_attention", "triton", supports=_prefill_triton_supports)(_prefill_triton)


def _triton_supports(q_lat, q_rope, kv_pool, block_table, seq_lens, *args, **kwargs):
    from .triton_decode import supports_triton

    return triton_ready(q_lat, q_rope, kv_pool, block_table, seq_lens) or supports_triton(
        q_lat, q_rope, kv_pool, block_table, seq_lens, *args, **kwargs)


def _triton_decode(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=None, num_splits=None,
                   out_dtype=None, out=None):
    from .triton_decode import mla_decode_triton  # lazy: importing triton kernels costs time

    return mla_decode_triton(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=visible_lens,
                             num_splits=num_splits, out_dtype=out_dtype, out=out)


register("mla_decode", "triton", supports=_triton_supports)(_triton_decode)


def _cuda_available():
    from . import cuda_decode

    return cuda_decode.available()


def _cuda_auto_skip(*args, **kwargs):
    from . import cuda_decode

    return cuda_decode.auto_skip(*args, **kwargs)


def _cuda_supports(*args, **kwargs):
    from . import cuda_decode

    return cuda_decode.supports(*args, **kwargs)


def _cuda_decode(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=None, num_splits=None,
                 out_dtype=None, out=None):
    from .cuda_decode import mla_decode_cuda  # compiled on first use

    return mla_decode_cuda(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=visible_lens,
                           num_splits=num_splits, out_dtype=out_dtype, out=out)


# auto tries cuda first: on sm_90 the warp-group kernel takes batched calls (small ones stay on triton); elsewhere
# the mma.sync kernel runs under an explicit k3nn.backend("cuda") only. See cuda_decode.auto_skip / supports.
register("mla_decode", "cuda", supports=_cuda_supports, available=_cuda_available,
         auto_skip=_cuda_auto_skip)(_cuda_decode)

__all__ = ["check_mla_decode_inputs", "default_visible_lens", "merge_attn_states", "mla_attention_reference",
           "mla_decode_reference", "mla_prefill"]
