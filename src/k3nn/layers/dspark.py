"""DSparkDrafter: a parallel block drafter conditioned on target hidden states (DFlash backbone + Markov and
confidence heads).

Shapes: B batch, L context length, G = γ block length, d hidden, m number of target taps, V vocab, r Markov rank.

* Context: the target's hidden states at ``target_layers`` (outputs of those decoder layers) are concatenated,
  ``H_ctx = RMSNorm(W_c [h_l1; …; h_lm])`` [B, L, d]. In every draft layer, keys/values are computed from
  ``[H_ctx ; block]`` with that layer's own k/v projections; queries come from the block only.
* Block: the embeddings (target's table) of ``[anchor, MASK×(γ−1)]`` at positions ``anchor_pos + k``; slot k
  predicts the token at ``anchor_pos + k + 1`` (γ inputs → γ drafts). A block query sees every context key
  strictly before the anchor and all keys of its own block (bidirectional; ``causal_block=True`` for the
  causal variant).
* Heads: base logits ``U_k = lm_head(norm(h_k))`` (target's lm_head); vanilla Markov bias
  ``B(x_{k−1}) = W2 W1[x_{k−1}]`` (x_0 = anchor); draft distribution ``q_k = softmax(U_k + B)`` sampled
  left → right; confidence ``c_k = σ(w·[h_k; W1[x_{k−1}]] + b)`` = P(slot k accepted | slots < k accepted).

The drafter does not own the embedding or lm_head: :meth:`DSparkDrafter.bind` attaches a target, and they are
neither registered as submodules nor saved.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..logits import process_logits

#: the drafter's attention kernels: a masked block over a context whose length changes every round, so not cuDNN
#: (it builds an execution plan per new shape: tens of ms each on the H200, more than the whole round)
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
from .mla import apply_rope
from .norm import RMSNorm

__all__ = ["DSparkConfig", "DSparkDrafter", "DraftState", "DraftProposal", "default_target_layers"]

CONFIG_NAME = "dspark_config.json"
WEIGHTS_NAME = "dspark.safetensors"


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's tap choice: one draft layer → the middle layer; else ``num_draft_layers`` taps spread
    uniformly over [1, num_target_layers − 3] (never the last layer)."""
    if num_target_layers < 2:
        return [0]
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, max(1, num_target_layers - 3)
    n = num_draft_layers
    return sorted({round(lo + (hi - lo) * i / (n - 1)) for i in range(n)})


