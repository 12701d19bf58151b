"""Fused KDA decode: argument checks and the eager reference (the layer math, composed).

One call per layer and step does, for B requests living in cache slots ``state_indices`` and T new tokens
(T = 1 for decode, a few for speculative verify windows)::

    qkv  = SiLU(ShortConv_W([conv_state[slot], qkv]))            conv_state[slot] ← last W−1 inputs
    q, k = L2Norm(q), L2Norm(k)        (x / sqrt(Σx² + 1e-6))
    g    = −exp(A_log)·softplus(f + dt_bias)  |  lower_bound·sigmoid(exp(A_log)·(f + dt_bias))
    β    = sigmoid(b)
    o    = KDA recurrence from recurrent_state[slot]              recurrent_state[slot] ← final state
    y    = norm_weight · RMSNorm(o) · sigmoid(gate)               (per head, eps = norm_eps)

Shapes: qkv [B, T, 3·H·D] (q, k, v channel blocks, pre-conv); f, gate [B, T, H·D]; b [B, T, H];
conv_weight [3·H·D, W]; A_log [H]; dt_bias [H·D]; norm_weight [D]; recurrent_state [N, H, D, D] fp32
(K-first, the cache layout); conv_state [N, W−1, 3·H·D] (token-major); state_indices [B] int (None: 0..B−1).
Returns y [B, T, H, D] in qkv's dtype.
"""

from __future__ import annotations

import torch

from ...utils import upcast
from .prologue import GATES, kda_gate, l2norm, short_conv

__all__ = ["check_fused_decode", "kda_fused_decode_reference"]


def check_fused_decode(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, recurrent_state, conv_state,
                       state_indices=None, gate_kind="softplus", lower_bound=-5.0, norm_eps=1e-5, scale=None):
    named = dict(qkv=qkv, f=f, b=b, gate=gate, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias,
                 norm_weight=norm_weight, recurrent_state=recurrent_state, conv_state=conv_state)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if gate_kind not in GATES:
        raise ValueError(f"gate_kind must be one of {GATES}, got {gate_kind!r}")
    if norm_weight.dim() != 1:
        raise ValueError(f"norm_weight must be [D], got {tuple(norm_weight.shape)}")
    if A_log.dim() != 1:
        raise ValueError(f"A_log must be [H], got {tuple(A_log.shape)}")
    D, H = norm_weight.shape[0], A_log.shape[0]
    if qkv.dim() != 3 or qkv.shape[-1] != 3 * H * D:
        raise ValueError(f"qkv must be [B, T, 3*H*D] = [B, T, {3 * H * D}], got {tuple(qkv.shape)}")
    B, T, _ = qkv.shape
    if f.shape != (B, T, H * D):
        raise ValueError(f"f must be [B, T, H*D] = {(B, T, H * D)}, got {tuple(f.shape)}")
    if gate.shape != (B, T, H * D):
        raise ValueError(f"gate must be [B, T, H*D] = {(B, T, H * D)}, got {tuple(gate.shape)}")
    if b.shape != (B, T, H):
        raise ValueError(f"b must be [B, T, H] = {(B, T, H)}, got {tuple(b.shape)}")
    if dt_bias.shape != (H * D,):
        raise ValueError(f"dt_bias must be [H*D] = [{H * D}], got {tuple(dt_bias.shape)}")
    if conv_weight.dim() != 2 or conv_weight.shape[0] != 3 * H * D or conv_weight.shape[1] < 1:
        raise ValueError(f"conv_weight must be [3*H*D, W] = [{3 * H * D}, W], got {tuple(conv_weight.shape)}")
    W = conv_weight.shape[1]
    if recurrent_state.dim() != 4 or recurrent_state.shape[1:] != (H, D, D):
        raise ValueError(f"recurrent_state must be [N, H, D, D] = [N, {H}, {D}, {D}], "
                         f"got {tuple(recurrent_state.shape)}")
    N = recurrent_state.shape[0]
    if conv_state.shape != (N, W - 1, 3 * H * D):
        raise ValueError(f"conv_state must be [N, W-1, 3*H*D] = {(N, W - 1, 3 * H * D)}, "
                         f"got {tuple(conv_state.shape)}")
    if state_indices is None:
        if N < B:
            raise ValueError(f"state_indices is None, so slots 0..B-1 are used, but the state holds N={N} < B={B}")
    else:
        if not isinstance(state_indices, torch.Tensor) or state_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError("state_indices must be an int32/int64 tensor")
        if state_indices.shape != (B,):
            raise ValueError(f"state_indices must be [B] = [{B}], got {tuple(state_indices.shape)}")
        if state_indices.device.type == "cpu" and B and (state_indices.min() < 0 or state_indices.max() >= N):
            raise ValueError(f"state_indices must lie in [0, {N}), got {state_indices.tolist()}")
    devs = {t.device for t in named.values()}
    if state_indices is not None:
        devs.add(state_indices.device)
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
    return B, T, H, D, W, N


def kda_fused_decode_reference(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, recurrent_state,
                               conv_state, state_indices=None, gate_kind="softplus", lower_bound=-5.0,
                               norm_eps=1e-5, scale=None):
    from .reference import kda_recurrent_reference

    B, T, _ = qkv.shape
    D, H = norm_weight.shape[0], A_log.shape[0]
    idx = torch.arange(B, device=qkv.device) if state_indices is None else state_indices.long()
    y_qkv, conv_new = short_conv(qkv, conv_weight, conv_state[idx])
    q, k, v = (t.reshape(B, T, H, D) for t in y_qkv.split(H * D, dim=-1))
    q, k = l2norm(q), l2norm(k)
    g = kda_gate(f, A_log, dt_bias, gate_kind, lower_bound, D)
    beta = torch.sigmoid(upcast(b))
    o, S = kda_recurrent_reference(q, k, v, g, beta, scale=scale, initial_state=recurrent_state[idx],
                                   output_final_state=True)
    recurrent_state[idx] = S.to(recurrent_state.dtype)
    conv_state[idx] = conv_new.to(conv_state.dtype)
    of = upcast(o)
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + norm_eps) * upcast(norm_weight)
    return (of * torch.sigmoid(upcast(gate).reshape(B, T, H, D))).to(qkv.dtype)
