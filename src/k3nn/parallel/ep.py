"""Expert parallelism over ``torch.distributed`` all-to-all.

The E routed experts are split evenly across the ranks of a process group (rank r holds global experts
[r·E/R, (r+1)·E/R)). Each rank routes its own tokens; every (token, slot) pair is sent to the rank that
holds its expert (dispatch), the expert output comes back the same way (combine) and the routing weights
are applied on the token's home rank — so the per-slot outputs feed the latent MoE's deferred
finalization unchanged. Exchange sizes are agreed with one small all-to-all of counts (a host sync: the
all-to-all needs split sizes on the host).

``apply_expert_parallel(moe, group)`` swaps a :class:`~k3nn.layers.moe.MoE`'s ``experts`` for an
:class:`EPExperts` holding only the local slice; the parameter / buffer names stay those of ``Experts``
(load with ``load_compressed_experts(..., local_offset=rank·E/R)``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layers.moe import Experts
from ..ops import moe_expert_outputs, moe_latent_finalize

__all__ = ["EPExperts", "apply_expert_parallel", "ep_dispatch_combine"]


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> None:
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)


def ep_dispatch_combine(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, local_fn, group=None) -> torch.Tensor:
    """Per-slot outputs [N, k, D] of experts spread over ``group``.

    x [N, D] (this rank's tokens), topk_ids [N, k] global expert ids; ``local_fn(x_recv [M, D], local_ids [M, 1])``
    computes [M, 1, D] with this rank's experts.
    """
    world = dist.get_world_size(group)
    if num_experts % world:
        raise ValueError(f"expert parallelism: {num_experts} experts do not split evenly over {world} ranks")
    e_local = num_experts // world
    N, D = x.shape
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    dest = flat // e_local
    order = torch.sort(dest, stable=True)[1]
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    s_splits, r_splits = send_counts.tolist(), recv_counts.tolist()
    M = sum(r_splits)
    send_x = x[order // k]
    recv_x = x.new_empty(M, D)
    _all_to_all(recv_x, send_x.contiguous(), r_splits, s_splits, group)
    send_e = (flat[order] % e_local).contiguous()
    recv_e = torch.empty(M, dtype=send_e.dtype, device=x.device)
    _all_to_all(recv_e, send_e, r_splits, s_splits, group)
    y_local = local_fn(recv_x, recv_e[:, None]).reshape(M, D).contiguous()
    back = x.new_empty(N * k, D)
    _all_to_all(back, y_local.to(x.dtype), s_splits, r_splits, group)
    out = torch.empty_like(back)
    out[order] = back
    return out.view(N, k, D)


class EPExperts(Experts):
    """The local slice of an expert-parallel :class:`Experts` (same parameter names, E/R experts)."""

    def __init__(self, num_experts: int, d_in: int, inter: int, act: str, beta: float,
                 linear_beta: float | None, mxfp4: bool = False, group=None):
        world = dist.get_world_size(group)
        if num_experts % world:
            raise ValueError(f"expert parallelism: {num_experts} experts do not split evenly over {world} ranks")
        super().__init__(num_experts // world, d_in, inter, act, beta, linear_beta, mxfp4)
        self.global_experts, self.group = num_experts, group
        self.expert_offset = dist.get_rank(group) * self.num_experts

    def _local(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return moe_expert_outputs(x, self.weight("w1"), self.weight("w3"), self.weight("w2"), ids,
                                  activation=self.act, beta=self.beta, linear_beta=self.linear_beta)

    def outputs(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return ep_dispatch_combine(x, ids, self.global_experts, self._local, self.group)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return moe_latent_finalize(self.outputs(x, ids), weights, None, out_dtype=x.dtype)


@torch.no_grad()
def apply_expert_parallel(moe: torch.nn.Module, group=None) -> torch.nn.Module:
    """Replace ``moe.experts`` by this rank's :class:`EPExperts` slice (weights copied from the full module
    when it holds real tensors; a meta-device module stays on meta for checkpoint loading). Returns ``moe``."""
    full: Experts = moe.experts
    ep = EPExperts(full.num_experts, full.d_in, full.inter, full.act, full.beta, full.linear_beta, full.mxfp4,
                   group=group)
    lo, hi = ep.expert_offset, ep.expert_offset + ep.num_experts
    src = dict(full.named_parameters(), **dict(full.named_buffers()))
    dev = next(iter(src.values())).device
    ep.to(dev)
    for name, t in list(ep.named_parameters()) + list(ep.named_buffers()):
        if dev.type != "meta":
            t.data = src[name][lo:hi].clone()
    moe.experts = ep
    return moe
