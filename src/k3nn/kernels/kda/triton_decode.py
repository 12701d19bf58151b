"""Triton fused KDA decode: one launch per layer (conv update + SiLU, gate, β, L2 norm, recurrence, gated RMSNorm).

Two kernels, picked per call by the number of (request, head) pairs B·H (:func:`decode_plan`):

* ``head`` (B·H large, the batched-decode case): grid (H, B), one program owns a whole request-head, and the
  programs launched together cover neighbouring heads of one request (one contiguous H·D²·4-byte state block per
  request). Its fp32 state ``[D, D]`` streams through registers in column chunks of BV (default 64 with 4 warps,
  two chunks per 128-wide head; BV = D holds the whole head at once); the load of the first chunk is issued
  before anything else, so the conv / L2-norm / gate prologue runs while it is in flight, and each later chunk
  is loaded while the previous one is updated. q, k, g and β
  are computed once per token for the whole head (for T = 1 once per program, not once per chunk). The gated
  RMSNorm (in registers when BV = D; otherwise over the raw outputs this program stored, after a block barrier)
  and the conv-state rewrite are done by the same program: no atomics, no data read from other programs.
* ``split`` (B·H small, B = 1 latency): grid (D/BV · H, B), a program owns a ``[D, BV]`` column block (more
  programs in flight than there are heads; the column blocks of a head, then the heads of a request, launched
  together). The last program of a request-head to arrive (an atomic arrival
  counter, acquire-release at GPU scope, after a block barrier so that every thread's stores of the raw output
  precede it) applies the RMSNorm over the whole head and rewrites the conv state, after every program has read
  it. Counters live in per-device buffers that every call leaves at zero and that are never freed while the
  process lives (a CUDA graph captured earlier keeps pointing at a valid, zeroed buffer when a later, larger
  call needs a new one); two calls running concurrently on different streams would share them, so issue decode
  calls of one device from one stream.

With programmatic dependent launch (:mod:`k3nn.kernels.pdl`, sm_90+) both kernels start while the projection
before them finishes: the recurrent state (this layer's, last written by this kernel a step ago) and the slot
metadata are read before ``griddepcontrol.wait``, the token's inputs and every store after it.

Streamed state loads and stores carry ``evict_first`` (each state byte is touched once per step); the state's V
dimension is contiguous and, when D is a power of two, unmasked, so loads and stores are 16-byte vectors.

Roundings follow the eager reference: the conv output, the SiLU output, the L2-normed q and k and the raw
recurrence output o are rounded to the activation dtype where the reference rounds them; the RMSNorm and the
sigmoid gate run in fp32 on the rounded o. See :mod:`.decode` for the contract.

Plan (:func:`decode_plan`, shapes only, so calls can be captured in a CUDA graph): ``head`` from B·H =
:attr:`KernelTuning.kda_decode_head_min <k3nn.kernels.registry.KernelTuning>` (default 256), else ``split``;
``head`` takes [D, 64] chunks over 4 warps, ``split`` [D, 32] blocks over 4 warps (both at most D wide), and a
[D, 32] ``head`` chunk (D ≤ 32) a register cap of :data:`HEAD_MAXNREG`. The heads of one request are launched
together, batch first above 65535 requests (the grid's second axis). ``evict_first`` goes on the state loads
and stores, on the loads only from B·H = :data:`EVICT_LOAD_ONLY_MIN`.

The heads of a request are launched together (neighbouring programs then read one contiguous state block) and
``head`` takes [D, 64] chunks because these were the fastest at the batched shapes; evict_first on the stores
only, two chunks ahead, a 96-register cap, wider tiles over 8 or 16 warps, the programs of one head for every
request launched together, several heads per program and T = 1 outputs gathered in registers for the RMSNorm
were all slower and are gone (figures in docs/perf.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import gdc_launch_dependents, gdc_wait, pdl_launch
from ..registry import current_tuning, triton_interpreting, triton_ready

__all__ = ["kda_fused_decode_triton", "supports_fused_decode", "decode_plan"]


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
def _qkgb(x_b, cs_b, conv_w, f, bl, row, t, h, cq, ck, rd, md, a, dtb, scale, lower_bound,
          DT: tl.constexpr, H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, SOFTPLUS: tl.constexpr):
    """Token t of one request-head: L2-normed q (times scale) and k, the decay exp(g) over K, and β."""
    C3: tl.constexpr = 3 * H * D
    C: tl.constexpr = H * D
    q = _silu_rounded(_conv(x_b, cs_b, conv_w, t, cq, md, W, C3), DT)
    k = _silu_rounded(_conv(x_b, cs_b, conv_w, t, ck, md, W, C3), DT)
    q = (q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)).to(DT).to(tl.float32) * scale
    k = (k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)).to(DT).to(tl.float32)
    xg = tl.load(f + row * C + h * D + rd, mask=md, other=0.0).to(tl.float32) + dtb
    if SOFTPLUS:
        spl = tl.where(xg > 20.0, xg, tl.log(1.0 + tl.exp(tl.minimum(xg, 20.0))))
        gk = -a * spl
    else:
        gk = lower_bound * _sigmoid(a * xg)
    beta = _sigmoid(tl.load(bl + row * H + h).to(tl.float32))
    return q, k, tl.exp(gk), beta


@triton.jit
def _gated_rmsnorm(o, gate, row, h, rv, mv, nw, eps, D: tl.constexpr, H: tl.constexpr):
    """norm_weight · RMSNorm(o) · sigmoid(gate) over one full head (o already rounded like the reference)."""
    o = o * (1.0 / tl.sqrt(tl.sum(o * o, 0) / D + eps)) * nw
    gt = tl.load(gate + row * (H * D) + h * D + rv, mask=mv, other=0.0).to(tl.float32)
    return o * _sigmoid(gt)


@triton.jit
def _rewrite_conv(x_b, cs_b, cs_ptr, cq, ck, cvf, md, T, C3: tl.constexpr, W: tl.constexpr):
    """conv state of one request-head: new row j = window row T + j. A barrier between each row's reads and
    writes (row T + j is never a row already rewritten, as T >= 1). The caller has made sure every read of the
    old rows (its own, and any other program's) is done."""
    for j in tl.static_range(W - 1):
        nq = _tap(x_b, cs_b, T + j, cq, md, C3, W - 1)
        nk = _tap(x_b, cs_b, T + j, ck, md, C3, W - 1)
        nv = _tap(x_b, cs_b, T + j, cvf, md, C3, W - 1)
        tl.debug_barrier()
        tl.store(cs_b + j * C3 + cq, nq.to(cs_ptr.dtype.element_ty), mask=md)
        tl.store(cs_b + j * C3 + ck, nk.to(cs_ptr.dtype.element_ty), mask=md)
        tl.store(cs_b + j * C3 + cvf, nv.to(cs_ptr.dtype.element_ty), mask=md)


@triton.jit
def _state_chunk(s_b, s_off, c, rb, md, BV: tl.constexpr, D: tl.constexpr, EVEN: tl.constexpr,
                 EV: tl.constexpr = "evict_first"):
    """Column chunk ``c`` ([D, BV] fp32) of one request-head's state, streamed (touched once per step)."""
    if EVEN:
        return tl.load(s_b + c * BV + s_off, eviction_policy=EV)
    return tl.load(s_b + c * BV + s_off, mask=md[:, None] & (c * BV + rb < D)[None, :], other=0.0,
                   eviction_policy=EV)


@triton.jit
def _slot(idx, b, HAS_IDX: tl.constexpr):
    """(cache slot of request ``b`` as int64, the raw index): ``idx[b]``, or ``b`` itself without state indices;
    a negative index is a padding row (its slot reads as 0, and nothing of it is stored: see :func:`_live`)."""
    if HAS_IDX:
        raw = tl.load(idx + b).to(tl.int64)
    else:
        raw = b.to(tl.int64)
    return tl.maximum(raw, 0), raw


@triton.jit
def _live(r, raw):
    """The row is not padding, as a mask shaped like the index vector ``r`` (a vector comparison: masks built
    from a scalar do not broadcast under the interpreter)."""
    return (r * 0 + raw) >= 0


@triton.jit
def _writes(wm, r, raw, b, HAS_WM: tl.constexpr):
    """Store this row's new state (a vector mask like ``r``): live, and ``write_state[b]`` when given."""
    ok = _live(r, raw)
    if HAS_WM:
        ok = ok & ((r * 0 + tl.load(wm + b)) != 0)
    return ok


@triton.jit
def _count(nt, b, T, HAS_NT: tl.constexpr):
    """Tokens request ``b`` feeds: ``num_tokens[b]``, or all T."""
    if HAS_NT:
        n = tl.load(nt + b)
    else:
        n = T
    return n


@triton.jit
def _gate_fed(eg, beta, t, n):
    """A token past its row's count leaves the state as it is: decay 1 and β = 0."""
    fed = t < n
    return tl.where(fed, eg, 1.0), tl.where(fed, beta, 0.0)


@triton.jit
def _head_inputs(qkv, cs_ptr, A_log, dt_bias, b, h, slot, rd, md, T, H: tl.constexpr, D: tl.constexpr,
                 W: tl.constexpr):
    """Per request-head pointers and constants: (b as int64, q and k channel columns, the request's tokens, its
    conv-state rows, a = exp(A_log[h]), the gate bias over the head)."""
    C3: tl.constexpr = 3 * H * D
    b64 = b.to(tl.int64)
    x_b = qkv + b64 * T * C3
    cs_b = cs_ptr + slot * (W - 1) * C3
    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    dtb = tl.load(dt_bias + h * D + rd, mask=md, other=0.0).to(tl.float32)
    return b64, h * D + rd, H * D + h * D + rd, x_b, cs_b, a, dtb


@triton.jit
def _kda_decode_head(qkv, f, bl, gate, conv_w, A_log, dt_bias, norm_w, S_ptr, cs_ptr, idx, nt, wm, y,
                     scale, lower_bound, eps, T,
                     H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, NC: tl.constexpr,
                     W: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_IDX: tl.constexpr, HAS_NT: tl.constexpr,
                     HAS_WM: tl.constexpr, T1: tl.constexpr,
                     EVEN: tl.constexpr, HEADS_FIRST: tl.constexpr = False,
                     LD_EV: tl.constexpr = "evict_first", ST_EV: tl.constexpr = "evict_first",
                     PDL: tl.constexpr = False):
    if HEADS_FIRST:  # grid (H, B): programs launched together cover neighbouring heads of one request
        h = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        h = tl.program_id(1)
    DT = qkv.dtype.element_ty
    C: tl.constexpr = H * D
    C3: tl.constexpr = 3 * H * D
    slot, raw = _slot(idx, b, HAS_IDX)
    n = _count(nt, b, T, HAS_NT)
    rd = tl.arange(0, BD)
    md = rd < D
    rb = tl.arange(0, BV)
    live_d = _live(rd, raw)
    live_b = _live(rb, raw)
    wr_d = _writes(wm, rd, raw, b, HAS_WM)
    s_b = S_ptr + (slot * H + h) * (D * D)
    s_off = rd[:, None] * D + rb[None, :]
    # the state is what this kernel waits for: issue its first chunk before anything else
    Sn = _state_chunk(s_b, s_off, 0, rb, md, BV, D, EVEN, LD_EV)
    if PDL:  # a programmatic dependent (kernels/pdl.py): the state loads before the wait, the token's inputs
        gdc_wait()  # and every store after it
    b64, cq, ck, x_b, cs_b, a, dtb = _head_inputs(qkv, cs_ptr, A_log, dt_bias, b, h, slot, rd, md, T, H, D, W)
    if T1:  # one token: q, k, g, β once for every chunk
        q, k, eg, beta = _qkgb(x_b, cs_b, conv_w, f, bl, b64, 0, h, cq, ck, rd, md, a, dtb, scale, lower_bound,
                               DT, H, D, W, SOFTPLUS)
        if HAS_NT:
            eg, beta = _gate_fed(eg, beta, 0, n)
    for c in tl.static_range(NC):
        S = Sn
        if c + 1 < NC:  # the next chunk in flight while this one is updated
            Sn = _state_chunk(s_b, s_off, c + 1, rb, md, BV, D, EVEN, LD_EV)
        rv = c * BV + rb
        mv = rv < D
        cv = 2 * C + h * D + rv
        if NC == 1:
            nw = tl.load(norm_w + rv, mask=mv, other=0.0).to(tl.float32)
        for t in range(1 if T1 else T):  # T1: a constant trip count, the loop folds away (fewer registers)
            row = b64 * T + t
            if not T1:
                q, k, eg, beta = _qkgb(x_b, cs_b, conv_w, f, bl, row, t, h, cq, ck, rd, md, a, dtb, scale,
                                       lower_bound, DT, H, D, W, SOFTPLUS)
                if HAS_NT:
                    eg, beta = _gate_fed(eg, beta, t, n)
            v = _silu_rounded(_conv(x_b, cs_b, conv_w, t, cv, mv, W, C3), DT)
            S = S * eg[:, None]
            pred = tl.sum(S * k[:, None], 0)
            S = S + (beta * k)[:, None] * (v - pred)[None, :]
            o = tl.sum(S * q[:, None], 0).to(DT).to(tl.float32)  # raw o, rounded like eager
            if NC == 1:  # the whole head is here: normalise in registers
                o = _gated_rmsnorm(o, gate, row, h, rv, mv, nw, eps, D, H)
            if HAS_IDX:
                o = tl.where(live_b, o, 0.0)
            tl.store(y + (row * H + h) * D + rv, o.to(y.dtype.element_ty), mask=mv)
        if HAS_IDX or HAS_WM:
            tl.store(s_b + c * BV + s_off, S, mask=(md & wr_d)[:, None] & (c * BV + rb < D)[None, :],
                     eviction_policy=ST_EV)
        elif EVEN:
            tl.store(s_b + c * BV + s_off, S, eviction_policy=ST_EV)
        else:
            tl.store(s_b + c * BV + s_off, S, mask=md[:, None] & mv[None, :], eviction_policy=ST_EV)
    if PDL:  # our state is read: the next kernel may start its weight prefetch
        gdc_launch_dependents()
    # every thread's reads of the old conv rows (and, for NC > 1, stores of raw o) precede what follows
    tl.debug_barrier()
    if NC > 1:
        nwf = tl.load(norm_w + rd, mask=md, other=0.0).to(tl.float32)
        for t in range(1 if T1 else T):
            row = b64 * T + t
            o = tl.load(y + (row * H + h) * D + rd, mask=md, other=0.0).to(tl.float32)
            o = _gated_rmsnorm(o, gate, row, h, rd, md, nwf, eps, D, H)
            if HAS_IDX:
                o = tl.where(live_d, o, 0.0)
            tl.store(y + (row * H + h) * D + rd, o.to(y.dtype.element_ty), mask=md)
    _rewrite_conv(x_b, cs_b, cs_ptr, cq, ck, 2 * C + h * D + rd, md & wr_d, n, C3, W)


@triton.jit
def _kda_decode_split(qkv, f, bl, gate, conv_w, A_log, dt_bias, norm_w, S_ptr, cs_ptr, idx, nt, wm, y, counter,
                      scale, lower_bound, eps, T,
                      H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
                      W: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_IDX: tl.constexpr, HAS_NT: tl.constexpr,
                      HAS_WM: tl.constexpr, T1: tl.constexpr,
                      EVEN: tl.constexpr, HEADS_FIRST: tl.constexpr = False,
                      LD_EV: tl.constexpr = "evict_first", ST_EV: tl.constexpr = "evict_first",
                      PDL: tl.constexpr = False):
    if HEADS_FIRST:  # grid (NS·H, B): the NS column blocks of a head, then the heads of a request, run together
        sp = tl.program_id(0) % NS
        h = tl.program_id(0) // NS
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
    DT = qkv.dtype.element_ty
    C: tl.constexpr = H * D
    C3: tl.constexpr = 3 * H * D
    slot, raw = _slot(idx, b, HAS_IDX)
    n = _count(nt, b, T, HAS_NT)
    rd = tl.arange(0, BD)
    md = rd < D
    rv = sp * BV + tl.arange(0, BV)
    live_d = _live(rd, raw)
    wr_d = _writes(wm, rd, raw, b, HAS_WM)
    mv = rv < D
    s_off = ((slot * H + h) * D + rd[:, None]) * D + rv[None, :]
    mdv = md[:, None] & mv[None, :]
    if EVEN:
        S = tl.load(S_ptr + s_off, eviction_policy=LD_EV)
    else:
        S = tl.load(S_ptr + s_off, mask=mdv, other=0.0, eviction_policy=LD_EV)
    if PDL:  # as in _kda_decode_head: the state block loads before the wait
        gdc_wait()
    b64, cq, ck, x_b, cs_b, a, dtb = _head_inputs(qkv, cs_ptr, A_log, dt_bias, b, h, slot, rd, md, T, H, D, W)
    cv = 2 * C + h * D + rv
    for t in range(1 if T1 else T):
        row = b64 * T + t
        q, k, eg, beta = _qkgb(x_b, cs_b, conv_w, f, bl, row, t, h, cq, ck, rd, md, a, dtb, scale, lower_bound,
                               DT, H, D, W, SOFTPLUS)
        if HAS_NT:
            eg, beta = _gate_fed(eg, beta, t, n)
        v = _silu_rounded(_conv(x_b, cs_b, conv_w, t, cv, mv, W, C3), DT)
        S = S * eg[:, None]
        pred = tl.sum(S * k[:, None], 0)
        S = S + (beta * k)[:, None] * (v - pred)[None, :]
        o = tl.sum(S * q[:, None], 0)
        tl.store(y + (row * H + h) * D + rv, o.to(y.dtype.element_ty), mask=mv)  # raw o, rounded like eager
    if PDL:  # our state is read: the next kernel may start its weight prefetch
        gdc_launch_dependents()
    if HAS_IDX or HAS_WM:
        tl.store(S_ptr + s_off, S, mask=mdv & wr_d[:, None], eviction_policy=ST_EV)
    elif EVEN:
        tl.store(S_ptr + s_off, S, eviction_policy=ST_EV)
    else:
        tl.store(S_ptr + s_off, S, mask=mdv, eviction_policy=ST_EV)
    # The last of the NS programs of this (request, head) finishes: RMSNorm over the whole head needs every V
    # block, and the conv state may only be rewritten once every program has read it. The barrier puts every
    # thread's y stores and conv reads before the (single-thread, acq_rel, GPU-scope) arrival.
    tl.debug_barrier()
    done = tl.atomic_add(counter + b * H + h, 1, sem="acq_rel", scope="gpu")
    if done == NS - 1:
        tl.store(counter + b * H + h, 0)  # back to zero for the next call (CUDA-graph safe)
        nw = tl.load(norm_w + rd, mask=md, other=0.0).to(tl.float32)
        for t in range(1 if T1 else T):
            row = b64 * T + t
            # .cg: from L2, never a stale L1 line of another SM's stores
            o = tl.load(y + (row * H + h) * D + rd, mask=md, other=0.0, cache_modifier=".cg").to(tl.float32)
            o = _gated_rmsnorm(o, gate, row, h, rd, md, nw, eps, D, H)
            if HAS_IDX:
                o = tl.where(live_d, o, 0.0)
            tl.store(y + (row * H + h) * D + rd, o.to(y.dtype.element_ty), mask=md)
        _rewrite_conv(x_b, cs_b, cs_ptr, cq, ck, 2 * C + h * D + rd, md & wr_d, n, C3, W)


_COUNTERS: dict = {}
_RETIRED: list = []  # counter buffers outgrown by a larger call: kept alive, a captured graph may point at one


def _counter(device: torch.device, n: int) -> torch.Tensor:
    """Per-(request, head) arrival counters, zero between calls (each call resets what it used)."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        if c is not None:
            _RETIRED.append(c)
        c = torch.zeros(max(n, 2 * (0 if c is None else c.numel()), 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[device] = c
    return c


#: ``head`` path register cap for [D, 32] chunks over 4 warps (its default tile before [D, 64]): 4 programs
#: of 128 threads per SM instead of 3, a little faster (docs/perf.md)
HEAD_MAXNREG = 128


def decode_plan(B: int, H: int, D: int) -> tuple[str, int, int]:
    """(path, BV, num_warps) the call takes: path ``head`` from B·H = ``kda_decode_head_min`` of the current
    :class:`~k3nn.kernels.registry.KernelTuning` (default 256: B=1 H=96 stays ``split``, B >= 3 at H=96 goes
    ``head``), else ``split``; see the module docstring."""
    BD = max(16, triton.next_power_of_2(D))
    path = "head" if B * H >= current_tuning().kda_decode_head_min else "split"
    if path == "head":  # [D, 64] chunks over 4 warps: faster than [D, 32] at B=64 H=96 (docs/perf.md)
        bv, nw = 64, 4
    else:
        bv, nw = 32, 4
    return path, min(BD, bv), nw


#: B·H from which the state loads alone carry ``evict_first`` (stores plain): faster than both hints at B=256
#: H=96 (3.2 GB of state), slower at B=64 H=96 (docs/perf.md)
EVICT_LOAD_ONLY_MIN = 16384


def _order_and_hints(B: int, H: int) -> tuple[bool, dict]:
    """(heads first?, cache-hint constexprs): the heads of a request launched together unless the batch does not
    fit the grid's second axis (65535 programs); ``evict_first`` on the state stores too below
    :data:`EVICT_LOAD_ONLY_MIN`."""
    return B <= 65535, dict(LD_EV="evict_first", ST_EV="evict_first" if B * H < EVICT_LOAD_ONLY_MIN else "")


def supports_fused_decode(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, recurrent_state, conv_state,
                          state_indices=None, gate_kind="softplus", lower_bound=-5.0, norm_eps=1e-5, scale=None,
                          num_tokens=None, write_state=None):
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
                            scale=None, num_tokens=None, write_state=None):
    B, T, _ = qkv.shape
    D, H = norm_weight.shape[0], A_log.shape[0]
    W = conv_weight.shape[1]
    scale = D ** -0.5 if scale is None else float(scale)
    y = torch.empty(B, T, H, D, dtype=qkv.dtype, device=qkv.device)
    if B == 0 or T == 0:
        return y
    qkv, f, b, gate = qkv.contiguous(), f.contiguous(), b.contiguous(), gate.contiguous()
    idx = state_indices.contiguous() if state_indices is not None else qkv
    nt = num_tokens.contiguous() if num_tokens is not None else qkv
    wm = write_state.contiguous() if write_state is not None else qkv
    BD = max(16, triton.next_power_of_2(D))
    path, BV, nw = decode_plan(B, H, D)
    common = (qkv, f, b, gate, conv_weight.contiguous(), A_log.contiguous(), dt_bias.contiguous(),
              norm_weight.contiguous(), recurrent_state, conv_state, idx, nt, wm, y)
    consts = dict(H=H, D=D, BD=BD, BV=BV, W=W, SOFTPLUS=gate_kind == "softplus",
                  HAS_IDX=state_indices is not None, HAS_NT=num_tokens is not None,
                  HAS_WM=write_state is not None, T1=T == 1, EVEN=BD == D,
                  num_warps=nw, **pdl_launch(qkv))
    # no autotune: the kernels update state in place
    hf, extra = _order_and_hints(B, H)
    if path == "head":
        # the cap was measured for [D, 32] chunks over 4 warps; other tiles keep the compiler's count
        if (BV, nw) == (32, 4) and not triton_interpreting():  # registers per thread: more programs per SM
            extra["maxnreg"] = HEAD_MAXNREG
        _kda_decode_head[(H, B) if hf else (B, H)](*common, scale, float(lower_bound), float(norm_eps), T,
                                                   NC=triton.cdiv(D, BV), HEADS_FIRST=hf, **consts, **extra)
    else:
        cnt = _counter(qkv.device, B * H)
        ns = triton.cdiv(D, BV)
        _kda_decode_split[(ns * H, B) if hf else (B, H, ns)](*common, cnt, scale, float(lower_bound),
                                                              float(norm_eps), T, NS=ns, HEADS_FIRST=hf,
                                                              **consts, **extra)
    return y
