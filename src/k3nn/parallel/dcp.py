"""Decode context parallelism (DCP) for MLA over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

The latent cache of every MLA layer is sharded along the sequence over the ``W`` ranks of a group,
interleaved with size ``I``: global position ``p`` lives on rank ``(p // I) % W`` (see
:mod:`k3nn.cache.pages` for the slot formulas; every rank builds a :class:`~k3nn.cache.pages.PagedLatentCache`
with its own ``rank``). KDA recurrent state is not sharded: it is fixed-size per request.

Decode of one MLA layer (``dcp_attention``, head-sharded "ag_rs" flow, 3 collectives):

1. each rank holds queries for its ``H/W`` heads → **all-gather Q** over heads → all ``H`` heads;
2. local absorbed attention over the local shard with rank-local lengths and causal bounds
   (``local_seq_lens(q_pos + 1)`` for a query at global position ``q_pos``; one small kernel computes both)
   → partial ``o_r``, ``lse_r``;
3. **all-gather LSE**; one fused kernel (:func:`k3nn.kernels.mla.merge.merge_scale`) computes
   ``lse = log Σ_r exp lse_r`` and ``o_r ← exp(lse_r − lse) o_r`` (empty shards: exactly 0), laid out per
   head group;
4. **reduce-scatter (sum)** over heads → each rank gets the exact result for its own heads.

With ``heads="replicated"`` every rank has all heads' queries (no TP): local attention into one flat buffer,
one all-gather of ``(o_r, lse_r)`` and the same exact merge on every rank (1 collective).

With ``check=False`` a step reads no device value on the host and can be captured in a CUDA graph, NCCL
collectives included (create the group with ``device_id=`` and run one collective outside capture first).

Model wiring: per step call ``cache.extend(ids, T)`` once (same on every rank), then per MLA layer
:func:`dcp_mla_decode_layer`; prompts are prefilled unsharded and stored with :func:`dcp_write_latents`;
chunked prefill after cached context gathers it with :func:`dcp_gather_context`. Every kernel call gets
rank-local lengths and causal bounds; a rank owning no token of a request contributes lse = −inf and 0.

Launch with ``torchrun --nproc-per-node W`` (or any initialised default group). ``torchrun ... -m
k3nn.parallel.dcp`` runs a layer-level self-check against a single-rank forward; the repository's ``bench.dcp``
times a sharded decode step against one device holding the whole cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Hashable, Literal, Sequence

import torch
import torch.distributed as dist

from ..cache.pages import PagedLatentCache, local_seq_lens
from ..kernels.mla import merge as _merge
from ..kernels.registry import current_backend, triton_interpreting

__all__ = ["DCPContext", "dcp_local_lens", "dcp_visible_lens", "dcp_attention", "dcp_write_latents",
           "dcp_mla_decode_layer", "dcp_gather_context"]

Heads = Literal["sharded", "replicated", "auto"]


@dataclass(frozen=True)
class DCPContext:
    """Who this rank is in its DCP group. ``group=None`` means the default group. A context with
    ``world_size == 1`` runs without any collective (handy for tests and for the 1-rank baseline)."""

    world_size: int
    rank: int
    interleave: int = 1
    group: object | None = None

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"DCPContext: rank {self.rank} must be in [0, world_size={self.world_size})")
        if self.interleave < 1:
            raise ValueError(f"DCPContext: interleave must be >= 1, got {self.interleave}")

    @classmethod
    def from_group(cls, group=None, interleave: int = 1) -> "DCPContext":
        """This rank's context in ``group`` (None: the default group) of an initialised ``torch.distributed``;
        ``interleave`` I: token p lives on rank (p // I) mod W. Raises RuntimeError when torch.distributed is not
        initialised."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DCPContext.from_group: torch.distributed is not initialised (launch with torchrun "
                               "and call dist.init_process_group first)")
        return cls(dist.get_world_size(group), dist.get_rank(group), interleave, group)

    def check_cache(self, cache: PagedLatentCache) -> None:
        """Raise a ValueError when ``cache`` was sharded for another world size, rank or interleave."""
        if (cache.world_size, cache.rank, cache.interleave) != (self.world_size, self.rank, self.interleave):
            raise ValueError(f"DCP cache was built for world_size={cache.world_size}, rank={cache.rank}, "
                             f"interleave={cache.interleave} but this rank is world_size={self.world_size}, "
                             f"rank={self.rank}, interleave={self.interleave}")


# -- collectives (list forms work on every backend; NCCL gets the fused tensor forms) -----------------------

