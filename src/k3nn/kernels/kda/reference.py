"""Eager reference for the KDA recurrence (plain PyTorch, one token at a time, fp32 or fp64 math).

Per head, with a per-key-channel log decay g_t and scalar β_t::

    S_t = (I - β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t-1} + β_t k_t v_tᵀ
    o_t = S_tᵀ (scale · q_t)

Operationally: decay the rows of S, predict ``S̃ᵀ k_t``, write ``β_t k_t ⊗ (v_t − S̃ᵀ k_t)``, read ``o_t``.
Shapes follow fla-core: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log-space; beta [B, T, H];
state [N, H, K, V]. With ``cu_seqlens`` (int [N+1]) B must be 1 and the T axis holds N packed sequences.
"""

from __future__ import annotations

import torch

from .api import Checkpoints, normalise_checkpoints

__all__ = ["kda_recurrent_reference"]


def kda_recurrent_reference(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                            cu_seqlens=None, checkpoint_positions=None):
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        cs = cu_seqlens.tolist()
        bounds = [(0, cs[i], cs[i + 1]) for i in range(len(cs) - 1)]
    N = len(bounds)
    ckpts: Checkpoints = normalise_checkpoints(checkpoint_positions, [e - s for _, s, e in bounds])
    want = {}
    for j, (n, p) in enumerate(ckpts):
        want.setdefault((n, p), []).append(j)
    o = torch.zeros(B, T, H, V, dtype=acc, device=q.device)
    final = torch.empty(N, H, K, V, dtype=acc, device=q.device)
    out_ck = torch.empty(len(ckpts), H, K, V, dtype=acc, device=q.device)
    for n, (b, s, e) in enumerate(bounds):
        S = (initial_state[n].to(acc).clone() if initial_state is not None
             else torch.zeros(H, K, V, dtype=acc, device=q.device))
        for j in want.get((n, 0), []):
            out_ck[j] = S
        for t in range(s, e):
            qt, kt, vt = q[b, t].to(acc) * scale, k[b, t].to(acc), v[b, t].to(acc)
            S = S * g[b, t].to(acc).exp()[..., None]
            pred = torch.einsum("hkv,hk->hv", S, kt)
            S = S + torch.einsum("hk,hv->hkv", kt * beta[b, t].to(acc)[:, None], vt - pred)
            o[b, t] = torch.einsum("hkv,hk->hv", S, qt)
            for j in want.get((n, t - s + 1), []):
                out_ck[j] = S
        final[n] = S
    o = o.to(v.dtype)
    res = (o, final if output_final_state else None)
    if checkpoint_positions is not None:
        res = res + (out_ck,)
    return res
