"""Block pieces of the KDA intra-chunk stage (:mod:`.triton_intra_g`) and its inverse kernel.

* strip loads and stores, the pairwise diagonal score block (the path of a 16-token strip whose decay exceeds SPAN
  nats: ``e^{c_a − c_b} ≤ 1``) and the diagonal-block stores of the score kernel;
* ``_split_solve`` (grid: chunks × heads): X = (I + L)⁻¹ in place in the fp32 scratch. The four diagonal 16×16
  blocks are solved together by forward substitution (15 row steps on a [4, 16, 16] tile), the off-diagonal
  blocks by blockwise substitution (fp32 "ieee" dots). Only the block-lower part is written. The solve runs in
  place, so its autotuner restores the scratch between timing runs;
* ``_run``: the launcher of the stage's kernels (autotuned, or a given config; the score and w/u products take
  ``DOT_PREC``, :func:`k3nn.kernels.precision.dot_precision`: IEEE for fp32 inputs while torch does not allow
  TF32).

(The pipeline these pieces were first written for, three launches rebuilding the cumulative decay from g in
each, was slower than :mod:`.triton_intra_g`'s precomputed decay and is gone; docs/perf.md.)
"""

from __future__ import annotations

import triton
import triton.language as tl
from ..precision import dot_precision

from ..tuning_cache import AUTOTUNE_KW
from .triton_common import PRUNE, _interp, _inverse_offdiag, _store_inverse

__all__: list[str] = []  # private pieces of :mod:`.triton_intra_g`


def _solve_configs():
    if _interp():
        return [triton.Config({}, num_warps=4)]
    cfgs = [triton.Config({}, num_warps=w, num_stages=1) for w in (2, 4, 1)]
    return cfgs