def _is_nccl(ctx: DCPContext) -> bool:
    return dist.get_backend(ctx.group) == "nccl"


def _all_gather(t: torch.Tensor, ctx: DCPContext, nccl: bool | None = None) -> torch.Tensor:
    """[...] on every rank → [W, ...] (rank order)."""
    t = t.contiguous()
    if _is_nccl(ctx) if nccl is None else nccl:
        out = torch.empty((ctx.world_size,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t, group=ctx.group)
        return out
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t, group=ctx.group)
    return torch.stack(parts)


def _reduce_scatter(t: torch.Tensor, ctx: DCPContext, nccl: bool | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """[W, ...] on every rank → Σ_ranks t[rank] (this rank's slice of the sum), into ``out`` when given."""
    t = t.contiguous()
    if _is_nccl(ctx) if nccl is None else nccl:
        if out is None:
            out = torch.empty(tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.reduce_scatter_tensor(out, t, group=ctx.group)
        return out
    dist.all_reduce(t, group=ctx.group)  # gloo has no reduce-scatter
    return t[ctx.rank] if out is None else out.copy_(t[ctx.rank])


# -- attention ---------------------------------------------------------------------------------------------

def _fused_kernels(t: torch.Tensor) -> bool:
    """Whether the small DCP kernels (lengths, LSE merge) run in Triton: on CUDA unless the eager backend is
    forced; on the CPU only for an explicit ``triton`` backend under ``TRITON_INTERPRET=1`` (tests)."""
    b = current_backend()
    if b == "eager" or _merge.triton is None:
        return False
    if t.is_cuda:
        return True
    return b == "triton" and triton_interpreting()


def _lens(seq_lens: torch.Tensor, Tq: int, ctx: DCPContext, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if fused:
        return _merge.dcp_lens(seq_lens, Tq, ctx.world_size, ctx.rank, ctx.interleave)
    return _merge.dcp_lens_reference(seq_lens, Tq, ctx.world_size, ctx.rank, ctx.interleave)


def dcp_local_lens(seq_lens: torch.Tensor, Tq: int, ctx: DCPContext) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local lengths int32 [B], rank-local causal bounds int32 [B, Tq])`` for a verify window of Tq queries
    ending at global lengths ``seq_lens`` [B] (one small kernel on CUDA). The same for every layer of a step:
    compute once and pass to :func:`dcp_attention` as ``local_lens``."""
    return _lens(seq_lens, Tq, ctx, _fused_kernels(seq_lens))


def dcp_visible_lens(seq_lens: torch.Tensor, Tq: int, ctx: DCPContext) -> torch.Tensor:
    """Rank-local causal bounds [B, Tq] for a verify window of Tq queries ending at global length seq_lens."""
    return dcp_local_lens(seq_lens, Tq, ctx)[1]


def _cat_last(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.cat([a, b], -1)``, contiguous; no copy when a and b are the two halves of one contiguous
    tensor (``q[..., :r]``, ``q[..., r:]``)."""
    n = a.shape[-1] + b.shape[-1]
    if (b.shape[-1] and a.dtype == b.dtype and a.device == b.device and a.stride(-1) == 1 and b.stride(-1) == 1
            and a.stride() == b.stride() and b.data_ptr() == a.data_ptr() + a.shape[-1] * a.element_size()):
        full = a.as_strided(tuple(a.shape[:-1]) + (n,), a.stride())
        if full.is_contiguous():
            return full
    return torch.cat([a, b], -1)


def _check_attention_args(q_lat, ctx, heads, out) -> None:
    if heads not in ("sharded", "replicated"):
        raise ValueError(f"dcp_attention: heads must be 'sharded' or 'replicated', got {heads!r}")
    if not isinstance(ctx, DCPContext):
        raise TypeError(f"dcp_attention: ctx must be a DCPContext, got {type(ctx).__name__}")
    if q_lat.dim() != 4:
        raise ValueError(f"dcp_attention: q_lat must be [B, Tq, H, r], got {tuple(q_lat.shape)}")
    W = ctx.world_size
    if W > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"dcp_attention: world_size={W} needs an initialised torch.distributed group")
    if W > 1 and dist.get_world_size(ctx.group) != W:
        raise ValueError(f"dcp_attention: ctx.world_size={W} but the process group has "
                         f"{dist.get_world_size(ctx.group)} ranks")
    if out is not None:
        B, Tq, H, r = q_lat.shape
        if (not isinstance(out, (tuple, list)) or len(out) != 2
                or tuple(out[0].shape) != (B, Tq, H, r) or tuple(out[1].shape) != (B, Tq, H)
                or out[0].dtype != torch.float32 or out[1].dtype != torch.float32
                or not (out[0].is_contiguous() and out[1].is_contiguous())):
            raise ValueError(f"dcp_attention: out must be contiguous fp32 (o [{B}, {Tq}, {H}, {r}], "
                             f"lse [{B}, {Tq}, {H}])")


def dcp_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, ctx: DCPContext, *, heads: Heads = "sharded",
                  num_splits: int | None = None, check: bool = True,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  local_lens: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode over a sequence-sharded paged latent cache, merged exactly across the group.

    Args:
        q_lat [B, Tq, Hq, r], q_rope [B, Tq, Hq, dr]: this rank's queries — its ``H/W`` heads with
            ``heads="sharded"`` (rank ``k`` owns heads ``[k·H/W, (k+1)·H/W)``), all ``H`` with ``"replicated"``.
            Passing the two halves of one contiguous ``[..., r + dr]`` tensor saves a copy.
        kv_pool: this rank's pool; block_table [B, max_blocks]: shared by the group.
        seq_lens: int [B] **global** lengths (identical on every rank; the Tq query tokens included).
        scale: softmax scale; ctx: the rank's :class:`DCPContext`.
        check: validate the arguments (and index values: a host sync). ``check=False`` skips every check and
            never reads a device value on the host: the call can then be captured in a CUDA graph (NCCL
            collectives included, once the group has run a collective outside capture).
        out: preallocated contiguous fp32 ``(o [B, Tq, Hq, r], lse [B, Tq, Hq])`` to write into.
        local_lens: :func:`dcp_local_lens` of ``seq_lens`` (computed here when omitted; pass it to share one
            computation between the layers of a step).
    Returns:
        ``(o [B, Tq, Hq, r] fp32, lse [B, Tq, Hq] fp32)``: exactly the single-rank result for this rank's heads.

    Sharded heads take 3 collectives and 2 small kernels besides the decode: lengths (one launch), all-gather
    Q, decode, all-gather LSE, fused merge (:func:`k3nn.kernels.mla.merge.merge_scale`: the merged LSE and this
    rank's weighted partial, laid out per head group), reduce-scatter. Replicated heads: lengths, decode
    written into one flat buffer, one all-gather of (o, lse), fused merge. Triton runs the small kernels on
    CUDA (and for an explicit ``triton`` backend under the interpreter); elsewhere their eager references.
    """
    from ..ops.mla import mla_decode

    if check:
        _check_attention_args(q_lat, ctx, heads, out)
    B, Tq, Hq, r = q_lat.shape
    W, rank = ctx.world_size, ctx.rank
    fused = _fused_kernels(q_lat)
    local, vis = _lens(seq_lens, Tq, ctx, fused) if local_lens is None else local_lens
    if W == 1:
        return mla_decode(q_lat, q_rope, kv_pool, block_table, local, scale, visible_lens=vis,
                          num_splits=num_splits, out_dtype=torch.float32, out=out, check=check)
    nccl = _is_nccl(ctx)
    dev = q_lat.device
    if heads == "sharded":
        qa = _all_gather(_cat_last(q_lat, q_rope), ctx, nccl)  # [W, B, Tq, Hl, r + dr]
        qa = qa.permute(1, 2, 0, 3, 4).reshape(B, Tq, W * Hq, -1)  # a view when B·Tq = 1
        o, lse = mla_decode(qa[..., :r], qa[..., r:], kv_pool, block_table, local, scale, visible_lens=vis,
                            num_splits=num_splits, out_dtype=torch.float32, check=check)
        lses = _all_gather(lse, ctx, nccl)  # [W, B, Tq, H]
        if fused:
            parts = torch.empty(W, B, Tq, Hq, r, dtype=torch.float32, device=dev)
            lse_out = out[1] if out is not None else torch.empty(B, Tq, Hq, dtype=torch.float32, device=dev)
            _merge.merge_scale(lses, o, rank, W, rank, out=(parts, lse_out))
        else:
            parts, lse_out = _merge.merge_scale_reference(lses, o, rank, W, rank)
            if out is not None:
                lse_out = out[1].copy_(lse_out)
        o_mine = _reduce_scatter(parts, ctx, nccl, out=None if out is None else out[0])
        return o_mine, lse_out
    n_o, n_l = B * Tq * Hq * r, B * Tq * Hq
    buf = torch.empty(n_o + n_l, dtype=torch.float32, device=dev)  # (o, lse) of this rank, gathered at once
    mla_decode(q_lat, q_rope, kv_pool, block_table, local, scale, visible_lens=vis, num_splits=num_splits,
               out_dtype=torch.float32, out=(buf[:n_o].view(B, Tq, Hq, r), buf[n_o:].view(B, Tq, Hq)),
               check=check)
    g = _all_gather(buf, ctx, nccl)  # [W, n_o + n_l]
    outs, lses = g[:, :n_o].view(W, B, Tq, Hq, r), g[:, n_o:].view(W, B, Tq, Hq)
    if fused:
        return _merge.merge_states(outs, lses, out=out)
    o, lse = _merge.merge_states_reference(outs, lses)
    if out is not None:
        return out[0].copy_(o), out[1].copy_(lse)
    return o, lse


# -- layer level -------------------------------------------------------------------------------------------

def dcp_write_latents(layer, x: torch.Tensor, cache: PagedLatentCache, layer_slot: int,
                      seq_ids: Sequence[Hashable], positions: torch.Tensor, ctx: DCPContext) -> None:
    """Compute the latents of tokens x [B, T, d] at global ``positions`` [B, T] (``-1`` = padding) and store
    the rows this rank owns (prefill runs unsharded; only its cache writes are sharded)."""
    ctx.check_cache(cache)
    c, k_r = layer.latents(x, positions.clamp_min(0))
    cache.write(layer_slot, seq_ids, positions, c, k_r)


def dcp_mla_decode_layer(layer, x: torch.Tensor, cache: PagedLatentCache, layer_slot: int,
                         seq_ids: Sequence[Hashable], positions: torch.Tensor, ctx: DCPContext, *,
                         heads: Heads = "auto", num_splits: int | None = None) -> torch.Tensor:
    """One decode step of a :class:`k3nn.layers.mla.MultiHeadLatentAttention` under DCP.

    x [B, T, d]: the new tokens (T = 1, or a verify window), identical on every rank; ``positions`` [B, T]:
    their global positions from ``cache.extend(seq_ids, T)`` (called once per step for all layers, same on
    every rank). Writes this layer's new latents (owned rows only), runs :func:`dcp_attention`, applies
    W_UV, the output gate and o_proj. ``heads="auto"`` means ``"replicated"``: the layer holds every head and x is
    the same on every rank, so each rank forms all queries itself and one all-gather of (o, lse) merges the
    step. ``"sharded"`` forms only this rank's H/W queries and costs four collectives (all-gather Q and LSE,
    reduce-scatter, all-gather of the projected heads): it pays only when the heads are tensor-parallel, where
    :func:`dcp_attention` is called with the rank's own heads. Returns y [B, T, d], the same on every rank and
    equal to the single-rank layer output.
    """
    ctx.check_cache(cache)
    B, T, _ = x.shape
    if positions.shape != (B, T) or bool((positions < 0).any()):
        raise ValueError(f"dcp_mla_decode_layer: positions must be [B={B}, T={T}] global positions (no padding)")
    H, W = layer.num_heads, ctx.world_size
    if heads == "auto":
        heads = "replicated"
    if heads == "sharded" and H % W:
        raise ValueError(f"dcp_mla_decode_layer: {H} heads cannot be sharded over {W} ranks; use heads='replicated'")
    seq_lens = cache.seq_lens(seq_ids)
    if bool((positions[:, -1] != seq_lens.to(positions.dtype) - 1).any()):
        raise ValueError("dcp_mla_decode_layer: the new tokens must be the last T positions of each request "
                         "(call cache.extend(seq_ids, T) first and pass its positions)")
    q_nope, q_rope = layer.queries(x, positions)
    c, k_r = layer.latents(x, positions)
    cache.write(layer_slot, seq_ids, positions, c, k_r)
    w_uk, w_uv = layer.w_uk_uv()
    hs = slice(None)
    if heads == "sharded" and W > 1:
        Hl = H // W
        hs = slice(ctx.rank * Hl, (ctx.rank + 1) * Hl)
    pool = cache.pools[layer_slot]
    q_lat = torch.einsum("bthd,hdr->bthr", q_nope[:, :, hs], w_uk[hs]).to(pool.dtype)
    o_lat, _ = dcp_attention(q_lat, q_rope[:, :, hs].to(pool.dtype), pool, cache.block_table(seq_ids), seq_lens,
                             layer.scale, ctx, heads=heads if W > 1 else "replicated", num_splits=num_splits)
    o = torch.einsum("bthr,hvr->bthv", o_lat, w_uv[hs].to(o_lat.dtype)).to(x.dtype)
    if heads == "sharded" and W > 1:
        o = _all_gather(o, ctx).permute(1, 2, 0, 3, 4).reshape(B, T, H, -1)
    return layer.finish(x, o)


def dcp_gather_context(cache: PagedLatentCache, layer_slot: int, seq_ids: Sequence[Hashable], ctx: DCPContext,
                       block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank gets the whole cached context of the requests, in global token order (for chunked prefill
    after cached context under DCP: gather, then decompress and attend as without DCP).

    Returns ``(pool, block_table, context_lens)`` describing an unsharded paged view of the gathered rows
    (``block_size``-row blocks, request b in blocks ``[b·n, (b+1)·n)``), ready for
    :func:`k3nn.kernels.mla.prefill.mla_prefill`'s ``kv_pool`` / ``block_table`` / ``context_lens``.
    """
    from ..cache.pages import gather_latents

    ctx.check_cache(cache)
    W, I = ctx.world_size, ctx.interleave
    sl = cache.seq_lens(seq_ids).long()
    B = sl.shape[0]
    Lg = int(sl.max()) if B else 0
    Lloc = max(int(local_seq_lens(torch.tensor(Lg), W, k, I)) for k in range(W))
    pool = cache.pools[layer_slot]
    local = gather_latents(pool, cache.block_table(seq_ids), max(Lloc, 1))  # [B, Lloc, D]
    parts = _all_gather(local, ctx) if W > 1 else local[None]  # [W, B, Lloc, D]
    p = torch.arange(Lg, device=pool.device)
    owner = torch.div(p, I, rounding_mode="floor") % W
    idx = torch.div(p, I * W, rounding_mode="floor") * I + p % I
    rows = parts[owner, :, idx].transpose(0, 1)  # [B, Lg, D]
    nb = max(1, -(-Lg // block_size))
    buf = torch.zeros(B, nb * block_size, pool.shape[-1], dtype=pool.dtype, device=pool.device)
    buf[:, :Lg] = rows
    table = torch.arange(B * nb, dtype=torch.int32, device=pool.device).view(B, nb)
    return buf.view(B * nb, block_size, -1), table, sl.to(torch.int32)


# -- torchrun self-check -----------------------------------------------------------------------------------

@torch.no_grad()
def _self_check(argv=None) -> int:
    """``torchrun --nproc-per-node W -m k3nn.parallel.dcp [--interleave I] [--backend eager|triton]``:
    decode with a DCP-sharded cache and compare against the unsharded layer forward on every rank."""
    import argparse

    from ..config import KimiK3Config
    from ..kernels.registry import backend as use_backend
    from ..layers.mla import MultiHeadLatentAttention

    ap = argparse.ArgumentParser(prog="python -m k3nn.parallel.dcp")
    ap.add_argument("--interleave", type=int, default=1)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--tokens", type=int, default=2, help="query tokens per decode step (verify window)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=dev if cuda else None)
    try:
        ctx = DCPContext.from_group(interleave=args.interleave)
        dtype = torch.bfloat16 if cuda else torch.float32
        cfg = KimiK3Config.tiny(num_attention_heads=4 * ctx.world_size, kv_lora_rank=64, qk_rope_head_dim=16)
        torch.manual_seed(0)
        layer = MultiHeadLatentAttention(cfg).to(dev, torch.float32)
        lens, T = [37, 130], args.tokens
        x = torch.randn(len(lens), max(lens) + T, cfg.hidden_size, device=dev)
        ref = torch.stack([layer(x[b:b + 1, : lens[b] + T])[0, lens[b]:] for b in range(len(lens))])
        cache = PagedLatentCache(1, 16, cfg.kv_lora_rank, cfg.qk_rope_head_dim, block_size=16, dtype=dtype,
                                 device=dev, world_size=ctx.world_size, rank=ctx.rank, interleave=ctx.interleave)
        ids = list(range(len(lens)))
        for i in ids:
            cache.add(i)
        pos = cache.extend(ids, lens)
        dcp_write_latents(layer, x[:, : max(lens)], cache, 0, ids, pos, ctx)
        pos = cache.extend(ids, T)
        xn = torch.stack([x[b, lens[b]: lens[b] + T] for b in ids])
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        rc = 0
        for heads in ("replicated", "sharded"):
            with use_backend(args.backend):
                y = dcp_mla_decode_layer(layer, xn, cache, 0, ids, pos, ctx, heads=heads)
            err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
            print(f"[dcp rank {ctx.rank}/{ctx.world_size} I={ctx.interleave} {dist.get_backend()} heads={heads}] "
                  f"rel err {err:.2e}", flush=True)
            rc |= int(not err < tol)
        return rc
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(_self_check())
