"""Router math of the Kimi Linear / DeepSeek "noaux_tc" MoE and K3's LatentMoE, as plain PyTorch::

    s = sigmoid(logits)  (or softmax)        choice = s + bias        (bias: e_score_correction_bias)
    I = TopK_k(choice)   (group-limited when num_group > 1: the topk_group groups with the best top-2 sums)
    w_j = s_j / Σ_I s  (renormalize) · scaling

Selection on the biased scores, weights from the raw ones.
"""

from __future__ import annotations

import torch

__all__ = ["assert_finite_flags", "check_finite_on_device", "check_route", "route_checked", "route_reference",
           "route_kernel_applies"]


def _capturing(t: torch.Tensor) -> bool:
    return t.device.type != "cpu" and torch.cuda.is_current_stream_capturing()


def assert_finite_flags(ok: torch.Tensor, what: str) -> None:
    """Raise when a flag of ``ok`` (bool, one per row of values a kernel read) is False, without a host sync on
    accelerators: a clear ValueError on CPU, an async device assert elsewhere (raised at the next
    synchronisation); skipped while a CUDA graph is being captured."""
    if ok.device.type == "cpu":
        if not ok.all():
            raise ValueError(f"{what} contains NaN or Inf")
    elif not _capturing(ok):
        torch._assert_async(ok.all(), f"{what} contains NaN or Inf")


def check_finite_on_device(t: torch.Tensor, what: str) -> None:
    """NaN/Inf check of ``t`` as :func:`assert_finite_flags` raises it (nothing is computed during a capture)."""
    if not _capturing(t):
        assert_finite_flags(torch.isfinite(t), what)


def check_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, score_func: str) -> None:
    """The routing call's shapes and arguments (the logits' values are checked by the implementation that reads
    them: :func:`route_checked`, or the route kernel's per-row flags)."""
    if logits.dim() != 2:
        raise ValueError(f"route: logits must be [N, E], got {tuple(logits.shape)}")
    check_route_args(logits.shape[-1], bias, top_k, score_func)


def check_route_args(num_experts: int, bias: torch.Tensor, top_k: int, score_func: str) -> None:
    """The routing arguments besides the logits, for ``num_experts`` experts."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"route: top_k={top_k} must be in [1, num_experts={num_experts}]")
    if bias.shape != (num_experts,):
        raise ValueError(f"route: bias must be [E={num_experts}], got {tuple(bias.shape)}")
    if score_func not in ("sigmoid", "softmax"):
        raise ValueError(f"route: score_func must be 'sigmoid' or 'softmax', got {score_func!r}")


def route_kernel_applies(num_group: int, topk_group: int, score_func: str) -> bool:
    """The routing kernels cover sigmoid scores without expert groups (Kimi Linear, K3); grouped or softmax
    routing has the eager form only."""
    return score_func == "sigmoid" and (num_group <= 1 or topk_group >= num_group)


def route_checked(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scaling: float,
                  num_group: int = 1, topk_group: int = 1, score_func: str = "sigmoid"):
    """:func:`route_reference` after the NaN/Inf check of the logits (the eager backend of ``moe_route``)."""
    check_finite_on_device(logits, "route: router logits")
    return route_reference(logits, bias, top_k, renormalize, scaling, num_group, topk_group, score_func)


def route_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scaling: float,
                    num_group: int = 1, topk_group: int = 1, score_func: str = "sigmoid"):
    """logits [N, E] fp32 → (topk_ids [N, k] int64, topk_weights [N, k] fp32); the top-k order is unspecified."""
    s = logits.sigmoid() if score_func == "sigmoid" else logits.softmax(-1)
    choice = s + bias.float()
    if num_group > 1 and topk_group < num_group:
        N, E = choice.shape
        g = choice.view(N, num_group, E // num_group).topk(min(2, E // num_group), -1)[0].sum(-1)
        keep = torch.zeros_like(g).scatter_(1, g.topk(topk_group, -1)[1], 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(E // num_group, 1), float("-inf"))
    ids = choice.topk(top_k, -1, sorted=False)[1]
    w = s.gather(1, ids)
    if renormalize and top_k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, (w * scaling if scaling != 1.0 else w)
