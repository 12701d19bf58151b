"""Pieces shared by the Triton chunked KDA kernels (forward intra stage, recurrence, backward): the chunk
geometry, strip loads and stores, the off-diagonal blocks of the (I + L)⁻¹ of a chunk, and autotuning that follows
:attr:`KernelTuning.autotune <k3nn.kernels.registry.KernelTuning>`. Imports nothing of the other kernel modules."""

from __future__ import annotations

import triton.language as tl
import triton

from ..registry import autotune_prune, triton_interpreting

__all__ = ["BT", "BC", "PRUNE"]

BT = 64  # chunk
BC = 16  # sub-chunk (strip)
_SPAN = 80.0  # nats of decay across a diagonal 16-block above which it is recomputed pairwise
#: ``prune_configs_by`` of every autotuned chunk kernel: all candidates, or the first only with autotune off
PRUNE = {"early_config_prune": autotune_prune}


def _interp() -> bool:
    return triton_interpreting()


@triton.jit
def _ld(x, bos, L, pid_h, S, s: tl.constexpr, kb, D: tl.constexpr, BD: tl.constexpr):
    """Rows 16s..16s+15 of the chunk, channels [kb, kb + BD) of x [tokens, H, D] as fp32 (zeros outside); S: the
    token stride in elements (H·D when contiguous; larger for a slice of a wider row, e.g. q of q | k | v)."""
    r = s * 16 + tl.arange(0, 16)
    rd = kb + tl.arange(0, BD)
    off = (bos + r).to(tl.int64)[:, None] * S + (pid_h * D + rd)[None, :]
    return tl.load(x + off, mask=(r < L)[:, None] & (rd < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _st(x, ob, s: tl.constexpr, kb, val, D: tl.constexpr, BD: tl.constexpr):
    """Store a [16, BD] strip into rows 16s.. of the per-chunk buffer x [chunk·H, 64, D]."""
    r = s * 16 + tl.arange(0, 16)
    rd = kb + tl.arange(0, BD)
    tl.store(x + ob * 64 * D + r[:, None] * D + rd[None, :], val.to(x.dtype.element_ty),
             mask=(r < 64)[:, None] & (rd < D)[None, :])


@triton.jit
def _blk_st(x, ro: tl.constexpr, co: tl.constexpr, val):
    r = tl.arange(0, 16)
    tl.store(x + (ro + r)[:, None] * 64 + co + r[None, :], val.to(x.dtype.element_ty))


@triton.jit
def _inverse_offdiag(X00, X11, X22, X33, L10, L20, L21, L30, L31, L32):
    """Off-diagonal 16×16 blocks of (I + L)⁻¹ from the inverted diagonal blocks Xii and the strictly lower
    blocks Lij of one 64-token chunk (blockwise forward substitution, fp32): (X10, X20, X21, X30, X31, X32)."""
    X10 = -tl.dot(X11, tl.dot(L10, X00, input_precision="ieee"), input_precision="ieee")
    X21 = -tl.dot(X22, tl.dot(L21, X11, input_precision="ieee"), input_precision="ieee")
    X32 = -tl.dot(X33, tl.dot(L32, X22, input_precision="ieee"), input_precision="ieee")
    X20 = -tl.dot(X22, tl.dot(L20, X00, input_precision="ieee") + tl.dot(L21, X10, input_precision="ieee"),
                  input_precision="ieee")
    X31 = -tl.dot(X33, tl.dot(L31, X11, input_precision="ieee") + tl.dot(L32, X21, input_precision="ieee"),
                  input_precision="ieee")
    X30 = -tl.dot(X33, tl.dot(L30, X00, input_precision="ieee") + tl.dot(L31, X10, input_precision="ieee")
                  + tl.dot(L32, X20, input_precision="ieee"), input_precision="ieee")
    return X10, X20, X21, X30, X31, X32


@triton.jit
def _store_inverse(Xp, X00, X11, X22, X33, X10, X20, X21, X30, X31, X32):
    """The ten lower blocks of a chunk's (I + L)⁻¹ into the [64, 64] tile at ``Xp``."""
    _blk_st(Xp, 0, 0, X00)
    _blk_st(Xp, 16, 16, X11)
    _blk_st(Xp, 32, 32, X22)
    _blk_st(Xp, 48, 48, X33)
    _blk_st(Xp, 16, 0, X10)
    _blk_st(Xp, 32, 0, X20)
    _blk_st(Xp, 32, 16, X21)
    _blk_st(Xp, 48, 0, X30)
    _blk_st(Xp, 48, 16, X31)
    _blk_st(Xp, 48, 32, X32)
