"""MLA kernels: absorbed paged decode (eager reference, Triton split-KV, CUDA split-KV), decompressed chunked
prefill."""

from __future__ import annotations

from ..registry import register, triton_ready
from .api import check_mla_decode_inputs, default_visible_lens, merge_attn_states
from .prefill import mla_prefill
from .reference import mla_decode_reference

register("mla_decode", "eager")(mla_decode_reference)


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

    return cuda_decode.available() or cuda_decode.enabled()


def _cuda_supports(*args, **kwargs):
    from . import cuda_decode

    return cuda_decode.supports(*args, **kwargs)


def _cuda_decode(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=None, num_splits=None,
                 out_dtype=None, out=None):
    from .cuda_decode import mla_decode_cuda  # compiled on first use

    return mla_decode_cuda(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=visible_lens,
                           num_splits=num_splits, out_dtype=out_dtype, out=out)


# auto tries cuda first: on sm_90 the warp-group kernel takes batched calls (small ones stay on triton); elsewhere
# the CUDA kernels are opt-in (K3NN_MLA_CUDA=1). See cuda_decode.enabled / supports.
register("mla_decode", "cuda", supports=_cuda_supports, available=_cuda_available)(_cuda_decode)

__all__ = ["check_mla_decode_inputs", "default_visible_lens", "merge_attn_states", "mla_decode_reference",
           "mla_prefill"]
