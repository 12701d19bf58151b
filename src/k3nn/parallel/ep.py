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


# -- torchrun self-check -----------------------------------------------------------------------------------

def _check_layer(mxfp4: bool, experts: int, topk: int, dim_scale: int, tokens: int, device, dtype):
    """The self-check's latent MoE (K3 expert dims divided by ``dim_scale``, seeded: the same full layer on every
    rank) on ``device`` and its input, ``tokens`` rows per rank: (moe, x [world·tokens, D])."""
    from ..config import KimiK3Config
    from ..layers.moe import MoE
    from ..quant import mxfp4_quantize

    s = dim_scale
    cfg = KimiK3Config.tiny(moe_kind="latent", mxfp4_experts=mxfp4, num_experts=experts, num_experts_per_token=topk,
                            hidden_size=7168 // s, routed_expert_hidden_size=3584 // s, moe_intermediate_size=3072 // s)
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    if mxfp4:
        g = torch.Generator(device=device).manual_seed(1)  # quantize where the ranks compute: K3 dims
        for n in ("w1", "w3", "w2"):
            shape = getattr(moe.experts, f"{n}_packed").shape
            q = mxfp4_quantize(torch.randn(*shape[:-1], shape[-1] * 2, generator=g, device=device) * 0.05)
            getattr(moe.experts, f"{n}_packed").copy_(q.packed)
            getattr(moe.experts, f"{n}_scale").copy_(q.scale)
    moe = moe.to(device, dtype)  # floating tensors only: the packed MXFP4 codes and scales stay uint8
    x = torch.randn(dist.get_world_size() * tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    return moe, x.to(device, dtype)


def _self_check(argv=None) -> int:
    """``torchrun --nproc-per-node W -m k3nn.parallel.ep [--tokens N] [--experts E]``: a latent MoE (bf16 and
    MXFP4 experts, K3 expert dims scaled by ``--dim-scale``) run expert-parallel on every rank equals the whole
    layer on one rank. (The repository's ``bench.ep`` times the same layers.)"""
    import argparse
    import os

    ap = argparse.ArgumentParser(prog="python -m k3nn.parallel.ep")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--dim-scale", type=int, default=8, help="divide K3's expert dims (3584 -> 3072) by this")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    bad = 0
    try:
        for mx in (False, True):
            moe, x = _check_layer(mx, args.experts, args.topk, args.dim_scale, args.tokens, dev, dtype)
            with torch.no_grad():
                ref = moe(x)[rank * args.tokens:(rank + 1) * args.tokens].float()
                apply_expert_parallel(moe)
                out = moe(x[rank * args.tokens:(rank + 1) * args.tokens]).float()
            err = ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            bad += err > (2e-2 if dtype == torch.bfloat16 else 1e-5)
            print(f"[ep rank {rank}/{world} {'mxfp4' if mx else str(dtype)[6:]} E={args.experts} k={args.topk} "
                  f"{dist.get_backend()}] rel err {err:.2e}", flush=True)
        return 1 if bad else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(_self_check())
