"""Which requests run in the next step, and how many tokens each feeds: the token budget, chunking, admission
order and preemption.

A step's budget is ``max_num_batched_tokens`` tokens. Decodes come first (every running request with one
token left to feed: its pending token, plus its drafts with a drafter), oldest first, each given the pages of
its tokens this step; when the pool runs out the newest running request is **preempted** (preemption by
recompute: what it fed is indexed for reuse, its row and pages are freed, and it is queued at the front to be
recomputed from prompt + output with the same generator). Prefill chunks get what the decodes leave
(:meth:`TokenBudget.prefill`): partial prefills first (FCFS), then waiting requests are admitted while rows, pages
and budget last. A waiting request that does not fit the free pages does not block smaller ones behind it; after a
preemption nothing new is admitted in the same step. A chunk that splits a prompt ends on a page boundary; a step
that already prefills starts no split chunk below 1/16 of the budget (a sliver would cost a forward of its own, the
rows of one forward being right-padded to its longest), and a prompt that overshoots the budget by at most 1/32
is taken whole.

The :class:`Scheduler` owns the queues (``waiting``, ``running``) and the policy; the pages and rows are the
:class:`~k3nn.engine.cache_manager.CacheManager`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .request import Request, RequestStatus

if TYPE_CHECKING:
    from .cache_manager import CacheManager

__all__ = ["Schedule", "Scheduler", "TokenBudget"]


@dataclass(frozen=True)
class TokenBudget:
    """Tokens per step and how the decodes' share is held back from the prefill chunks.

    ``mode="adaptive"``: prefill gets ``max_num_batched_tokens − max(reserve_per_seq · decodes, decode tokens)``
    (a lone request is not cut into several forwards); ``"fixed"``: ``max_num_batched_tokens −
    reserve_per_seq · max_num_seqs`` (a reservation for the largest batch, the pre-adaptive vLLM behaviour). Never
    below ``min_prefill_tokens`` (no starvation)."""

    max_num_batched_tokens: int
    mode: str
    reserve_per_seq: int
    min_prefill_tokens: int
    max_num_seqs: int

    def prefill(self, num_decodes: int, decode_tokens: int = 0) -> int:
        """Tokens left for prefill chunks in a step with ``num_decodes`` decode rows feeding ``decode_tokens``."""
        held = self.max_num_seqs if self.mode == "fixed" else num_decodes
        return max(self.max_num_batched_tokens - max(self.reserve_per_seq * held, decode_tokens),
                   self.min_prefill_tokens)


@dataclass
class Schedule:
    """One step's work: the decode requests, the prefill requests with their chunk lengths, and the waiting
    requests whose admission raised (already out of the queue, nothing held; the engine fails them)."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)


