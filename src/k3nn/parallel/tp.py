"""Tensor parallelism for KimiK3, applied from outside the model by a plan over module names.

``apply_tensor_parallel(model, group=None, plan=None)`` shards a fully materialised model in place over the
ranks of ``group`` (every rank holds the same full weights before the call, e.g. same seed or same checkpoint):

==========================================  ===================  ==========================================
module (fnmatch over ``named_modules``)      style                what happens
==========================================  ===================  ==========================================
``*.self_attn.{q,k,v,g,f_b,b}_proj``         ``colwise``          output rows split by head (KDA)
``*.self_attn.{q,q_b,kv_b,g}_proj``          ``colwise``          output rows split by head (MLA)
``*.self_attn`` (KDA)                        ``kda_heads``        conv kernels, ``A_log``, ``dt_bias`` split
                                                                  by head; ``num_heads`` = H / world
``*.self_attn`` (MLA)                        ``mla_heads``        ``num_heads`` = H / world (latents stay
                                                                  replicated: one shared c, k_r per token)
``*.self_attn.o_proj``                       ``rowwise``          input columns split, output all-reduced
``*.mlp.{gate,up}_proj`` / shared experts    ``colwise``          intermediate split
``*.mlp.down_proj`` / shared experts         ``rowwise``          all-reduced
``*.block_sparse_moe.experts``               ``experts_inter``    every expert's intermediate split (w1, w3
                                                                  rows, w2 columns; MXFP4 packed + scales);
                                                                  the (per-slot) expert outputs all-reduced
                                                                  before the weighting / latent RMSNorm
==========================================  ===================  ==========================================

Everything else (embeddings, lm_head, norms, routers, latent down/up projections, AttnRes queries, the
low-rank ``f_a``/``g_a`` projections, MLA ``q_a``/``kv_a``) stays replicated. Per step: two all-reduces per
layer (mixer, FFN) plus one for the routed experts of MoE layers. The model's ``config`` becomes the rank-local
one (``kda_num_heads`` and ``num_attention_heads`` divided), so ``new_cache`` allocates the local KDA state;
``model.tp_global_config`` keeps the original. Collectives go through ``torch.distributed`` (gloo on CPU,
NCCL on GPU) and are CUDA-graph capturable on NCCL.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
from torch import nn

from ..layers.kda import KimiDeltaAttention
from ..layers.mla import MultiHeadLatentAttention
from ..layers.moe import Experts

__all__ = ["default_plan", "apply_tensor_parallel", "TP_STYLES"]

TP_STYLES = ("colwise", "rowwise", "kda_heads", "mla_heads", "experts_inter")


def default_plan(config) -> dict[str, str]:
    """The plan above as ``{module-name pattern: style}`` (the first matching pattern wins)."""
    plan = {}
    for name in ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "g_b_proj", "b_proj", "q_b_proj", "kv_b_proj"):
        plan[f"model.layers.*.self_attn.{name}"] = "colwise"
    plan["model.layers.*.self_attn.o_proj"] = "rowwise"
    plan["model.layers.*.self_attn"] = "heads"  # kda_heads or mla_heads by module type
    for mlp in ("mlp", "block_sparse_moe.shared_experts"):
        plan[f"model.layers.*.{mlp}.gate_proj"] = "colwise"
        plan[f"model.layers.*.{mlp}.up_proj"] = "colwise"
        plan[f"model.layers.*.{mlp}.down_proj"] = "rowwise"
    plan["model.layers.*.block_sparse_moe.experts"] = "experts_inter"
    return plan


def _chunk(t: torch.Tensor, dim: int, rank: int, world: int, what: str) -> torch.Tensor:
    if t.shape[dim] % world:
        raise ValueError(f"tensor parallel: {what} has {t.shape[dim]} entries along dim {dim}, not divisible by "
                         f"the world size {world}")
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n).clone()


def _set_param(mod: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(mod, name)
    if isinstance(old, nn.Parameter):
        setattr(mod, name, nn.Parameter(value, requires_grad=old.requires_grad))
    else:  # buffer
        setattr(mod, name, value)


def _all_reduce_hook(group):
    def hook(mod, args, out):
        dist.all_reduce(out, group=group)
        return out

    return hook


class _TPExperts(Experts):
    """Experts with a sharded intermediate: each rank's outputs are partial sums, all-reduced here."""

    tp_group = None

    def forward(self, x, ids, weights):
        out = super().forward(x, ids, weights)
        dist.all_reduce(out, group=self.tp_group)
        return out

    def outputs(self, x, ids):
        out = super().outputs(x, ids)
        dist.all_reduce(out, group=self.tp_group)
        return out


