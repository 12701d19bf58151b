"""Which KDA states the prefix cache keeps (retention) and which entries it drops first (eviction).

A KDA prefix of length L is reusable only if the state at exactly L was exported, so *where* snapshots are
taken decides the hit rate (reference/hybrid_cache.md §0.2). Positions are absolute token counts, multiples of
the match unit U (64). Policies (combine them with ``+``):

* :class:`ReplayBoundary` — ``floor((N−1)/U)·U``: what an identical or longer follow-up prompt resumes from
  (the last prompt token is always recomputed, so the state at N itself is never enough).
* :class:`Interval` — every ``every`` tokens.
* :class:`PromptBoundaries` — positions the caller names per request (turn / document / tool boundaries),
  rounded down to U.
* :class:`Marconi` — selective retention: a shared prefix's state is cached only on its *second* hit. The
  prefix index reports how far the latent pages match (``kv_len``) beyond the deepest snapshot
  (``hit_len``); a gap ≥ U means another request already went through this prefix, so a checkpoint at the
  junction ``floor(kv_len/U)·U`` is exported in this prefill (Pan et al., MLSys'25; vLLM #37898).

Eviction orders candidates (:class:`LRU`, or :class:`MarconiEviction`'s ``recency + α·FLOP efficiency``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..config import KimiK3Config
from .prefix_entry import PrefixEntry
from .states import kda_layer_ids, latent_bytes_per_token, mla_layer_ids, state_bytes_per_slot

__all__ = ["PlanInput", "RetentionPolicy", "ReplayBoundary", "Interval", "PromptBoundaries", "Marconi",
           "NoRetention", "EvictionPolicy", "LRU", "MarconiEviction", "CostModel", "make_retention",
           "make_eviction"]

UNIT = 64


@dataclass
class PlanInput:
    """What a retention policy sees about one request when its prefill is planned."""

    num_prompt_tokens: int
    hit_len: int = 0  # tokens reused (KDA snapshot + pages)
    kv_len: int = 0  # tokens whose latent pages are in the index (≥ hit_len)
    boundaries: Sequence[int] = ()  # caller-given prompt / turn boundaries
    unit: int = UNIT


class RetentionPolicy:
    """``plan(inp)`` → sorted absolute positions p (multiples of U, hit_len < p ≤ N) to snapshot in this
    request's prefill."""

    def positions(self, inp: PlanInput) -> set[int]:
        """Candidate snapshot positions for the request ``inp`` describes (:meth:`plan` keeps the multiples of
        the unit in (hit_len, N])."""
        raise NotImplementedError

    def plan(self, inp: PlanInput) -> list[int]:
        U, N = inp.unit, inp.num_prompt_tokens
        return sorted(p for p in self.positions(inp) if p % U == 0 and inp.hit_len < p <= N)

    def __add__(self, other: "RetentionPolicy") -> "RetentionPolicy":
        return _Union([self, other])

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class _Union(RetentionPolicy):
    def __init__(self, parts: list[RetentionPolicy]):
        self.parts = [q for p in parts for q in (p.parts if isinstance(p, _Union) else [p])]

    def positions(self, inp: PlanInput) -> set[int]:
        return set().union(*(p.positions(inp) for p in self.parts))

    def __repr__(self) -> str:
        return " + ".join(map(repr, self.parts))


class NoRetention(RetentionPolicy):
    def positions(self, inp: PlanInput) -> set[int]:
        return set()


