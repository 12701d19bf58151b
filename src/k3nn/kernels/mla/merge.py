"""Small fused kernels of the DCP decode step: the exact LSE merge and the rank-local lengths.

**LSE merge** (one launch). ``S`` partial attention results over disjoint key sets, natural-log LSEs
``lse_s`` [S, B, Tq, H]. Per query row (b, t, h)::

    ok_s = isfinite(lse_s)                      (−inf: a part that saw no key; NaN / +inf are treated alike)
    m    = max_{ok} lse_s  (0 if no part is ok)
    tot  = Σ_{ok} exp(lse_s − m)
    lse  = m + log tot   (−inf if tot = 0: no part saw a key)
    w_s  = exp(lse_s − lse) if ok_s and tot > 0 else 0

Two forms share the kernel:

* :func:`merge_scale` — DCP with sharded heads: only partial ``index`` (this rank's) is at hand; it returns
  ``w_index · o`` laid out ``[G, B, Tq, H/G, r]`` (head group g = heads ``[g·H/G, (g+1)·H/G)``, ready for a
  reduce-scatter over the groups) and the merged lse of head group ``lse_group`` ``[B, Tq, H/G]``.
* :func:`merge_states` — ``o = Σ_s w_s o_s`` with all partials at hand (``merge_attn_states`` in one launch).

A weighted output is ``where(w > 0, w · o, 0)``: a part with weight 0 (empty shard, or all parts empty)
contributes exactly 0 even when its ``o`` holds NaN garbage; a row where every part is empty gets o = 0 and
lse = −inf. All math in fp32; outputs fp32. The eager references (``*_reference``) are the same formulas in
PyTorch and the CPU / gloo path of :mod:`k3nn.parallel.dcp`.

**Local lengths** (:func:`dcp_lens`, one launch): for global lengths ``n`` [B] and a verify window of ``Tq``
queries, ``vis[b, t] = local(max(n_b − Tq + 1 + t, 0))`` and ``local_len[b] = local(n_b) = vis[b, Tq−1]``,
with ``local`` = :func:`k3nn.cache.pages.local_seq_lens` for the rank (interleave ``I`` over ``W`` ranks).

Nothing here reads a device value on the host, so every call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from ...cache.pages import local_seq_lens

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # pragma: no cover - no Triton on this platform: the eager references still work
    triton = tl = None

    def _jit(fn):
        return fn

__all__ = ["dcp_lens", "dcp_lens_reference", "merge_scale", "merge_scale_reference", "merge_states",
           "merge_states_reference"]


# -- eager references -----------------------------------------------------------------------------------------

def _merge_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lses [S, ...] → (w [S, ...] fp32, merged lse [...] fp32) per the module docstring."""
    lse = lses.float()
    ok = torch.isfinite(lse)
    lse = torch.where(ok, lse, torch.full_like(lse, float("-inf")))
    m = lse.amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    tot = torch.where(ok, torch.exp(lse - m), torch.zeros_like(lse)).sum(0)
    glse = torch.where(tot > 0, m + torch.log(tot), torch.full_like(m, float("-inf")))
    w = torch.where(ok & (tot > 0), torch.exp(lse - glse), torch.zeros_like(lse))
    return w, glse


