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

__all__ = ["kda_recurrent_reference", "kda_intra_reference"]


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


def kda_intra_reference(q, k, v, g, beta, scale, chunk_start, chunk_len):
    """The intra-chunk quantities of the chunked form, in fp64: per chunk c of the plan (``chunk_start`` /
    ``chunk_len``: first token in the flattened B·T axis and length ≤ 64) and head, with ``G`` the chunk-local
    cumulative log decay (``G_last`` at its last token, and on the 64 − len padding rows)::

        qg = scale · q ⊙ e^G          kg = k ⊙ e^{G_last − G}          egl = e^{G_last}
        A[i, j] = scale · Σ_d q_id k_jd e^{G_id − G_jd}   (j ≤ i)
        L[i, j] = β_i Σ_d k_id k_jd e^{G_id − G_jd}       (j < i)      X = (I + L)⁻¹
        w = X (β ⊙ k ⊙ e^G)           u = X (β ⊙ v)

    Padding rows hold zeros (X: the identity). Returns ``(qg, kg, w, u, A, egl, X)`` shaped ``[NC, H, 64, K]``
    (qg, kg, w), ``[NC, H, 64, V]``, ``[NC, H, 64, 64]`` (A, X) and ``[NC, H, K]``: what the Triton chunk
    kernels' intra stage computes (they keep X's block-lower part only)."""
    H, K, V = q.shape[-2], q.shape[-1], v.shape[-1]
    f64, dev = torch.float64, q.device
    qf, kf, vf, gf = (t.reshape(-1, H, t.shape[-1]).to(f64) for t in (q, k, v, g))
    bf = beta.reshape(-1, H).to(f64)
    starts, lens = chunk_start.tolist(), chunk_len.tolist()
    NC = len(starts)
    out = [torch.zeros(NC, H, 64, d, dtype=f64, device=dev) for d in (K, K, K, V)]
    qg, kg, w, u = out
    A = torch.zeros(NC, H, 64, 64, dtype=f64, device=dev)
    X = torch.eye(64, dtype=f64, device=dev).repeat(NC, H, 1, 1)
    egl = torch.ones(NC, H, K, dtype=f64, device=dev)
    for c, (s, n) in enumerate(zip(starts, lens)):
        if n == 0:
            continue
        sl = slice(s, s + n)
        qc, kc, vc, bc = (t[sl].transpose(0, 1) for t in (qf, kf, vf, bf))  # [H, n, .], beta [H, n]
        G = gf[sl].transpose(0, 1).cumsum(1)  # [H, n, K]
        Gl = G[:, -1]
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        diff = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
        decay = diff.exp()  # e^{G_i − G_j} ≤ 1 where j ≤ i, 0 elsewhere
        Aqk = scale * torch.einsum("hid,hjd,hijd->hij", qc, kc, decay)
        Lkk = bc[:, :, None] * torch.einsum("hid,hjd,hijd->hij", kc, kc, decay).tril(-1)
        Xc = torch.linalg.inv(torch.eye(n, dtype=f64, device=dev) + Lkk)
        qg[c, :, :n] = scale * qc * G.exp()
        kg[c, :, :n] = kc * (Gl[:, None] - G).exp()
        w[c, :, :n] = Xc @ (bc[..., None] * kc * G.exp())
        u[c, :, :n] = Xc @ (bc[..., None] * vc)
        A[c, :, :n, :n] = Aqk
        X[c, :, :n, :n] = Xc
        egl[c] = Gl.exp()
    return qg, kg, w, u, A, egl, X
