"""Prefix cache for the hybrid model: hash-chained 64-token blocks → latent pages + optional KDA snapshots.

Rules (reference/hybrid_cache.md §0, §7.2):

* The match unit equals the latent page (64 tokens), so every indexed page is full and immutable; requests
  share it by reference count and never write into it.
* Block k's key is ``H(key_{k-1} ‖ tokens[64k : 64k+64] ‖ extra_k)`` (blake2b), so one key names the whole prefix;
  ``extra_k`` is empty for text and holds the content hashes of the images with tokens in block k.
* A hit at length L needs every page of [0, L) **and** a KDA snapshot at exactly L. L ≤ N−1: the last prompt
  token is always recomputed (its logits start generation; KDA updates are not idempotent).
* The snapshot is copied into the request's private running row before the request extends it
  (copy-on-write); the snapshot slot itself is never written again.
* Entries appear only after the forward that wrote them has finished (:meth:`insert` / :meth:`add_snapshot`
  are called after the step), so a request scheduled in the same step never reads a state not yet written.
* Nothing held by a running request is evicted: pages with a reference besides the index's stay; eviction
  takes leaves first (a middle page would break every longer prefix) and drops snapshots independently.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .paged import HybridPools
from .prefix_entry import PrefixEntry
from .retention import CostModel, EvictionPolicy, make_eviction

__all__ = ["PrefixCache", "PrefixEntry", "PrefixMatch", "block_hashes", "extra_block_keys"]


def block_hashes(tokens: Sequence[int], unit: int = 64, salt: bytes = b"", prev: bytes | None = None,
                 start_block: int = 0, extra_keys: Mapping[int, bytes] | None = None) -> list[bytes]:
    """Chained keys of the full ``unit``-token blocks of ``tokens`` from block ``start_block`` on (``prev`` =
    key of the block before it).

    ``extra_keys``: block index → bytes mixed into that block's key besides its token ids (the content hashes
    of the images whose tokens lie in the block: :func:`extra_block_keys`), so equal token ids with different
    image content give different keys. Blocks without an entry hash as they do without ``extra_keys``: text
    keys are unchanged, and the blocks before a prompt's first image are shared with text prompts."""
    out, h = [], prev if prev is not None else hashlib.blake2b(salt, digest_size=16).digest()
    for k in range(start_block, len(tokens) // unit):
        blk = b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens[k * unit:(k + 1) * unit])
        extra = extra_keys.get(k, b"") if extra_keys else b""  # blk has a fixed length: no ambiguity
        h = hashlib.blake2b(h + blk + extra, digest_size=16).digest()
        out.append(h)
    return out


