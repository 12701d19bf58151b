"""Triton fused KDA decode: one launch per layer (conv update + SiLU, gate, β, L2 norm, recurrence, gated RMSNorm).

Grid (B, H, D/32): a program owns a ``[D, 32]`` column block of one request-head's fp32 state, which stays in
registers across the T tokens and is written back once (small blocks: many programs in flight, so the state
streams at close to copy bandwidth). The last program of a request-head to finish (an atomic arrival counter)
applies the gated RMSNorm over the whole head and rewrites the conv state, after every program has read it.
The counters live in one per-device buffer that every call leaves at zero; two calls running concurrently on
different streams would share it, so issue decode calls of one device from one stream. Roundings follow the eager
reference (conv output, SiLU output, L2-normed q/k and o are rounded to the activation dtype where the
reference rounds them) so bf16 results agree closely. See :mod:`.decode` for the contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..registry import triton_ready

__all__ = ["kda_fused_decode_triton", "supports_fused_decode"]


@triton.jit
def _tap(x_ptr, cs_ptr, r, cols, m, C3: tl.constexpr, WM1: tl.constexpr):
    """Row r of the window [conv_state rows (W−1) ; new tokens]: from the cache or from the new inputs."""
    rr = cols * 0 + r
    from_cache = rr < WM1
    a = tl.load(cs_ptr + rr * C3 + cols, mask=m & from_cache, other=0.0).to(tl.float32)
    bb = tl.load(x_ptr + (rr - WM1) * C3 + cols, mask=m & (rr >= WM1), other=0.0).to(tl.float32)
    return tl.where(from_cache, a, bb)


@triton.jit
def _conv(x_ptr, cs_ptr, w_ptr, t, cols, m, W: tl.constexpr, C3: tl.constexpr):
    acc = tl.zeros_like(cols).to(tl.float32)
    for j in tl.static_range(W):
        wj = tl.load(w_ptr + cols * W + j, mask=m, other=0.0).to(tl.float32)
        acc += wj * _tap(x_ptr, cs_ptr, t + j, cols, m, C3, W - 1)
    return acc


@triton.jit
def _sigmoid(x):
    e = tl.exp(-tl.abs(x))  # never overflows
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _silu_rounded(x, DT: tl.constexpr):
    x = x.to(DT).to(tl.float32)
    return (x * _sigmoid(x)).to(DT).to(tl.float32)


@triton.jit
def _kda_decode(qkv, f, bl, gate, conv_w, A_log, dt_bias, norm_w, S_ptr, cs_ptr, idx, y, counter,
                scale, lower_bound, eps, T,
                H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
                W: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_IDX: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    DT = qkv.dtype.element_ty
    C: tl.constexpr = H * D
    C3: tl.constexpr = 3 * H * D
    if HAS_IDX:
        slot = tl.load(idx + b).to(tl.int64)
    else:
        slot = b.to(tl.int64)
    rd = tl.arange(0, BD)
    md = rd < D
    rv = sp * BV + tl.arange(0, BV)
    mv = rv < D
    cq = h * D + rd
    ck = C + h * D + rd
    cv = 2 * C + h * D + rv
    x_b = qkv + b.to(tl.int64) * T * C3
    cs_b = cs_ptr + slot * (W - 1) * C3
    s_off = ((slot * H + h) * D + rd[:, None]) * D + rv[None, :]
    mdv = md[:, None] & mv[None, :]
    S = tl.load(S_ptr + s_off, mask=mdv, other=0.0)
    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    dtb = tl.load(dt_bias + h * D + rd, mask=md, other=0.0).to(tl.float32)
    for t in range(T):
        q = _silu_rounded(_conv(x_b, cs_b, conv_w, t, cq, md, W, C3), DT)
        k = _silu_rounded(_conv(x_b, cs_b, conv_w, t, ck, md, W, C3), DT)
        v = _silu_rounded(_conv(x_b, cs_b, conv_w, t, cv, mv, W, C3), DT)
        q = (q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)).to(DT).to(tl.float32) * scale
        k = (k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)).to(DT).to(tl.float32)
        row = b.to(tl.int64) * T + t
        xg = tl.load(f + row * C + h * D + rd, mask=md, other=0.0).to(tl.float32) + dtb
        if SOFTPLUS:
            spl = tl.where(xg > 20.0, xg, tl.log(1.0 + tl.exp(tl.minimum(xg, 20.0))))
            gk = -a * spl
        else:
            gk = lower_bound * _sigmoid(a * xg)
        beta = _sigmoid(tl.load(bl + row * H + h).to(tl.float32))
        S = S * tl.exp(gk)[:, None]
        pred = tl.sum(S * k[:, None], 0)
        S = S + (beta * k)[:, None] * (v - pred)[None, :]
        o = tl.sum(S * q[:, None], 0)
        tl.store(y + (row * H + h) * D + rv, o.to(y.dtype.element_ty), mask=mv)  # raw o, rounded like eager
    tl.store(S_ptr + s_off, S, mask=mdv)
    # The last of the NS programs of this (request, head) finishes: RMSNorm over the whole head needs every V
    # block, and the conv state may only be rewritten once every program has read it.
    tl.debug_barrier()
    done = tl.atomic_add(counter + b * H + h, 1)
    if done == NS - 1:
        tl.store(counter + b * H + h, 0)  # back to zero for the next call (CUDA-graph safe)
        nw = tl.load(norm_w + rd, mask=md, other=0.0).to(tl.float32)
        for t in range(T):
            row = b.to(tl.int64) * T + t
            o = tl.load(y + (row * H + h) * D + rd, mask=md, other=0.0, cache_modifier=".cg").to(tl.float32)
            o = o * (1.0 / tl.sqrt(tl.sum(o * o, 0) / D + eps)) * nw
            gt = tl.load(gate + row * C + h * D + rd, mask=md, other=0.0).to(tl.float32)
            tl.store(y + (row * H + h) * D + rd, (o * _sigmoid(gt)).to(y.dtype.element_ty), mask=md)
        # conv state: new row j = window row T + j; a barrier between each row's reads and writes (row T + j
        # is never a row already rewritten, as T >= 1)
        cvf = 2 * C + h * D + rd
        for j in tl.static_range(W - 1):
            nq = _tap(x_b, cs_b, T + j, cq, md, C3, W - 1)
            nk = _tap(x_b, cs_b, T + j, ck, md, C3, W - 1)
            nv = _tap(x_b, cs_b, T + j, cvf, md, C3, W - 1)
            tl.debug_barrier()
            tl.store(cs_b + j * C3 + cq, nq.to(cs_ptr.dtype.element_ty), mask=md)
            tl.store(cs_b + j * C3 + ck, nk.to(cs_ptr.dtype.element_ty), mask=md)
            tl.store(cs_b + j * C3 + cvf, nv.to(cs_ptr.dtype.element_ty), mask=md)


_COUNTERS: dict = {}


def _counter(device: torch.device, n: int) -> torch.Tensor:
    """Per-(request, head) arrival counters, zero between calls (each call resets what it used)."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 2 * (0 if c is None else c.numel()), 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = c
    return c


