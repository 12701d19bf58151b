"""Prefix index against a pure-Python model (state machine), the N−1 rule, retention and eviction policies."""

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from k3nn import KimiK3Config
from k3nn.cache.paged import HybridPools
from k3nn.cache.prefix import PrefixCache, block_hashes
from k3nn.cache.retention import (LRU, CostModel, Interval, Marconi, MarconiEviction, PlanInput, PromptBoundaries,
                                  ReplayBoundary, make_eviction, make_retention)

CFG = KimiK3Config.tiny()
U = 64


def tokens(symbols, tail=0):
    """A prompt made of 64-token blocks, block i = [symbols[i]] * 64 (so prefixes are shared), plus a tail."""
    out = [s for s in symbols for _ in range(U)]
    return out + [255] * tail


def pools(num_pages=12, num_snapshots=4):
    return HybridPools(CFG, num_pages=num_pages, max_running=1, num_snapshots=num_snapshots, dtype=torch.float32)


class PrefixIndexMachine(RuleBasedStateMachine):
    """Model: the set of indexed prefixes (tuples of block symbols), the subset with a snapshot, and pages held
    by running requests. Lookups must agree with the model; evictions must keep the index prefix-closed and
    never drop a held page."""

    def __init__(self):
        super().__init__()
        self.pools = pools()
        self.cache = PrefixCache(self.pools, "lru")
        self.indexed: set[tuple] = set()
        self.snap: set[tuple] = set()
        self.holds: list[list[int]] = []

    seqs = st.lists(st.integers(0, 2), min_size=1, max_size=4).map(tuple)

    def _sync(self):
        return {self._symbols(e) for e in self.cache.entries.values()}

    def _after_make_room(self):
        """make_room() may evict: the index may only shrink (prefix-closed, checked by the invariant)."""
        now = self._sync()
        snaps = {self._symbols(e) for e in self.cache.entries.values() if e.snapshot is not None}
        assert now <= self.indexed and snaps <= self.snap
        self.indexed, self.snap = now, snaps

    def _symbols(self, e):
        out = []
        while e is not None:
            out.append(e.key)
            e = e.parent
        return tuple(self._key_sym[k] for k in reversed(out))

    _key_sym: dict = {}

    def _keys(self, seq):
        keys = block_hashes(tokens(seq))
        for k, s in zip(keys, seq):
            self._key_sym[k] = s
        return keys

    @rule(seq=seqs)
    def insert(self, seq):
        keys = self._keys(seq)
        need = len(seq)
        if self.pools.allocator.num_free < need:
            ok = self.cache.make_room(pages=need)
            self._after_make_room()
            if not ok:
                return
        blocks = self.pools.allocator.allocate(need)
        self.cache.insert(keys, blocks, need)
        self.pools.allocator.free(blocks)  # the request finished: only the index keeps pages
        for k in range(1, len(seq) + 1):
            self.indexed.add(seq[:k])

    @rule(seq=seqs, k=st.integers(1, 4))
    def snapshot(self, seq, k):
        k = min(k, len(seq))
        keys = self._keys(seq)
        if self.pools.snapshots.num_free == 0:
            ok = self.cache.make_room(snapshots=1)
            self._after_make_room()
            if not ok:
                return
        slot = self.pools.snapshots.allocate(1)[0]
        ok = self.cache.add_snapshot(keys[k - 1], slot)
        expect = seq[:k] in self.indexed and seq[:k] not in self.snap
        assert ok == expect
        if ok:
            self.snap.add(seq[:k])
        else:
            self.pools.snapshots.free([slot])

    @rule(seq=seqs, tail=st.integers(0, 2))
    def match(self, seq, tail):
        toks = tokens(seq, tail)
        m = self.cache.match(toks, self._keys(seq), record=True)
        usable = [k for k in range(1, len(seq) + 1) if k * U <= len(toks) - 1]
        kv = 0
        for k in usable:
            if seq[:k] not in self.indexed:
                break
            kv = k
        hit = max((k for k in range(1, kv + 1) if seq[:k] in self.snap), default=0)
        assert m.kv_len == kv * U
        assert m.hit_len == hit * U
        assert len(m.pages) == hit and (m.snapshot is not None) == (hit > 0)

    @rule(seq=seqs)
    def hold(self, seq):
        m = self.cache.match(tokens(seq, 1), self._keys(seq), record=False)
        pages = [self.cache.entries[k].page for k in self._keys(seq)[:m.kv_len // U]]
        self.pools.allocator.incref(pages)
        self.holds.append(pages)

    @precondition(lambda self: self.holds)
    @rule()
    def release(self):
        self.pools.allocator.free(self.holds.pop())

    @rule(n=st.integers(1, 5))
    def evict_pages(self, n):
        held = {p for h in self.holds for p in h}
        before = {e.page for e in self.cache.entries.values()}
        freed = self.cache.evict_pages(n)
        after_sets = self._sync()
        assert after_sets <= self.indexed
        assert len(self.indexed) - len(after_sets) == freed <= n
        gone = before - {e.page for e in self.cache.entries.values()}
        assert not gone & held, "evicted a page a running request holds"
        self.indexed = after_sets
        self.snap &= after_sets

    @rule(n=st.integers(1, 3))
    def evict_snapshots(self, n):
        freed = self.cache.evict_snapshots(n)
        now = {self._symbols(e) for e in self.cache.entries.values() if e.snapshot is not None}
        assert now <= self.snap and len(self.snap) - len(now) == freed
        self.snap = now

    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        assert self._sync() == self.indexed
        for s in self.indexed:  # prefix-closed
            assert all(s[:k] in self.indexed for k in range(1, len(s)))
        refs = {}
        for e in self.cache.entries.values():
            refs[e.page] = refs.get(e.page, 0) + 1
        for h in self.holds:
            for p in h:
                refs[p] = refs.get(p, 0) + 1
        alloc = self.pools.allocator
        assert all(alloc.refcount(p) == c for p, c in refs.items())
        assert alloc.num_free == alloc.num_blocks - len(refs)
        n_snap = sum(e.snapshot is not None for e in self.cache.entries.values())
        assert self.pools.snapshots.num_free == self.pools.snapshots.num_slots - n_snap


PrefixIndexMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
TestPrefixIndex = PrefixIndexMachine.TestCase


def test_hashes_are_chained_and_deterministic():
    a = block_hashes(tokens([0, 1]))
    b = block_hashes(tokens([1, 1]))
    assert a == block_hashes(tokens([0, 1], tail=5)) and len(a) == 2
    assert a[1] != b[1]  # same block, different prefix → different key
    assert block_hashes(tokens([0]), salt=b"lora") != block_hashes(tokens([0]))


def test_last_prompt_token_is_never_reused():
    """A prompt that is an exact multiple of the block with a snapshot at N: the hit is capped at N−1 (the
    previous boundary), never N."""
    p = pools()
    c = PrefixCache(p)
    seq = [0, 1]
    keys = block_hashes(tokens(seq))
    blocks = p.allocator.allocate(2)
    c.insert(keys, blocks, 2)
    for k in keys:
        c.add_snapshot(k, p.snapshots.allocate(1)[0])
    assert c.match(tokens(seq)).hit_len == 64  # N = 128: cap at 127 → 64
    assert c.match(tokens(seq, tail=1)).hit_len == 128
    assert c.match(tokens([0], tail=0)).hit_len == 0  # N = 64: nothing reusable


def test_retention_policies_plan_aligned_positions():
    inp = PlanInput(num_prompt_tokens=300, hit_len=64, kv_len=256, boundaries=[100, 250])
    assert ReplayBoundary().plan(inp) == [256]
    assert Interval(128).plan(inp) == [128, 256]
    assert PromptBoundaries().plan(inp) == [192]  # 100 → 64 (already cached), 250 → 192
    assert Marconi().plan(inp) == [256]
    assert Marconi().plan(PlanInput(300, hit_len=192, kv_len=240)) == []  # gap < U: no second hit
    assert (ReplayBoundary() + Interval(64)).plan(PlanInput(200)) == [64, 128, 192]
    assert make_retention("none").plan(inp) == []
    assert make_retention("interval:128").plan(PlanInput(129)) == [128]
    with pytest.raises(ValueError, match="multiple of 64"):
        Interval(100)
    with pytest.raises(ValueError, match="outside the prompt"):
        PromptBoundaries().plan(PlanInput(10, boundaries=[11]))
    with pytest.raises(ValueError, match="unknown retention"):
        make_retention("sometimes")


def test_lru_evicts_oldest_leaf_and_marconi_prefers_flop_efficient_entries():
    p = pools(num_pages=12, num_snapshots=4)
    c = PrefixCache(p, "lru")
    for sym in range(3):  # three one-block prefixes, then touch the first
        b = p.allocator.allocate(1)
        c.insert(block_hashes(tokens([sym])), b, 1)
        p.allocator.free(b)
    c.match(tokens([0], tail=1))  # no snapshot: nothing refreshed (LRU refreshes the reused path only)
    k0 = block_hashes(tokens([0]))[0]
    c.add_snapshot(k0, p.snapshots.allocate(1)[0])
    c.match(tokens([0], tail=1))
    assert c.evict_pages(1) == 1
    assert k0 in c.entries and block_hashes(tokens([1]))[0] not in c.entries

    cost = CostModel(CFG, 4)
    assert cost.saved(0, 4096) > 4 * cost.saved(0, 1024)  # superlinear in length (attention)
    q = pools(num_pages=12, num_snapshots=4)
    m = PrefixCache(q, MarconiEviction(alpha=2.0))
    long_seq, short_seq = [1, 1, 1, 1], [2]
    for seq in (long_seq, short_seq):
        b = q.allocator.allocate(len(seq))
        keys = block_hashes(tokens(seq))
        m.insert(keys, b, len(seq))
        q.allocator.free(b)
        m.add_snapshot(keys[-1], q.snapshots.allocate(1)[0])
    # the short prefix is more recent, but the long one saves far more FLOPs per byte: evict the short one
    m.evict_snapshots(1)
    assert m.entries[block_hashes(tokens(long_seq))[-1]].snapshot is not None
    assert m.entries[block_hashes(tokens(short_seq))[0]].snapshot is None
    assert isinstance(make_eviction("lru"), LRU) and make_eviction("marconi:0.5").alpha == 0.5
    with pytest.raises(ValueError, match="unknown eviction"):
        make_eviction("fifo")