@dataclass
class DSparkConfig:
    """The shape of a DSpark drafter (saved as ``dspark_config.json``).

    ``hidden_size`` / ``vocab_size`` must equal the target's (the drafter shares its embedding and lm_head);
    ``target_layers``: the 0-based target layers whose outputs are concatenated into the drafter's context;
    ``num_layers`` draft layers of ``num_heads`` × ``head_dim`` (default hidden_size // num_heads) with an MLP of
    ``intermediate_size`` (default 3·hidden_size); ``block_size`` γ: tokens drafted per round from [anchor, MASK×(γ−1)]
    (``mask_token_id``, default vocab_size − 1); ``markov_rank``: rank of the previous-token bias head;
    ``confidence_with_markov``: the confidence head also reads the Markov features; ``causal_block``: causal instead
    of bidirectional attention inside the block. Errors name the field (``DSparkConfig.<field>``).

    Example::

        cfg = DSparkConfig.for_target(model.config, num_layers=1, block_size=5)
        drafter = DSparkDrafter(cfg, target=model)
    """

    hidden_size: int
    vocab_size: int
    target_layers: list[int]
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int | None = None  # default hidden_size // num_heads
    intermediate_size: int | None = None  # default 3 · hidden_size
    block_size: int = 7  # γ
    mask_token_id: int | None = None  # default vocab_size − 1
    markov_rank: int = 64
    confidence_with_markov: bool = True
    causal_block: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    model_type: str = "k3nn_dspark"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.intermediate_size is None:
            self.intermediate_size = 3 * self.hidden_size
        if self.mask_token_id is None:
            self.mask_token_id = self.vocab_size - 1
        self.target_layers = [int(i) for i in self.target_layers]
        for name in ("hidden_size", "vocab_size", "num_layers", "num_heads", "head_dim", "block_size",
                     "markov_rank", "intermediate_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DSparkConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.target_layers:
            raise ValueError("DSparkConfig.target_layers must name at least one target layer")
        if self.head_dim % 2:
            raise ValueError(f"DSparkConfig.head_dim must be even (RoPE), got {self.head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside [0, {self.vocab_size})")

    @classmethod
    def for_target(cls, target_config, **overrides: Any) -> "DSparkConfig":
        """A drafter config sized from a :class:`KimiK3Config` (hidden size, vocab, default taps)."""
        n = overrides.get("num_layers", 2)
        base = dict(hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size,
                    target_layers=default_target_layers(target_config.num_hidden_layers, n),
                    rms_norm_eps=target_config.rms_norm_eps)
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        """Every field, as ``dspark_config.json`` stores it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DSparkConfig":
        """A config from :meth:`to_dict`'s form; unknown keys are kept in ``extra``."""
        names = {f.name for f in dataclasses.fields(cls)}
        extra = {k: v for k, v in d.items() if k not in names}
        kw = {k: v for k, v in d.items() if k in names}
        kw.setdefault("extra", {}).update(extra)
        return cls(**kw)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, T, H, Dh], positions [B, T] → rotated x (NeoX half rotation, fp32 math)."""
    return apply_rope(x, positions, theta)


class DraftAttention(nn.Module):
    """Multi-head attention with per-head q/k RMSNorm and RoPE; K/V over [context ; block]."""

    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.h, self.dh, self.theta = c.num_heads, c.head_dim, c.rope_theta
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d] → k, v [B, T, H, Dh] (k normed and rotated)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.h, self.dh))
        return _rope(k, positions, self.theta), self.v_proj(x).view(B, T, self.h, self.dh)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x [B, Tq, d] block inputs; ctx_k/v [B, L, H, Dh]; mask [B, Tq, L + Tq] bool (True = visible)."""
        B, T, _ = x.shape
        q = _rope(self.q_norm(self.q_proj(x).view(B, T, self.h, self.dh)), positions, self.theta)
        kb, vb = self.keys_values(x, positions)
        k = torch.cat([ctx_k.to(kb.dtype), kb], 1).transpose(1, 2)
        v = torch.cat([ctx_v.to(vb.dtype), vb], 1).transpose(1, 2)
        with sdpa_kernel(_SDPA_BACKENDS):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None])
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class DraftLayer(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, h, positions, ctx_k, ctx_v, mask):
        h = h + self.self_attn(self.input_layernorm(h), positions, ctx_k, ctx_v, mask)
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class DraftState:
    """Per-request draft cache: each layer's projected-context K/V [B, cap, H, Dh], key mask, rope positions.

    Only context (committed target positions) is cached; block K/V are recomputed every round. The block attends
    over the whole capacity through ``key_mask``; ``length`` (host-side end of the written columns) is
    bookkeeping for :meth:`DSparkDrafter.extend`'s default position."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    key_mask: torch.Tensor  # [B, cap] bool
    length: int = 0

    @property
    def capacity(self) -> int:
        """Context positions the state can hold per row."""
        return self.key_mask.shape[1]

    def reset(self) -> None:
        """Empty the state in place (zeros, no reallocation) for a new batch of the same shape."""
        for t in (*self.k, *self.v, self.key_mask):
            t.zero_()
        self.length = 0


@dataclass
class DraftProposal:
    """One round's drafts: ``tokens`` [B, n] long; ``probs`` [B, n, V] fp32, the draft distribution q (None when
    drafting greedily: q is one-hot); ``confidence`` [B, n] in (0, 1), the confidence head's estimate that each draft
    is accepted given the ones before it (None when not computed)."""

    tokens: torch.Tensor  # [B, n] draft ids
    probs: torch.Tensor | None  # [B, n, V] fp32 draft distribution q (None: greedy, q is one-hot)
    confidence: torch.Tensor | None  # [B, n] conditional acceptance estimates in (0, 1)


class DSparkDrafter(nn.Module):
    """The DSpark drafter (see the module docstring). ``target``: a :class:`k3nn.KimiK3` whose embedding and
    lm_head are shared (frozen); may be attached later with :meth:`bind`."""

    def __init__(self, config: DSparkConfig, target=None, *, device=None, dtype=None):
        super().__init__()
        self.config = c = config
        m = len(c.target_layers)
        self.fc = nn.Linear(m * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.markov_embed = nn.Embedding(c.vocab_size, c.markov_rank)  # W1
        self.markov_proj = nn.Linear(c.markov_rank, c.vocab_size, bias=False)  # W2
        conf_in = c.hidden_size + (c.markov_rank if c.confidence_with_markov else 0)
        self.confidence = nn.Linear(conf_in, 1)
        self.init_weights()
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)
        self.last_stats = None  # SpecStats of the last speculative_generate call
        self.spec_options = None  # k3nn.spec.SpecOptions used by generate(drafter=self)
        if target is not None:
            self.bind(target)

    # -- target sharing ----------------------------------------------------------------------------------
    def bind(self, target) -> "DSparkDrafter":
        """Share ``target``'s embedding and lm_head (kept out of this module's parameters and state_dict)."""
        tc = target.config
        if tc.hidden_size != self.config.hidden_size or tc.vocab_size != self.config.vocab_size:
            raise ValueError(f"target (hidden {tc.hidden_size}, vocab {tc.vocab_size}) does not match the drafter "
                             f"(hidden {self.config.hidden_size}, vocab {self.config.vocab_size})")
        bad = [i for i in self.config.target_layers if not 0 <= i < tc.num_hidden_layers]
        if bad:
            raise ValueError(f"target_layers {bad} outside the target's {tc.num_hidden_layers} layers")
        self.__dict__["_target"] = target  # not a submodule: not saved, not trained
        return self

    @property
    def target(self):
        """The bound target model (:meth:`bind`); RuntimeError when none is bound."""
        t = self.__dict__.get("_target")
        if t is None:
            raise RuntimeError("DSparkDrafter has no target: call drafter.bind(target) first")
        return t

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] → the target's token embeddings [..., d] (shared, not a parameter of the drafter)."""
        return self.target.model.embed_tokens(ids)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] → logits [..., V] through the target's lm_head (shared)."""
        return self.target.lm_head(h)

    @property
    def target_layers(self) -> list[int]:
        """The target layers (0-based) whose outputs condition the drafter."""
        return list(self.config.target_layers)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """normal(0, std) linear / embedding weights from a CPU generator seeded with ``seed``, zero biases, unit
        norms (run by the constructor)."""
        gen = torch.Generator().manual_seed(seed)
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * std)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.zero_()
            elif isinstance(mod, RMSNorm):
                mod.weight.fill_(1.0)

    # -- backbone ----------------------------------------------------------------------------------------
    def project_context(self, taps: list[torch.Tensor]) -> torch.Tensor:
        """Target hidden states (one [B, T, d] per tap) → H_ctx [B, T, d]."""
        if len(taps) != len(self.config.target_layers):
            raise ValueError(f"expected {len(self.config.target_layers)} target hidden states, got {len(taps)}")
        w = self.fc.weight
        return self.hidden_norm(self.fc(torch.cat([t.to(w.dtype) for t in taps], -1)))

    def backbone(self, h: torch.Tensor, positions: torch.Tensor, ctx: list[tuple[torch.Tensor, torch.Tensor]],
                 mask: torch.Tensor) -> torch.Tensor:
        """h [B, Tq, d] block embeddings → normed hidden [B, Tq, d]; ctx: per layer (k, v) [B, L, H, Dh]."""
        for layer, (ck, cv) in zip(self.layers, ctx):
            h = layer(h, positions, ck, cv, mask)
        return self.norm(h)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev ids [...] → Markov logit bias [..., V]."""
        return self.markov_proj(self.markov_embed(prev))

    def confidence_logit(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """h [..., d], prev ids [...] → confidence logit [...]."""
        z = torch.cat([h, self.markov_embed(prev).to(h.dtype)], -1) if self.config.confidence_with_markov else h
        return self.confidence(z)[..., 0]

    # -- training forward ----------------------------------------------------------------------------------
    def forward_train(self, taps: list[torch.Tensor], input_ids: torch.Tensor, anchors: torch.Tensor,
                      context_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Teacher-forced forward over many blocks of one batch.

        taps: target hidden states [B, L, d] per tap; input_ids [B, L]; anchors [B, N] anchor positions
        (each block predicts tokens anchor+1 … anchor+γ; callers keep anchor + γ < L or mask the labels).
        Returns ``logits`` [B, N, γ, V] (base + Markov bias, fp32), ``confidence`` [B, N, γ] logits,
        ``labels`` [B, N, γ] (ids at anchor + k + 1, clamped inside the sequence).
        """
        c = self.config
        G = c.block_size
        B, L = input_ids.shape
        N = anchors.shape[1]
        dev = input_ids.device
        ctx = self.project_context(taps)
        ctx_pos = torch.arange(L, device=dev).expand(B, L)
        k_idx = torch.arange(G, device=dev)
        pos = (anchors[:, :, None] + k_idx).reshape(B, N * G)
        ids = torch.full((B, N, G), c.mask_token_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = input_ids.gather(1, anchors)
        lab_pos = (anchors[:, :, None] + k_idx + 1).clamp(max=L - 1)
        labels = input_ids.gather(1, lab_pos.reshape(B, -1)).view(B, N, G)
        # visibility: context key j for block n iff j < anchor_n; block keys within the same block
        vis_ctx = torch.arange(L, device=dev)[None, None, :] < anchors.repeat_interleave(G, 1)[:, :, None]
        if context_mask is not None:
            vis_ctx = vis_ctx & context_mask.bool()[:, None, :]
        blk = torch.arange(N * G, device=dev) // G
        vis_blk = blk[:, None] == blk[None, :]
        if c.causal_block:
            slot = torch.arange(N * G, device=dev) % G
            vis_blk = vis_blk & (slot[None, :] <= slot[:, None])
        mask = torch.cat([vis_ctx, vis_blk.expand(B, -1, -1)], -1)
        kv = [layer.self_attn.keys_values(ctx, ctx_pos) for layer in self.layers]
        h = self.backbone(self.embed(ids.view(B, N * G)).to(self.fc.weight.dtype), pos, kv, mask)
        h = h.view(B, N, G, -1)
        prev = torch.cat([ids[:, :, :1], labels[:, :, :-1]], -1)  # teacher forcing: [anchor, x*_1 … x*_{γ−1}]
        logits = self.lm_head(h.to(self.target.lm_head.weight.dtype)).float() + self.markov_bias(prev).float()
        return {"logits": logits, "confidence": self.confidence_logit(h, prev).float(), "labels": labels,
                "hidden": h}

    # -- inference -----------------------------------------------------------------------------------------
    def new_state(self, batch_size: int, capacity: int, device=None) -> DraftState:
        """An empty :class:`DraftState` for ``batch_size`` rows of up to ``capacity`` context positions (K/V per
        layer [B, capacity, H, Dh] in the drafter's dtype), on ``device`` (default: the drafter's)."""
        c = self.config
        dev = device or self.fc.weight.device
        dt = self.fc.weight.dtype
        shape = (batch_size, capacity, c.num_heads, c.head_dim)
        return DraftState([torch.zeros(shape, dtype=dt, device=dev) for _ in self.layers],
                          [torch.zeros(shape, dtype=dt, device=dev) for _ in self.layers],
                          torch.zeros(batch_size, capacity, dtype=torch.bool, device=dev))

    @torch.no_grad()
    def extend(self, state: DraftState, taps: list[torch.Tensor], positions: torch.Tensor,
               mask: torch.Tensor | None = None, start: int | None = None) -> None:
        """Append committed target rows: taps [B, T, d] each, rope positions [B, T], mask [B, T] (False = not a
        committed token, e.g. padding or a rejected draft). Written at ``start`` (default: the end); the cache
        then ends after the last column any row keeps (like the target cache's shared write position).
        Host-synchronising (capacity check, ``length``); :meth:`extend_at` is the graph-safe variant."""
        ctx = self.project_context(taps)
        B, T, _ = ctx.shape
        s = state.length if start is None else start
        if s + T > state.capacity:
            raise ValueError(f"draft cache full: {s} + {T} > capacity {state.capacity}")
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(ctx, positions)
            state.k[i][:, s:s + T] = k
            state.v[i][:, s:s + T] = v
        state.key_mask[:, s:s + T] = True if mask is None else mask.bool()
        state.key_mask[:, s + T:] = False
        if mask is None:
            state.length = s + T
        else:
            cols = mask.bool().any(0).nonzero()
            state.length = s + (int(cols.max()) + 1 if cols.numel() else 0)

    @torch.no_grad()
    def extend_at(self, state: DraftState, taps: list[torch.Tensor], positions: torch.Tensor, mask: torch.Tensor,
                  start: torch.Tensor) -> None:
        """Graph-safe :meth:`extend`: the rows land at the device position ``start`` (0-dim long tensor),
        columns ``start … start + T − 1``, and every key from ``start + T`` on is masked, as in :meth:`extend`.
        Same K/V, mask and layout as ``extend(state, taps, positions, mask, start=int(start))``; no host sync,
        so no capacity check (the caller sizes the cache) and ``state.length`` is left to the caller."""
        ctx = self.project_context(taps)
        T = ctx.shape[1]
        dev = ctx.device
        idx = start + torch.arange(T, device=dev)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(ctx, positions)
            state.k[i].index_copy_(1, idx, k.to(state.k[i].dtype))
            state.v[i].index_copy_(1, idx, v.to(state.v[i].dtype))
        state.key_mask.logical_and_(torch.arange(state.capacity, device=dev)[None, :] < start + T)
        state.key_mask.index_copy_(1, idx, mask.bool())

    @torch.no_grad()
    def block_hidden(self, state: DraftState, anchor: torch.Tensor, anchor_pos: torch.Tensor, n: int) -> torch.Tensor:
        """Backbone over the block [anchor, MASK×(n−1)] at positions anchor_pos + k → normed hidden [B, n, d].

        The block attends over the whole context capacity, the key mask hiding every uncommitted column (no
        host-side length): graph-safe, and the same arithmetic whatever ``state.length`` is."""
        c = self.config
        B, dev = anchor.shape[0], anchor.device
        ids = torch.full((B, n), c.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchor
        pos = anchor_pos[:, None] + torch.arange(n, device=dev)
        L = state.capacity
        vis_blk = torch.ones(n, n, dtype=torch.bool, device=dev)
        if c.causal_block:
            vis_blk = torch.tril(vis_blk)
        mask = torch.cat([state.key_mask[:, None, :].expand(B, n, L), vis_blk.expand(B, n, n)], -1)
        kv = list(zip(state.k, state.v))
        return self.backbone(self.embed(ids).to(self.fc.weight.dtype), pos, kv, mask)

    @torch.no_grad()
    def draft_logits(self, state: DraftState, anchor: torch.Tensor, anchor_pos: torch.Tensor,
                     n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The backbone part of :meth:`propose` (graph-safe): normed block hidden [B, n, d] and base logits
        ``U`` [B, n, V] fp32."""
        h = self.block_hidden(state, anchor, anchor_pos, n)
        return h, self.lm_head(h.to(self.target.lm_head.weight.dtype)).float()

    @torch.no_grad()
    def markov_draft(self, h: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor, sample_cfg=None,
                     generator: torch.Generator | None = None, confidence: bool = True) -> DraftProposal:
        """The serial Markov / confidence heads of :meth:`propose` over :meth:`draft_logits`' outputs.
        Graph-safe when greedy (``sample_cfg`` None or not sampling); sampling draws from ``generator``.
        ``confidence=False`` skips the confidence head (``confidence`` None)."""
        B, n = base.shape[:2]
        dev = anchor.device
        sampling = sample_cfg is not None and sample_cfg.do_sample
        toks = torch.empty(B, n, dtype=torch.long, device=dev)
        probs = torch.empty_like(base) if sampling else None
        conf = torch.empty(B, n, device=dev) if confidence else None
        prev = anchor
        for k in range(n):
            z = base[:, k] + self.markov_bias(prev).float()
            if conf is not None:
                conf[:, k] = torch.sigmoid(self.confidence_logit(h[:, k], prev).float())
            if sampling:
                p = process_logits(z, sample_cfg.temperature, sample_cfg.top_k, sample_cfg.top_p).softmax(-1)
                probs[:, k] = p
                noise = torch.empty_like(p).exponential_(generator=generator)
                prev = (p / noise).argmax(-1)
            else:
                prev = z.argmax(-1)
            toks[:, k] = prev
        return DraftProposal(toks, probs, conf)

    @torch.no_grad()
    def propose(self, state: DraftState, anchor: torch.Tensor, anchor_pos: torch.Tensor, n: int,
                sample_cfg=None, generator: torch.Generator | None = None, confidence: bool = True) -> DraftProposal:
        """Draft ``n`` tokens after ``anchor`` [B] (at rope position ``anchor_pos`` [B]) in one backbone pass,
        then the serial Markov sampling. ``sample_cfg``: a GenerationConfig (``do_sample``, temperature,
        top-k/p; None or greedy → argmax drafts and ``probs=None``). Graph-safe when greedy
        (:meth:`draft_logits` then :meth:`markov_draft`). ``confidence=False``: no confidence estimates (a
        caller that cuts nothing saves the head's launches)."""
        h, base = self.draft_logits(state, anchor, anchor_pos, n)
        return self.markov_draft(h, base, anchor, sample_cfg, generator, confidence)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """``dspark_config.json`` + ``dspark.safetensors`` (drafter weights only; embedding/lm_head stay the
        target's)."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, CONFIG_NAME), "w") as f:
            json.dump(self.config.to_dict(), f, indent=2)
        sd = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(sd, os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, target=None, *, device=None,
                        dtype=None) -> "DSparkDrafter":
        """Load what :meth:`save_pretrained` wrote (``dspark_config.json`` + safetensors weights) into a drafter
        on ``device`` / ``dtype``, bound to ``target`` when given. A missing file is a FileNotFoundError naming it;
        missing or unexpected tensors a ValueError naming them.

        Example::

            drafter = DSparkDrafter.from_pretrained(os.path.expanduser("~/.cache/k3nn/demo/drafter"), target=model)
        """
        from safetensors.torch import load_file

        cfg_path, w_path = os.path.join(directory, CONFIG_NAME), os.path.join(directory, WEIGHTS_NAME)
        for p in (cfg_path, w_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"DSparkDrafter.from_pretrained: missing {p}")
        with open(cfg_path) as f:
            config = DSparkConfig.from_dict(json.load(f))
        drafter = cls(config)
        sd = load_file(w_path)
        missing, unexpected = drafter.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise ValueError(f"DSparkDrafter.from_pretrained: missing keys {missing}, unexpected keys {unexpected}")
        drafter.to(device=device, dtype=dtype)
        if target is not None:
            drafter.bind(target)
        return drafter