def _shard(name: str, mod: nn.Module, style: str, rank: int, world: int, group) -> None:
    if style == "colwise":
        _set_param(mod, "weight", _chunk(mod.weight.data, 0, rank, world, f"{name}.weight"))
        mod.out_features = mod.weight.shape[0]
    elif style == "rowwise":
        _set_param(mod, "weight", _chunk(mod.weight.data, 1, rank, world, f"{name}.weight"))
        mod.in_features = mod.weight.shape[1]
        mod.register_forward_hook(_all_reduce_hook(group))
    elif style == "heads" and isinstance(mod, KimiDeltaAttention) or style == "kda_heads":
        if mod.num_heads % world:
            raise ValueError(f"tensor parallel: {name} has {mod.num_heads} KDA heads, not divisible by {world}")
        for conv in (mod.q_conv1d, mod.k_conv1d, mod.v_conv1d):
            _set_param(conv, "weight", _chunk(conv.weight.data, 0, rank, world, f"{name} conv"))
        _set_param(mod, "A_log", _chunk(mod.A_log.data, 0, rank, world, f"{name}.A_log"))
        _set_param(mod, "dt_bias", _chunk(mod.dt_bias.data, 0, rank, world, f"{name}.dt_bias"))
        mod.num_heads //= world
    elif style == "heads" and isinstance(mod, MultiHeadLatentAttention) or style == "mla_heads":
        if mod.num_heads % world:
            raise ValueError(f"tensor parallel: {name} has {mod.num_heads} MLA heads, not divisible by {world}")
        mod.num_heads //= world
    elif style == "experts_inter":
        if not isinstance(mod, Experts):
            raise TypeError(f"tensor parallel: {name} is a {type(mod).__name__}, experts_inter needs Experts")
        if mod.mxfp4 and (mod.inter // world) % 32:
            raise ValueError(f"tensor parallel: MXFP4 experts {name} need moe_intermediate_size / world "
                             f"({mod.inter} / {world}) divisible by 32 (one scale per 32 values)")
        suffixes = ("_packed", "_scale") if mod.mxfp4 else ("",)
        for w, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
            for sfx in suffixes:
                t = getattr(mod, w + sfx)
                _set_param(mod, w + sfx, _chunk(t.data, dim, rank, world, f"{name}.{w}{sfx}"))
        mod.inter //= world
        mod.__class__ = _TPExperts
        mod.tp_group = group
    elif style == "heads":
        raise TypeError(f"tensor parallel: {name} is a {type(mod).__name__}; 'heads' needs a KDA or MLA mixer")
    else:
        raise ValueError(f"tensor parallel: unknown style {style!r} for {name}; choose one of {TP_STYLES}")


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup | None = None,
                          plan: dict[str, str] | None = None) -> nn.Module:
    """Shard ``model`` (a :class:`~k3nn.KimiK3`) in place over ``group`` (default: the world) by ``plan``
    (default :func:`default_plan`). Returns the model. A world of one leaves it unchanged."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("apply_tensor_parallel: torch.distributed is not initialised (init_process_group)")
    if getattr(model, "tp_global_config", None) is not None:
        raise RuntimeError("apply_tensor_parallel: the model is already sharded")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = model.config
    if world == 1:
        return model
    if model.device.type == "meta":
        raise ValueError("apply_tensor_parallel: materialise the weights first (the model is on the meta device)")
    plan = default_plan(cfg) if plan is None else plan
    matched: list[tuple[str, nn.Module, str]] = []
    for name, mod in model.named_modules():
        for pat, style in plan.items():
            if fnmatch.fnmatchcase(name, pat):
                matched.append((name, mod, style))
                break
    for name, mod, style in matched:
        _shard(name, mod, style, rank, world, group)
    local = cfg.replace(kda_num_heads=cfg.kda_num_heads // world,
                        num_attention_heads=cfg.num_attention_heads // world)
    model.tp_global_config = cfg
    model.config = local
    if hasattr(model, "model"):
        model.model.config = local
    if getattr(model, "decode_prepared", False):  # packed again from the shards (hooked projections not at all)
        model.prepare_decode(False).prepare_decode()
    model.tp_world_size = world
    return model
