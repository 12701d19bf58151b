"""Fused KDA decode: argument checks and the eager reference (the layer math, composed).

One call per layer and step does, for B requests living in cache slots ``state_indices`` and T new tokens
(T = 1 for decode, a few for speculative verify windows), of which row b feeds its first ``num_tokens[b]``::

    qkv  = SiLU(ShortConv_W([conv_state[slot], qkv]))            conv_state[slot] ← last W−1 inputs
    q, k = L2Norm(q), L2Norm(k)        (x / sqrt(Σx² + 1e-6))
    g    = −exp(A_log)·softplus(f + dt_bias)  |  lower_bound·sigmoid(exp(A_log)·(f + dt_bias))
    β    = sigmoid(b)
    o    = KDA recurrence from recurrent_state[slot]              recurrent_state[slot] ← final state
    y    = norm_weight · RMSNorm(o) · sigmoid(gate)               (per head, eps = norm_eps)

Shapes: qkv [B, T, 3·H·D] (q, k, v channel blocks, pre-conv); f, gate [B, T, H·D]; b [B, T, H];
conv_weight [3·H·D, W]; A_log [H]; dt_bias [H·D]; norm_weight [D]; recurrent_state [N, H, D, D] fp32
(K-first, the cache layout); conv_state [N, W−1, 3·H·D] (token-major); state_indices [B] int (None: 0..B−1; a
negative index marks a padding row: no state is read or written and its outputs are zero); num_tokens [B] int
(None: every row feeds all T tokens): the state of row b advances over its first ``num_tokens[b]`` tokens only
(0 leaves it untouched), so right-padded rows and partly accepted verify windows end in their exact state; the
outputs at positions ``t >= num_tokens[b]`` are unspecified (finite); write_state [B] bool (None: all True): False
leaves row b's cache state untouched (its outputs are computed from it as usual): a speculative verify window
reads the committed state and the accepted prefix is folded in afterwards.
Returns y [B, T, H, D] in qkv's dtype.
"""

from __future__ import annotations

import torch

from ...utils import upcast
from .prologue import GATES, kda_gate, l2norm, short_conv

__all__ = ["check_fused_decode", "kda_fused_decode_reference"]


def check_fused_decode(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, recurrent_state, conv_state,
                       state_indices=None, gate_kind="softplus", lower_bound=-5.0, norm_eps=1e-5, scale=None,
                       num_tokens=None, write_state=None):
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
        if state_indices.device.type == "cpu" and B and (state_indices.min() < -1 or state_indices.max() >= N):
            raise ValueError(f"state_indices must lie in [0, {N}) (or be -1 for a padding row), got "
                             f"{state_indices.tolist()}")
    if num_tokens is not None:
        if not isinstance(num_tokens, torch.Tensor) or num_tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError("num_tokens must be an int32/int64 tensor")
        if num_tokens.shape != (B,):
            raise ValueError(f"num_tokens must be [B] = [{B}], got {tuple(num_tokens.shape)}")
        if num_tokens.device.type == "cpu" and B and (num_tokens.min() < 0 or num_tokens.max() > T):
            raise ValueError(f"num_tokens must lie in [0, T={T}], got {num_tokens.tolist()}")
    if write_state is not None:
        if not isinstance(write_state, torch.Tensor) or write_state.dtype != torch.bool:
            raise TypeError("write_state must be a bool tensor")
        if write_state.shape != (B,):
            raise ValueError(f"write_state must be [B] = [{B}], got {tuple(write_state.shape)}")
    devs = {t.device for t in named.values()}
    for t in (state_indices, num_tokens, write_state):
        if t is not None:
            devs.add(t.device)
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
    return B, T, H, D, W, N


def kda_fused_decode_reference(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, recurrent_state,
                               conv_state, state_indices=None, gate_kind="softplus", lower_bound=-5.0,
                               norm_eps=1e-5, scale=None, num_tokens=None, write_state=None):
    from .reference import kda_recurrent_reference

    B, T, _ = qkv.shape
    D, H = norm_weight.shape[0], A_log.shape[0]
    dev = qkv.device
    idx = torch.arange(B, device=dev) if state_indices is None else state_indices.long()
    n = torch.full((B,), T, dtype=torch.long, device=dev) if num_tokens is None else num_tokens.long()
    live = idx >= 0
    n = torch.where(live, n, torch.zeros_like(n))
    slot = idx.clamp_min(0)
    rec0, conv0 = recurrent_state[slot], conv_state[slot]
    y_qkv, _ = short_conv(qkv, conv_weight, conv0)
    q, k, v = (t.reshape(B, T, H, D) for t in y_qkv.split(H * D, dim=-1))
    q, k = l2norm(q), l2norm(k)
    g = kda_gate(f, A_log, dt_bias, gate_kind, lower_bound, D)
    beta = torch.sigmoid(upcast(b))
    # a token past its row's count leaves the state as it is: decay 1 (g = 0) and no write (β = 0)
    fed = torch.arange(T, device=dev)[None, :] < n[:, None]  # [B, T]
    g = torch.where(fed[..., None, None], g, torch.zeros_like(g))
    beta = torch.where(fed[..., None], beta, torch.zeros_like(beta))
    o, S = kda_recurrent_reference(q, k, v, g, beta, scale=scale, initial_state=rec0, output_final_state=True)
    # conv state: the last W−1 rows of [old state ; the fed tokens]
    W1 = conv_state.shape[1]
    window = torch.cat([conv0.to(qkv.dtype), qkv], 1)  # [B, W−1+T, C]
    rows = n[:, None] + torch.arange(W1, device=dev)[None, :]  # [B, W−1]
    conv_new = window.gather(1, rows[..., None].expand(-1, -1, window.shape[-1]))
    writes = live if write_state is None else live & write_state
    keep = writes.nonzero().flatten()  # the eager path may sync with the host (it is never graph-captured)
    recurrent_state[slot[keep]] = S[keep].to(recurrent_state.dtype)
    conv_state[slot[keep]] = conv_new[keep].to(conv_state.dtype)
    of = upcast(o)
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + norm_eps) * upcast(norm_weight)
    y = (of * torch.sigmoid(upcast(gate).reshape(B, T, H, D))).to(qkv.dtype)
    return torch.where(live[:, None, None, None], y, torch.zeros_like(y))