class ReplayBoundary(RetentionPolicy):
    """Snapshot the last block boundary before the prompt's last token: a repeat of the same prompt then recomputes
    less than one block."""

    def positions(self, inp: PlanInput) -> set[int]:
        return {(inp.num_prompt_tokens - 1) // inp.unit * inp.unit}


class Interval(RetentionPolicy):
    """Snapshot every ``every`` tokens (a positive multiple of 64)."""

    def __init__(self, every: int):
        if every < UNIT or every % UNIT:
            raise ValueError(f"Interval: every must be a positive multiple of {UNIT}, got {every}")
        self.every = every

    def positions(self, inp: PlanInput) -> set[int]:
        return set(range(self.every, inp.num_prompt_tokens + 1, self.every))

    def __repr__(self) -> str:
        return f"Interval({self.every})"


class PromptBoundaries(RetentionPolicy):
    """Snapshot at the caller's prompt / turn boundaries (``add_request(boundaries=...)``), rounded down to a block
    boundary; a boundary outside the prompt is a ValueError."""

    def positions(self, inp: PlanInput) -> set[int]:
        for b in inp.boundaries:
            if not 0 <= int(b) <= inp.num_prompt_tokens:
                raise ValueError(f"boundary {b} is outside the prompt of {inp.num_prompt_tokens} tokens")
        return {int(b) // inp.unit * inp.unit for b in inp.boundaries}


class Marconi(RetentionPolicy):
    """Second-hit admission: snapshot the junction of a prefix that the index has seen before."""

    def positions(self, inp: PlanInput) -> set[int]:
        if inp.kv_len - inp.hit_len >= inp.unit:
            return {inp.kv_len // inp.unit * inp.unit}
        return set()


def make_retention(spec: str | RetentionPolicy | None) -> RetentionPolicy:
    """``"marconi"`` (default: replay boundary + second-hit junctions), ``"interval:N"``, ``"boundaries"``,
    ``"replay"``, ``"none"``, or a policy object."""
    if isinstance(spec, RetentionPolicy):
        return spec
    s = (spec or "marconi").lower()
    if s == "marconi":
        return ReplayBoundary() + Marconi() + PromptBoundaries()
    if s == "replay":
        return ReplayBoundary() + PromptBoundaries()
    if s == "boundaries":
        return PromptBoundaries()
    if s == "none":
        return NoRetention()
    if s.startswith("interval:"):
        return Interval(int(s.split(":", 1)[1])) + ReplayBoundary() + PromptBoundaries()
    raise ValueError(f"unknown retention policy {spec!r}; use marconi, replay, boundaries, none or interval:N")


# -- eviction ------------------------------------------------------------------------------------------------
class CostModel:
    """FLOPs a cached prefix saves and the bytes it holds, from the config (Marconi §4.2, our layer mix).

    Per token and layer: projections ≈ 2·params FLOPs; MLA attention adds 4·l·d_attn per token at context l;
    a KDA layer adds 4·H·K·V per token (state update + read)."""

    def __init__(self, config: KimiK3Config, dtype_bytes: int = 2):
        import torch

        dt = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[dtype_bytes]
        c, d = config, config.hidden_size
        self.n_kda, self.n_mla = len(kda_layer_ids(c)), len(mla_layer_ids(c))
        H, D = c.kda_num_heads, c.kda_head_dim
        kda_params = d * 3 * H * D + 2 * H * D * d + d * H * D
        self.kda_tok = 2 * kda_params + 4 * H * D * D
        Ha, dq = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
        mla_params = d * Ha * dq + d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * Ha * (
            c.qk_nope_head_dim + c.v_head_dim) + Ha * c.v_head_dim * d
        self.mla_tok = 2 * mla_params
        self.attn_ctx = 2 * Ha * (dq + c.v_head_dim)  # per (query, key) pair
        ffn = c.num_experts_per_token * 3 * c.moe_intermediate_size * (c.routed_expert_hidden_size or d)
        self.ffn_tok = 2 * ffn * c.num_hidden_layers
        self.state_bytes = state_bytes_per_slot(c, dt)
        self.token_bytes = latent_bytes_per_token(c, dt)

    def flops(self, L: int) -> float:
        """FLOPs of a prefill of L tokens from scratch."""
        return (L * (self.n_kda * self.kda_tok + self.n_mla * self.mla_tok + self.ffn_tok)
                + self.n_mla * self.attn_ctx * L * (L + 1) / 2)

    def saved(self, parent_len: int, length: int) -> float:
        return self.flops(length) - self.flops(parent_len)

    def bytes(self, length: int, has_snapshot: bool) -> float:
        return length * self.token_bytes + (self.state_bytes if has_snapshot else 0)


class EvictionPolicy:
    """``order(candidates, now)`` → candidates, the first to evict first."""

    def order(self, candidates: list[PrefixEntry], now: int, cost: CostModel | None = None) -> list[PrefixEntry]:
        """``candidates`` sorted so that the first is evicted first (``now``: the index's clock; ``cost``: the
        FLOP / byte model, for policies that weigh what an entry saves)."""
        raise NotImplementedError


class LRU(EvictionPolicy):
    """Least recently used first (ties: the longer prefix, so children go before their parents)."""

    def order(self, candidates, now, cost=None):
        return sorted(candidates, key=lambda e: (e.last_access, -e.end))

    def __repr__(self) -> str:
        return "LRU()"


def _minmax(xs: list[float]) -> list[float]:
    lo, hi = min(xs), max(xs)
    return [1.0] * len(xs) if hi - lo <= 0 else [(x - lo) / (hi - lo) for x in xs]


class MarconiEviction(EvictionPolicy):
    """Utility ``S = norm(recency) + α·norm(saved FLOPs / bytes)``; the lowest S is evicted first.

    recency = 1 / (now − last_access); saved FLOPs are counted from the nearest ancestor that holds a snapshot
    (what is lost if this entry goes); an entry without a snapshot saves nothing by itself."""

    def __init__(self, alpha: float = 1.0):
        if alpha < 0:
            raise ValueError(f"MarconiEviction: alpha must be >= 0, got {alpha}")
        self.alpha = alpha

    def order(self, candidates, now, cost=None):
        if not candidates:
            return []
        rec = _minmax([1.0 / max(now - e.last_access, 1) for e in candidates])
        if cost is None or self.alpha == 0:
            eff = [0.0] * len(candidates)
        else:
            eff = []
            for e in candidates:
                if e.snapshot is None:
                    eff.append(0.0)
                    continue
                eff.append(cost.saved(e.snapshot_parent_len(), e.end) / cost.bytes(e.end, True))
            eff = _minmax(eff)
        score = [r + self.alpha * f for r, f in zip(rec, eff)]
        idx = sorted(range(len(candidates)), key=lambda i: (score[i], candidates[i].last_access))
        return [candidates[i] for i in idx]

    def __repr__(self) -> str:
        return f"MarconiEviction(alpha={self.alpha})"


def make_eviction(spec: str | EvictionPolicy | None) -> EvictionPolicy:
    if isinstance(spec, EvictionPolicy):
        return spec
    s = (spec or "lru").lower()
    if s == "lru":
        return LRU()
    if s == "marconi":
        return MarconiEviction()
    if s.startswith("marconi:"):
        return MarconiEviction(float(s.split(":", 1)[1]))
    raise ValueError(f"unknown eviction policy {spec!r}; use lru, marconi or marconi:ALPHA")
