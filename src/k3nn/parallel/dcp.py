"""Decode context parallelism (DCP) for MLA over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

The latent cache of every MLA layer is sharded along the sequence over the ``W`` ranks of a group,
interleaved with size ``I``: global position ``p`` lives on rank ``(p // I) % W`` (see
:mod:`k3nn.cache.pages` for the slot formulas; every rank builds a :class:`~k3nn.cache.pages.PagedLatentCache`
with its own ``rank``). KDA recurrent state is not sharded: it is fixed-size per request.

Decode of one MLA layer (``dcp_attention``, head-sharded "ag_rs" flow, 3 collectives):

1. each rank holds queries for its ``H/W`` heads → **all-gather Q** over heads → all ``H`` heads;
2. local absorbed attention over the local shard with rank-local lengths and causal bounds
   (``local_seq_lens(q_pos + 1)`` for a query at global position ``q_pos``) → partial ``o_r``, ``lse_r``;
3. **all-gather LSE**; ``lse = log Σ_r exp lse_r``; rescale ``o_r ← exp(lse_r − lse) o_r`` (empty shards: 0);
4. **reduce-scatter (sum)** over heads → each rank gets the exact result for its own heads.

With ``heads="replicated"`` every rank has all heads' queries (no TP): local attention, then all-gather of
``(o_r, lse_r)`` and the same exact merge on every rank (2 collectives).

Model wiring: per step call ``cache.extend(ids, T)`` once (same on every rank), then per MLA layer
:func:`dcp_mla_decode_layer`; prompts are prefilled unsharded and stored with :func:`dcp_write_latents`;
chunked prefill after cached context gathers it with :func:`dcp_gather_context`. Every kernel call gets
rank-local lengths and causal bounds; a rank owning no token of a request contributes lse = −inf and 0.

Launch with ``torchrun --nproc-per-node W`` (or any initialised default group). ``torchrun ... -m
k3nn.parallel.dcp`` runs a layer-level self-check against a single-rank forward; ``--bench B,L,H`` times a
sharded decode step against one device holding the whole cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Literal, Sequence

import torch
import torch.distributed as dist

from ..cache.pages import PagedLatentCache, local_seq_lens
from ..kernels.mla.api import default_visible_lens, merge_attn_states

__all__ = ["DCPContext", "dcp_visible_lens", "dcp_attention", "dcp_write_latents", "dcp_mla_decode_layer",
           "dcp_gather_context"]

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
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DCPContext.from_group: torch.distributed is not initialised (launch with torchrun "
                               "and call dist.init_process_group first)")
        return cls(dist.get_world_size(group), dist.get_rank(group), interleave, group)

    def check_cache(self, cache: PagedLatentCache) -> None:
        if (cache.world_size, cache.rank, cache.interleave) != (self.world_size, self.rank, self.interleave):
            raise ValueError(f"DCP cache was built for world_size={cache.world_size}, rank={cache.rank}, "
                             f"interleave={cache.interleave} but this rank is world_size={self.world_size}, "
                             f"rank={self.rank}, interleave={self.interleave}")


# -- collectives (list forms work on every backend; NCCL gets the fused tensor forms) -----------------------

def _is_nccl(ctx: DCPContext) -> bool:
    return dist.get_backend(ctx.group) == "nccl"


def _all_gather(t: torch.Tensor, ctx: DCPContext) -> torch.Tensor:
    """[...] on every rank → [W, ...] (rank order)."""
    t = t.contiguous()
    if _is_nccl(ctx):
        out = torch.empty((ctx.world_size,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t, group=ctx.group)
        return out
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t, group=ctx.group)
    return torch.stack(parts)


def _reduce_scatter(t: torch.Tensor, ctx: DCPContext) -> torch.Tensor:
    """[W, ...] on every rank → Σ_ranks t[rank] (this rank's slice of the sum)."""
    t = t.contiguous()
    if _is_nccl(ctx):
        out = torch.empty(tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.reduce_scatter_tensor(out, t, group=ctx.group)
        return out
    dist.all_reduce(t, group=ctx.group)  # gloo has no reduce-scatter
    return t[ctx.rank]


# -- attention ---------------------------------------------------------------------------------------------

def dcp_visible_lens(seq_lens: torch.Tensor, Tq: int, ctx: DCPContext) -> torch.Tensor:
    """Rank-local causal bounds [B, Tq] for a verify window of Tq queries ending at global length seq_lens."""
    return local_seq_lens(default_visible_lens(seq_lens, Tq), ctx.world_size, ctx.rank, ctx.interleave).to(torch.int32)


def dcp_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, ctx: DCPContext, *, heads: Heads = "sharded",
                  num_splits: int | None = None, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode over a sequence-sharded paged latent cache, merged exactly across the group.

    Args:
        q_lat [B, Tq, Hq, r], q_rope [B, Tq, Hq, dr]: this rank's queries — its ``H/W`` heads with
            ``heads="sharded"`` (rank ``k`` owns heads ``[k·H/W, (k+1)·H/W)``), all ``H`` with ``"replicated"``.
        kv_pool: this rank's pool; block_table [B, max_blocks]: shared by the group.
        seq_lens: int [B] **global** lengths (identical on every rank; the Tq query tokens included).
        scale: softmax scale; ctx: the rank's :class:`DCPContext`.
    Returns:
        ``(o [B, Tq, Hq, r] fp32, lse [B, Tq, Hq] fp32)``: exactly the single-rank result for this rank's heads.
    """
    from ..ops.mla import mla_decode

    if heads not in ("sharded", "replicated"):
        raise ValueError(f"dcp_attention: heads must be 'sharded' or 'replicated', got {heads!r}")
    if not isinstance(ctx, DCPContext):
        raise TypeError(f"dcp_attention: ctx must be a DCPContext, got {type(ctx).__name__}")
    if q_lat.dim() != 4:
        raise ValueError(f"dcp_attention: q_lat must be [B, Tq, H, r], got {tuple(q_lat.shape)}")
    B, Tq = q_lat.shape[:2]
    W = ctx.world_size
    if W > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"dcp_attention: world_size={W} needs an initialised torch.distributed group")
    if W > 1 and dist.get_world_size(ctx.group) != W:
        raise ValueError(f"dcp_attention: ctx.world_size={W} but the process group has "
                         f"{dist.get_world_size(ctx.group)} ranks")
    local = local_seq_lens(seq_lens, W, ctx.rank, ctx.interleave).to(torch.int32)
    vis = dcp_visible_lens(seq_lens, Tq, ctx)
    if W == 1:
        return mla_decode(q_lat, q_rope, kv_pool, block_table, local, scale, visible_lens=vis,
                          num_splits=num_splits, out_dtype=torch.float32, check=check)
    if heads == "sharded":
        qa = _all_gather(torch.cat([q_lat, q_rope], -1), ctx)  # [W, B, Tq, Hl, r + dr]
        Hl = q_lat.shape[2]
        qa = qa.permute(1, 2, 0, 3, 4).reshape(B, Tq, W * Hl, -1)
        ql, qr = qa.split([q_lat.shape[-1], q_rope.shape[-1]], -1)
        o, lse = mla_decode(ql, qr, kv_pool, block_table, local, scale, visible_lens=vis, num_splits=num_splits,
                            out_dtype=torch.float32, check=check)
        lses = _all_gather(lse, ctx)  # [W, B, Tq, H]
        ok = torch.isfinite(lses)
        lses = torch.where(ok, lses, torch.full_like(lses, float("-inf")))
        m = lses.amax(0)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        tot = torch.exp(lses - m).sum(0)
        glse = torch.where(tot > 0, m + torch.log(tot.clamp_min(1e-38)), torch.full_like(m, float("-inf")))
        mine = lses[ctx.rank]
        w = torch.where(torch.isfinite(mine) & (tot > 0), torch.exp(mine - glse), torch.zeros_like(mine))
        o = torch.where(w[..., None] > 0, o * w[..., None], torch.zeros_like(o))  # never 0·NaN
        parts = o.view(B, Tq, W, Hl, -1).permute(2, 0, 1, 3, 4)  # [W, B, Tq, Hl, r]
        o_mine = _reduce_scatter(parts, ctx)
        return o_mine, glse.view(B, Tq, W, Hl)[:, :, ctx.rank].contiguous()
    o, lse = mla_decode(q_lat, q_rope, kv_pool, block_table, local, scale, visible_lens=vis, num_splits=num_splits,
                        out_dtype=torch.float32, check=check)
    return merge_attn_states(_all_gather(o, ctx), _all_gather(lse, ctx))


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
    W_UV, the output gate and o_proj. ``heads="auto"`` shards heads when ``H % W == 0``. Returns y [B, T, d],
    the same on every rank and equal to the single-rank layer output.
    """
    ctx.check_cache(cache)
    B, T, _ = x.shape
    if positions.shape != (B, T) or bool((positions < 0).any()):
        raise ValueError(f"dcp_mla_decode_layer: positions must be [B={B}, T={T}] global positions (no padding)")
    H, W = layer.num_heads, ctx.world_size
    if heads == "auto":
        heads = "sharded" if H % W == 0 else "replicated"
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

def _self_check(argv=None) -> int:
    """``torchrun --nproc-per-node W -m k3nn.parallel.dcp [--interleave I] [--backend eager|triton]``:
    decode with a DCP-sharded cache and compare against the unsharded layer forward on every rank."""
    import argparse
    import os

    from ..config import KimiK3Config
    from ..kernels.registry import backend as use_backend
    from ..layers.mla import MultiHeadLatentAttention

    ap = argparse.ArgumentParser(prog="python -m k3nn.parallel.dcp")
    ap.add_argument("--interleave", type=int, default=1)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--tokens", type=int, default=2, help="query tokens per decode step (verify window)")
    ap.add_argument("--bench", metavar="B,L,H", default=None,
                    help="instead of the check, time one DCP decode step (K3 dims, bf16) against one GPU holding "
                         "the whole cache; rank 0 writes mla-dcp-*.json under $K3NN_RESULTS_DIR")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        ctx = DCPContext.from_group(interleave=args.interleave)
        if args.bench:
            return _bench(ctx, *(int(v) for v in args.bench.split(",")), backend_name=args.backend)
        dev = torch.device("cuda" if cuda else "cpu")
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
        with use_backend(args.backend):
            y = dcp_mla_decode_layer(layer, xn, cache, 0, ids, pos, ctx)
        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        print(f"[dcp rank {ctx.rank}/{ctx.world_size} I={ctx.interleave} {dist.get_backend()}] rel err {err:.2e}",
              flush=True)
        return 0 if err < tol else 1
    finally:
        dist.destroy_process_group()


def _bench(ctx: DCPContext, B: int, L: int, H: int, backend_name: str = "auto") -> int:
    """Per-step time of ``dcp_attention`` (sharded heads: all-gather Q, local decode, LSE all-gather,
    reduce-scatter) over a cache of B requests × L tokens sharded on W ranks, against one rank decoding the
    whole cache alone (rank 0, same process, no collectives)."""
    import os
    import time

    from ..kernels.registry import backend as use_backend
    from ..ops.mla import mla_decode

    W, r, dr, bs = ctx.world_size, 512, 64, 64
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if H % W:
        raise ValueError(f"--bench: H={H} must divide by the world size {W}")
    g = torch.Generator(device=dev).manual_seed(1234 + ctx.rank)

    def timed(fn, iters=20, together=True):
        for _ in range(3):
            fn()
        if cuda:
            torch.cuda.synchronize()
        if W > 1 and together:
            dist.barrier(group=ctx.group)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters * 1e3

    def make(world, rank, heads):
        cache = PagedLatentCache(1, B * -(-L // (bs * world)) + 1, r, dr, block_size=bs, dtype=dtype, device=dev,
                                 world_size=world, rank=rank, interleave=ctx.interleave if world > 1 else 1)
        ids = list(range(B))
        for i in ids:
            cache.add(i)
        cache.extend(ids, L)
        cache.pools[0].copy_(torch.randn(cache.pools[0].shape, device=dev, generator=g).to(dtype))
        q = torch.randn(B, 1, heads, r + dr, device=dev, generator=g).to(dtype)
        return cache, q, ids

    cache, q, ids = make(W, ctx.rank, H // W)
    bt, sl = cache.block_table(ids), cache.seq_lens(ids)
    with use_backend(backend_name):
        dcp_attention(q[..., :r], q[..., r:], cache.pools[0], bt, sl, 0.0722, ctx)  # tune outside the timing
        ms_dcp = timed(lambda: dcp_attention(q[..., :r], q[..., r:], cache.pools[0], bt, sl, 0.0722, ctx,
                                             check=False))
    if ctx.rank == 0 and os.environ.get("K3NN_DCP_PROFILE"):  # where a DCP step's time goes (kernels, host ops)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with use_backend(backend_name), profile(activities=acts) as prof:
            for _ in range(5):
                dcp_attention(q[..., :r], q[..., r:], cache.pools[0], bt, sl, 0.0722, ctx, check=False)
            if cuda:
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
        if cuda:
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8), flush=True)
    elif os.environ.get("K3NN_DCP_PROFILE"):
        with use_backend(backend_name):
            for _ in range(5):  # the peer's side of the profiled collectives
                dcp_attention(q[..., :r], q[..., r:], cache.pools[0], bt, sl, 0.0722, ctx, check=False)
    kv_bytes = cache.pools[0].numel() * cache.pools[0].element_size()
    del cache
    rows = []
    if ctx.rank == 0:
        full, qf, ids = make(1, 0, H)
        btf, slf = full.block_table(ids), full.seq_lens(ids)
        with use_backend(backend_name):
            mla_decode(qf[..., :r], qf[..., r:], full.pools[0], btf, slf, 0.0722)
            ms_one = timed(lambda: mla_decode(qf[..., :r], qf[..., r:], full.pools[0], btf, slf, 0.0722, check=False),
                           together=False)
        kv_one = full.pools[0].numel() * full.pools[0].element_size()
        rows.append({"case": f"B={B} L={L} H={H} Tq=1 W={W} I={ctx.interleave} {str(dtype)[6:]}",
                     "k3nn_ms": round(ms_dcp, 4), "anchor": "k3nn mla_decode on one device, whole cache",
                     "anchor_ms": round(ms_one, 4), "kv_bytes_per_rank": kv_bytes, "kv_bytes_one_device": kv_one,
                     "tpot_ratio": round(ms_dcp / ms_one, 3), "timing": "host wall clock per step, 20 steps"})
        print(f"[dcp bench] {rows[0]}", flush=True)
        if os.environ.get("K3NN_RESULTS_DIR") and cuda:
            from ..bench.common import write_results

            write_results("mla-dcp", rows, {"world_size": W, "backend": dist.get_backend(ctx.group)})
    if W > 1:
        dist.barrier(group=ctx.group)
    return 0


if __name__ == "__main__":
    raise SystemExit(_self_check())