@triton.jit
def _ld_rows(x, bos, L, pid_h, S, row0, hi, NR: tl.constexpr, kb, D: tl.constexpr, BD: tl.constexpr):
    """Chunk rows row0..row0+NR−1 (only those < hi and < L; zeros elsewhere), channels [kb, kb + BD) of
    x [tokens, H, D] as fp32; S: the token stride in elements (H·D when contiguous)."""
    r = row0 + tl.arange(0, NR)
    rd = kb + tl.arange(0, BD)
    off = (bos + r).to(tl.int64)[:, None] * S + (pid_h * D + rd)[None, :]
    return tl.load(x + off, mask=((r < L) & (r < hi))[:, None] & (rd < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _bst(p, rows, co, val):
    """Store a 16×16 block at rows ``rows``, columns co.. of a per-chunk [64, 64] tile."""
    tl.store(p + rows[:, None] * 64 + co + tl.arange(0, 16)[None, :], val.to(p.dtype.element_ty))


@triton.jit
def _pairwise_diag(q_s, k_s, c, dA, dQ):
    """Replace a diagonal block's scores by the exact pairwise form, ``e^{c_a − c_b} ≤ 1`` for b ≤ a (c: the
    strip rows' cumulative decay, any common offset): never overflows, whatever the strip's decay."""
    r16 = tl.arange(0, 16)
    for jj in range(16):
        sel = r16[:, None] == jj
        kj = tl.sum(tl.where(sel, k_s, 0.0), 0)
        cj = tl.sum(tl.where(sel, c, 0.0), 0)
        e = tl.exp(tl.minimum(c - cj[None, :], 0.0))
        hit = r16[None, :] == jj
        dA = tl.where(hit, tl.sum(k_s * kj[None, :] * e, 1)[:, None], dA)
        dQ = tl.where(hit, tl.sum(q_s * kj[None, :] * e, 1)[:, None], dQ)
    return dA, dQ


@triton.jit
def _store_diag(Ap, Lp, i, accA, accQ, b_i, scale):
    """Diagonal block i: L = β ⊙ Akk strictly lower, Aqk (scaled) causal, and the zero blocks right of it."""
    r16 = tl.arange(0, 16)
    ri = i * 16 + r16
    strict = r16[:, None] > r16[None, :]
    causal = r16[:, None] >= r16[None, :]
    _bst(Lp, ri, i * 16, tl.where(strict, accA * b_i[:, None], 0.0))
    _bst(Ap, ri, i * 16, tl.where(causal, accQ * scale, 0.0))
    r64 = tl.arange(0, 64)
    tl.store(Ap + ri[:, None] * 64 + r64[None, :], tl.zeros([16, 64], dtype=Ap.dtype.element_ty),
             mask=(r64 >= (i + 1) * 16)[None, :] & (ri < 64)[:, None])


@triton.jit
def _strip_setup(chunk_start, chunk_len, beta, A_out, L_out, pid_c, pid_h, i, H):
    """Row strip i of one chunk and head: (first token, chunk length, chunk-head index, the strip's rows, their β,
    this chunk-head's [64, 64] Aqk and L blocks)."""
    bos = tl.load(chunk_start + pid_c)
    L = tl.load(chunk_len + pid_c)
    ob = (pid_c * H + pid_h).to(tl.int64)
    ri = i * 16 + tl.arange(0, 16)
    b_i = tl.load(beta + (bos + ri).to(tl.int64) * H + pid_h, mask=ri < L, other=0.0).to(tl.float32)
    return bos, L, ob, ri, b_i, A_out + ob * 4096, L_out + ob * 4096


@triton.jit
def _sub16(X3, a, s4, t: tl.constexpr):
    """Block t of a [4, 16, 16] stack as a [16, 16] tile (exact: a sum of zeros and one value)."""
    return tl.sum(tl.where(s4 == t, X3, 0.0), 0)


@triton.jit
def _ld_blk(p, ro: tl.constexpr, co: tl.constexpr):
    r = tl.arange(0, 16)
    return tl.load(p + (ro + r)[:, None] * 64 + co + r[None, :])


@triton.jit
def _solve_blocks(Xp):
    """The ten lower 16×16 blocks of (I + L)⁻¹ from the strictly lower L in the fp32 [64, 64] tile at ``Xp``
    (fp32): the four diagonal blocks together by forward substitution (15 row steps on a [4, 16, 16] tile), the
    rest by blockwise substitution. Returns (X00, X11, X22, X33, X10, X20, X21, X30, X31, X32)."""
    s4 = tl.arange(0, 4)[:, None, None]
    a = tl.arange(0, 16)[None, :, None]
    b = tl.arange(0, 16)[None, None, :]
    L3 = tl.load(Xp + (16 * s4 + a) * 64 + 16 * s4 + b)  # the four diagonal blocks of L (strictly lower)
    X3 = tl.where(a == b, 1.0, 0.0) + tl.zeros([4, 16, 16], dtype=tl.float32)
    for r in range(1, 16):
        # row r of every diagonal block: X_r = e_r − Σ_{c<r} L_rc X_c (rows c < r are final)
        lr = tl.sum(tl.where(a == r, L3, 0.0), 1)  # [4, 16]: L_r,c
        acc = tl.sum(lr[:, :, None] * X3, 1)  # [4, 16]: Σ_c L_rc X_c,:
        X3 = tl.where(a == r, X3 - acc[:, None, :], X3)
    X00 = _sub16(X3, a, s4, 0)
    X11 = _sub16(X3, a, s4, 1)
    X22 = _sub16(X3, a, s4, 2)
    X33 = _sub16(X3, a, s4, 3)
    L10 = _ld_blk(Xp, 16, 0)
    L20 = _ld_blk(Xp, 32, 0)
    L21 = _ld_blk(Xp, 32, 16)
    L30 = _ld_blk(Xp, 48, 0)
    L31 = _ld_blk(Xp, 48, 16)
    L32 = _ld_blk(Xp, 48, 32)
    X10, X20, X21, X30, X31, X32 = _inverse_offdiag(X00, X11, X22, X33, L10, L20, L21, L30, L31, L32)
    return X00, X11, X22, X33, X10, X20, X21, X30, X31, X32


@triton.jit
def _split_solve_kernel(X, H):
    pid_c = tl.program_id(0)
    pid_h = tl.program_id(1)
    ob = (pid_c * H + pid_h).to(tl.int64)
    Xp = X + ob * 4096
    X00, X11, X22, X33, X10, X20, X21, X30, X31, X32 = _solve_blocks(Xp)
    tl.debug_barrier()  # every L block is read before X overwrites it
    _store_inverse(Xp, X00, X11, X22, X33, X10, X20, X21, X30, X31, X32)


@triton.jit
def _xcol(Xp, r64, s: tl.constexpr):
    """Column block s of X: [64, 16] (rows above the block are zero)."""
    r16 = tl.arange(0, 16)
    return tl.load(Xp + r64[:, None] * 64 + s * 16 + r16[None, :], mask=(r64 >= s * 16)[:, None], other=0.0)


_split_solve = triton.autotune(**AUTOTUNE_KW, configs=_solve_configs(), key=[], restore_value=["X"], prune_configs_by=PRUNE)(
    _split_solve_kernel)


def _run(kern, grid, args, kw, config, dtype):
    """Launch ``kern`` (autotuned, or with ``config``); ``dtype``: the activations' (a kernel with a ``DOT_PREC``
    argument gets :func:`~k3nn.kernels.precision.dot_precision`: fp32 products follow torch's TF32 setting)."""
    if "DOT_PREC" in kern.arg_names:
        kw = {**kw, "DOT_PREC": dot_precision(dtype)}
    if config is None:
        kern[grid](*args, **kw)
    else:
        g = grid(config.kwargs) if callable(grid) else grid
        kern.fn[g](*args, **kw, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)

