"""Triton kernels for the KDA prologue (prefill): the causal short convolution with SiLU and the L2 norm of
q and k in one pass, and the decay gate in another. Forward only; see :mod:`.prologue` for the math and the
references they match.

``short_conv``: grid (token tiles, channel tiles, batch). A program loads the W shifted ``[BT, BC]`` input tiles
of its tokens (the overlapping rows come from L1 / L2), reading history rows from ``initial_state`` where
``t − s`` falls before the start of the token's own sequence (packed sequences never read across a start),
accumulates in fp32, rounds like the reference (conv output and SiLU output to x's dtype), and, on the
channel tiles below ``l2norm_channels``, divides by the L2 norm of its head (the channel tile is then one head,
``GROUP = head_dim`` channels). The final conv state is gathered with a few torch indexing ops (no host sync).

``kda_gate``: one elementwise pass over ``f`` [R, H·D] → g fp32.

Both are single memory-bound passes; tiles come from :func:`conv_config` / :func:`gate_config` (``config=``
overrides them for benchmarks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...utils import records_grad
from ..registry import triton_interpreting, triton_ready
from ..tl_math import sigmoid, softplus

__all__ = ["short_conv_triton", "kda_gate_triton", "supports_short_conv", "supports_kda_gate", "conv_config",
           "gate_config", "MAX_GROUP", "MAX_WIDTH"]

MAX_GROUP = 1024  # one head's channels per tile when normalising (the tile holds BT · head_dim accumulators)
MAX_WIDTH = 16  # conv taps, unrolled
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports_short_conv(x, weight, initial_state=None, cu_seqlens=None, l2norm_channels=0, head_dim=None,
                        eps=1e-6) -> str | None:
    why = triton_ready(*(t for t in (x, weight, initial_state, cu_seqlens) if t is not None))
    if why:
        return why
    if x.dtype not in _DTYPES:
        return f"x dtype {x.dtype} (the Triton kernel takes fp16, bf16, fp32)"
    if records_grad(x, weight, initial_state):
        return "forward only: inputs require grad (the eager path trains)"
    if weight.shape[1] > MAX_WIDTH:
        return f"kernel width {weight.shape[1]} above {MAX_WIDTH}"
    if x.shape[0] > 65535:
        return f"batch {x.shape[0]} above 65535 (the grid's third dim)"
    if l2norm_channels and head_dim > MAX_GROUP:
        return f"head_dim {head_dim} above {MAX_GROUP}"
    return None


def supports_kda_gate(f, A_log, dt_bias, kind, lower_bound, head_dim) -> str | None:
    why = triton_ready(f, A_log, dt_bias)
    if why:
        return why
    if f.dtype not in _DTYPES or A_log.dtype == torch.float64 or dt_bias.dtype == torch.float64:
        return (f"dtypes f {f.dtype}, A_log {A_log.dtype}, dt_bias {dt_bias.dtype} (the Triton kernel takes "
                "fp16, bf16, fp32 and returns fp32)")
    if records_grad(f, A_log, dt_bias):
        return "forward only: inputs require grad (the eager path trains)"
    return None


@triton.jit(do_not_specialize=["SEQ", "T"])  # per-request lengths: one compile for all
def _short_conv_fwd(X, Wt, H0, Y, SEQ, CU, T, C, NORM_CH, eps,
                    s_xb, s_xt, s_xc, s_hn, s_hw, s_hc, s_yb, s_yt,
                    W: tl.constexpr, GROUP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                    HAS_H0: tl.constexpr, VARLEN: tl.constexpr, NORM: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    t = pid_t * BT + tl.arange(0, BT)
    cl = tl.arange(0, BC)
    c0 = pid_c * GROUP
    c = c0 + cl
    in_t = t < T
    in_c = (cl < GROUP) & (c < C)
    if VARLEN:  # sequence of each token, and the position of the token inside it
        n = tl.load(SEQ + t, mask=in_t, other=0).to(tl.int64)
        rel = t - tl.load(CU + n, mask=in_t, other=0)
    else:
        n = t.to(tl.int64) * 0 + b
        rel = t
    t64 = t.to(tl.int64)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        # tap j reads the input s = W−1−j tokens back (conv1d over [history ; x] is a cross-correlation)
        s = W - 1 - j
        wj = tl.load(Wt + c * W + j, mask=in_c, other=0.0).to(tl.float32)
        in_x = rel >= s
        xv = tl.load(X + b * s_xb + (t64 - s)[:, None] * s_xt + c[None, :] * s_xc,
                     mask=(in_t & in_x)[:, None] & in_c[None, :], other=0.0)
        if HAS_H0:
            hv = tl.load(H0 + n[:, None] * s_hn + (rel + j)[:, None] * s_hw + c[None, :] * s_hc,
                         mask=(in_t & (rel < s))[:, None] & in_c[None, :], other=0.0)
            xv = tl.where(in_x[:, None], xv, hv)
        acc += wj[None, :] * xv.to(tl.float32)
    DT: tl.constexpr = Y.dtype.element_ty
    y = acc.to(DT).to(tl.float32)
    y = (y * sigmoid(y)).to(DT).to(tl.float32)
    if NORM:
        yn = y / tl.sqrt(tl.sum(y * y, 1) + eps)[:, None]  # masked lanes hold SiLU(0) = 0
        y = tl.where(c0 < NORM_CH, yn, y)
    tl.store(Y + b * s_yb + t64[:, None] * s_yt + c[None, :], y.to(DT), mask=in_t[:, None] & in_c[None, :])


@triton.jit(do_not_specialize=["R"])
def _kda_gate_fwd(Fp, A, DTB, G, R, C, HD, s_fr, lower_bound,
                  BR: tl.constexpr, BC: tl.constexpr, SOFTPLUS: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    in_c = c < C
    m = (r < R)[:, None] & in_c[None, :]
    x = tl.load(Fp + r[:, None] * s_fr + c[None, :], mask=m, other=0.0).to(tl.float32)
    x = x + tl.load(DTB + c, mask=in_c, other=0.0).to(tl.float32)[None, :]
    a = tl.exp(tl.load(A + c // HD, mask=in_c, other=0.0).to(tl.float32))[None, :]
    if SOFTPLUS:
        g = -a * softplus(x)
    else:
        g = lower_bound * sigmoid(a * x)
    tl.store(G + r[:, None] * C + c[None, :], g, mask=m)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def conv_config(group: int, W: int) -> tuple[int, int]:
    """(BT, num_warps) for channel tiles of ``group`` channels: about 8K fp32 accumulators per program."""
    bc = _pow2(group)
    if triton_interpreting():
        return 16, 1
    return max(1, min(64, 8192 // bc)), 8 if bc * 64 >= 8192 else 4


def gate_config(C: int) -> tuple[int, int, int]:
    """(BR, BC, num_warps): rows of up to 1024 channels, about 4K elements per program."""
    bc = min(_pow2(C), 1024)
    if triton_interpreting():
        return 16, min(bc, 64), 1
    return max(1, 4096 // bc), bc, 4


def _final_state(x: torch.Tensor, h0: torch.Tensor | None, cu: torch.Tensor | None, W: int, N: int) -> torch.Tensor:
    """The last W−1 inputs of each sequence, history included: [N, W−1, C] in x's dtype (device ops only)."""
    B, T, C = x.shape
    W1 = W - 1
    hist = h0 if h0 is not None else x.new_zeros(N, W1, C)
    if W1 == 0 or T == 0:
        return hist.clone()
    if cu is None:
        return torch.cat([hist, x[:, max(T - W1, 0):]], dim=1)[:, -W1:].contiguous()
    cu = cu.long()
    starts, ends = cu[:-1, None], cu[1:, None]
    j = torch.arange(W1, device=x.device)
    p = ends - W1 + j  # [N, W−1]: packed position of each final-state row
    xv = x[0][p.clamp(0, T - 1)]
    hv = hist[torch.arange(N, device=x.device)[:, None], (ends - starts + j).clamp(max=W1 - 1)]
    return torch.where((p >= starts)[..., None], xv, hv)


