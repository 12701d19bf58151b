"""Latency-specialized decode (``decode_backend="latency_specialized"``): one token per row, per layer the
fused ops instead of the module-by-module forward.

Per decoder layer (x_BD: the layer's normed input, one token per row)::

    KDA   y = x W_inᵀ  (W_in = [W_q; W_k; W_v; W_gate; W_fa; W_b], one GEMM)  →  f = W_fb fa
          o = ops.kda_fused_decode(qkv, f, b, gate, ...)   (conv, gate, β, L2 norm, recurrence, gated norm;
          cache state updated in place)  →  o_proj
    MLA   y = x W_inᵀ  (W_in = [W_qa | W_q; W_kva; W_g])  →  q = W_qb RMSNorm(qa),  c = RMSNorm(c)
          (W_qb's / W_q's rows permuted at plan time to [nope | rope]: q_rope is a contiguous slice, no copy)
          q_lat = W_UKᵀ q_nope  (one bmm)   →  (c, k_r) index_copy'd at the device position of the static pool
          (the position and MLA's key count computed once per step, shared by the MLA layers)
          o_lat = ops.mla_decode(q_lat, q_rope, pool, identity block table)  →  W_UV o_lat  →  ⊙ σ(g) → o_proj
    AttnRes  ops.attnres_phase1 once per block (every query that sees that set of blocks, batched), then per
          sublayer ops.attnres_phase2 merging the running partial, with the residual add and the following
          RMSNorm fused (input_layernorm / post_attention_layernorm / the final norm); the FFN output is not
          added to the residual on its own: it is the ``update`` of the next merge (no separate add)
    FFN   MoE: router GEMM → one-launch top-k routing (:mod:`k3nn.decode.kernels`; its eager form: unsorted
          top-k, no NaN check) → fused routed experts → deferred latent finalization; shared experts and the
          dense MLP as one gate|up GEMM + one GLU kernel; the shared experts' down projection accumulates onto
          the routed output in its GEMM (addmm: no separate add).
    Norms outside AttnRes (MLA's q_a / kv_a norms, plain-residual models) and the MLA output gate are one
    kernel each.

Works on the static, ``mla_pool`` :class:`~k3nn.cache.hybrid.HybridCache` (graph-safe: fixed shapes, device
write position, no host sync), so the whole step is captured by :class:`~k3nn.decode.runner.DecodeRunner`.
Falls back (``unsupported``) for left-padded (mixed-length) batches (``mla_decode`` masks by length only) and
for caches without the pool layout. Numerics: the same math as the standard path up to rounding (phase-2
merge order, MLA in the kernel's split-KV order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import ops
from ..cache.hybrid import HybridCache, KDAState
from . import kernels as K
from ..kernels.registry import backend as use_backend
from ..layers.mla import apply_rope

__all__ = ["LatencySpecializedDecoder"]


def _norm(mod, x: torch.Tensor) -> torch.Tensor:
    return K.rmsnorm(x, mod.weight, mod.eps)


@dataclass
class _KDAPlan:
    w_in: torch.Tensor  # [3C + Cg + D + H, d]
    splits: list[int]
    conv_w: torch.Tensor  # [3C, W]


@dataclass
class _MLAPlan:
    w_in: torch.Tensor  # [(q_lora | H·dq) + r + dr (+ H·dv), d]; without q_lora its q rows are nope | rope
    splits: list[int]
    w_qb: torch.Tensor | None  # q_b_proj with its rows permuted to [all heads' nope | all heads' rope]
    w_uk: torch.Tensor  # [H, dn, r]
    w_uv_t: torch.Tensor  # [H, r, dv]


@dataclass
class _AttnResPlan:
    """Query q of the model: ("attn", i) / ("mlp", i) / ("final", -1). groups[k]: the queries that see the
    block set after the k-th push, stacked as phase-1 weights."""

    push_layers: list[int] = field(default_factory=list)
    group_of: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)  # query → (group, row)
    qw: list[torch.Tensor] = field(default_factory=list)  # per group [Q, d]
    nw: list[torch.Tensor] = field(default_factory=list)
    eps: list[float] = field(default_factory=list)


class LatencySpecializedDecoder:
    """Built once per model (``for_model`` caches it on the model); ``step_fn(cache)`` gives the decode step."""

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.plans: list[_KDAPlan | _MLAPlan] = []
        with torch.no_grad():
            for layer in model.model.layers:
                self.plans.append(self._mla_plan(layer.self_attn) if layer.is_mla else self._kda_plan(layer.self_attn))
            self.attnres = self._attnres_plan() if self.config.use_attn_res else None
        self._key = self._weights_key(model)
        self.glu_weights: dict[int, torch.Tensor] = {}  # fused gate|up weights of the dense / shared MLPs
        with torch.no_grad():
            for layer in model.model.layers:
                mlp = layer.block_sparse_moe.shared_experts if layer.is_moe else layer.mlp
                if mlp is not None:
                    self.glu_weights[id(mlp)] = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0).contiguous()

    # -- construction --------------------------------------------------------------------------------------
    @staticmethod
    def _weights_key(model):
        return tuple((p.data_ptr(), p._version) for p in (model.lm_head.weight, model.model.embed_tokens.weight))

    @classmethod
    def for_model(cls, model) -> "LatencySpecializedDecoder":
        dec = getattr(model, "_latency_decoder", None)
        if dec is None or dec._key != cls._weights_key(model):
            dec = cls(model)
            model._latency_decoder = dec
        return dec

    @staticmethod
    def unsupported(model, cache, attention_mask: torch.Tensor | None) -> str | None:
        """None when the fused path can decode this batch, else why not (the caller falls back)."""
        if not isinstance(cache, HybridCache) or type(cache) is not HybridCache:
            return "needs the contiguous HybridCache"
        if any(not isinstance(st, KDAState) and st.kv is None for st in cache.layers):
            return "the cache was created without mla_pool=True"
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            return "left-padded (mixed-length) batch"
        if model.device.type == "meta":
            return "weights on the meta device"
        return None

    def _kda_plan(self, a) -> _KDAPlan:
        gate = [a.g_proj.weight] if a.full_rank_gate else [a.g_a_proj.weight]
        ws = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, *gate, a.f_a_proj.weight, a.b_proj.weight]
        return _KDAPlan(torch.cat(ws, 0).contiguous(), [w.shape[0] for w in ws], a.conv_weight().contiguous())

    @staticmethod
    def _nope_rope_rows(w: torch.Tensor, H: int, dn: int, dr: int) -> torch.Tensor:
        """q weight [H·(dn+dr), k] → rows [H·dn nope | H·dr rope]: q_nope and q_rope come out as two contiguous
        slices (no copy before the kernels; the same dot products, only their order in the output)."""
        w = w.view(H, dn + dr, -1)
        return torch.cat([w[:, :dn].reshape(H * dn, -1), w[:, dn:].reshape(H * dr, -1)], 0).contiguous()

    def _mla_plan(self, a) -> _MLAPlan:
        H, dn, dr = a.num_heads, a.dn, a.dr
        wq = a.q_proj.weight if a.q_lora_rank is None else a.q_a_proj.weight
        if a.q_lora_rank is None:
            wq = self._nope_rope_rows(wq, H, dn, dr)
        ws = [wq, a.kv_a_proj_with_mqa.weight]
        if a.use_output_gate:
            ws.append(a.g_proj.weight)
        w_uk, w_uv = a.w_uk_uv()
        w_qb = None if a.q_lora_rank is None else self._nope_rope_rows(a.q_b_proj.weight, H, dn, dr)
        return _MLAPlan(torch.cat(ws, 0).contiguous(), [w.shape[0] for w in ws], w_qb, w_uk.contiguous(),
                        w_uv.transpose(1, 2).contiguous())

    def _attnres_plan(self) -> _AttnResPlan:
        layers, bs = self.model.model.layers, self.config.attn_res_block_size
        plan = _AttnResPlan()
        groups: list[list[tuple[str, int, torch.nn.Module, torch.nn.Module]]] = []
        for i, layer in enumerate(layers):
            if groups:  # the attention query sees the blocks pushed so far (before this layer's push)
                groups[-1].append(("attn", i, layer.self_attention_res_proj, layer.self_attention_res_norm))
            if i % bs == 0:
                plan.push_layers.append(i)
                groups.append([])
            groups[-1].append(("mlp", i, layer.mlp_res_proj, layer.mlp_res_norm))
        m = self.model.model
        groups[-1].append(("final", -1, m.output_attn_res_proj, m.output_attn_res_norm))
        for g, qs in enumerate(groups):
            for row, (kind, i, _, _) in enumerate(qs):
                plan.group_of[(kind, i)] = (g, row)
            plan.qw.append(torch.stack([p.weight[0] for _, _, p, _ in qs]).contiguous())
            plan.nw.append(torch.stack([n.weight for _, _, _, n in qs]).contiguous())
            eps = {n.eps for _, _, _, n in qs}
            if len(eps) != 1:
                raise ValueError("latency_specialized: AttnRes norms of one block need one eps")
            plan.eps.append(eps.pop())
        return plan

    # -- per-layer decode --------------------------------------------------------------------------------
    def _kda(self, a, plan: _KDAPlan, x: torch.Tensor, state: KDAState) -> torch.Tensor:
        B = x.shape[0]
        qkv_n = 3 * a.num_heads * a.head_dim
        y = F.linear(x, plan.w_in)
        qkv, g, fa, b = y.split([qkv_n, plan.splits[3], plan.splits[4], plan.splits[5]], -1)
        gate = g if a.full_rank_gate else a.g_b_proj(g)
        o = ops.kda_fused_decode(qkv, a.f_b_proj(fa), b, gate, plan.conv_w, a.A_log, a.dt_bias, a.o_norm.weight,
                                 state.recurrent, state.conv, None, gate_kind=a.gate_kind,
                                 lower_bound=a.lower_bound, norm_eps=a.o_norm.eps)
        return a.o_proj(o.reshape(B, 1, -1))

    def _mla(self, a, plan: _MLAPlan, x: torch.Tensor, state, cache: HybridCache, positions) -> torch.Tensor:
        B = x.shape[0]
        H, dn, dr, r = a.num_heads, a.dn, a.dr, a.kv_lora_rank
        parts = F.linear(x, plan.w_in).split(plan.splits, -1)
        q = parts[0] if a.q_lora_rank is None else F.linear(_norm(a.q_a_layernorm, parts[0]), plan.w_qb)
        q_nope, q_rope = q.split([H * dn, H * dr], -1)  # plan rows: nope | rope (contiguous at B = 1)
        q_rope = q_rope.reshape(B, 1, H, dr)
        c, k_r = parts[1].split([r, dr], -1)
        c = _norm(a.kv_a_layernorm, c)
        if not a.use_nope and dr:
            q_rope, k_r = apply_rope(q_rope, positions, a.rope_theta), apply_rope(k_r, positions, a.rope_theta)
        q_lat = torch.bmm(q_nope.reshape(B, H, dn).transpose(0, 1), plan.w_uk).transpose(0, 1)  # [B, H, r]
        # the new token at the device write position (HybridCache.write_static without its per-layer index)
        idx = cache.write_pos.view(1)
        state.latent.index_copy_(1, idx, c.to(state.latent.dtype))
        state.rope.index_copy_(1, idx, k_r.to(state.rope.dtype))
        pool, table = state.pool()
        o_lat, _ = ops.mla_decode(q_lat.reshape(B, 1, H, r), q_rope.contiguous(), pool, table, self._seq_lens,
                                  a.scale, check=False)
        o = torch.bmm(o_lat.reshape(B, H, r).transpose(0, 1), plan.w_uv_t).transpose(0, 1)  # [B, H, dv]
        o = o.reshape(B, 1, H * a.dv)
        if a.use_output_gate:
            o = K.sigmoid_gate(o, parts[2].reshape(o.shape))
        return a.o_proj(o)

    # -- FFN: fused gate|up GEMM + one activation kernel; MoE with the one-launch router ----------------
    def _mlp(self, mlp, x: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
        """mlp(x), or ``acc + mlp(x)`` with the add in the down projection's GEMM (acc [N, d], x [N, d])."""
        h = K.glu(F.linear(x, self.glu_weights[id(mlp)]), mlp.act, mlp.beta, mlp.linear_beta)
        if acc is None:
            return mlp.down_proj(h)
        return torch.addmm(acc, h, mlp.down_proj.weight.t())

    def _ffn(self, layer, x: torch.Tensor) -> torch.Tensor:
        if not layer.is_moe:
            return self._mlp(layer.mlp, x)
        moe = layer.block_sparse_moe
        if moe.record_routing:
            return moe(x)
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        ids, w = K.route(moe.gate.logits(xf), moe.gate)
        y = moe.routed(xf, ids, w)
        if moe.shared_experts is not None:
            y = self._mlp(moe.shared_experts, xf, acc=y)
        return y.view(shape)

    def _mixer(self, i: int, layer, x, cache, positions):
        if layer.is_mla:
            return self._mla(layer.self_attn, self.plans[i], x, cache.layers[i], cache, positions)
        return self._kda(layer.self_attn, self.plans[i], x, cache.layers[i])

    # -- the step ------------------------------------------------------------------------------------------
    def step_fn(self, cache: HybridCache):
        model = self.model

        def step(ids: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), use_backend(model.backend):
                return self.forward(ids, cache)

        return step

    def forward(self, ids: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """ids [B, 1] → logits [B, V]; the cache must be static (``set_static(True)``) and ``mla_pool``."""
        m = self.model.model
        h = m.embed_tokens(ids)
        _, positions = cache.begin(1, None)
        self._seq_lens = (cache.write_pos + 1).expand(ids.shape[0])  # MLA's key count, shared by its layers
        if self.attnres is None:
            for i, layer in enumerate(m.layers):
                h = h + self._mixer(i, layer, _norm(layer.input_layernorm, h), cache, positions)
                h = h + self._ffn(layer, _norm(layer.post_attention_layernorm, h))
            out = _norm(m.norm, h)
        else:
            out = self._attnres_layers(h, cache, positions)
        cache.commit(1, None)
        return self.model.lm_head(out[:, -1])

    def _attnres_layers(self, h: torch.Tensor, cache: HybridCache, positions) -> torch.Tensor:
        m, plan = self.model.model, self.attnres
        blocks: list[torch.Tensor] = []
        partial: torch.Tensor | None = h
        state = None  # (o, m, l) of the current group

        def merge(kind, i, partial, update, norm):
            g, row = plan.group_of[(kind, i)]
            o, mx, l = state
            return ops.attnres_phase2(o[row], mx[row], l[row], partial, plan.qw[g][row], plan.nw[g][row],
                                      plan.eps[g], update=update, post_norm_weight=norm.weight,
                                      post_norm_eps=norm.eps)

        group = -1
        pending = None  # the previous FFN output: added to the partial inside the next merge (no separate add)
        for i, layer in enumerate(m.layers):
            if blocks:
                r = merge("attn", i, partial, pending, layer.input_layernorm)
                x, partial, pending = r.normed, r.partial, None
            else:
                if pending is not None:
                    partial, pending = partial + pending, None
                x = _norm(layer.input_layernorm, partial)
            if i % self.config.attn_res_block_size == 0:
                blocks.append(partial)
                partial = None
                group += 1
                state = ops.attnres_phase1(blocks, plan.qw[group], plan.nw[group], plan.eps[group])
            a = self._mixer(i, layer, x, cache, positions)
            r = merge("mlp", i, partial, a, layer.post_attention_layernorm)
            partial, pending = r.partial, self._ffn(layer, r.normed)
        return merge("final", -1, partial, pending, m.norm).normed