def _weighted(w: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    w = w[..., None]
    return torch.where(w > 0, o.float() * w, torch.zeros((), dtype=torch.float32, device=o.device))


def merge_scale_reference(lses: torch.Tensor, o: torch.Tensor, index: int, groups: int = 1,
                          lse_group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """lses [S, B, Tq, H], o [B, Tq, H, r] (partial ``index``) → (parts [G, B, Tq, H/G, r], lse [B, Tq, H/G])."""
    B, Tq, H, r = o.shape
    w, glse = _merge_weights(lses)
    parts = _weighted(w[index], o).view(B, Tq, groups, H // groups, r).permute(2, 0, 1, 3, 4).contiguous()
    return parts, glse.view(B, Tq, groups, H // groups)[:, :, lse_group].contiguous()


def merge_states_reference(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [S, ..., r], lses [S, ...] → (o [..., r] fp32, lse [...] fp32)."""
    w, glse = _merge_weights(lses)
    return _weighted(w, outs).sum(0), glse


def dcp_lens_reference(seq_lens: torch.Tensor, Tq: int, world_size: int, rank: int,
                       interleave: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_lens int [B] global → (local lengths int32 [B], rank-local causal bounds int32 [B, Tq])."""
    t = torch.arange(Tq, device=seq_lens.device, dtype=torch.int32)
    v = (seq_lens.to(torch.int32)[:, None] + (t - (Tq - 1))).clamp_min(0)
    vis = local_seq_lens(v, world_size, rank, interleave).to(torch.int32)
    return vis[:, -1], vis


# -- Triton -----------------------------------------------------------------------------------------------------

@_jit
def _lse_merge_kernel(lse_ptr, o_ptr, out_ptr, lse_out_ptr,
                      S, NROWS, H, R, HG, index, lse_group,
                      s_ls, s_lbt, s_lh, s_os, s_obt, s_oh, s_pg, s_pbt, s_pj, s_qbt, s_qj,
                      SUM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (b·Tq + t)·H + h
    rmask = rows < NROWS
    bt = (rows // H).to(tl.int64)
    h = rows % H
    g = h // HG
    j = h % HG
    ss = tl.arange(0, BLOCK_S)
    smask = ss < S
    lmask = smask[:, None] & rmask[None, :]
    l = tl.load(lse_ptr + ss[:, None] * s_ls + bt[None, :] * s_lbt + h[None, :] * s_lh, mask=lmask,
                other=float("-inf")).to(tl.float32)
    ok = (l > float("-inf")) & (l < float("inf"))  # NaN compares false
    lk = tl.where(ok, l, float("-inf"))
    m = tl.max(lk, 0)
    m = tl.where(m > float("-inf"), m, 0.0)
    tot = tl.sum(tl.where(ok, tl.exp(lk - m[None, :]), 0.0), 0)
    glse = tl.where(tot > 0, m + tl.log(tl.maximum(tot, 1.0)), float("-inf"))  # tot >= 1 when any split counts
    cols = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cmask = cols < R
    omask = rmask[:, None] & cmask[None, :]
    o_rows = o_ptr + bt[:, None] * s_obt + h[:, None] * s_oh + cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    if SUM:
        for s in range(S):
            ls = tl.load(lse_ptr + s * s_ls + bt * s_lbt + h * s_lh, mask=rmask, other=float("-inf")).to(tl.float32)
            oks = (ls > float("-inf")) & (ls < float("inf")) & (tot > 0)
            w = tl.where(oks, tl.exp(tl.where(oks, ls, 0.0) - tl.where(oks, glse, 0.0)), 0.0)
            o = tl.load(o_rows + s * s_os, mask=omask & (w[:, None] > 0), other=0.0).to(tl.float32)
            acc += tl.where(w[:, None] > 0, o * w[:, None], 0.0)
    else:
        ls = tl.load(lse_ptr + index * s_ls + bt * s_lbt + h * s_lh, mask=rmask, other=float("-inf")).to(tl.float32)
        oks = (ls > float("-inf")) & (ls < float("inf")) & (tot > 0)
        w = tl.where(oks, tl.exp(tl.where(oks, ls, 0.0) - tl.where(oks, glse, 0.0)), 0.0)
        o = tl.load(o_rows, mask=omask & (w[:, None] > 0), other=0.0).to(tl.float32)
        acc = tl.where(w[:, None] > 0, o * w[:, None], 0.0)
    dst = out_ptr + g[:, None].to(tl.int64) * s_pg + bt[:, None] * s_pbt + j[:, None] * s_pj + cols[None, :]
    tl.store(dst, acc, mask=omask)
    if pid_r == 0:
        tl.store(lse_out_ptr + bt * s_qbt + j * s_qj, glse, mask=rmask & (g == lse_group))


def _launch_merge(lses3, o3, os_, parts, lse_out, S, H, R, HG, index, lse_group, SUM):
    """lses3 [S, BT, H] (any strides); o3 [BT, H, R] partial (stride os_ between partials when SUM);
    parts [G, BT, HG, R] written; lse_out [BT, HG] (the heads of group ``lse_group``)."""
    nrows = lses3.shape[1] * H
    block_s = max(2, triton.next_power_of_2(S))
    block_r = min(128, max(16, triton.next_power_of_2(R)))
    block_m = max(1, min(32, 2048 // block_r))
    grid = (triton.cdiv(nrows, block_m), triton.cdiv(R, block_r))
    _lse_merge_kernel[grid](
        lses3, o3, parts, lse_out, S, nrows, H, R, HG, index, lse_group,
        lses3.stride(0), lses3.stride(1), lses3.stride(2), os_, o3.stride(0), o3.stride(1),
        parts.stride(0), parts.stride(1), parts.stride(2), lse_out.stride(0), lse_out.stride(1),
        SUM=SUM, BLOCK_S=block_s, BLOCK_M=block_m, BLOCK_R=block_r, num_warps=4)


def _rows(o: torch.Tensor) -> torch.Tensor:
    return o if o.stride(-1) == 1 else o.contiguous()


def merge_scale(lses: torch.Tensor, o: torch.Tensor, index: int, groups: int = 1, lse_group: int = 0, *,
                out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`merge_scale_reference`. lses [S, B, Tq, H] (fp32), o [B, Tq, H, r] → (parts [G, B, Tq, H/G,
    r] fp32, lse [B, Tq, H/G] fp32), written into ``out = (parts, lse)`` when given (contiguous last dims)."""
    S, B, Tq, H = lses.shape
    R = o.shape[-1]
    HG = H // groups
    if out is None:
        parts = torch.empty(groups, B, Tq, HG, R, dtype=torch.float32, device=o.device)
        lse_out = torch.empty(B, Tq, HG, dtype=torch.float32, device=o.device)
    else:
        parts, lse_out = out
    o = _rows(o)
    _launch_merge(lses.reshape(S, B * Tq, H), o.reshape(B * Tq, H, R), 0, parts.view(groups, B * Tq, HG, R),
                  lse_out.view(B * Tq, HG), S, H, R, HG, int(index), int(lse_group), False)
    return parts, lse_out


def merge_states(outs: torch.Tensor, lses: torch.Tensor, *,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`merge_states_reference`. outs [S, ..., r], lses [S, ...] → (o [..., r] fp32, lse [...] fp32)."""
    S, R = outs.shape[0], outs.shape[-1]
    lead = tuple(lses.shape[1:])
    H = lead[-1] if lead else 1
    n = 1
    for d in lead:
        n *= d
    if out is None:
        o_out = torch.empty(lead + (R,), dtype=torch.float32, device=outs.device)
        lse_out = torch.empty(lead, dtype=torch.float32, device=outs.device)
    else:
        o_out, lse_out = out
    outs = _rows(outs)
    o3 = outs.reshape(S, n // H, H, R)
    _launch_merge(lses.reshape(S, n // H, H), o3[0], o3.stride(0), o_out.view(1, n // H, H, R),
                  lse_out.view(n // H, H), S, H, R, H, 0, 0, True)
    return o_out, lse_out


@_jit
def _dcp_lens_kernel(sl_ptr, local_ptr, vis_ptr, N, Tq, W, rank, I, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    b = offs // Tq
    t = offs % Tq
    n = tl.load(sl_ptr + b, mask=mask, other=0).to(tl.int32)
    v = tl.maximum(n - Tq + 1 + t, 0)
    base = (v // (I * W)) * I
    loc = base + tl.minimum(tl.maximum(v - base * W - rank * I, 0), I)
    tl.store(vis_ptr + offs, loc, mask=mask)
    tl.store(local_ptr + b, loc, mask=mask & (t == Tq - 1))


def dcp_lens(seq_lens: torch.Tensor, Tq: int, world_size: int, rank: int, interleave: int = 1, *,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`dcp_lens_reference` (one launch): (local int32 [B], vis int32 [B, Tq])."""
    B = seq_lens.shape[0]
    if out is None:
        local = torch.empty(B, dtype=torch.int32, device=seq_lens.device)
        vis = torch.empty(B, Tq, dtype=torch.int32, device=seq_lens.device)
    else:
        local, vis = out
    N = B * Tq
    block = max(16, min(1024, triton.next_power_of_2(max(N, 1))))
    _dcp_lens_kernel[(triton.cdiv(N, block),)](seq_lens.contiguous(), local, vis, N, Tq, world_size, rank,
                                               interleave, BLOCK=block, num_warps=1)
    return local, vis
