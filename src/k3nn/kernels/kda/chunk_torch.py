"""Chunked KDA in plain PyTorch (differentiable), and the autograd Function of the Triton chunk path.

``kda_chunk_torch`` is the chunkwise WY/UT form with 16-token chunks and the exact pairwise decay
``e^{G_i − G_j}`` (j ≤ i, never > 1), so it is safe for the unbounded gate and differentiable by autograd. It
is used as the backward of :class:`KDAChunkFunction`: the forward runs the Triton kernels, the backward
recomputes this formulation under autograd (exact gradients, chunk-parallel, but fp32 PyTorch: a Triton
backward kernel would be faster).
"""

from __future__ import annotations

import torch

from .api import normalise_checkpoints, seq_lengths

__all__ = ["kda_chunk_torch", "kda_chunk_eager", "KDAChunkFunction", "kda_chunk_triton"]


def _one(q, k, v, g, beta, scale, S, C):
    """One batch of equal-length sequences. q, k, g: [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; S [B, H, K, V]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    pad = (-T) % C
    if pad:
        z = lambda x: torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))  # noqa: E731
        q, k, v, g = z(q), z(k), z(v), z(g)
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    NC = (T + pad) // C
    # [B, H, NC, C, D]
    r = lambda x: x.reshape(B, NC, C, H, -1).permute(0, 3, 1, 2, 4)  # noqa: E731
    q, k, v, g = r(q), r(k), r(v), r(g)
    beta = beta.reshape(B, NC, C, H).permute(0, 3, 1, 2)
    G = g.cumsum(-2)
    idx = torch.arange(C, device=q.device)
    causal = idx[:, None] >= idx[None, :]
    D = G[..., :, None, :] - G[..., None, :, :]  # [B, H, NC, C, C, K]
    E = torch.exp(D.masked_fill(~causal[..., None], float("-inf")))
    Akk = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", k, k, E)
    Aqk = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", q, k, E) * scale
    strict = idx[:, None] > idx[None, :]
    Lm = (Akk * beta[..., None]).masked_fill(~strict, 0.0)
    eye = torch.eye(C, device=q.device, dtype=q.dtype)
    X = torch.linalg.solve_triangular(eye + Lm, eye.expand_as(Lm), upper=False, unitriangular=True)
    eG = G.exp()
    Gl = G[..., -1:, :]
    w = X @ (k * eG * beta[..., None])
    u = X @ (v * beta[..., None])
    qg = q * eG * scale
    kg = k * torch.exp(Gl - G)
    egl = Gl.exp().squeeze(-2)  # [B, H, NC, K]
    outs = []
    for c in range(NC):
        vn = u[:, :, c] - w[:, :, c] @ S
        outs.append(qg[:, :, c] @ S + Aqk[:, :, c] @ vn)
        S = S * egl[:, :, c, :, None] + kg[:, :, c].transpose(-1, -2) @ vn
    o = torch.stack(outs, 2) if outs else v.new_zeros(B, H, 0, C, V)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, NC * C, H, V)[:, :T]
    return o, S


def kda_chunk_torch(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, chunk_size: int = 16):
    """Differentiable chunked KDA in fp32 (or fp64). Returns ``(o in v's dtype, final_state fp32 [N, H, K, V])``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    f = lambda x: x.to(acc)  # noqa: E731
    if cu_seqlens is None:
        S0 = f(initial_state) if initial_state is not None else q.new_zeros(B, H, K, V, dtype=acc)
        o, S = _one(f(q), f(k), f(v), f(g), f(beta), scale, S0, chunk_size)
        return o.to(v.dtype), S
    cs = cu_seqlens.tolist()
    os_, Ss = [], []
    for n in range(len(cs) - 1):
        a, b = cs[n], cs[n + 1]
        S0 = (f(initial_state[n:n + 1]) if initial_state is not None
              else q.new_zeros(1, H, K, V, dtype=acc))
        if b == a:
            Ss.append(S0)
            continue
        o, S = _one(f(q[:, a:b]), f(k[:, a:b]), f(v[:, a:b]), f(g[:, a:b]), f(beta[:, a:b]), scale, S0, chunk_size)
        os_.append(o)
        Ss.append(S)
    o = torch.cat(os_, 1) if os_ else v.new_zeros(1, 0, H, V, dtype=acc)
    return o.to(v.dtype), torch.cat(Ss, 0)


def kda_chunk_eager(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                    checkpoint_positions=None):
    """The eager ``kda_chunk``: the chunk-parallel PyTorch form (same function as the per-token reference up to
    rounding; differentiable; several times faster on CPU). Checkpoints cut each sequence into segments at the
    requested positions and carry the state across them, so they come out of the same single pass."""
    if checkpoint_positions is None:
        o, S = kda_chunk_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)
        return o, (S if output_final_state else None)
    B, T, H, K = q.shape
    lengths = seq_lengths(T, B, cu_seqlens)
    wanted = normalise_checkpoints(checkpoint_positions, lengths)
    starts = [0] * B if cu_seqlens is None else cu_seqlens.tolist()[:-1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    finals, states = [], {}
    for n, L in enumerate(lengths):
        b, base = (n, 0) if cu_seqlens is None else (0, starts[n])
        S = (initial_state[n:n + 1].to(acc) if initial_state is not None
             else q.new_zeros(1, H, K, v.shape[-1], dtype=acc))
        cuts = sorted({p for m, p in wanted if m == n} | {0, L})
        states[(n, 0)] = S
        for a, e in zip(cuts, cuts[1:]):
            sl = slice(base + a, base + e)
            seg = lambda x: x[b:b + 1, sl]  # noqa: E731
            o_seg, S = kda_chunk_torch(seg(q), seg(k), seg(v), seg(g), seg(beta), scale=scale, initial_state=S)
            o[b:b + 1, sl] = o_seg
            states[(n, e)] = S
        finals.append(S)
    ck = torch.cat([states[w] for w in wanted]) if wanted else q.new_empty(0, H, K, v.shape[-1], dtype=acc)
    return o, (torch.cat(finals) if output_final_state else None), ck


class KDAChunkFunction(torch.autograd.Function):
    """Triton forward; backward = autograd through :func:`kda_chunk_torch` (recompute, exact)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, cu_seqlens, checkpoint_positions):
        from .triton_chunk import kda_chunk_triton_fwd  # needs triton; the eager form above does not

        o, ht, ck = kda_chunk_triton_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                         output_final_state=True, cu_seqlens=cu_seqlens,
                                         checkpoint_positions=checkpoint_positions)
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.scale, ctx.cu_seqlens = scale, cu_seqlens
        if ck is None:
            ck = q.new_empty(0)
        ctx.mark_non_differentiable(ck)
        return o, ht, ck

    @staticmethod
    def backward(ctx, do, dht, dck):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        ins = [q, k, v, g, beta] + ([h0] if h0 is not None else [])
        need = ctx.needs_input_grad[:len(ins)]
        with torch.enable_grad():
            xs = [x.detach().requires_grad_(True) for x in ins]
            o, ht = kda_chunk_torch(*xs[:5], scale=ctx.scale, initial_state=xs[5] if h0 is not None else None,
                                    cu_seqlens=ctx.cu_seqlens)
            outs, grads = [o], [do]
            if dht is not None:
                outs.append(ht)
                grads.append(dht)
            gr = torch.autograd.grad(outs, [x for x, n in zip(xs, need) if n], grads, allow_unused=True)
        it = iter(gr)
        res = [next(it) if n else None for n in need]
        res = [None if r is None else r.to(x.dtype) for r, x in zip(res, ins)]
        if h0 is None:
            res.append(None)
        return (*res, None, None, None)


def kda_chunk_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, checkpoint_positions=None):
    """The registered Triton ``kda_chunk``: plain forward without grad, autograd Function otherwise."""
    from .triton_chunk import kda_chunk_triton_fwd

    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    if not grad:
        o, ht, ck = kda_chunk_triton_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                         output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                         checkpoint_positions=checkpoint_positions)
    else:
        o, ht, ck = KDAChunkFunction.apply(q, k, v, g, beta, initial_state, scale, cu_seqlens,
                                           checkpoint_positions)
        if checkpoint_positions is None:
            ck = None
    res = (o, ht if output_final_state else None)
    if checkpoint_positions is not None:
        res = res + (ck,)
    return res