def short_conv_triton(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None, l2norm_channels: int = 0, head_dim: int | None = None,
                      eps: float = 1e-6, *, config: tuple[int, int, int] | None = None,
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`k3nn.ops.short_conv` (arguments already validated there). ``config``: (group, BT, num_warps)
    for ``l2norm_channels == 0`` or (head_dim, BT, num_warps); ``out``: a [B, T, C] buffer to write y into."""
    B, T, C = x.shape
    W = weight.shape[1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    w = weight.to(x.dtype).contiguous()  # the reference convolves with the kernel rounded to x's dtype
    h0 = None if initial_state is None else initial_state.to(x.dtype)
    y = out if out is not None else torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    norm = l2norm_channels > 0
    if config is not None:
        group, bt, warps = config
    else:
        group = head_dim if norm else min(_pow2(C), 128)
        bt, warps = conv_config(group, W)
    if norm and group != head_dim:
        raise ValueError(f"config group {group} must equal head_dim={head_dim} when normalising")
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int32)
        seq = torch.searchsorted(cu[1:], torch.arange(T, device=x.device, dtype=torch.int32), right=True,
                                 out_int32=True)
    else:
        cu = seq = y  # unused
    hp = h0 if h0 is not None else y
    if B * T * C:
        grid = (triton.cdiv(T, bt), triton.cdiv(C, group), B)
        _short_conv_fwd[grid](
            x, w, hp, y, seq, cu, T, C, l2norm_channels, float(eps),
            x.stride(0), x.stride(1), x.stride(2),
            hp.stride(0) if h0 is not None else 0, hp.stride(1) if h0 is not None else 0,
            hp.stride(2) if h0 is not None else 0, y.stride(0), y.stride(1),
            W=W, GROUP=group, BT=bt, BC=_pow2(group), HAS_H0=h0 is not None, VARLEN=cu_seqlens is not None,
            NORM=norm, num_warps=warps)
    return y, _final_state(x, h0, None if cu_seqlens is None else cu, W, N)


def kda_gate_triton(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, kind: str, lower_bound: float,
                    head_dim: int, *, config: tuple[int, int, int] | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`k3nn.ops.kda_gate`. ``config``: (BR, BC, num_warps); ``out``: a [..., H, D] fp32 buffer."""
    C = f.shape[-1]
    f2 = f.reshape(-1, C)
    if f2.stride(-1) != 1:
        f2 = f2.contiguous()
    R = f2.shape[0]
    g = out if out is not None else torch.empty(*f.shape[:-1], C // head_dim, head_dim, dtype=torch.float32,
                                                device=f.device)
    br, bc, warps = config or gate_config(C)
    if R * C:
        grid = (triton.cdiv(R, br), triton.cdiv(C, bc))
        lb = float(lower_bound) if kind == "lower_bound" else 0.0
        _kda_gate_fwd[grid](f2, A_log.contiguous(), dt_bias.contiguous(), g, R, C, head_dim, f2.stride(0), lb,
                            BR=br, BC=bc, SOFTPLUS=kind == "softplus", num_warps=warps)
    return g
