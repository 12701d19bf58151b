"""Skinny GEMM in Triton: ``y = x Wᵀ (+ bias) (+ residual)`` for at most 16 rows of x (decode steps, verify
windows), a weight-streaming kernel: every weight byte is read once, in 16-byte loads along K, accumulated in fp32.

At decode a projection is a read of its weight matrix (tens to thousands of MB) against a few activation rows; the
time is the weight bytes over the memory bandwidth. A program owns ``BN`` output features (weight rows) and a slice
of K, streams its ``[BN, BK]`` weight tiles once (``evict_first``: they are never read again in this step) and
keeps every row of x in flight against them. Two inner products:

* ``fma`` (1-4 rows): CUDA-core FMAs into a ``[BM, BN, BK]`` fp32 accumulator, reduced over K once at the end
  (no cross-lane traffic inside the loop, no shared-memory staging of the weights);
* ``dot`` (any row count up to 16): ``tl.dot(W_tile, x_tileᵀ)``, the weight tile as the MMA's M side (swap-AB),
  the rows of x padded to 16 as its N side; fp32 operands take ``DOT_PREC`` (IEEE when torch forbids TF32).

``split_k`` > 1 gives each output tile that many programs over disjoint K ranges, for matrices with too few rows
to fill the GPU: each writes an fp32 partial, and a second launch sums them in a fixed order (deterministic, no
atomics) and applies bias, residual and the cast. Products and sums are fp32 whatever the input dtype; the output
is rounded once, like cuBLAS's epilogue (``residual`` is added before that rounding, as ``torch.addmm``).

On sm_90+ the kernel is launched as a programmatic dependent (:mod:`k3nn.kernels.pdl`, ``KernelTuning.pdl``): a
program requests its first :data:`PREFETCH_TILES` weight tiles into L2, then waits for the kernel before it (which
wrote x) and streams, so its weight stream starts while that kernel finishes.

The launch shape comes from :data:`k3nn.kernels.linear.tuned.TUNED` where the shape was measured, else from
:func:`default_config`; :func:`linear_skinny` takes an explicit ``config`` (benchmarks, tests). CUDA-graph safe: no
host sync, the only allocations are the output and the split-K workspace.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...utils import records_grad
from ..pdl import gdc_launch_dependents, gdc_wait, l2_prefetch, pdl_launch
from ..precision import dot_precision
from ..registry import current_tuning, triton_interpreting, triton_ready
from .reference import MAX_SKINNY_ROWS, rows_of
from .tuned import auto_reason, lookup, row_bucket

__all__ = ["SkinnyConfig", "default_config", "config_for", "linear_skinny", "supports_skinny", "auto_skip_skinny",
           "row_bucket"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: weight tiles ([BN, BK]) a program launched as a programmatic dependent requests into L2 before its wait
PREFETCH_TILES = 2


class SkinnyConfig(NamedTuple):
    """Launch shape: ``kind`` ``"fma"`` | ``"dot"``, ``block_n`` weight rows per program, ``block_k`` K per loop
    step, ``warps``, ``stages`` (software pipelining depth of the weight loads), ``split_k`` programs per output
    tile along K."""

    kind: str = "fma"
    block_n: int = 16
    block_k: int = 512
    warps: int = 4
    stages: int = 3
    split_k: int = 1

    def name(self) -> str:
        return f"{self.kind} n{self.block_n} k{self.block_k} w{self.warps} s{self.stages} sk{self.split_k}"


@triton.jit
def _skinny_kernel(X, W, Bias, R, Y, WS, M, N, K, K_SPLIT, sxm, swn, srm, sym,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, DOT_PREC: tl.constexpr,
                   SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr,
                   PDL: tl.constexpr = False, PRE_LINES: tl.constexpr = 1, LINE: tl.constexpr = 64):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    rn_ld = tl.minimum(rn, N - 1).to(tl.int64)  # rows past N re-read the last one and are never stored
    rm = tl.arange(0, BM)
    m_ok = rm < M
    rk = tl.arange(0, BK)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    if PDL:  # a programmatic dependent (kernels/pdl.py): weights into L2 while the kernel before us finishes
        gdc_launch_dependents()
        rl = k_lo + tl.arange(0, PRE_LINES) * LINE  # one pointer per 128-byte line of the first tiles
        l2_prefetch(W + rn_ld[:, None] * swn + rl[None, :], (rl < k_hi)[None, :] & (rn < N)[:, None])
        gdc_wait()  # x, the residual and every store come after the previous kernel completed
    w_ptr = W + rn_ld[:, None] * swn + rk[None, :]
    x_ptr = X + rm[:, None] * sxm + rk[None, :]
    if DOT:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    elif BM == 1:  # a GEMV: [BN, BK] partial products, one x row broadcast
        acc = tl.zeros([BN, BK], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN, BK], dtype=tl.float32)
    for k in range(k_lo, k_hi, BK):
        if EVEN_K:
            w = tl.load(w_ptr + k, eviction_policy="evict_first")
            if DOT or BM > 1:
                x = tl.load(x_ptr + k, mask=m_ok[:, None], other=0.0)
            else:
                x = tl.load(X + k + rk)
        else:
            k_ok = (k + rk) < k_hi
            w = tl.load(w_ptr + k, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            if DOT or BM > 1:
                x = tl.load(x_ptr + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            else:
                x = tl.load(X + k + rk, mask=k_ok, other=0.0)
        if DOT:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PREC)
        elif BM == 1:
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        else:
            acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    if DOT:
        out = tl.trans(acc)
    elif BM == 1:
        out = tl.sum(acc, 1)[None, :]
    else:
        out = tl.sum(acc, 2)
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            out += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            out += tl.load(R + rm[:, None] * srm + rn[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + rm[:, None] * sym + rn[None, :], out.to(Y.dtype.element_ty), mask=ok)
    else:
        base = WS + (pid_k * M).to(tl.int64) * N
        tl.store(base + rm[:, None] * N + rn[None, :], out, mask=ok)


@triton.jit
def _splitk_reduce(WS, Bias, R, Y, M, N, srm, sym, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched as a programmatic dependent (kernels/pdl.py): no earlier kernel's data is read before this
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    m = offs // N
    n = offs % N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # fixed order: the same sum on every run
        acc += tl.load(WS + s * M * N + offs, mask=ok, other=0.0)
    if PDL:  # our loads are done: a programmatic dependent (a skinny GEMM) may start its weight prefetch
        gdc_launch_dependents()
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(R + m * srm + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + m * sym + n, acc.to(Y.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 4  # the interpreter: a few programs
    return _num_sms(dev.index if dev.index is not None else torch.cuda.current_device())


def default_config(m: int, n: int, k: int, dtype: torch.dtype, sms: int = 132) -> SkinnyConfig:
    """The launch shape for an unmeasured shape: FMAs for 1-2 rows (fp32: up to 4), the swapped dot above; 16 weight
    rows per FMA program, 64 per dot program; split-K while the programs would not fill the GPU twice and every
    split keeps at least 2 loop steps."""
    bm = row_bucket(m)
    kp = triton.next_power_of_2(max(k, 16))
    if bm <= (4 if dtype == torch.float32 else 2):
        cfg = SkinnyConfig("fma", 16, max(16, min(512 // bm, kp)), 4, 1, 1)
    else:
        cfg = SkinnyConfig("dot", 64, max(16, min(128, kp)), 4, 4, 1)
    split = 1
    tiles = triton.cdiv(n, cfg.block_n)
    while tiles * split < 2 * sms and k // (split * 2) >= 2 * cfg.block_k:
        split *= 2
    return cfg._replace(split_k=split)


def config_for(m: int, n: int, k: int, dtype: torch.dtype, dev: torch.device) -> SkinnyConfig:
    """The measured launch shape of :data:`.tuned.TUNED` for (dtype, N, K, row bucket) (:func:`.tuned.lookup`: the
    nearest measured bucket that can serve these rows), else :func:`default_config`."""

    if triton_interpreting() and dev.type == "cpu":
        return SkinnyConfig("fma", min(64, triton.next_power_of_2(n)), min(128, triton.next_power_of_2(max(k, 16))),
                            1, 1, 1)
    hit, _ = lookup(str(dtype).removeprefix("torch."), n, k, row_bucket(m))
    return SkinnyConfig(*hit) if hit is not None else default_config(m, n, k, dtype, _sms(dev))


def _rows2d(t: torch.Tensor, cols: int) -> torch.Tensor | None:
    """``t`` as a [rows, cols] view with unit column stride, or None when no such view exists."""
    try:
        v = t.view(-1, cols)
    except RuntimeError:
        return None
    return v if (v.stride(1) == 1 or cols == 1) else None


def supports_skinny(x, weight, bias=None, residual=None, out_dtype=None) -> str | None:
    why = triton_ready(x, weight, *(t for t in (bias, residual) if t is not None))
    if why:
        return why
    if x.dtype not in _DTYPES or (out_dtype is not None and out_dtype not in _DTYPES):
        return f"dtype {x.dtype} -> {out_dtype or x.dtype} (the skinny GEMM takes fp16, bf16, fp32)"
    if records_grad(x, weight, bias, residual):
        return "forward only: inputs require grad (the eager path trains)"
    N, K = weight.shape
    if N == 0 or K == 0:
        return f"empty weight [{N}, {K}]"
    m = rows_of(x)
    if m > MAX_SKINNY_ROWS:
        return f"{m} rows above {MAX_SKINNY_ROWS} (a skinny GEMM is for decode-sized inputs; torch's GEMM runs more)"
    if weight.stride(1) != 1 and K > 1:
        return "weight is not contiguous along K (16-byte loads need unit stride)"
    if _rows2d(x, K) is None:
        return "x cannot be viewed as [rows, K] with unit stride along K"
    if residual is not None and _rows2d(residual, N) is None:
        return "residual cannot be viewed as [rows, N] with unit stride along N"
    if bias is not None and not bias.is_contiguous():
        return "bias is not contiguous"
    return None


def auto_skip_skinny(x, weight, bias=None, residual=None, out_dtype=None) -> str | None:
    """Why ``auto`` leaves this call to torch's GEMM: ``KernelTuning.skinny_linear`` (``"never"``; ``"always"``
    takes the kernel wherever it runs), a step without a CUDA graph (``KernelTuning.uncaptured``), else the
    measured rule of :data:`.tuned.AUTO_RULE`."""
    t = current_tuning()
    if t.skinny_linear == "never":
        return "KernelTuning.skinny_linear = 'never'"
    if t.skinny_linear == "always":
        return None
    if t.uncaptured:
        return "a step without a CUDA graph: torch's GEMM costs the host less per launch (KernelTuning.uncaptured)"

    return auto_reason(x.dtype, rows_of(x), *weight.shape, weight.element_size())


def linear_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *,
                  config: SkinnyConfig | None = None, partials: bool = False) -> torch.Tensor:
    """See :func:`k3nn.ops.linear`; at most 16 rows. ``config``: an explicit :class:`SkinnyConfig`.
    ``partials`` (no bias or residual, fp32 out): the split-K partial sums ``[S, rows, N]`` fp32 unreduced, for a
    consumer that adds them itself in the fixed order ``0 … S-1`` (the reduce launch's order); ``[1, rows, N]``
    without a split."""
    N, K = weight.shape
    x2 = _rows2d(x, K)
    M = x2.shape[0]
    if partials and (bias is not None or residual is not None or out_dtype != torch.float32):
        raise ValueError("linear_skinny: partials take no bias or residual and an fp32 output")
    y = torch.empty(*x.shape[:-1], N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return y.view(1, M, N) if partials else y
    y2 = y.view(M, N)
    r2 = _rows2d(residual, N) if residual is not None else None
    cfg = config if config is not None else config_for(M, N, K, x.dtype, x.device)
    if cfg.kind not in ("fma", "dot"):
        raise ValueError(f"linear_skinny: config.kind must be 'fma' or 'dot', got {cfg.kind!r}")
    bm = max(row_bucket(M), 16 if cfg.kind == "dot" else 1)
    bk = max(16, min(cfg.block_k, triton.next_power_of_2(K)))
    split = max(1, min(cfg.split_k, triton.cdiv(K, bk)))
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_split)
    even_k = K % bk == 0
    ws = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y2
    dummy = y2
    bn = max(16, cfg.block_n) if cfg.kind == "dot" else cfg.block_n  # tl.dot takes 16 rows at least
    grid = (triton.cdiv(N, bn), split)
    pdl_kw = pdl_launch(x)
    # PDL: the first PREFETCH_TILES weight tiles of each program are requested before the wait
    line = 128 // weight.element_size()
    pre = dict(pdl_kw, PRE_LINES=triton.next_power_of_2(max(1, PREFETCH_TILES * bk // line)), LINE=line) \
        if pdl_kw else {}
    _skinny_kernel[grid](x2, weight, bias if bias is not None else dummy, r2 if r2 is not None else dummy, y2, ws,
                         M, N, K, k_split, x2.stride(0), weight.stride(0), r2.stride(0) if r2 is not None else 0,
                         y2.stride(0), BM=bm, BN=bn, BK=bk, DOT=cfg.kind == "dot",
                         DOT_PREC=dot_precision(x.dtype), SPLIT=split, HAS_BIAS=bias is not None,
                         HAS_RES=r2 is not None, EVEN_K=even_k, num_warps=cfg.warps, num_stages=cfg.stages, **pre)
    if partials:
        return ws if split > 1 else y2.view(1, M, N)
    if split > 1:
        block = 1024
        _splitk_reduce[(triton.cdiv(M * N, block),)](ws, bias if bias is not None else dummy,
                                                     r2 if r2 is not None else dummy, y2, M, N,
                                                     r2.stride(0) if r2 is not None else 0, y2.stride(0),
                                                     SPLIT=split, BLOCK=block, HAS_BIAS=bias is not None,
                                                     HAS_RES=r2 is not None, num_warps=4, **pdl_kw)
    return y
