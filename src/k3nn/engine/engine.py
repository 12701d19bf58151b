"""In-process continuous batching over the paged hybrid cache.

One :meth:`Engine.step`:

1. **Schedule** (token budget per step): every request with one token left to feed (decodes, and prompts
   whose last token is all that is left) gets 1 token first; the prefill budget is what remains —
   ``adaptive``: ``max_num_batched_tokens − reserve_per_seq · (running decodes)`` (so a lone request is not
   cut into several forwards); ``fixed``: ``max_num_batched_tokens − reserve_per_seq · max_num_seqs``
   (a reservation for the largest batch, the pre-adaptive vLLM behaviour). Partial prefills continue first
   (FCFS), then waiting requests are admitted while rows, pages and budget last. A split chunk ends on a
   64-token boundary.
2. **Admit**: prefix lookup (pages + KDA snapshot at L ≤ N−1), copy the snapshot into the request's running row
   (copy-on-write), share the pages, allocate the rest of the prompt + max_new_tokens up front (so a running
   request never runs out: nothing running is ever evicted), plan snapshot positions (retention policy).
3. **Lay out** running rows so the decode batch is rows ``[0, D)`` and the prefill batch ``[D, D+P)``: the KDA
   layers then read/write contiguous slices. Rows move only when the membership changes (arrivals,
   completions), not per layer or per forward.
4. **Run** one mixed forward ``[D + P, T]`` when the prefill chunks are short (≤ ``mixed_forward_max_tokens``),
   else two (decodes ``[D, 1]``, then prefills ``[P, T]``); rows are right-padded and the KDA state of a short
   row, like every planned snapshot, is exported inside the same pass. Sample, then **commit**: index the new full pages and
   snapshots (visible to lookups from the next step on), finish requests, free their rows and pages.

Failures: :meth:`Engine.add_request` checks every argument (nothing is queued on error); inside a step, an error
that belongs to one request (admission, snapshot plan, sampling — NaN logits included —, stop check, commit) ends
that request FAILED with its reason, an error in a forward ends the requests of that forward, and the engine
keeps serving the rest; :meth:`Engine.stream` raises :class:`EngineStalledError` rather than spin when nothing
can progress.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from ..cache.hybrid import CacheFullError
from ..cache.paged import HybridPools, PagedHybridCache, enable_state_capture, pool_sizes_for_budget
from ..cache.prefix import PrefixCache, PrefixMatch, block_hashes
from ..cache.retention import EvictionPolicy, PlanInput, RetentionPolicy, make_retention
from ..generation import GenerationConfig
from ..logits import LogitsPipeline
from .request import Request, RequestOutput, RequestStatus, SamplingParams, _int

__all__ = ["Engine", "EngineConfig", "EngineStalledError", "RequestFailedError"]

_DONE = (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED)


class EngineStalledError(RuntimeError):
    """:meth:`Engine.stream` found requests waiting that no step can ever admit (nothing running would free a
    row or pages): e.g. every row or the pages are held by prefilled requests awaiting export."""


class RequestFailedError(RuntimeError):
    """:meth:`Engine.generate`: some of its requests failed inside ``step()`` (the others completed);
    ``failures`` maps request id → reason."""

    def __init__(self, failures: dict[str, str]):
        self.failures = failures
        super().__init__("request(s) failed: " + "; ".join(f"{k!r}: {v}" for k, v in failures.items()))


@dataclass
class EngineConfig:
    max_num_seqs: int = 8  # running rows (KDA running slots)
    num_pages: int | None = 512  # latent pages of 64 tokens (None: from cache_memory_bytes)
    num_snapshots: int | None = 32  # KDA snapshot slots for the prefix cache
    cache_memory_bytes: int | None = None  # alternative sizing: split this budget (see pool_sizes_for_budget)
    max_num_batched_tokens: int = 8192
    budget: str = "adaptive"  # "adaptive" | "fixed"
    reserve_per_seq: int = 1  # tokens reserved per decode (1 + speculative tokens)
    min_prefill_tokens: int = 64  # the prefill budget never drops below this (no starvation)
    mixed_forward_max_tokens: int = 16  # prefill chunks up to this run in the decodes' forward (right-padded)
    retain_decode_state: bool = True  # index prompt + answer and the last 64-aligned decode state on finish
    enable_prefix_caching: bool = True
    retention: str | RetentionPolicy | None = "marconi"
    eviction: str | EvictionPolicy | None = "lru"
    pad_token_id: int = 0

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.budget not in ("adaptive", "fixed"):
            raise ValueError(f"budget must be 'adaptive' or 'fixed', got {self.budget!r}")
        if self.max_num_batched_tokens < 1 or self.reserve_per_seq < 1 or self.min_prefill_tokens < 1:
            raise ValueError("max_num_batched_tokens, reserve_per_seq and min_prefill_tokens must be >= 1")
        if self.num_pages is None and self.cache_memory_bytes is None:
            raise ValueError("give num_pages (and num_snapshots) or cache_memory_bytes")


class Engine:
    """Continuous-batching generation for a :class:`k3nn.KimiK3` on one device.

    ``add_request(prompt_ids, ...)`` → id; ``step()`` → list of :class:`RequestOutput` (new tokens per request);
    ``stream()`` steps until every request finished; ``generate(prompts)`` → outputs in order; ``metrics()``.
    """

    def __init__(self, model, config: EngineConfig | None = None, **overrides):
        cfg = config or EngineConfig()
        if overrides:
            cfg = EngineConfig(**{**cfg.__dict__, **overrides})
        cfg.validate()
        self.model, self.config, self.mcfg = model, cfg, model.config
        dtype, device = model.dtype, model.device
        if cfg.num_pages is not None:
            num_pages, num_snaps = cfg.num_pages, cfg.num_snapshots or 1
        else:
            num_pages, num_snaps = pool_sizes_for_budget(self.mcfg, cfg.cache_memory_bytes, cfg.max_num_seqs,
                                                         dtype=dtype)
        self.pools = HybridPools(self.mcfg, num_pages, cfg.max_num_seqs, num_snaps, dtype, device)
        self.prefix = PrefixCache(self.pools, cfg.eviction) if cfg.enable_prefix_caching else None
        self.retention = make_retention(cfg.retention)
        if cfg.budget == "fixed" and cfg.max_num_batched_tokens - cfg.reserve_per_seq * cfg.max_num_seqs < 1:
            raise ValueError("budget='fixed': max_num_batched_tokens must exceed reserve_per_seq · max_num_seqs")
        enable_state_capture(model)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admission order (includes PREFILLED requests held for export)
        self.requests: dict[str, Request] = {}
        self.row_owner: list[Request | None] = [None] * cfg.max_num_seqs
        self._ids = itertools.count()
        self.num_steps = self.num_forwards = self.rows_moved = 0
        self.prompt_tokens = self.generated_tokens = self.computed_prompt_tokens = 0
        self.start_time: float | None = None
        self._failed_outputs: list[RequestOutput] = []  # failures outside a forward, reported by the next step()
        self._stall: str | None = None  # why the last admission attempt was refused (for EngineStalledError)

    # -- requests --------------------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int] | torch.Tensor, params: SamplingParams | None = None, *,
                    request_id: str | None = None, boundaries: Sequence[int] = (), prefill_only: bool = False,
                    **sampling) -> str:
        """Queue a prompt (token ids). ``boundaries``: prompt positions worth a KDA snapshot (turn ends);
        ``prefill_only``: compute N−1 tokens and hold the state for :func:`k3nn.cache.transfer.export_request_state`.

        Everything is checked here (TypeError for a wrong type, ValueError / CacheFullError for a value out of
        range, each naming the argument); on error nothing is queued."""
        req = self._make_request(prompt, params, request_id, boundaries, prefill_only, sampling)
        self._enqueue(req)
        return req.request_id

    def _make_request(self, prompt, params, request_id, boundaries, prefill_only, sampling,
                      taken: frozenset[str] = frozenset()) -> Request:
        """A validated, unregistered :class:`Request` (no engine state changes except the id counter)."""
        prompt = self._token_ids(prompt)
        if params is not None and sampling:
            raise TypeError("give a SamplingParams or sampling keyword arguments, not both")
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params = params or SamplingParams(**sampling)
        params.validate()
        if not isinstance(prefill_only, bool):
            raise TypeError(f"prefill_only must be a bool, got {type(prefill_only).__name__}")
        if isinstance(boundaries, (str, bytes, torch.Tensor)) or not isinstance(boundaries, Sequence):
            raise TypeError(f"boundaries must be a sequence of ints, got {type(boundaries).__name__}")
        bounds = [_int("boundaries", b, lo=0, hi=len(prompt)) for b in boundaries]
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests or rid in taken:
            raise ValueError(f"request id {rid!r} is already in use")
        need = self.pools.pages_for(self._cache_tokens(len(prompt), params, prefill_only))
        if need > self.pools.allocator.num_blocks:
            raise CacheFullError(f"request {rid!r} needs {need} latent pages (prompt {len(prompt)} + "
                                 f"{params.max_new_tokens} new tokens) but the pool has "
                                 f"{self.pools.allocator.num_blocks}; create the engine with more num_pages")
        req = Request(rid, prompt, params, boundaries=bounds, prefill_only=prefill_only)
        req.eos_ids = self._eos_ids(params)
        req.generator = self._generator(params)
        if self.prefix is not None:
            req.keys = self.prefix.hashes(prompt)
        return req

    def _token_ids(self, prompt) -> list[int]:
        """Prompt token ids as a list of ints in [0, vocab_size): no floats, bools or strings."""
        if isinstance(prompt, np.ndarray):
            prompt = torch.from_numpy(prompt) if prompt.dtype.kind in "iub" else prompt.tolist()
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1:
                raise ValueError(f"prompt must be a 1-D tensor of token ids, got shape {tuple(prompt.shape)}")
            if prompt.dtype == torch.bool or prompt.is_floating_point() or prompt.is_complex():
                raise TypeError(f"prompt must be an integer tensor of token ids, got dtype {prompt.dtype}")
            prompt = prompt.tolist()
        elif isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(f"prompt must be a sequence of token ids (ints) or a 1-D integer tensor, "
                            f"got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError("prompt is empty: a request needs at least one token")
        ids = []
        for i, t in enumerate(prompt):
            try:
                ids.append(_int(f"prompt[{i}]", t))
            except TypeError as e:
                raise TypeError(f"prompt must hold token ids (ints): {e}") from None
        V = self.mcfg.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt has token ids outside [0, vocab_size={V}): {bad[:8]}")
        return ids

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        """A sampling request's generator: ``seed`` when set (reproducible), else fresh OS randomness (an unset
        seed never means the same samples for every request)."""
        if not params.do_sample:
            return None
        g = torch.Generator(device=self.pools.device)
        if params.seed is None:
            g.seed()
        else:
            g.manual_seed(int(params.seed))
        return g

    def _enqueue(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.prompt_tokens += len(req.prompt)
        if self.start_time is None:
            self.start_time = time.perf_counter()

    @staticmethod
    def _cache_tokens(n_prompt: int, params: SamplingParams, prefill_only: bool) -> int:
        return max(n_prompt - 1, 1) if prefill_only else n_prompt + params.max_new_tokens - 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(r.status == RequestStatus.RUNNING for r in self.running)

    def _get(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request id {request_id!r}")
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a waiting, running or prefilled request and free its row and pages; returns whether it was live.
        A request that already ended (finished, aborted, failed) is left as it is."""
        req = self._get(request_id)
        if req.status in _DONE:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req, RequestStatus.ABORTED, "abort")
        return True

    def release(self, request_id: str) -> None:
        """Free a PREFILLED (exported) request's row and pages."""
        req = self._get(request_id)
        if req.status != RequestStatus.PREFILLED:
            raise ValueError(f"request {request_id!r} is {req.status.value}, not prefilled")
        self._release(req, RequestStatus.FINISHED, "exported")

    def _release(self, req: Request, status: RequestStatus, reason: str) -> None:
        if req.decode_snap is not None:
            self.pools.snapshots.free([req.decode_snap[1]])
            req.decode_snap = None
        if req.row is not None:
            self.row_owner[req.row] = None
            req.row = None
        if req.blocks:
            self.pools.allocator.free(req.blocks)
            req.blocks = []
        if req in self.running:
            self.running.remove(req)
        req.status, req.finish_reason = status, req.finish_reason or reason
        req.finish_time = time.perf_counter()

    def _fail(self, req: Request, exc: BaseException, where: str) -> RequestOutput:
        """End one request on an error: free its row, pages and private snapshot; the output that reports it."""
        if req in self.waiting:
            self.waiting.remove(req)
        req.finish_reason = "error"
        req.error = f"{where}: {type(exc).__name__}: {exc}"
        self._release(req, RequestStatus.FAILED, "error")
        return RequestOutput(req.request_id, [], True, "error", list(req.output), req.error)

    # -- admission ---------------------------------------------------------------------------------------------
    def _free_row(self) -> int | None:
        for r, o in enumerate(self.row_owner):
            if o is None:
                return r
        return None

    def _admit(self, req: Request) -> bool:
        row = self._free_row()
        if row is None:
            self._stall = f"all {len(self.row_owner)} running rows are held"
            return False
        N = req.num_prompt_tokens
        m = self.prefix.match(req.prompt, req.keys, record=False) if self.prefix is not None else PrefixMatch()
        total = self.pools.pages_for(self._cache_tokens(N, req.params, req.prefill_only))
        need = max(total - len(m.pages), 0)
        alloc = self.pools.allocator
        alloc.incref(m.pages)
        req.blocks = list(m.pages)  # owned from here on: _release frees them if anything below fails
        if alloc.num_free < need and self.prefix is not None:
            self.prefix.make_room(pages=need)
        if alloc.num_free < need:
            alloc.free(m.pages)
            req.blocks = []
            self._stall = (f"request {req.request_id!r} needs {need} free latent pages, {alloc.num_free} of "
                           f"{alloc.num_blocks} are free and nothing is running that would release more")
            return False
        req.blocks += alloc.allocate(need)
        req.row = row
        self.row_owner[row] = req
        if m.snapshot is not None:
            self.pools.running.copy_([row], self.pools.snapshots, [m.snapshot])  # copy-on-write
        else:
            self.pools.running.zero_([row])
        req.num_computed = req.hit_len = m.hit_len
        req.kv_len = m.kv_len
        req.indexed_blocks = len(m.pages)
        if self.prefix is not None:
            self.prefix.record(m, N)
            req.plan = self.retention.plan(PlanInput(N, m.hit_len, m.kv_len, req.boundaries, self.pools.block_size))
        self.computed_prompt_tokens += N - m.hit_len
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if req.prefill_only and req.remaining <= 0:
            req.status = RequestStatus.PREFILLED
        return True

    def adopt(self, prompt: Sequence[int], num_computed: int, pages: Sequence[torch.Tensor],
              recurrent: Sequence[torch.Tensor], conv: Sequence[torch.Tensor], params: SamplingParams | None = None,
              request_id: str | None = None) -> str:
        """Start a request from a transferred state: ``num_computed`` prompt tokens are already done (their latent
        pages ``pages`` [n_pages, 64, D] per MLA layer, KDA state per KDA layer). The next step recomputes the
        rest of the prompt (normally its last token, as a decode row) and generates."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        prompt = self._token_ids(prompt)
        num_computed = _int("num_computed", num_computed)
        if not 0 <= num_computed < len(prompt):
            raise ValueError(f"adopt: num_computed must be in [0, {len(prompt)}), got {num_computed}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        row = self._free_row()
        if row is None:
            raise CacheFullError(f"adopt: all {len(self.row_owner)} running rows are busy")
        n_src = self.pools.pages_for(num_computed)
        total = self.pools.pages_for(self._cache_tokens(len(prompt), params, False))
        if self.pools.allocator.num_free < total and self.prefix is not None:
            self.prefix.make_room(pages=total)
        blocks = self.pools.allocator.allocate(total)
        if n_src:
            self.pools.write_pages(blocks[:n_src], [p[:n_src] for p in pages])
        self.pools.running.write(row, recurrent, conv)
        req = Request(rid, prompt, params, status=RequestStatus.RUNNING, row=row, blocks=blocks,
                      num_computed=num_computed)
        req.generator = self._generator(params)
        if self.prefix is not None:
            req.keys = self.prefix.hashes(prompt)
        self.row_owner[row] = req
        self.requests[rid] = req
        self.running.append(req)
        self.prompt_tokens += len(prompt)
        self.computed_prompt_tokens += len(prompt) - num_computed
        if self.start_time is None:
            self.start_time = time.perf_counter()
        return rid

    # -- scheduling ---------------------------------------------------------------------------------------------
    def prefill_budget(self, num_decodes: int) -> int:
        c = self.config
        held = c.max_num_seqs if c.budget == "fixed" else num_decodes
        return max(c.max_num_batched_tokens - c.reserve_per_seq * held, c.min_prefill_tokens)

    def _chunk(self, req: Request, budget: int) -> int:
        rem = req.remaining
        n = min(rem, budget)
        if n < rem:
            U = self.pools.block_size
            end = (req.num_computed + n) // U * U
            if end > req.num_computed:
                n = end - req.num_computed
        return n

    def schedule(self) -> tuple[list[Request], list[tuple[Request, int]]]:
        """Decide this step's work: (decode requests, [(prefill request, tokens)])."""
        active = [r for r in self.running if r.status == RequestStatus.RUNNING]
        decodes = [r for r in active if r.remaining == 1]
        budget = self.prefill_budget(len(decodes))
        prefills: list[tuple[Request, int]] = []
        for r in active:
            if r.remaining > 1 and budget > 0:
                n = self._chunk(r, budget)
                prefills.append((r, n))
                budget -= n
        while self.waiting and budget > 0:
            req = self.waiting[0]
            try:
                admitted = self._admit(req)
            except Exception as e:  # this request's admission (prefix match, retention plan): fail it alone
                self._failed_outputs.append(self._fail(req, e, "admission"))
                continue
            if not admitted:
                break
            self.waiting.pop(0)
            if req.status != RequestStatus.RUNNING:
                continue
            if req.remaining == 1:
                decodes.append(req)
            else:
                n = self._chunk(req, budget)
                prefills.append((req, n))
                budget -= n
        return decodes, prefills

    def _layout(self, groups: Sequence[Sequence[Request]]) -> None:
        """Move running rows so the groups occupy consecutive rows in order: [0, |g0|), [|g0|, |g0|+|g1|), ..."""
        target: dict[int, int] = {}
        r = 0
        for g in groups:
            for req in sorted(g, key=lambda q: q.row):
                target[id(req)] = r
                r += 1
        lo = set(range(r))
        others = [q for q in self.running if id(q) not in target and q.row is not None]
        used = lo | {q.row for q in others if q.row not in lo}
        spare = iter(sorted(set(range(len(self.row_owner))) - used))
        new_row: dict[int, tuple[Request, int]] = {}
        for g in groups:
            for req in g:
                new_row[id(req)] = (req, target[id(req)])
        for q in others:
            new_row[id(q)] = (q, q.row if q.row not in lo else next(spare))
        moves = [(new, q.row) for q, new in new_row.values() if new != q.row]
        if moves:
            self.pools.running.copy_([d for d, _ in moves], self.pools.running, [s for _, s in moves])
            self.rows_moved += len(moves)
        self.row_owner = [None] * len(self.row_owner)
        for q, new in new_row.values():
            q.row = new
            self.row_owner[new] = q

    # -- execution ---------------------------------------------------------------------------------------------
    def _eos(self, req: Request) -> list[int]:
        if req.eos_ids is None:
            req.eos_ids = self._eos_ids(req.params)
        return req.eos_ids

    def _eos_ids(self, params: SamplingParams) -> list[int]:
        """The request's eos ids; unset: generate()'s resolution at the time the request is added (the model's
        ``generation_config`` when it has one, else the model config's ``eos_token_id``)."""
        e = params.eos_token_id
        if e is not None:
            return [int(e)] if not isinstance(e, (list, tuple)) else [int(t) for t in e]
        gc = getattr(self.model, "generation_config", None)
        gc = (GenerationConfig.coerce(gc, source="model.generation_config") if gc is not None
              else GenerationConfig.from_model_config(self.mcfg))
        return gc.eos_ids

    def _sample(self, reqs: Sequence[Request], logits: torch.Tensor) -> list[int | Exception]:
        """Each request's next token through its own :class:`~k3nn.logits.LogitsPipeline` (the processors of
        ``generate()``; greedy rows: argmax), or the error that fails that request alone (NaN logits, a
        sampler error)."""
        greedy, nan = torch.stack([logits.argmax(-1), torch.isnan(logits).any(-1).long()]).tolist()  # one sync
        out: list[int | Exception] = []
        for b, r in enumerate(reqs):
            if nan[b]:
                out.append(FloatingPointError("the logits contain NaN"))
                continue
            try:
                out.append(int(greedy[b]) if not r.params.do_sample else self._sample_one(r, logits[b:b + 1]))
            except Exception as e:
                out.append(e)
        return out

    def _sample_one(self, r: Request, logits: torch.Tensor) -> int:
        pipe = r.logits_pipeline
        if pipe is None:
            p = r.params
            pipe = r.logits_pipeline = LogitsPipeline.for_sampling(p.do_sample, p.temperature, p.top_k, p.top_p)
        return int(pipe.choose(pipe(None, logits.float()), r.generator)[0])

    def _forward(self, reqs: Sequence[Request], num_new: Sequence[int], row0: int,
                 snapshots: Sequence[Sequence[tuple[int, int]]] | None = None) -> torch.Tensor:
        """One model forward over consecutive rows; returns the logits at each row's last new token [B, V]."""
        if [r.row for r in reqs] != list(range(row0, row0 + len(reqs))):
            raise RuntimeError(f"engine: rows {[r.row for r in reqs]} are not consecutive from {row0}")
        cache = PagedHybridCache(self.pools, row0, [r.blocks for r in reqs], [r.num_computed for r in reqs],
                                 num_new, snapshots)
        ids = cache.input_ids([r.tokens_to_feed(n) for r, n in zip(reqs, num_new)], self.config.pad_token_id)
        with torch.inference_mode():
            out = self.model(ids, cache=cache, checkpoint_positions=cache.checkpoint_positions, logits_to_keep=1)
            if cache.T == 1 or all(n == cache.T for n in num_new):
                logits = out.logits[:, -1]
            else:
                h = out.last_hidden_state[torch.arange(len(reqs), device=ids.device), cache.last_index()]
                logits = self.model.lm_head(h)
        self.num_forwards += 1
        for r, n in zip(reqs, num_new):
            r.num_computed += n
            if r.first_token_time is None:
                r.num_forwards += 1
        return logits

    def _plan_snapshots(self, req: Request, n: int) -> list[tuple[int, int]]:
        """Snapshot slots for the planned positions inside this chunk (relative positions)."""
        if self.prefix is None or not req.plan:
            return []
        U, lo, hi = self.pools.block_size, req.num_computed, req.num_computed + n
        out = []
        try:
            for p in [p for p in req.plan if lo < p <= hi]:
                req.plan.remove(p)
                if p // U > len(req.keys):
                    continue
                e = self.prefix.entries.get(req.keys[p // U - 1])
                if e is not None and e.snapshot is not None:
                    continue  # already cached (by another request)
                if self.pools.snapshots.num_free == 0 and not self.prefix.make_room(snapshots=1):
                    continue  # retention is best effort: never block a request for a snapshot
                out.append((p - lo, self.pools.snapshots.allocate(1)[0]))
        except Exception:
            self.pools.snapshots.free([s for _, s in out])
            raise
        return out

    def step(self) -> list[RequestOutput]:
        """Schedule, run at most two forwards (decode batch, prefill batch), sample and commit.

        An error that belongs to one request (its admission, snapshot plan, sampling, stop check, commit) fails
        that request alone; an error in a forward fails the requests of that forward. A failed request ends
        FAILED (``finish_reason="error"``, the reason in ``error``), its row, pages and snapshots are freed,
        and its :class:`RequestOutput` comes back from this step; the engine keeps serving the others."""
        decodes, prefills = self.schedule()
        self.num_steps += 1
        outputs, self._failed_outputs = self._failed_outputs, []
        if not decodes and not prefills:
            return outputs
        self._layout([decodes, [r for r, _ in prefills]])
        decodes.sort(key=lambda q: q.row)
        prefills.sort(key=lambda x: x[0].row)
        produced: list[tuple[Request, int]] = []
        rows = [(r, 1) for r in decodes] + list(prefills)
        if prefills and max(n for _, n in prefills) > self.config.mixed_forward_max_tokens and decodes:
            batches = [rows[:len(decodes)], rows[len(decodes):]]  # decodes first, then the (long) prefills
        else:
            batches = [rows]  # one mixed forward: short chunks cost little padding

        def fail(r: Request, e: Exception, where: str) -> None:
            outputs.append(self._fail(r, e, where))

        for batch in batches:
            snaps = []
            for r, n in batch:
                try:
                    snaps.append(self._plan_snapshots(r, n))
                except Exception as e:
                    fail(r, e, "snapshot plan")
                    snaps.append(None)
            batch = [(rn, sn) for rn, sn in zip(batch, snaps) if sn is not None]
            if not batch:
                continue
            if [r.row for (r, _), _ in batch] != list(range(batch[0][0][0].row, batch[0][0][0].row + len(batch))):
                self._layout([[r for (r, _), _ in batch]])  # a failed request left a gap in the rows
            reqs = [r for (r, _), _ in batch]
            ns = [n for (_, n), _ in batch]
            snaps = [sn for _, sn in batch]
            absolute = [[(r.num_computed + p, s) for p, s in sn] for r, sn in zip(reqs, snaps)]
            try:
                logits = self._forward(reqs, ns, reqs[0].row, snaps)
            except Exception as e:  # the whole forward: its requests fail, the engine goes on
                self.pools.snapshots.free([s for sn in snaps for _, s in sn])
                for r in reqs:
                    fail(r, e, "forward")
                continue
            done = [b for b, r in enumerate(reqs) if r.remaining == 0 and not r.prefill_only]
            if done:
                toks = self._sample([reqs[b] for b in done], logits[done])
                for b, t in zip(done, toks):
                    if isinstance(t, Exception):
                        fail(reqs[b], t, "sampling")
                    else:
                        produced.append((reqs[b], t))
            for r, sn in zip(reqs, absolute):
                if r.status == RequestStatus.FAILED:
                    self.pools.snapshots.free([s for _, s in sn])
                    continue
                try:
                    self._commit_prefix([r], [sn])
                    self._track_decode_state([r])
                except Exception as e:
                    fail(r, e, "cache commit")
        now = time.perf_counter()
        for r, t in produced:
            if r.status == RequestStatus.FAILED:
                continue
            try:
                outputs.append(self._append_token(r, t, now))
            except Exception as e:
                fail(r, e, "stop check")
        for r in list(self.running):
            if r.prefill_only and r.status == RequestStatus.RUNNING and r.remaining <= 0:
                r.status = RequestStatus.PREFILLED
                if r.first_token_time is None:
                    r.first_token_time = now
        return outputs

    def _append_token(self, r: Request, t: int, now: float) -> RequestOutput:
        """Add a sampled token, finish the request on eos / length."""
        r.output.append(int(t))
        self.generated_tokens += 1
        if r.first_token_time is None:
            r.first_token_time = now
        finished, reason = False, None
        if int(t) in self._eos(r):
            finished, reason = True, "stop"
        elif len(r.output) >= r.params.max_new_tokens:
            finished, reason = True, "length"
        if finished:
            r.finish_reason = reason
            self._retain_finished(r)
            self._release(r, RequestStatus.FINISHED, reason)
        return RequestOutput(r.request_id, [int(t)], finished, reason, list(r.output) if finished else None)

    def _commit_prefix(self, reqs: Sequence[Request], snapshots: Sequence[Sequence[tuple[int, int]]]) -> None:
        """After the forward: index the requests' new full prompt pages, then attach the written snapshots."""
        for r, snaps in zip(reqs, snapshots):
            if self.prefix is None:
                continue
            full = min(r.num_computed, r.num_prompt_tokens) // self.pools.block_size
            full = min(full, len(r.keys))
            if full > r.indexed_blocks:
                self.prefix.insert(r.keys, r.blocks, full)
                r.indexed_blocks = full
            for p, slot in snaps:
                if not self.prefix.add_snapshot(r.keys[p // self.pools.block_size - 1], slot):
                    self.pools.snapshots.free([slot])

    def _track_decode_state(self, reqs: Sequence[Request]) -> None:
        """Decode-state retention (input+output reuse): keep a private copy of the state each time a decoding
        request completes a 64-token block past its prompt; it is indexed when the request finishes, so the
        next chat turn (prompt + answer + more) resumes past the answer."""
        if self.prefix is None or not self.config.retain_decode_state:
            return
        U = self.pools.block_size
        for r in reqs:
            n = r.num_computed
            if r.prefill_only or not r.output or n % U or n <= r.num_prompt_tokens:
                continue
            if r.decode_snap is None:
                if self.pools.snapshots.num_free == 0 and not self.prefix.make_room(snapshots=1):
                    continue
                r.decode_snap = (n, self.pools.snapshots.allocate(1)[0])
            slot = r.decode_snap[1]
            self.pools.snapshots.copy_([slot], self.pools.running, [r.row])
            r.decode_snap = (n, slot)

    def _retain_finished(self, r: Request) -> None:
        """Index the full pages of everything the request fed (prompt + answer) and its last decode state."""
        if self.prefix is None or not self.config.retain_decode_state or r.prefill_only:
            return
        U = self.pools.block_size
        fed = r.all_tokens()[:r.num_computed]
        keys = list(r.keys)
        keys += block_hashes(fed, U, self.prefix.salt, keys[-1] if keys else None, len(keys))
        full = min(len(keys), r.num_computed // U, len(r.blocks))
        if full > r.indexed_blocks:
            self.prefix.insert(keys, r.blocks, full)
            r.indexed_blocks = full
        if r.decode_snap is not None:
            p, slot = r.decode_snap
            if p // U <= full and self.prefix.add_snapshot(keys[p // U - 1], slot):
                r.decode_snap = None  # the index owns the slot now

    # -- loops ------------------------------------------------------------------------------------------------
    def stream(self) -> Iterator[RequestOutput]:
        """Step until nothing is left to run, yielding every new token (and every failure) as it is produced.

        Raises :class:`EngineStalledError` when requests are waiting but no step can make progress (nothing
        runs, nothing is admitted): the engine is left as it is (release or abort requests, then stream again)."""
        while self.has_unfinished():
            before = (self.num_forwards, len(self.waiting), len(self.running))
            self._stall = None
            outs = self.step()
            yield from outs
            if not outs and before == (self.num_forwards, len(self.waiting), len(self.running)):
                held = [r.request_id for r in self.running if r.status == RequestStatus.PREFILLED]
                raise EngineStalledError(
                    f"no progress possible: {len(self.waiting)} request(s) waiting "
                    f"({[r.request_id for r in self.waiting[:4]]}...), none can be admitted "
                    f"({self._stall or 'no budget'}) and nothing is running"
                    + (f"; prefilled requests {held} hold rows and pages until release()" if held else ""))

    def generate(self, prompts: Iterable[Sequence[int]], params: SamplingParams | None = None,
                 progress: bool = False, **sampling) -> list[list[int]]:
        """Run a batch of prompts to completion; returns the generated ids per prompt, in order.

        Every prompt is checked before any is queued (an invalid one raises and queues none). If some requests
        fail inside a step the others still run to completion, then :class:`RequestFailedError` names the failed
        ones; on any other error (a stall, an interrupt) this call's unfinished requests are aborted."""
        prompts = list(prompts)
        reqs: list[Request] = []
        for i, p in enumerate(prompts):
            try:
                reqs.append(self._make_request(p, params, None, (), False, sampling))
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from e
        for r in reqs:
            self._enqueue(r)
        ids = [r.request_id for r in reqs]
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), unit="req")
        try:
            for out in self.stream():
                if bar is not None and out.finished:
                    bar.update(1)
        except BaseException:
            for r in reqs:
                self.abort(r.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        failed = {r.request_id: r.error for r in reqs if r.status == RequestStatus.FAILED}
        if failed:
            raise RequestFailedError(failed)
        return [r.output for r in reqs]

    # -- metrics ------------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        done = [r for r in self.requests.values() if r.first_token_time is not None]
        ttft = sorted(r.first_token_time - r.arrival_time for r in done)
        tpot = [(r.finish_time - r.first_token_time) / (len(r.output) - 1) for r in done
                if r.finish_time is not None and len(r.output) > 1]
        wall = (time.perf_counter() - self.start_time) if self.start_time else 0.0

        def pct(xs, q):
            return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0

        count = {st: 0 for st in RequestStatus}
        for r in self.requests.values():
            count[r.status] += 1
        m = {"requests": len(self.requests), "finished": count[RequestStatus.FINISHED],
             "aborted": count[RequestStatus.ABORTED], "failed": count[RequestStatus.FAILED],
             "steps": self.num_steps, "forwards": self.num_forwards, "rows_moved": self.rows_moved,
             "ttft_mean_s": sum(ttft) / len(ttft) if ttft else 0.0, "ttft_p50_s": pct(ttft, 0.5),
             "ttft_p95_s": pct(ttft, 0.95), "tpot_mean_s": sum(tpot) / len(tpot) if tpot else 0.0,
             "generated_tokens": self.generated_tokens, "prompt_tokens": self.prompt_tokens,
             "computed_prompt_tokens": self.computed_prompt_tokens,
             "throughput_tok_s": self.generated_tokens / wall if wall > 0 else 0.0}
        if self.prefix is not None:
            st = self.prefix.stats()
            m.update(cache_hit_rate=st["token_hit_rate"], cache_hits=st["hits"], cache_queries=st["queries"])
        return m
