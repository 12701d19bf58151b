"""The scheduler on its own: the token budget, page-aligned chunks, admission that skips a request too large for
the free pages, and preemption of the newest running request (on a CacheManager over real pools, no model)."""

import torch

from k3nn.cache.paged import HybridPools
from k3nn.engine import RequestStatus, SamplingParams
from k3nn.engine.cache_manager import CacheManager
from k3nn.engine.request import Request
from k3nn.engine.scheduler import Scheduler, TokenBudget

from engine_helpers import CFG, rand_ids


def test_token_budget_adaptive_and_fixed():
    a = TokenBudget(100, "adaptive", 1, 8, 4)
    assert (a.prefill(0), a.prefill(3), a.prefill(3, 30), a.prefill(3, 99)) == (100, 97, 70, 8)
    f = TokenBudget(100, "fixed", 2, 8, 4)
    assert f.prefill(0) == f.prefill(3) == 92 and f.prefill(1, 50) == 50


def scheduler(num_pages, rows=2, budget=1000):
    pools = HybridPools(CFG, num_pages, rows, 1, torch.float32, "cpu")
    cache = CacheManager(pools, None, None, watermark=0.0, retain_decode_state=False)
    return Scheduler(TokenBudget(budget, "adaptive", 1, 8, rows), cache), cache


def request(rid, n, new=8):
    return Request(rid, rand_ids(n, len(rid)), SamplingParams(max_new_tokens=new))


def test_chunks_end_on_a_page_boundary_and_a_large_request_does_not_block_smaller_ones():
    s, cache = scheduler(num_pages=4, rows=3, budget=100)
    big, mid, small = request("big", 300), request("mid", 150), request("small", 30)
    s.waiting += [big, mid, small]
    plan = s.schedule()
    # big needs 5 pages of 4: skipped; mid's 100-token chunk is cut back to the page boundary at 64; small's
    # whole prompt fits the 36 tokens left
    assert plan.prefills == [(mid, 64), (small, 30)] and not plan.decodes and not plan.failed
    assert s.waiting == [big] and "needs 5 free latent pages" in s.stall
    assert [len(r.blocks) for r in (mid, small)] == [3, 1] and cache.pools.allocator.num_free == 0
    assert all(r.status == RequestStatus.RUNNING and cache.row_owner[r.row] is r for r in (mid, small))


def test_no_sliver_chunks_and_a_small_overshoot_takes_the_prompt_whole():
    """A step that already prefills starts no split chunk below max(page, budget / 16): the 36 tokens left after
    mid's chunk would split small's 40-token prompt, so small waits for the next step; a prompt within 1/32 over
    the budget is taken whole rather than leaving a few tokens for a forward of their own."""
    s, cache = scheduler(num_pages=8, rows=3, budget=100)
    mid, small = request("mid", 150), request("small", 40)
    s.waiting += [mid, small]
    assert s.schedule().prefills == [(mid, 64)] and s.waiting == [small]
    mid.num_computed = 64
    assert s.schedule().prefills == [(mid, 86)] and s.waiting == [small]  # 86 tokens finish mid: within budget
    mid.num_computed = 150
    mid.output = [1]
    plan = s.schedule()
    assert plan.decodes == [mid] and plan.prefills == [(small, 40)]
    s2, _ = scheduler(num_pages=8, rows=2, budget=100)
    over = request("over", 103)
    s2.waiting.append(over)
    assert s2.schedule().prefills == [(over, 103)]
    assert s.chunk(request("long", 200), 100) == 64  # a split still ends on a page boundary


def test_the_newest_running_request_is_preempted_when_the_pool_runs_out():
    s, cache = scheduler(num_pages=3, rows=2)
    old, new = request("old", 64), request("new", 64)
    s.waiting += [old, new]
    s.schedule()
    assert [len(r.blocks) for r in (old, new)] == [1, 1]
    for r in (old, new):  # both prefilled their prompt and sampled a token: each needs a second page to decode
        r.num_computed, r.output = 64, [1]
    plan = s.schedule()
    assert plan.decodes == [old] and len(old.blocks) == 2
    assert s.waiting == [new] and new.status == RequestStatus.WAITING and new.num_preemptions == 1
    assert new.row is None and not new.blocks and new.num_computed == 0 and s.num_preemptions == 1
    assert cache.pools.allocator.num_free == 1 and s.running == [old]
