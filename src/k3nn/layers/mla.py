"""MultiHeadLatentAttention (DeepSeek / Kimi MLA) with the K3 sigmoid output gate.

Projections (H heads, nope dim dn, rope dim dr, value dim dv, latent rank r)::

    q        = W_qb RMSNorm(W_qa x)   (q_lora_rank)   |   W_q x          → [H, dn + dr]
    c, k_r   = split(W_kva x);  c = RMSNorm(c)                             latent c [r], shared k_r [dr]
    k_h      = [W_UK,h c ; k_r],   v_h = W_UV,h c                          (W_kvb = [W_UK; W_UV] per head)
    o_h      = softmax(q_h · k_hᵀ / sqrt(dn + dr)) v_h
    y        = W_o (o ⊙ sigmoid(W_g x))                                    (output gate only in K3)

Prefill uses the decompressed K/V (``ops.mla_attention``: causal flash attention, no ``[T, L]`` mask or score
matrix; the cached context is decompressed ``kv_segment`` keys at a time). Decode uses the absorbed form over the latent cache only:
``q_lat,h = W_UK,hᵀ q_nope,h`` so ``score = q_lat·c + q_rope·k_r`` and ``o_h = W_UV,h (Σ p c)``.
The rope part is rotated (NeoX half-rotation) unless ``mla_use_nope`` (Kimi Linear and K3 use no rotation).
The cache stores per token only ``c`` [r] and ``k_r`` [dr].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..kernels.mla.api import merge_attn_states
from ..utils import upcast

from ..config import KimiK3Config
from .linear import Linear, project_onto
from .norm import RMSNorm
from .packed import Packed, pack_linears, unpack

__all__ = ["MultiHeadLatentAttention", "apply_rope", "absorbed_attention", "decompressed_attention"]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x [B, T, ..., dr] by positions [B, T] (NeoX half rotation), fp32 math."""
    dr = x.shape[-1]
    acc = upcast(x).dtype
    inv = 1.0 / (theta ** (torch.arange(0, dr, 2, device=x.device, dtype=acc) / dr))
    ang = positions.to(acc)[..., None] * inv  # [B, T, dr/2]
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(-2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    xf = upcast(x)
    x1, x2 = xf.chunk(2, -1)
    return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def _mask(q_pos: torch.Tensor, L: int, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Boolean [B, 1, T, L]: key j visible to the query at absolute index i iff j <= i and key_mask[j];
    the diagonal is always visible so padded queries stay finite."""
    j = torch.arange(L, device=q_pos.device)
    causal = j[None, None, :] <= q_pos[..., None]  # [B, T, L]
    if key_mask is not None:
        causal = causal & key_mask[:, None, :].bool()
    causal = causal | (j[None, None, :] == q_pos[..., None])
    return causal[:, None]


def decompressed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """q [B, T, H, dq], k [B, L, H, dq], v [B, L, H, dv], mask [B, 1, T, L] → [B, T, H, dv] (fp32 softmax)."""
    s = torch.einsum("bthd,blhd->bhtl", upcast(q), upcast(k)) * scale
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhtl,blhd->bthd", p, upcast(v)).to(v.dtype)


def absorbed_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, k_r: torch.Tensor,
                       mask: torch.Tensor, scale: float):
    """Latent-space attention. q_lat [B, T, H, r], q_rope [B, T, H, dr], c [B, L, r], k_r [B, L, dr],
    mask [B, 1, T, L] → (o_lat [B, T, H, r] fp32, lse [B, T, H] fp32)."""
    s = (torch.einsum("bthr,blr->bhtl", upcast(q_lat), upcast(c))
         + torch.einsum("bthd,bld->bhtl", upcast(q_rope), upcast(k_r))) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("bhtl,blr->bthr", (s - lse[..., None]).exp(), upcast(c))
    return o, lse.transpose(1, 2)


class MultiHeadLatentAttention(nn.Module):
    """Multi-head Latent Attention (the math is in the module docstring), with K3's sigmoid output gate.

    ``forward(x [B, T, d], state=None, attention_mask=None, positions=None, start=0) → [B, T, d]`` in x's dtype.
    Without ``state``: causal attention over these T tokens. With a latent cache view the new latents (``c`` [r]
    and ``k_r`` [dr] per token) are appended and the queries attend over everything visible: prefill-shaped calls
    on decompressed K/V (flash attention, no ``[T, L]`` matrix), decode-shaped ones (up to ``absorb_max_tokens``
    new tokens) in the absorbed latent form. ``positions`` [B, T]: rope positions (unused with ``mla_use_nope``).

    Parameters: ``q_proj`` (or ``q_a_proj`` → ``q_a_layernorm`` → ``q_b_proj`` with ``q_lora_rank``),
    ``kv_a_proj_with_mqa`` [r + dr, d], ``kv_a_layernorm``, ``kv_b_proj`` [H·(dn + dv), r] (W_UK and W_UV per
    head), ``o_proj`` [d, H·dv] and, with ``mla_use_output_gate``, ``g_proj`` [H·dv, d].

    Example::

        mla = MultiHeadLatentAttention(KimiK3Config.tiny())
        y = mla(torch.randn(2, 16, 64))           # [2, 16, 64]
    """

    #: decode-shaped calls (new tokens ≤ this, with cached context) use the absorbed latent form
    absorb_max_tokens = 16

    def __init__(self, config: KimiK3Config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        d, H = config.hidden_size, config.num_attention_heads
        self.num_heads, self.dn, self.dr, self.dv = H, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = config.kv_lora_rank, config.q_lora_rank
        self.use_nope, self.rope_theta = config.mla_use_nope, config.rope_theta
        dq = self.dn + self.dr
        if self.q_lora_rank is None:
            self.q_proj = Linear(d, H * dq, bias=False)
        else:
            self.q_a_proj = Linear(d, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # DeepSeek / Kimi use the default 1e-6 here
            self.q_b_proj = Linear(self.q_lora_rank, H * dq, bias=False)
        self.kv_a_proj_with_mqa = Linear(d, self.kv_lora_rank + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(self.kv_lora_rank, H * (self.dn + self.dv), bias=False)
        self.use_output_gate = config.mla_use_output_gate
        if self.use_output_gate:
            self.g_proj = Linear(d, H * self.dv, bias=False)
        self.o_proj = Linear(H * self.dv, d, bias=False)
        self.scale = dq ** -0.5
        self._decode_in: Packed | None = None  # prepare_decode(): q (or q_a) | kv_a | g as one GEMM

    def prepare_decode(self, on: bool = True) -> None:
        """Pack the input projections into one GEMM weight (see :mod:`k3nn.layers.packed`; kept when already
        packed); ``on=False`` drops it."""
        if not on:
            unpack(self._decode_in)
            self._decode_in = None
        elif self._decode_in is None:
            q = self.q_proj if self.q_lora_rank is None else self.q_a_proj
            self._decode_in = pack_linears([[q], [self.kv_a_proj_with_mqa]]
                                           + ([[self.g_proj]] if self.use_output_gate else []))

    # -- pieces shared by every path (and by the kernels' callers) -----------------------------------
    def queries(self, x: torch.Tensor, positions: torch.Tensor | None, proj: torch.Tensor | None = None):
        """``proj``: ``q_proj(x)`` (``q_a_proj(x)`` with a q LoRA) when already computed."""
        B, T, _ = x.shape
        if proj is None:
            proj = self.q_proj(x) if self.q_lora_rank is None else self.q_a_proj(x)
        q = proj if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(proj))
        q = q.view(B, T, self.num_heads, self.dn + self.dr)
        q_nope, q_rope = q.split([self.dn, self.dr], -1)
        if not self.use_nope and self.dr:
            q_rope = apply_rope(q_rope, positions, self.rope_theta)
        return q_nope, q_rope

    def latents(self, x: torch.Tensor, positions: torch.Tensor | None, proj: torch.Tensor | None = None):
        """``proj``: ``kv_a_proj_with_mqa(x)`` when already computed."""
        proj = self.kv_a_proj_with_mqa(x) if proj is None else proj
        c, k_r = proj.split([self.kv_lora_rank, self.dr], -1)
        c = self.kv_a_layernorm(c)
        if not self.use_nope and self.dr:
            k_r = apply_rope(k_r, positions, self.rope_theta)
        return c, k_r

    def w_uk_uv(self):
        """(W_UK [H, dn, r], W_UV [H, dv, r]): views of ``kv_b_proj.weight`` that decompress latents into keys and
        values (the absorbed decode folds them into the query and the output)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.kv_lora_rank)
        return w[:, : self.dn], w[:, self.dn:]  # [H, dn, r], [H, dv, r]

    def finish(self, x: torch.Tensor, o: torch.Tensor, gate: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """``gate``: ``g_proj(x)`` when already computed; ``residual``: added to the output inside ``o_proj``'s GEMM
        (:func:`~k3nn.layers.linear.project_onto`)."""
        B, T = x.shape[:2]
        o = o.reshape(B, T, self.num_heads * self.dv)
        if self.use_output_gate:
            g = self.g_proj(x) if gate is None else gate
            o = ops.sigmoid_gate(o, g.reshape(o.shape).to(o.dtype))
        return project_onto(self.o_proj, o, residual)

    def forward(self, x: torch.Tensor, state=None, attention_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, start: int = 0, *, residual: torch.Tensor | None = None):
        """x [B, T, d]; state: latent cache view (see the cache protocol in :mod:`k3nn.cache.hybrid`):
        ``state.append(c, k_r, attention_mask, start)`` stores the new latents and returns every visible
        latent ``[B, L, r]``, rope key ``[B, L, dr]``, key mask ``[B, L]`` and the new queries' absolute
        indices ``[B, T]``; attention_mask [B, T] for these tokens; positions [B, T] rope positions;
        ``residual`` [B, T, d]: returned ``residual + attention(x)``, the add inside ``o_proj``'s GEMM."""
        B, T, _ = x.shape
        # the absorbed form: a decode-shaped call with cached context, or any short call on a paged cache (its
        # rows carry their own cached lengths; the decode kernel reads the pages in place)
        decode = state is not None and T <= self.absorb_max_tokens and (start > 0 or state.paged)
        proj = [None, None, None]
        if self._decode_in is not None and not torch.is_grad_enabled():  # prepared: one GEMM, any length
            proj = self._decode_in.split(x) + [None]  # q | kv_a (| g)
        q_nope, q_rope = self.queries(x, positions, proj[0])
        c, k_r = self.latents(x, positions, proj[1])
        gate = proj[2]
        w_uk, w_uv = self.w_uk_uv()
        if decode:
            paged = state.paged_decode(c, k_r)  # pages the decode kernel reads in place (None: not this step)
            if paged is not None:
                pool, table, seq_lens = paged
                q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk).to(pool.dtype)
                o_lat, _ = ops.mla_decode(q_lat, q_rope.to(pool.dtype).contiguous(), pool, table, seq_lens,
                                          self.scale, check=False)
                # the latent output is in the pool's dtype already: W_UV in that dtype too (a 16-bit GEMM accumulates
                # in fp32 and rounds once, as the fp32 product would), never an fp32 copy of the weight per step
                o = torch.einsum("bthr,hvr->bthv", o_lat, w_uv.to(o_lat.dtype)).to(x.dtype)
                return self.finish(x, o, gate, residual)
        if state is not None:
            c_all, kr_all, key_mask, q_pos = state.append(c, k_r, attention_mask, start)
        else:
            c_all, kr_all, key_mask = c, k_r, attention_mask
            q_pos = torch.arange(T, device=x.device).expand(B, T)
        if decode:
            q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)
            mask = _mask(q_pos, c_all.shape[1], key_mask)
            o_lat, _ = absorbed_attention(q_lat, q_rope, c_all, kr_all, mask, self.scale)
            o = torch.einsum("bthr,hvr->bthv", o_lat, upcast(w_uv)).to(x.dtype)
        else:
            o = self.decompressed(q_nope, q_rope, c_all, kr_all, key_mask, q_pos[:, 0]).to(x.dtype)
        return self.finish(x, o, gate, residual)

    #: keys decompressed at a time on the prefill path: bounds the K/V workspace (L·H·(dn + dv) values) for long
    #: cached contexts; the segments' partial results merge exactly by their LSE
    kv_segment = 1 << 17

    def decompressed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, k_r: torch.Tensor,
                     key_mask: torch.Tensor | None, q_start: torch.Tensor) -> torch.Tensor:
        """Causal attention of the new queries over decompressed keys ``[W_UK c ; k_r]`` and values ``W_UV c``.

        q_nope [B, T, H, dn], q_rope [B, T, H, dr]; c [B, L, r], k_r [B, L, dr] every visible latent;
        key_mask [B, L] bool or None; q_start [B] int: key index of each row's first query."""
        B, L = c.shape[:2]
        H, dn, dv = self.num_heads, self.dn, self.dv
        w = self.kv_b_proj.weight.to(c.dtype)
        q_nope = q_nope.to(c.dtype)
        q_rope = q_rope.to(c.dtype) if self.dr else None
        capturing = c.is_cuda and torch.cuda.is_current_stream_capturing()
        if key_mask is not None and not capturing and bool(key_mask.all()):
            key_mask = None  # no padding: the kernel skips the mask loads
        seg = max(1, int(self.kv_segment))
        parts = []
        for a in range(0, L, seg):
            e = min(L, a + seg)
            kv = F.linear(c[:, a:e], w).view(B, e - a, H, dn + dv)
            parts.append(ops.mla_attention(q_nope, q_rope, kv[..., :dn], k_r[:, a:e] if self.dr else None,
                                           kv[..., dn:], self.scale, q_start=q_start - a,
                                           key_mask=None if key_mask is None else key_mask[:, a:e],
                                           return_lse=L > seg))
        if len(parts) == 1:
            return parts[0]
        o, _ = merge_attn_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        return o
