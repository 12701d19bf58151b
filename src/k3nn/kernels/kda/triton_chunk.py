"""Triton chunked KDA forward (chunk 64), varlen, fp32 states and in-pass checkpoint export.

Two stages per call:

1. The intra-chunk stage (:func:`intra_fill`, the four kernels of :mod:`.triton_intra_g`; eager fp64 form:
   :func:`k3nn.kernels.kda.reference.kda_intra_reference`). Per 64-token chunk and head, with ``G`` the
   chunk-local cumulative log decay (computed once into an fp32 temporary the size of g):
   ``Aqk[i, j] = scale · Σ_d q_id k_jd e^{G_id − G_jd}`` (j ≤ i), ``L[i, j] = β_i Σ_d k_id k_jd e^{G_id − G_jd}``
   (j < i), ``X = (I + L)⁻¹`` (block-lower part, fp32), ``w = X (β ⊙ k ⊙ e^G)``, ``u = X (β ⊙ v)``,
   ``qg = scale · q ⊙ e^G``, ``kg = k ⊙ e^{G_last − G}`` and ``e^{G_last}``; every exponential factor is ≤ 1 or
   capped (a diagonal block whose decay exceeds ``_SPAN`` nats is recomputed pairwise), so no factor overflows
   for any gate ≤ 0.

2. ``_kda_recur`` (grid: sequences × heads × V blocks). Walks the chunks of one sequence with the state
   ``h [K, BV]`` in fp32 registers: ``v' = u − w h``, ``o = qg h + Aqk v'``, ``h ← e^{G_last} ⊙ h + kgᵀ v'``.
   Output is written here (no per-chunk state round trip through memory). Chunk boundaries are every 64
   tokens from each sequence start *and* at every requested checkpoint position, so a checkpoint is just
   the state at a chunk start, stored by the same kernel (masked store; no second pass).

This split into a precomputed decay, three intra kernels and one recurrence is the design because it was the
fastest at K3 prefill shapes: one fused program per chunk and head, the same three stages rebuilding G from g
in each, and a row-strip design were slower and are gone (docs/perf.md). The backward recomputes this stage.

Inputs must satisfy ``g ≤ 0`` (a log decay; both Kimi gates do). bf16/fp16 inputs use tensor-core dots with
operands in the input dtype: the off-diagonal intra blocks, ``X z`` / ``X (β v)`` (X rounded to the input
dtype), and in the recurrence the state cast for ``w h`` / ``qg h`` (fla does the same); the diagonal intra
blocks and the inverse stay fp32. fp32 inputs stay fp32: every product takes ``DOT_PREC``
(:func:`k3nn.kernels.precision.dot_precision`: IEEE fp32 while torch does not allow TF32, else TF32; the inverse
is IEEE fp32 always).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..precision import dot_precision
from ..registry import triton_interpreting, triton_ready
from ..tuning_cache import AUTOTUNE_KW
from .api import normalise_checkpoints, seq_lengths
from .triton_common import BT, PRUNE
from .triton_intra_g import intra_g_launch, token_rows

__all__ = ["kda_chunk_triton_fwd", "build_chunk_plan", "supports_kda_chunk"]


def _recur_configs(stages=(2, 3)):
    if triton_interpreting():
        return [triton.Config({"BV": 32}, num_warps=4)]
    cfgs = [triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv in (32, 64) for w in (4, 8) for s in stages]
    # BV 16: four times the programs of BV 64, for few heads (the chunk loop is sequential per program)
    cfgs += [triton.Config({"BV": 16}, num_warps=4, num_stages=s) for s in stages]
    return cfgs


@triton.jit
def _kda_recur_kernel(qg, kg, w, u, A, egl, chunk_start, chunk_len, seq_lo, seq_hi, export_slot,
               o, h0, ht, ckpt, H,
               K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, HAS_CKPT: tl.constexpr, DOT_PREC: tl.constexpr):
    n = tl.program_id(0)
    pid_h = tl.program_id(1)
    iv = tl.program_id(2)
    rk = tl.arange(0, BK)
    rv = iv * BV + tl.arange(0, BV)
    r64 = tl.arange(0, 64)
    mk = rk < K
    mv = rv < V
    mkv = mk[:, None] & mv[None, :]
    soff = ((n * H + pid_h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :]
    if HAS_INIT:
        h = tl.load(h0 + soff, mask=mkv, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BK, BV], dtype=tl.float32)
    lo = tl.load(seq_lo + n)
    hi = tl.load(seq_hi + n)
    dt = w.dtype.element_ty
    for c in range(lo, hi):
        if HAS_CKPT:
            slot = tl.load(export_slot + c)
            coff = ((tl.maximum(slot, 0).to(tl.int64) * H + pid_h) * K + rk[:, None]) * V + rv[None, :]
            tl.store(ckpt + coff, h, mask=mkv & ((rk[:, None] * 0 + slot) >= 0))
        bos = tl.load(chunk_start + c)
        L = tl.load(chunk_len + c)
        ob = (c * H + pid_h).to(tl.int64)
        offk = ob * 64 * K + r64[:, None] * K + rk[None, :]
        b_w = tl.load(w + offk, mask=mk[None, :], other=0.0)
        b_q = tl.load(qg + offk, mask=mk[None, :], other=0.0)
        b_k = tl.load(kg + offk, mask=mk[None, :], other=0.0)
        b_u = tl.load(u + ob * 64 * V + r64[:, None] * V + rv[None, :], mask=mv[None, :], other=0.0)
        b_A = tl.load(A + ob * 64 * 64 + r64[:, None] * 64 + r64[None, :])
        b_e = tl.load(egl + ob * K + rk, mask=mk, other=0.0)
        hb = h.to(dt)
        vn = b_u.to(tl.float32) - tl.dot(b_w, hb, input_precision=DOT_PREC)
        vnb = vn.to(dt)
        # the state update first (the loop-carried chain), the output after it (nothing waits on it)
        h = h * b_e[:, None] + tl.dot(tl.trans(b_k), vnb, input_precision=DOT_PREC)
        b_o = tl.dot(b_q, hb, input_precision=DOT_PREC) + tl.dot(b_A, vnb, input_precision=DOT_PREC)
        tok = (bos + r64).to(tl.int64)
        tl.store(o + (tok * H + pid_h)[:, None] * V + rv[None, :], b_o.to(o.dtype.element_ty),
                 mask=(r64[:, None] < L) & mv[None, :])
    if STORE_FINAL:
        tl.store(ht + soff, h, mask=mkv)


_kda_recur = triton.autotune(**AUTOTUNE_KW, configs=_recur_configs(), key=["K", "V", "H", "DOT_PREC"],
                             prune_configs_by=PRUNE)(_kda_recur_kernel)
# fp32 operands: pipelined stages do not fit in shared memory, so a separate tuner without them
_kda_recur_f32 = triton.autotune(**AUTOTUNE_KW, configs=_recur_configs((1,)), key=["K", "V", "H", "DOT_PREC"],
                                 prune_configs_by=PRUNE)(_kda_recur_kernel)


@functools.lru_cache(maxsize=64)
def _plan_cached(lengths: tuple, offsets: tuple, cuts: tuple, device: str):
    starts, lens, lo, hi, slot = [], [], [], [], []
    cut_map = {}
    for (n, p), m in cuts:
        cut_map.setdefault(n, {})[p] = m
    for n, (Ln, off) in enumerate(zip(lengths, offsets)):
        lo.append(len(starts))
        cm = cut_map.get(n, {})
        bounds = sorted(set(range(0, Ln, BT)) | {p for p in cm if 0 < p < Ln})
        for a_i, a in enumerate(bounds):
            b = bounds[a_i + 1] if a_i + 1 < len(bounds) else Ln
            starts.append(off + a)
            lens.append(b - a)
            slot.append(cm.get(a, -1) if a > 0 else -1)
        hi.append(len(starts))
    dev = torch.device(device)
    mk = lambda x: torch.tensor(x if x else [0], dtype=torch.int32).to(dev, non_blocking=True)  # noqa: E731
    return len(starts), mk(starts), mk(lens), mk(lo), mk(hi), mk(slot)


def build_chunk_plan(B: int, T: int, cu_seqlens, ckpts, device):
    """Chunk table: (start token in the flattened B·T axis, length ≤ 64), per sequence its chunk range, and
    per chunk the checkpoint slot to fill with the state at its start (−1: none). Cached per layout."""
    lengths = seq_lengths(T, B, cu_seqlens)
    if cu_seqlens is None:
        offsets = [b * T for b in range(B)]
    else:
        offsets = cu_seqlens.tolist()[:-1]
    uniq: dict = {}
    for key in ckpts:
        uniq.setdefault(key, len(uniq))
    cuts = tuple(sorted(uniq.items()))
    return _plan_cached(tuple(lengths), tuple(offsets), cuts, str(device)), lengths, uniq


def supports_kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                       cu_seqlens=None, checkpoint_positions=None):
    r = triton_ready(q, k, v, g, beta)
    if r:
        return r
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} not supported (float32, float16, bfloat16)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q, k, v must share one dtype"
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        return "bfloat16 tl.dot is not exact under the Triton interpreter"
    if v.shape[-1] > 256:
        return f"V must be <= 256, got {v.shape[-1]}"
    return None


def intra_fill(q, k, v, g, beta, scale, NC, c_start, c_len, qg, kg, w, u, A, egl, X, config=None):
    """Run the intra-chunk stage into the given buffers (layouts of :func:`_intra_launch`; X: the fp32
    [NC, H, 64, 64] scratch, left holding (I + L)⁻¹ in its block-lower part). ``config``: a tuple of four
    ``triton.Config`` (cumsum, scores, solve, w/u; None entries autotuned) to run instead of the tuned choices."""
    intra_g_launch(q, k, v, g, beta, scale, NC, c_start, c_len, qg, kg, w, u, A, egl, X, configs=config)


def _intra_launch(q, k, v, g, beta, scale, NC, c_start, c_len, config=None, return_x=False):
    """Intra-chunk quantities of NC chunks (contiguous inputs); returns (qg, kg, w, u, A, egl), plus the fp32
    X = (I + L)⁻¹ scratch with ``return_x``. ``config``: as in :func:`intra_fill`."""
    _, _, H, K = q.shape
    V = v.shape[-1]
    dt, dev = q.dtype, q.device
    qg = torch.empty(NC, H, 64, K, dtype=dt, device=dev)
    kg = torch.empty_like(qg)
    w = torch.empty_like(qg)
    u = torch.empty(NC, H, 64, V, dtype=dt, device=dev)
    A = torch.empty(NC, H, 64, 64, dtype=dt, device=dev)
    egl = torch.empty(NC, H, K, dtype=torch.float32, device=dev)
    scratch = torch.empty(NC, H, 64, 64, dtype=torch.float32, device=dev)
    intra_fill(q, k, v, g, beta, scale, NC, c_start, c_len, qg, kg, w, u, A, egl, scratch, config=config)
    out = (qg, kg, w, u, A, egl)
    return out + (scratch,) if return_x else out


def kda_chunk_triton_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None, checkpoint_positions=None, _force_final=False):
    """Forward only (no autograd); see :func:`k3nn.ops.kda_chunk` for the contract."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    dev = q.device
    ckpts = normalise_checkpoints(checkpoint_positions, seq_lengths(T, B, cu_seqlens))
    (NC, c_start, c_len, s_lo, s_hi, slot), lengths, uniq = build_chunk_plan(B, T, cu_seqlens, ckpts, dev)
    N = len(lengths)
    q, k = token_rows(q, k)  # views of one q | k | v buffer stay as they are: no copies
    v, = token_rows(v)
    g, beta = g.contiguous(), beta.contiguous()
    dt = q.dtype
    BK = max(16, triton.next_power_of_2(K))
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=dev)
    need_final = output_final_state or _force_final or any(p == lengths[n] for n, p in ckpts)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if need_final else None
    ck = torch.empty(max(len(uniq), 1), H, K, V, dtype=torch.float32, device=dev) if ckpts else None
    if NC > 0:
        qg, kg, w, u, A, egl = _intra_launch(q, k, v, g, beta, scale, NC, c_start, c_len)
        h0 = initial_state.float().contiguous() if initial_state is not None else qg
        grid = lambda META: (N, H, triton.cdiv(V, META["BV"]))  # noqa: E731
        recur = _kda_recur_f32 if dt == torch.float32 else _kda_recur
        recur[grid](qg, kg, w, u, A, egl, c_start, c_len, s_lo, s_hi, slot,
                         o, h0, ht if ht is not None else qg, ck if ck is not None else qg, H,
                         K=K, V=V, BK=BK, HAS_INIT=initial_state is not None, STORE_FINAL=ht is not None,
                         HAS_CKPT=bool(ckpts), DOT_PREC=dot_precision(dt))
    elif ht is not None:
        ht.zero_()
    if ht is not None and NC == 0 and initial_state is not None:
        ht.copy_(initial_state)
    # checkpoints at position 0 (the initial state) and at the sequence end (the final state) are not chunk
    # starts; fill them (and duplicates) from what the kernel produced.
    res_ck = None
    if checkpoint_positions is not None:
        interior = all(0 < p < lengths[n] for n, p in ckpts)
        if not ckpts:
            res_ck = torch.empty(0, H, K, V, dtype=torch.float32, device=dev)
        elif interior and len(uniq) == len(ckpts):
            res_ck = ck[:len(ckpts)]  # the common case: slots already in the order asked
        else:
            res_ck = torch.empty(len(ckpts), H, K, V, dtype=torch.float32, device=dev)
            for m, (n, p) in enumerate(ckpts):
                if p == 0:
                    res_ck[m] = initial_state[n] if initial_state is not None else 0.0
                elif p == lengths[n]:
                    res_ck[m] = ht[n]
                else:
                    res_ck[m] = ck[uniq[(n, p)]]
    return o, (ht if output_final_state else None), res_ck
