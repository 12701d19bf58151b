"""Mixture of Experts: the Kimi Linear / DeepSeek "noaux_tc" MoE and K3's Stable LatentMoE.

Router (both)::

    s = sigmoid(W_r x)  (fp32)        choice = s + b        (b = e_score_correction_bias, no gradient)
    I = TopK_k(choice)  (group-limited when num_expert_group > 1)
    p_j = s_j / Σ_{I} s (moe_renormalize) · routed_scaling_factor

Standard: ``y = Σ_j p_j E_j(x) + Shared(x)`` with E_j(x) = W2_j act(W1_j x, W3_j x).
Stable LatentMoE: ``z = W_down x``; ``u = Σ_j p_j E_j(z)`` in latent width; ``y = W_up RMSNorm(u) + Shared(x)``.
The latent path computes per-slot expert outputs and defers the weighting: one
``moe_latent_finalize`` pass does Σ_j p_j E_j(z), the fp32 RMSNorm and the gain (deferred finalization).
Experts are stored stacked: w1, w3 [E, I, D_in], w2 [E, D_in, I] (bf16 parameters, or MXFP4 buffers).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..config import KimiK3Config
from ..quant.mxfp4 import BLOCK, MXFP4Weight
from .linear import Linear
from .mlp import MLP
from ..kernels.registry import backend
from ..utils import records_grad, upcast
from .norm import RMSNorm

__all__ = ["Router", "Experts", "MoE", "route"]


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scaling: float,
          num_group: int = 1, topk_group: int = 1, score_func: str = "sigmoid"):
    """logits [N, E] fp32 → (topk_ids [N, k] int64, topk_weights [N, k] fp32) (:func:`k3nn.ops.moe_route`).
    Selection on biased scores, weights from the raw scores. Non-finite logits raise (asynchronously on GPU: no
    host sync)."""
    if records_grad(logits):  # the kernels are forward only; the weights carry the router's gradient
        with backend("eager"):
            return ops.moe_route(logits, bias, top_k, renormalize, scaling, num_group, topk_group, score_func)
    return ops.moe_route(logits, bias, top_k, renormalize, scaling, num_group, topk_group, score_func)


class Router(nn.Module):
    """The MoE router (``gate``): ``weight`` [E, d] fp32 and the Quantile Balancing correction bias
    ``e_score_correction_bias`` [E] fp32 (a buffer: no gradient). ``forward(x [N, d])`` → (topk_ids [N, k] int64,
    topk_weights [N, k] fp32), selection on sigmoid (or softmax) scores + bias, weights from the raw scores (see the
    module docstring)."""

    def __init__(self, config: KimiK3Config):
        super().__init__()
        E = config.num_experts
        self.weight = nn.Parameter(torch.empty(E, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        self.top_k, self.renormalize = config.num_experts_per_token, config.moe_renormalize
        self.scaling, self.score_func = config.routed_scaling_factor, config.moe_router_activation_func
        self.num_group, self.topk_group = config.num_expert_group, config.topk_group

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [..., E] in fp32 (fp64 when checking in fp64): :func:`k3nn.ops.linear` as if on upcast
        inputs (half-precision x and weight: ``out_dtype=float32``, no cast copies on the Triton path)."""
        if x.dtype == self.weight.dtype and x.dtype in (torch.float16, torch.bfloat16):
            return ops.linear(x, self.weight, out_dtype=torch.float32)
        return ops.linear(upcast(x), upcast(self.weight))

    def forward(self, x: torch.Tensor):
        """x [N, d] → (topk_ids [N, k] int64, topk_weights [N, k] fp32): :func:`route` on :meth:`logits`, in one
        op where nothing records gradients (:func:`k3nn.ops.moe_gate_route`: a decode-sized router one launch
        shorter, the same logits)."""
        if records_grad(x, self.weight):
            return route(self.logits(x), self.e_score_correction_bias, self.top_k, self.renormalize, self.scaling,
                         self.num_group, self.topk_group, self.score_func)
        w = self.weight
        if not (x.dtype == w.dtype and x.dtype in (torch.float16, torch.bfloat16)):
            x, w = upcast(x), upcast(w)  # as :meth:`logits`
        return ops.moe_gate_route(x, w, self.e_score_correction_bias, self.top_k, self.renormalize, self.scaling,
                                  self.num_group, self.topk_group, self.score_func)


