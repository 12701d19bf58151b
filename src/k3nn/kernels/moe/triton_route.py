"""Triton router (:func:`.routing.route_reference` for sigmoid scores without expert groups): one program per
token does the sigmoid, the biased top-k selection, the raw-score weights, the renormalisation and the scaling in
one launch (the eager form is ~10 launches). Ties pick the lowest expert index; the top-k order is by score. It
flags each row whose logits hold a NaN or Inf, so the check costs no launches of its own.

The selection is K rounds of one max-reduction over 64-bit keys (the biased score's bits, mapped to an order-
preserving signed integer, above ``BLOCK_E − 1 − expert``): one reduction yields both the best score and its lowest
index. The program is one warp up to 1024 experts, so every reduction stays in shuffles (no shared memory, no
barrier); the weights are the sigmoid recomputed at the chosen ids."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...utils import records_grad
from ..pdl import gdc_launch_dependents, gdc_wait, pdl_launch
from ..registry import triton_ready
from .routing import assert_finite_flags, route_kernel_applies

__all__ = ["route_triton", "route_kernel_reason", "supports_route"]

MAX_EXPERTS = 4096  # one row of scores in registers


@triton.jit
def _logits(logit_ptr, row, E, NE, idx, m, S: tl.constexpr):
    """The logits of ``row`` at ``idx``: the sum of S partial sums in the fixed order 0 … S-1."""
    x = tl.load(logit_ptr + row * E + idx, mask=m, other=0.0).to(tl.float32)
    for s in tl.static_range(1, S):
        x += tl.load(logit_ptr + s * NE + row * E + idx, mask=m, other=0.0)
    return x


@triton.jit
def _route_kernel(logit_ptr, bias_ptr, ids_ptr, w_ptr, ok_ptr, E, NE, scaling, K: tl.constexpr,
                  RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, S: tl.constexpr,
                  PDL: tl.constexpr = False):
    if PDL:  # launched as a programmatic dependent (kernels/pdl.py): no earlier kernel's data is read before this
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    m = offs < E
    x = _logits(logit_ptr, row, E, NE, offs, m, S)
    bad = m & ((x != x) | (tl.abs(x) == float("inf")))
    tl.store(ok_ptr + row, tl.max(bad.to(tl.int32), 0) == 0)  # the row's logits are all finite
    choice = 1.0 / (1.0 + tl.exp(-x)) + tl.load(bias_ptr + offs, mask=m, other=0.0).to(tl.float32)
    choice = tl.where(choice == 0.0, 0.0, choice)  # -0.0 ties with +0.0, as in a float comparison
    bits = choice.to(tl.int32, bitcast=True)
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed-int order == float order
    key = order.to(tl.int64) * 4294967296 + (BLOCK_E - 1 - offs)
    lowest = -9223372036854775807 - 1
    key = tl.where(m, key, lowest)
    if PDL:  # our loads are done: a programmatic dependent (a skinny GEMM) may start its weight prefetch
        gdc_launch_dependents()
    ks = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(key, 0)
        idx = (BLOCK_E - 1) - (best & 4294967295)
        ids = tl.where(ks == j, idx, ids)
        key = tl.where(offs == idx, lowest, key)
    km = ks < K
    xs = _logits(logit_ptr, row, E, NE, ids, km, S)
    w = tl.where(km, 1.0 / (1.0 + tl.exp(-xs)), 0.0)
    if RENORM:
        w = w / (tl.sum(w, 0) + 1e-20)
    tl.store(ids_ptr + row * K + ks, ids, mask=km)
    tl.store(w_ptr + row * K + ks, w * scaling, mask=km)


def route_kernel_reason(num_experts: int, num_group: int = 1, topk_group: int = 1,
                        score_func: str = "sigmoid") -> str | None:
    """Why the kernel cannot route ``num_experts`` experts this way (None: it can)."""
    if not route_kernel_applies(num_group, topk_group, score_func):
        return "grouped or softmax routing (the kernel covers sigmoid scores without expert groups)"
    if num_experts > MAX_EXPERTS:
        return f"{num_experts} experts above {MAX_EXPERTS}"
    return None


def supports_route(logits, bias, top_k, renormalize, scaling, num_group=1, topk_group=1,
                   score_func="sigmoid") -> str | None:
    why = triton_ready(logits, bias)
    if why:
        return why
    if records_grad(logits):
        return "forward only: the logits require grad (the eager path trains)"
    return route_kernel_reason(logits.shape[-1], num_group, topk_group, score_func)


def route_triton(logits, bias, top_k, renormalize, scaling, num_group=1, topk_group=1, score_func="sigmoid"):
    """``logits`` [N, E], or [S, N, E] fp32 partial sums (a split-K GEMM's, unreduced) that the kernel adds in the
    order 0 … S-1 before routing. Logits (their sums) holding NaN or Inf raise as
    :func:`.routing.assert_finite_flags` does."""
    S = logits.shape[0] if logits.dim() == 3 else 1
    N, E = logits.shape[-2:]
    ids = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    if N:
        ok = torch.empty(N, dtype=torch.bool, device=logits.device)
        block_e = triton.next_power_of_2(E)
        _route_kernel[(N,)](logits.float().contiguous(), bias.contiguous(), ids, w, ok, E, N * E, float(scaling),
                            K=top_k, RENORM=bool(renormalize and top_k > 1), BLOCK_E=block_e,
                            BLOCK_K=triton.next_power_of_2(top_k), S=S, num_warps=max(1, block_e // 1024),
                            **pdl_launch(logits))
        assert_finite_flags(ok, "route: router logits")
    return ids, w