def supports_fused_decode(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, recurrent_state, conv_state,
                          state_indices=None, gate_kind="softplus", lower_bound=-5.0, norm_eps=1e-5, scale=None):
    r = triton_ready(qkv, f, b, gate, recurrent_state, conv_state)
    if r:
        return r
    if recurrent_state.dtype != torch.float32:
        return f"recurrent_state must be float32 for the Triton kernel, got {recurrent_state.dtype}"
    if qkv.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {qkv.dtype} not supported"
    D = norm_weight.shape[0]
    if D > 128:
        return f"head dim D must be <= 128 for the Triton decode kernel, got {D}"
    if not recurrent_state.is_contiguous() or not conv_state.is_contiguous():
        return "recurrent_state and conv_state must be contiguous (they are updated in place)"
    return None


def kda_fused_decode_triton(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, recurrent_state,
                            conv_state, state_indices=None, gate_kind="softplus", lower_bound=-5.0, norm_eps=1e-5,
                            scale=None):
    B, T, _ = qkv.shape
    D, H = norm_weight.shape[0], A_log.shape[0]
    W = conv_weight.shape[1]
    scale = D ** -0.5 if scale is None else float(scale)
    y = torch.empty(B, T, H, D, dtype=qkv.dtype, device=qkv.device)
    if B == 0 or T == 0:
        return y
    qkv, f, b, gate = qkv.contiguous(), f.contiguous(), b.contiguous(), gate.contiguous()
    idx = state_indices.contiguous() if state_indices is not None else qkv
    BD = max(16, triton.next_power_of_2(D))
    BV = min(32, BD)
    NS = triton.cdiv(D, BV)
    cnt = _counter(qkv.device, B * H)
    # no autotune: the kernel updates state in place
    _kda_decode[(B, H, NS)](qkv, f, b, gate, conv_weight.contiguous(), A_log.contiguous(), dt_bias.contiguous(),
                            norm_weight.contiguous(), recurrent_state, conv_state, idx, y, cnt,
                            scale, float(lower_bound), float(norm_eps), T,
                            H=H, D=D, BD=BD, BV=BV, NS=NS, W=W,
                            SOFTPLUS=gate_kind == "softplus", HAS_IDX=state_indices is not None, num_warps=4)
    return y