class Experts(nn.Module):
    """E stacked GLU experts D_in → I → D_in; bf16/fp32 parameters or MXFP4 buffers (``*_packed``/``*_scale``)."""

    def __init__(self, num_experts: int, d_in: int, inter: int, act: str, beta: float,
                 linear_beta: float | None, mxfp4: bool = False):
        super().__init__()
        self.num_experts, self.d_in, self.inter = num_experts, d_in, inter
        self.act, self.beta, self.linear_beta, self.mxfp4 = act, beta, linear_beta, mxfp4
        shapes = {"w1": (num_experts, inter, d_in), "w3": (num_experts, inter, d_in), "w2": (num_experts, d_in, inter)}
        for name, (E, n, k) in shapes.items():
            if mxfp4:
                self.register_buffer(f"{name}_packed", torch.zeros(E, n, k // 2, dtype=torch.uint8))
                self.register_buffer(f"{name}_scale", torch.full((E, n, k // BLOCK), 127, dtype=torch.uint8))
            else:
                self.register_parameter(name, nn.Parameter(torch.empty(E, n, k)))

    def weight(self, name: str):
        """Expert weight ``name`` ("w1", "w3": [E, I, D_in]; "w2": [E, D_in, I]): the parameter, or an
        :class:`~k3nn.quant.mxfp4.MXFP4Weight` of its packed codes and scales when the experts are MXFP4."""
        if self.mxfp4:
            return MXFP4Weight(getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"))
        return getattr(self, name)

    def logical_numel(self) -> int:
        """Weights the experts represent (3·E·I·D_in), whether stored dense or as MXFP4."""
        return 3 * self.num_experts * self.inter * self.d_in

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, D_in], ids/weights [N, k] → Σ_k weights · E_ids(x), [N, D_in]."""
        return ops.moe_experts(x, self.weight("w1"), self.weight("w3"), self.weight("w2"), ids, weights,
                               activation=self.act, beta=self.beta, linear_beta=self.linear_beta)

    def outputs(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, D_in], ids [N, k] → unweighted per-slot outputs [N, k, D_in] (weights applied at finalization)."""
        return ops.moe_expert_outputs(x, self.weight("w1"), self.weight("w3"), self.weight("w2"), ids,
                                      activation=self.act, beta=self.beta, linear_beta=self.linear_beta)


class MoE(nn.Module):
    """A MoE block: :class:`Router` + :class:`Experts` + shared experts, in the standard (Kimi Linear / DeepSeek) or
    the Stable LatentMoE (K3) form chosen by ``config.moe_kind`` (see the module docstring for the math).

    ``forward(x [..., d]) → [..., d]`` in x's dtype. With ``record_routing`` set (Quantile Balancing does), each forward
    keeps ``last_routing = (router logits [N, E] fp32, topk_ids [N, k])``.

    Example::

        moe = MoE(KimiK3Config.tiny())
        y = moe(torch.randn(2, 8, 64))   # [2, 8, 64]
    """

    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.latent = config.moe_kind == "latent"
        d = config.hidden_size
        d_in = config.expert_input_size
        act = dict(act=config.hidden_act, beta=config.activation_situ_beta, linear_beta=config.activation_situ_linear_beta)
        self.gate = Router(config)
        self.experts = Experts(config.num_experts, d_in, config.moe_intermediate_size, mxfp4=config.mxfp4_experts, **act)
        if self.latent:
            self.routed_expert_down_proj = Linear(d, d_in, bias=False)
            self.routed_expert_norm = RMSNorm(d_in, config.rms_norm_eps) if config.latent_moe_use_norm else None
            self.routed_expert_up_proj = Linear(d_in, d, bias=False)
        self.shared_experts = (MLP(d, config.shared_expert_intermediate_size, **act)
                               if config.num_shared_experts > 0 else None)
        #: set by routing utilities (Quantile Balancing) that need the last routing decision
        self.last_routing: tuple[torch.Tensor, torch.Tensor] | None = None
        self.record_routing = False

    def routed(self, xf: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The routed part for tokens xf [N, d] already routed to (ids, w) [N, k]: Σ_k w·E(x), or for the latent
        kind ``W_up RMSNorm(Σ_k w·E(W_down x))``."""
        if not self.latent:
            return self.experts(xf, ids, w)
        # deferred finalization: top-k weighting + reduction fused with the latent RMSNorm
        z = self.routed_expert_down_proj(xf)
        norm = self.routed_expert_norm
        u = ops.moe_latent_finalize(self.experts.outputs(z, ids), w, None if norm is None else norm.weight,
                                    1e-5 if norm is None else norm.eps, out_dtype=z.dtype)
        return self.routed_expert_up_proj(u)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] → routed experts + shared experts [..., d] in x's dtype."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        if self.record_routing:  # the logits are kept: the two-op form
            logits = self.gate.logits(xf)
            ids, w = route(logits, self.gate.e_score_correction_bias, self.gate.top_k, self.gate.renormalize,
                           self.gate.scaling, self.gate.num_group, self.gate.topk_group, self.gate.score_func)
            self.last_routing = (logits.detach(), ids)
        else:
            ids, w = self.gate(xf)
        y = self.routed(xf, ids, w)
        if self.shared_experts is not None:
            y = self.shared_experts(xf, add_to=y)
        return y.view(shape)