def extra_block_keys(spans: Sequence[tuple[Sequence[int], bytes]], unit: int = 64) -> dict[int, bytes]:
    """``spans``: (token positions, content key) per image, in prompt order → the ``extra_keys`` of
    :func:`block_hashes`: for every ``unit``-token block holding any of an image's positions, the keys of those
    images, concatenated in prompt order."""
    per_block: dict[int, list[bytes]] = {}
    for positions, key in spans:
        if not isinstance(key, (bytes, bytearray)) or not key:
            raise ValueError(f"extra_block_keys: each content key must be non-empty bytes, got {key!r}")
        for k in sorted({int(p) // unit for p in positions}):
            per_block.setdefault(k, []).append(bytes(key))
    return {k: b"".join(v) for k, v in per_block.items()}


@dataclass
class PrefixMatch:
    """The answer of :meth:`PrefixCache.match`: ``hit_len`` tokens can be reused (a multiple of the page size, at most
    N − 1: the last prompt token always runs), their ``pages`` (one per 64 tokens, per MLA layer's pool), the
    ``snapshot`` slot holding the KDA state after ``hit_len`` tokens (None when ``hit_len`` is 0), and ``kv_len``: how
    far the pages alone match (≥ hit_len; the second-hit signal of Marconi retention)."""

    hit_len: int = 0  # reusable tokens (pages + snapshot)
    pages: list[int] = field(default_factory=list)  # pages of [0, hit_len)
    snapshot: int | None = None  # slot holding the state at hit_len (None when hit_len == 0)
    kv_len: int = 0  # tokens whose pages are indexed (≥ hit_len): the Marconi second-hit signal


class PrefixCache:
    """The prefix index of the hybrid cache: hash-chained 64-token blocks of prompts → latent pages, plus KDA state
    snapshots at block boundaries (a hit at length L needs every page of [0, L) and a snapshot at exactly L).

    :meth:`match` finds the longest reusable prefix, :meth:`insert` / :meth:`add_snapshot` index a request's blocks and
    snapshots (written in the current step, they become visible once committed), :meth:`make_room` evicts by the
    ``eviction`` policy ("lru", "marconi" or a policy object) when the pools run short. Pages and snapshots are
    reference counted: an entry in use by a request is never evicted under it."""

    def __init__(self, pools: HybridPools, eviction: str | EvictionPolicy | None = "lru", salt: bytes = b""):
        self.pools, self.unit, self.salt = pools, pools.block_size, salt
        self.eviction = make_eviction(eviction)
        self.cost = CostModel(pools.config, max(1, pools.pages[0].element_size()) if pools.pages else 2)
        self.entries: dict[bytes, PrefixEntry] = {}
        self.clock = 0
        self.queries = self.query_tokens = self.hit_tokens = self.hits = 0
        self.evicted_pages = self.evicted_snapshots = 0

    # -- lookup --------------------------------------------------------------------------------------------
    def hashes(self, tokens: Sequence[int], extra_keys: Mapping[int, bytes] | None = None) -> list[bytes]:
        """The chained block keys of ``tokens`` under this index (``extra_keys``: see :func:`block_hashes`)."""
        return block_hashes(tokens, self.unit, self.salt, extra_keys=extra_keys)

    def tick(self) -> int:
        """Advance and return the logical clock (recency for eviction)."""
        self.clock += 1
        return self.clock

    def match(self, tokens: Sequence[int], keys: Sequence[bytes] | None = None, record: bool = True) -> PrefixMatch:
        """Longest reusable prefix of ``tokens`` (≤ N−1), plus how far the pages alone match."""
        N = len(tokens)
        keys = self.hashes(tokens) if keys is None else keys
        now = self.tick()
        path: list[PrefixEntry] = []
        for k, key in enumerate(keys):
            if (k + 1) * self.unit > N - 1:
                break
            e = self.entries.get(key)
            if e is None:
                break
            path.append(e)
        best = max((i for i, e in enumerate(path) if e.snapshot is not None), default=-1)
        m = PrefixMatch(kv_len=len(path) * self.unit)
        if best >= 0:
            m.hit_len = path[best].end
            m.pages = [e.page for e in path[:best + 1]]
            m.snapshot = path[best].snapshot
        for e in path[:best + 1]:
            e.last_access = now
        if record:
            self.record(m, N)
        return m

    def record(self, m: PrefixMatch, num_prompt_tokens: int) -> None:
        """Count one lookup in the hit-rate statistics."""
        self.queries += 1
        self.query_tokens += num_prompt_tokens
        self.hit_tokens += m.hit_len
        self.hits += m.hit_len > 0

    # -- insertion (after the forward that wrote the data) -------------------------------------------------
    def insert(self, keys: Sequence[bytes], blocks: Sequence[int], num_blocks: int) -> int:
        """Index the first ``num_blocks`` full pages of a request (``blocks[k]`` holds the tokens of
        ``keys[k]``). Pages already indexed under the same key are kept (the request keeps its own copy).
        Returns how many entries were added."""
        if num_blocks > min(len(keys), len(blocks)):
            raise ValueError(f"insert: {num_blocks} blocks requested, {len(keys)} keys / {len(blocks)} pages given")
        now, added, parent = self.tick(), 0, None
        for k in range(num_blocks):
            e = self.entries.get(keys[k])
            if e is None:
                self.pools.allocator.incref([blocks[k]])
                e = PrefixEntry(keys[k], parent, (k + 1) * self.unit, blocks[k], last_access=now)
                self.entries[keys[k]] = e
                if parent is not None:
                    parent.children += 1
                added += 1
            parent = e
        return added

    def add_snapshot(self, key: bytes, slot: int) -> bool:
        """Attach a written snapshot slot to the entry ``key``. The index takes over the slot's reference on
        success; returns False (the caller frees the slot) when the entry is missing or already has one."""
        e = self.entries.get(key)
        if e is None or e.snapshot is not None:
            return False
        e.snapshot = slot
        e.last_access = self.tick()
        return True

    # -- eviction -------------------------------------------------------------------------------------------
    def _page_candidates(self) -> list[PrefixEntry]:
        alloc = self.pools.allocator
        return [e for e in self.entries.values() if e.children == 0 and alloc.refcount(e.page) == 1]

    def _drop(self, e: PrefixEntry) -> None:
        del self.entries[e.key]
        self.pools.allocator.free([e.page])
        if e.snapshot is not None:
            self.pools.snapshots.free([e.snapshot])
            self.evicted_snapshots += 1
        if e.parent is not None:
            e.parent.children -= 1
        self.evicted_pages += 1

    def evict_pages(self, n: int) -> int:
        """Free up to ``n`` pages held only by the index (leaves first, in the policy's order)."""
        freed = 0
        while freed < n:
            cands = self.eviction.order(self._page_candidates(), self.clock, self.cost)
            if not cands:
                break
            for e in cands:
                if freed >= n:
                    break
                self._drop(e)
                freed += 1
        return freed

    def evict_snapshots(self, n: int) -> int:
        """Free up to ``n`` snapshot slots (the entries stay, as page-only entries)."""
        cands = self.eviction.order([e for e in self.entries.values() if e.snapshot is not None], self.clock,
                                    self.cost)
        freed = 0
        for e in cands[:n]:
            self.pools.snapshots.free([e.snapshot])
            e.snapshot = None
            self.evicted_snapshots += 1
            freed += 1
        return freed

    def make_room(self, pages: int = 0, snapshots: int = 0) -> bool:
        """Evict until ``pages`` latent pages and ``snapshots`` snapshot slots are free; True on success."""
        need_p = pages - self.pools.allocator.num_free
        if need_p > 0:
            self.evict_pages(need_p)
        need_s = snapshots - self.pools.snapshots.num_free
        if need_s > 0:
            self.evict_snapshots(need_s)
        return self.pools.allocator.num_free >= pages and self.pools.snapshots.num_free >= snapshots

    def clear(self) -> None:
        """Drop every entry (pages still used by requests stay allocated to them)."""
        for e in list(self.entries.values()):
            self.pools.allocator.free([e.page])
            if e.snapshot is not None:
                self.pools.snapshots.free([e.snapshot])
        self.entries.clear()

    # -- introspection ------------------------------------------------------------------------------------
    @property
    def hit_rate(self) -> float:
        """Fraction of queried prompt tokens served from the cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def stats(self) -> dict[str, float]:
        """Counters: ``entries``, ``snapshots``, ``queries``, ``hits``, ``hit_tokens``, ``query_tokens``,
        ``token_hit_rate``, ``evicted_pages``, ``evicted_snapshots``."""
        return {"entries": len(self.entries), "snapshots": sum(e.snapshot is not None for e in self.entries.values()),
                "queries": self.queries, "hits": self.hits, "hit_tokens": self.hit_tokens,
                "query_tokens": self.query_tokens, "token_hit_rate": round(self.hit_rate, 4),
                "evicted_pages": self.evicted_pages, "evicted_snapshots": self.evicted_snapshots}

    def check_invariants(self) -> None:
        """Raise AssertionError if the index is inconsistent (tests)."""
        kids: dict[int, int] = {}
        for e in self.entries.values():
            assert e.end % self.unit == 0 and e.end > 0
            assert self.pools.allocator.refcount(e.page) >= 1, f"indexed page {e.page} is free"
            if e.snapshot is not None:
                assert self.pools.snapshots.refcount(e.snapshot) >= 1, f"snapshot {e.snapshot} is free"
            if e.parent is not None:
                assert self.entries.get(e.parent.key) is e.parent, "entry whose parent was evicted"
                assert e.parent.end + self.unit == e.end
                kids[id(e.parent)] = kids.get(id(e.parent), 0) + 1
            else:
                assert e.end == self.unit
        for e in self.entries.values():
            assert e.children == kids.get(id(e), 0), "children count out of sync"
        snaps = [e.snapshot for e in self.entries.values() if e.snapshot is not None]
        assert len(snaps) == len(set(snaps)), "one snapshot slot indexed twice"