class Scheduler:
    """The waiting and running queues and the step policy of the module docstring.

    ``cache``: what grants rows and pages (:meth:`CacheManager.admit`, :meth:`~CacheManager.grow`,
    :meth:`~CacheManager.free`); ``speculative``: decode rows may carry verify windows (the engine has a
    drafter); ``share_prompts``: the samples of an ``n > 1`` request wait for the sibling prefilling their prompt
    (true with prefix caching: the wait turns the prompt into a hit)."""

    def __init__(self, budget: TokenBudget, cache: CacheManager, *, speculative: bool = False,
                 share_prompts: bool = False):
        self.budget, self.cache = budget, cache
        self.speculative, self.share_prompts = speculative, share_prompts
        self.block_size = cache.pools.block_size
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admission order (includes PREFILLED requests held for export)
        self.num_preemptions = 0
        self.stall: str | None = None  # why the last admission this step was refused

    # -- per request ---------------------------------------------------------------------------------------------
    def draft_len(self, req: Request) -> int:
        """Drafts this decode row may verify: its ``num_speculative_tokens``, at most one less than the tokens it
        may still emit (the target's own token always follows the accepted drafts)."""
        if not self.speculative or req.num_spec <= 0:
            return 0
        return max(0, min(req.num_spec, req.params.max_new_tokens - len(req.output) - 1))

    def chunk(self, req: Request, budget: int) -> int:
        """Tokens ``req`` feeds this step within ``budget``; a chunk that does not finish the prompt ends on a page
        boundary when one lies inside it. A prompt that overshoots the budget by at most 1/32 of it is taken
        whole (rather than leaving a sliver of a few tokens for a forward of its own next step)."""
        rem = req.remaining
        if rem <= budget + budget // 32:
            return rem
        n = min(rem, budget)
        if n < rem:
            U = self.block_size
            end = (req.num_computed + n) // U * U
            if end > req.num_computed:
                n = end - req.num_computed
        return n

    def _sibling_prefilling(self, req: Request) -> bool:
        """``req`` is a sample of an n > 1 request whose sibling is still prefilling the shared prompt."""
        if not self.share_prompts or req.parent is None or req.output or req.num_prompt_tokens <= self.block_size:
            return False
        return any(q.parent == req.parent and q.status == RequestStatus.RUNNING and q.remaining > 1
                   for q in self.running)

    # -- preemption ----------------------------------------------------------------------------------------------
    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make ``req``'s pages cover ``num_tokens`` tokens, preempting the newest running request (``req`` itself
        when it is the newest) while the cache cannot. Returns False when ``req`` itself was preempted."""
        while not self.cache.grow(req, num_tokens):
            victim = next((q for q in reversed(self.running) if q.status == RequestStatus.RUNNING and q is not req),
                          None)
            if victim is None or self.running.index(victim) < self.running.index(req):
                self.preempt(req)
                return False
            self.preempt(victim)
        return True

    def preempt(self, req: Request) -> None:
        """Preemption by recompute: index what ``req`` fed (so its recompute may hit the prefix index), free its
        row, pages and snapshots, and queue it at the front; it resumes from prompt + output with the same
        generator (identical output)."""
        self.cache.retain_finished(req)
        self.cache.free(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed = req.indexed_blocks = 0
        req.plan = []
        req.clear_drafts()
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    # -- the step ------------------------------------------------------------------------------------------------
    def schedule(self) -> Schedule:
        """This step's decodes and prefill chunks (see the module docstring)."""
        self.stall = None
        out = Schedule()
        active = [r for r in self.running if r.status == RequestStatus.RUNNING]
        preempted = self.num_preemptions
        for r in [r for r in active if r.remaining == 1]:
            if r.status == RequestStatus.RUNNING:  # an earlier decode's growth may have preempted it
                self._grow(r, r.num_computed + 1 + self.draft_len(r))
        active = [r for r in active if r.status == RequestStatus.RUNNING]
        out.decodes = [r for r in active if r.remaining == 1]
        budget = self.budget.prefill(len(out.decodes), sum(1 + self.draft_len(r) for r in out.decodes))
        # a chunk that leaves its prompt unfinished is worth a forward slot only from this size on (a step that
        # already prefills does not start one smaller: the next step gives it a full share)
        floor = max(self.block_size, self.budget.max_num_batched_tokens // 16)

        def worth(r: Request, n: int) -> bool:
            return n >= r.remaining or n >= floor or not out.prefills

        for r in active:
            if r.remaining > 1 and budget > 0:
                n = self.chunk(r, budget)
                if worth(r, n):
                    out.prefills.append((r, n))
                    budget -= n
        i = 0
        while i < len(self.waiting) and budget > 0 and self.num_preemptions == preempted:
            if not worth(self.waiting[i], self.chunk(self.waiting[i], budget)):
                break  # admitted next step with a useful chunk
            req = self.waiting[i]
            if self._sibling_prefilling(req):
                i += 1  # a sibling sample is computing the same prompt: wait one step and share its pages
                continue
            try:
                refused = self.cache.admit(req)
            except Exception as e:  # this request's admission (prefix match, retention plan): it alone fails
                self.waiting.pop(i)
                self.cache.free(req)
                out.failed.append((req, e))
                continue
            if refused is not None:
                self.stall = refused
                if self.cache.free_row() is None:
                    break
                i += 1  # too large for the free pages now: smaller requests behind it may fit
                continue
            self.waiting.pop(i)
            self.running.append(req)
            if req.prefill_only and req.remaining <= 0:
                req.status = RequestStatus.PREFILLED
                continue
            req.status = RequestStatus.RUNNING
            if req.remaining == 1:
                if self._grow(req, req.num_computed + 1 + self.draft_len(req)):
                    out.decodes.append(req)
            else:
                n = self.chunk(req, budget)
                out.prefills.append((req, n))
                budget -= n
        return out
