"""In-process continuous batching over the paged hybrid cache.

One :meth:`Engine.step`:

1. **Schedule** (:mod:`k3nn.engine.scheduler`): the decodes (1 token, or with a drafter a verify window of
   1 + n drafts) and their pages first, preempting the newest running request when the pool runs out; the prefill
   chunks within the token budget that remains (``adaptive`` or ``fixed``).
2. **Admit** (:mod:`k3nn.engine.cache_manager`): each newly scheduled request gets a running row, its cached
   prefix (pages + KDA snapshot, copy-on-write), the pages of what it feeds before its first sample (keeping
   ``watermark`` of the pool free) and its planned snapshot positions (retention policy).
3. **Draft** (with a drafter): the decode rows' drafts (greedy rows batched, sampling rows each from its own
   generator; :mod:`k3nn.engine.speculative`).
4. **Lay out** running rows so the decode batch is rows ``[0, D)`` and the prefill batch ``[D, D+P)``: the KDA
   layers then read/write contiguous slices. Rows move only when the membership changes (arrivals,
   completions), not per layer or per forward.
5. **Run** one mixed forward ``[D + P, T]`` when the prefill chunks are short (≤ ``mixed_forward_max_tokens``),
   else two (decodes and verify windows, then prefills ``[P, T]``); rows are right-padded and the KDA state of a
   short row, like every planned snapshot, is exported inside the same pass. **Verify** the windows (accept,
   rewind, replay the KDA state of partly rejected rows), sample the rest through each request's
   :class:`~k3nn.engine.sampling.RequestSampler`, then **commit**: index the new full pages and snapshots
   (visible to lookups from the next step on), check stop conditions, finish requests, free their rows and pages.

Failures: :meth:`Engine.add_request` checks every argument (nothing is queued on error); inside a step, an error
that belongs to one request (admission, its images in the vision tower, snapshot plan, sampling — NaN logits
included —, stop check, commit) ends that request FAILED with its reason, an error in a forward ends the requests of
that forward, and the engine keeps serving the rest; :meth:`Engine.stream` raises :class:`EngineStalledError` rather
than spin when nothing can progress.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

from ..cache.hybrid import CacheFullError
from ..cache.paged import HybridPools, PagedHybridCache, pool_sizes_for_budget
from ..cache.prefix import PrefixCache
from ..cache.retention import EvictionPolicy, RetentionPolicy, make_retention
from ..generation import GenerationConfig
from ..spec.generate import SpecOptions
from .cache_manager import CacheManager
from .images import check_images, encode_images, feeds_images, image_block_keys, image_embeds
from .request import (ImageInputs, Request, RequestOutput, RequestStatus, SamplingParams, TokenLogprobs, _int,
                      token_ids)
from .sampling import RequestSampler, sample_next
from .scheduler import Scheduler, TokenBudget
from .speculative import KDAReplay, as_engine_drafter, draft, verify

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
    """How an :class:`Engine` is sized and scheduled (every field also a keyword of ``Engine(model, ...)``).

    Capacity: ``max_num_seqs`` running requests (each holds a KDA state row), ``num_pages`` latent pages of 64 tokens
    per MLA layer (or ``cache_memory_bytes``, split between pages and snapshot slots), ``num_snapshots`` KDA snapshot
    slots for the prefix cache. Scheduling: ``max_num_batched_tokens`` per step, ``budget`` "adaptive" (decodes first,
    prefill gets the rest) or "fixed", ``min_prefill_tokens``, ``mixed_forward_max_tokens``, ``watermark`` (the
    fraction of pages admission leaves free for running requests to grow). Prefix reuse: ``enable_prefix_caching``,
    ``retention`` ("marconi", "replay", "interval:N", a policy object or None), ``eviction`` ("lru", "marconi", a
    policy or None), ``retain_decode_state``. Speculation (with a drafter): ``num_speculative_tokens`` (None: the
    drafter's block size), ``spec``. ``cuda_graphs``: replay captured decode / verify steps on a GPU. Errors name the
    field (:meth:`validate`)."""

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
    watermark: float = 0.01  # admission keeps this fraction of the pages free for running requests to grow
    num_speculative_tokens: int | None = None  # per-request default with a drafter (None: the drafter's block size)
    spec: SpecOptions | None = None  # confidence_threshold, synthetic_acceptance_length (rollback is replay)

    def validate(self) -> None:
        """Check every field (run by the Engine); a ValueError / TypeError naming the field."""
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)) \
                or not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {self.watermark!r}")
        if self.num_speculative_tokens is not None:
            _int("num_speculative_tokens", self.num_speculative_tokens, lo=0)
        if self.spec is not None:
            if not isinstance(self.spec, SpecOptions):
                raise TypeError(f"spec must be a k3nn.spec.SpecOptions, got {type(self.spec).__name__}")
            if self.spec.rollback != "replay":
                raise ValueError(f"the engine rolls KDA back by replay only; got spec.rollback={self.spec.rollback!r}")
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
    The policy of a step is the :class:`~k3nn.engine.scheduler.Scheduler`'s (``self.scheduler``: the waiting and
    running queues), the rows and pages the :class:`~k3nn.engine.cache_manager.CacheManager`'s (``self.cache``).

    Built on a :class:`k3nn.KimiK3ForConditionalGeneration`, the engine runs its text model (``self.model``; the
    wrapper is ``self.multimodal``) and ``add_request`` also takes ``pixel_values`` / ``image_grid_thw``
    (:mod:`k3nn.engine.images`: the vision tower runs once per request, in the first forward that feeds one of its
    image tokens; prefix keys mix in a hash of each image).
    """

    def __init__(self, model, config: EngineConfig | None = None, *, drafter=None, tokenizer=None, **overrides):
        cfg = config or EngineConfig()
        if overrides:
            cfg = EngineConfig(**{**cfg.__dict__, **overrides})
        cfg.validate()
        from ..multimodal import KimiK3ForConditionalGeneration

        self.multimodal = None  # the KimiK3ForConditionalGeneration whose text model this engine runs
        if isinstance(model, KimiK3ForConditionalGeneration):
            self.multimodal, model = model, model.language_model
        self.model, self.config, self.mcfg = model, cfg, model.config
        self.tokenizer = tokenizer  # decode(ids) -> str: stop strings and RequestOutput.text
        dtype, device = model.dtype, model.device
        if cfg.num_pages is not None:
            num_pages, num_snaps = cfg.num_pages, cfg.num_snapshots or 1
        else:
            num_pages, num_snaps = pool_sizes_for_budget(self.mcfg, cfg.cache_memory_bytes, cfg.max_num_seqs,
                                                         dtype=dtype)
        self.pools = HybridPools(self.mcfg, num_pages, cfg.max_num_seqs, num_snaps, dtype, device)
        self.prefix = PrefixCache(self.pools, cfg.eviction) if cfg.enable_prefix_caching else None
        if cfg.budget == "fixed" and cfg.max_num_batched_tokens - cfg.reserve_per_seq * cfg.max_num_seqs < 1:
            raise ValueError("budget='fixed': max_num_batched_tokens must exceed reserve_per_seq · max_num_seqs")
        self.drafter = None
        self.spec_options = cfg.spec or SpecOptions()
        self.default_num_spec = 0
        if drafter is not None:
            self.drafter = as_engine_drafter(drafter, num_pages, self.pools.block_size, device)
            gamma = getattr(getattr(drafter, "config", None), "block_size", None)
            self.default_num_spec = (cfg.num_speculative_tokens if cfg.num_speculative_tokens is not None
                                     else int(gamma or 1))
        self.cache = CacheManager(self.pools, self.prefix, make_retention(cfg.retention), watermark=cfg.watermark,
                                  retain_decode_state=cfg.retain_decode_state)
        budget = TokenBudget(cfg.max_num_batched_tokens, cfg.budget, cfg.reserve_per_seq, cfg.min_prefill_tokens,
                             cfg.max_num_seqs)
        self.scheduler = Scheduler(budget, self.cache, speculative=self.drafter is not None,
                                   share_prompts=self.prefix is not None)
        self.replay = KDAReplay(model, self.pools)
        self.spec_rounds = self.spec_drafted = self.spec_accepted = 0
        self.warmup_s = 0.0
        self.requests: dict[str, Request] = {}
        self.parents: dict[str, list[str]] = {}  # an n > 1 request's id → its samples' ids
        self.leases: dict = {}  # request id → its live P/D lease (k3nn.engine.transfer.Lease)
        self._ids = itertools.count()
        self.num_steps = self.num_forwards = 0
        self.prompt_tokens = self.generated_tokens = 0
        self.start_time: float | None = None
        self._failed_outputs: list[RequestOutput] = []  # failures outside a forward, reported by the next step()

    @property
    def waiting(self) -> list[Request]:
        """Requests waiting for admission, in admission order (preempted ones at the front)."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        """Requests holding a running row, in admission order (PREFILLED ones held for export included)."""
        return self.scheduler.running

    @property
    def row_owner(self) -> list[Request | None]:
        """The request holding each running row (None: free)."""
        return self.cache.row_owner

    # -- requests --------------------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int] | torch.Tensor, params: SamplingParams | None = None, *,
                    request_id: str | None = None, boundaries: Sequence[int] = (), prefill_only: bool = False,
                    num_speculative_tokens: int | None = None, pixel_values: torch.Tensor | None = None,
                    image_grid_thw: torch.Tensor | None = None, **sampling) -> str:
        """Queue a prompt (token ids). ``boundaries``: prompt positions worth a KDA snapshot (turn ends);
        ``prefill_only``: compute N−1 tokens and hold the state for :func:`k3nn.engine.transfer.export_request_state`;
        ``num_speculative_tokens``: drafts per verify window for this request (0: plain decoding; None: the
        engine's default; needs a drafter). ``pixel_values`` [L, C, p, p] / ``image_grid_thw`` [N, 3]: the
        prompt's images as transformers' Kimi K2.5 processor makes them (an engine built on a
        :class:`k3nn.KimiK3ForConditionalGeneration`); their tokens fill the prompt's image tokens in order.
        Their content hashes are taken here; the vision tower runs in the first forward feeding an image token.
        A ``prefill_only`` request with images exports their content keys; the importing engine is given the same
        images (:func:`k3nn.engine.transfer.import_request_state`).

        Everything is checked here (TypeError for a wrong type, ValueError / CacheFullError for a value out of
        range, each naming the argument); on error nothing is queued."""
        reqs = self._make_requests(prompt, params, request_id, boundaries, prefill_only, sampling,
                                   num_spec=num_speculative_tokens, pixel_values=pixel_values,
                                   image_grid_thw=image_grid_thw)
        for r in reqs:
            self._enqueue(r)
        return reqs[0].parent or reqs[0].request_id

    def _make_requests(self, prompt, params, request_id, boundaries, prefill_only, sampling,
                       taken: frozenset[str] = frozenset(), num_spec: int | None = None, *,
                       pixel_values: torch.Tensor | None = None,
                       image_grid_thw: torch.Tensor | None = None) -> list[Request]:
        """The request, or an ``n > 1`` request's n samples (ids ``"<id>/<i>"``, parameters
        :meth:`SamplingParams.child`), validated and unregistered."""
        if params is not None and sampling:
            raise TypeError("give a SamplingParams or sampling keyword arguments, not both")
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params = params or SamplingParams(**sampling)
        params.validate(self.tokenizer)
        images = self._images(prompt, pixel_values, image_grid_thw)  # shared by an n > 1 request's samples
        if params.n == 1:
            return [self._make_request(prompt, params, request_id, boundaries, prefill_only, taken, num_spec,
                                       images)]
        if prefill_only:
            raise ValueError("prefill_only requests take n=1 (one state to export)")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests or rid in self.parents or rid in taken:
            raise ValueError(f"request id {rid!r} is already in use")
        reqs = []
        for i in range(params.n):
            r = self._make_request(prompt, params.child(i), f"{rid}/{i}", boundaries, False,
                                   taken | {x.request_id for x in reqs}, num_spec, images)
            r.parent = rid
            reqs.append(r)
        return reqs

    def _make_request(self, prompt, params: SamplingParams, request_id, boundaries, prefill_only,
                      taken: frozenset[str] = frozenset(), num_spec: int | None = None,
                      images: ImageInputs | None = None) -> Request:
        """A validated, unregistered :class:`Request` for parameters :meth:`_make_requests` resolved and validated
        (no engine state changes except the id counter)."""
        if num_spec is not None:
            num_spec = _int("num_speculative_tokens", num_spec, lo=0)
            if num_spec > 0 and self.drafter is None:
                raise ValueError("num_speculative_tokens > 0 needs an engine with a drafter (Engine(model, "
                                 "drafter=...))")
        prompt = self._token_ids(prompt)
        if not isinstance(prefill_only, bool):
            raise TypeError(f"prefill_only must be a bool, got {type(prefill_only).__name__}")
        if isinstance(boundaries, (str, bytes, torch.Tensor)) or not isinstance(boundaries, Sequence):
            raise TypeError(f"boundaries must be a sequence of ints, got {type(boundaries).__name__}")
        bounds = [_int("boundaries", b, lo=0, hi=len(prompt)) for b in boundaries]
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests or rid in self.parents or rid in taken:
            raise ValueError(f"request id {rid!r} is already in use")
        need = self.pools.pages_for(self._cache_tokens(len(prompt), params, prefill_only))
        if need > self.pools.allocator.num_blocks:
            raise CacheFullError(f"request {rid!r} needs {need} latent pages (prompt {len(prompt)} + "
                                 f"{params.max_new_tokens} new tokens) but the pool has "
                                 f"{self.pools.allocator.num_blocks}; create the engine with more num_pages")
        req = Request(rid, prompt, params, boundaries=bounds, prefill_only=prefill_only)
        req.num_spec = self.default_num_spec if num_spec is None else num_spec
        req.eos_ids = self._eos_ids(params)
        req.generator = self._generator(params)
        req.sampler = self._sampler(req)
        req.images, req.image_keys = images, image_block_keys(images, self.pools.block_size)
        if self.prefix is not None:
            req.keys = self.cache.block_keys(req, prompt)
        return req

    def _images(self, prompt, pixel_values, image_grid_thw) -> ImageInputs | None:
        return check_images(self.multimodal, type(self.model).__name__, self._token_ids(prompt), pixel_values,
                            image_grid_thw)

    def _sampler(self, req: Request) -> RequestSampler:
        return RequestSampler(req.params, req.prompt, vocab_size=self.mcfg.vocab_size, eos_ids=req.eos_ids,
                              device=self.pools.device, generator=req.generator, tokenizer=self.tokenizer)

    def _token_ids(self, prompt) -> list[int]:
        return token_ids(prompt, self.mcfg.vocab_size)

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
        if req.parent is not None:
            self.parents.setdefault(req.parent, []).append(req.request_id)
        self.waiting.append(req)
        self.prompt_tokens += len(req.prompt)
        if self.start_time is None:
            self.start_time = time.perf_counter()

    @staticmethod
    def _cache_tokens(n_prompt: int, params: SamplingParams, prefill_only: bool) -> int:
        return max(n_prompt - 1, 1) if prefill_only else n_prompt + params.max_new_tokens - 1

    def has_unfinished(self) -> bool:
        """Some request is still waiting or running (``step()`` has work to do)."""
        return bool(self.waiting) or any(r.status == RequestStatus.RUNNING for r in self.running)

    def _get(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request id {request_id!r}")
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a waiting, running or prefilled request and free its row and pages; returns whether it was live.
        A request that already ended (finished, aborted, failed) is left as it is. The id of an ``n > 1``
        request aborts all its samples."""
        if request_id in self.parents:
            return any([self.abort(c) for c in self.parents[request_id]])
        req = self._get(request_id)
        if req.status in _DONE:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req, RequestStatus.ABORTED, "abort")
        return True

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Free the exported requests whose P/D lease ran out (``time.monotonic()`` clock); leases whose request
        ended some other way are dropped. Every :meth:`step` calls it first. Returns the ids it freed."""
        if not self.leases:
            return []
        now = time.monotonic() if now is None else now
        freed = []
        for rid, lease in list(self.leases.items()):
            if not lease._held():
                lease._end("gone")
            elif lease.expires_at is not None and now >= lease.expires_at:
                if lease._end("expired"):
                    freed.append(rid)
        return freed

    def release(self, request_id: str) -> None:
        """Free a PREFILLED (exported) request's row and pages."""
        req = self._get(request_id)
        if req.status != RequestStatus.PREFILLED:
            raise ValueError(f"request {request_id!r} is {req.status.value}, not prefilled")
        self._release(req, RequestStatus.FINISHED, "exported")

    def _free_resources(self, req: Request) -> None:
        """Give back ``req``'s private decode snapshot, running row and page references; off the running list."""
        self.cache.free(req)
        if req in self.running:
            self.running.remove(req)

    def _release(self, req: Request, status: RequestStatus, reason: str) -> None:
        req.images = None  # pixels / features (an n > 1 request's samples share them)
        self._free_resources(req)
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

    def adopt(self, prompt: Sequence[int], num_computed: int, pages: Sequence[torch.Tensor],
              recurrent: Sequence[torch.Tensor], conv: Sequence[torch.Tensor], params: SamplingParams | None = None,
              request_id: str | None = None, *, pixel_values: torch.Tensor | None = None,
              image_grid_thw: torch.Tensor | None = None) -> str:
        """Start a request from a transferred state: ``num_computed`` prompt tokens are already done (their latent
        pages ``pages`` [n_pages, 64, D] per MLA layer, KDA state per KDA layer). The next step recomputes the
        rest of the prompt (normally its last token, as a decode row) and generates. A prompt with image tokens
        needs its ``pixel_values`` / ``image_grid_thw`` (its prefix keys hash them; the tower runs only if an image
        token is among the tokens left to compute)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.tokenizer)
        prompt = self._token_ids(prompt)
        images = self._images(prompt, pixel_values, image_grid_thw)
        num_computed = _int("num_computed", num_computed)
        if not 0 <= num_computed < len(prompt):
            raise ValueError(f"adopt: num_computed must be in [0, {len(prompt)}), got {num_computed}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if self.pools.pages_for(len(prompt) + params.max_new_tokens - 1) > self.pools.allocator.num_blocks:
            raise CacheFullError(f"adopt: request {rid!r} (prompt {len(prompt)} + {params.max_new_tokens} new "
                                 f"tokens) can never fit the pool of {self.pools.allocator.num_blocks} pages")
        req = Request(rid, prompt, params, status=RequestStatus.RUNNING, num_computed=num_computed)
        req.generator = self._generator(params)
        req.eos_ids = self._eos_ids(params)
        req.sampler = self._sampler(req)
        req.num_spec = 0  # the shipped pages carry no drafter context: an adopted request decodes plainly
        req.images, req.image_keys = images, image_block_keys(images, self.pools.block_size)
        if self.prefix is not None:
            req.keys = self.cache.block_keys(req, prompt)
        self.cache.place(req, self.pools.pages_for(num_computed), pages, recurrent, conv)
        self.requests[rid] = req
        self.running.append(req)
        self.prompt_tokens += len(prompt)
        if self.start_time is None:
            self.start_time = time.perf_counter()
        return rid

    # -- scheduling ---------------------------------------------------------------------------------------------
    def prefill_budget(self, num_decodes: int, decode_tokens: int = 0) -> int:
        """Tokens left for prefill chunks this step: the step budget minus what the decodes hold
        (``reserve_per_seq`` per decode row — per row of ``max_num_seqs`` with ``budget="fixed"`` — or the
        decodes' actual tokens with their verify windows, whichever is larger)."""
        return self.scheduler.budget.prefill(num_decodes, decode_tokens)

    def schedule(self) -> tuple[list[Request], list[tuple[Request, int]]]:
        """Decide this step's work (:meth:`Scheduler.schedule <k3nn.engine.scheduler.Scheduler.schedule>`):
        (decode requests, [(prefill request, tokens)]). A waiting request whose admission raised is failed here;
        its output comes back from the next :meth:`step`."""
        plan = self.scheduler.schedule()
        for req, e in plan.failed:
            self._failed_outputs.append(self._fail(req, e, "admission"))
        return plan.decodes, plan.prefills

    # -- execution ---------------------------------------------------------------------------------------------
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

    def _forward(self, reqs: Sequence[Request], num_new: Sequence[int], row0: int,
                 snapshots: Sequence[Sequence[tuple[int, int]]] | None = None):
        """One model forward over consecutive rows. Returns (the logits at each row's last new token [B, V],
        the cache view, the final hidden states [B, T, d]); rows with drafts are verify windows (their KDA inputs
        recorded for :class:`~k3nn.engine.speculative.KDAReplay`); with a drafter the tapped hidden states of every
        fed token go into its paged context."""
        if [r.row for r in reqs] != list(range(row0, row0 + len(reqs))):
            raise RuntimeError(f"engine: rows {[r.row for r in reqs]} are not consecutive from {row0}")
        cache = PagedHybridCache(self.pools, row0, [r.blocks for r in reqs], [r.num_computed for r in reqs],
                                 num_new, snapshots)
        ids = cache.input_ids([r.tokens_to_feed(n) for r, n in zip(reqs, num_new)], self.config.pad_token_id)
        self.replay.begin(cache, [b for b, r in enumerate(reqs) if r.drafts])
        taps = self.drafter.target_layers if self.drafter is not None else None
        with torch.inference_mode():
            embeds = (image_embeds(self.multimodal, self.model.model.embed_tokens, reqs, num_new, ids)
                      if self.multimodal is not None else None)
            out = self.model(ids if embeds is None else None, cache=cache, inputs_embeds=embeds,
                             checkpoint_positions=cache.checkpoint_positions, logits_to_keep=1,
                             output_hidden_layers=taps)
            if cache.T == 1 or all(n == cache.T for n in num_new):
                logits = out.logits[:, -1]
            else:
                h = out.last_hidden_state[torch.arange(len(reqs), device=ids.device), cache.last_index()]
                logits = self.model.lm_head(h)
            if self.drafter is not None:
                self.drafter.write(out.hidden_states, cache.q_pos, cache.write_slots)
        self.num_forwards += 1
        for r, n in zip(reqs, num_new):
            r.num_computed += n
            if r.first_token_time is None:
                r.num_forwards += 1
        return logits, cache, out.last_hidden_state

    def step(self) -> list[RequestOutput]:
        """Schedule, run at most two forwards (decode batch, prefill batch), sample and commit.

        An error that belongs to one request (its admission, vision tower run, snapshot plan, sampling, stop
        check, commit) fails that request alone; an error in a forward fails the requests of that forward. A
        failed request ends FAILED (``finish_reason="error"``, the reason in ``error``), its row, pages and
        snapshots are freed, and its :class:`RequestOutput` comes back from this step; the engine keeps serving
        the others."""
        self.expire_leases()
        decodes, prefills = self.schedule()
        self.num_steps += 1
        outputs, self._failed_outputs = self._failed_outputs, []
        if not decodes and not prefills:
            return outputs
        if self.drafter is not None:
            draft(self.drafter, decodes, self.scheduler.draft_len, self.spec_options.confidence_threshold,
                  self.mcfg.vocab_size)
        self.cache.layout([decodes, [r for r, _ in prefills]], self.running)
        decodes.sort(key=lambda q: q.row)
        prefills.sort(key=lambda x: x[0].row)
        produced: list[tuple[Request, list[int], list[TokenLogprobs] | None]] = []
        rows = [(r, 1 + len(r.drafts)) for r in decodes] + list(prefills)
        if prefills and max(n for _, n in prefills) > self.config.mixed_forward_max_tokens and decodes:
            batches = [rows[:len(decodes)], rows[len(decodes):]]  # decodes first, then the (long) prefills
        else:
            batches = [rows]  # one mixed forward: short chunks cost little padding

        def fail(r: Request, e: Exception, where: str) -> None:
            outputs.append(self._fail(r, e, where))

        for batch in batches:
            if self.multimodal is not None:
                batch = self._encode_images(batch, fail)
            snaps = []
            for r, n in batch:
                try:
                    snaps.append(self.cache.plan_snapshots(r, n))
                except Exception as e:
                    fail(r, e, "snapshot plan")
                    snaps.append(None)
            batch = [(rn, sn) for rn, sn in zip(batch, snaps) if sn is not None]
            if not batch:
                continue
            if [r.row for (r, _), _ in batch] != list(range(batch[0][0][0].row, batch[0][0][0].row + len(batch))):
                self.cache.layout([[r for (r, _), _ in batch]], self.running)  # a failed request left a gap
            reqs = [r for (r, _), _ in batch]
            ns = [n for (_, n), _ in batch]
            snaps = [sn for _, sn in batch]
            absolute = [[(r.num_computed + p, s) for p, s in sn] for r, sn in zip(reqs, snaps)]
            try:
                logits, cache, hidden = self._forward(reqs, ns, reqs[0].row, snaps)
            except Exception as e:  # the whole forward: its requests fail, the engine goes on
                self.pools.snapshots.free([s for sn in snaps for _, s in sn])
                for r in reqs:
                    r.drafts, r.draft_probs = [], None
                    fail(r, e, "forward")
                continue
            verified = verify(self.model.lm_head, reqs, hidden, self.spec_options.synthetic_acceptance_length)
            keep: dict[int, int] = {}
            for b, res in verified.items():
                r = reqs[b]
                n = len(r.drafts)
                r.drafts, r.draft_probs = [], None
                if isinstance(res, Exception):
                    fail(r, res, "verification")
                    continue
                m = len(res[0]) - 1
                r.num_computed -= n - m  # keep the pending token + the accepted drafts
                keep[b] = m + 1
                r.spec_rounds += 1
                r.spec_drafted += n
                r.spec_accepted += m
                self.spec_rounds, self.spec_drafted, self.spec_accepted = (
                    self.spec_rounds + 1, self.spec_drafted + n, self.spec_accepted + m)
                produced.append((r, *res))
            if verified:
                try:
                    self.replay.commit(cache, keep)
                except Exception as e:  # the rebuilt KDA states are not trustworthy: fail the windows' requests
                    for b in keep:
                        fail(reqs[b], e, "speculative rollback")
            done = [b for b, r in enumerate(reqs)
                    if b not in verified and r.remaining == 0 and not r.prefill_only]
            if done:
                toks = sample_next([reqs[b] for b in done], logits[done])
                for b, t in zip(done, toks):
                    if isinstance(t, Exception):
                        fail(reqs[b], t, "sampling")
                    else:
                        produced.append((reqs[b], *t))
            for r, sn in zip(reqs, absolute):
                if r.status == RequestStatus.FAILED:
                    self.pools.snapshots.free([s for _, s in sn])
                    continue
                try:
                    self.cache.commit_prefix(r, sn)
                    self.cache.track_decode_state(r)
                except Exception as e:
                    fail(r, e, "cache commit")
        now = time.perf_counter()
        for r, toks, lps in produced:
            if r.status == RequestStatus.FAILED:
                continue
            try:
                outputs.append(self._append_tokens(r, toks, lps, now))
            except Exception as e:
                fail(r, e, "stop check")
        for r in list(self.running):
            if r.prefill_only and r.status == RequestStatus.RUNNING and r.remaining <= 0:
                r.status = RequestStatus.PREFILLED
                if r.first_token_time is None:
                    r.first_token_time = now
        return outputs

    def _encode_images(self, batch: list[tuple[Request, int]], fail) -> list[tuple[Request, int]]:
        """Run the vision tower for the requests of ``batch`` whose chunk feeds an image token of theirs for the
        first time, each request's images on their own, so a tower error fails that request alone (``fail``);
        the rest of ``batch``."""
        ready = []
        for r, n in batch:
            try:
                if feeds_images(r, n):
                    encode_images(self.multimodal, r.images)
            except Exception as e:  # noqa: BLE001 - this request's images: it alone fails
                fail(r, e, "vision tower")
                continue
            ready.append((r, n))
        return ready

    def _append_tokens(self, r: Request, toks: Sequence[int], lps: list[TokenLogprobs] | None,
                       now: float) -> RequestOutput:
        """Add the step's tokens (one, or a verify window's emissions) and check the stop conditions (eos, stop
        ids and strings, length — :meth:`RequestSampler.check_stop`); tokens after the one that ended the request
        are dropped."""
        if r.first_token_time is None:
            r.first_token_time = now
        r.output.extend(int(t) for t in toks)
        finished, reason, trim = r.sampler.check_stop(r.output)
        new = [int(t) for t in toks]
        if trim:
            del r.output[-trim:]
            new = new[:len(new) - trim]
            lps = None if lps is None else lps[:len(new)]
        self.generated_tokens += len(new)
        if finished:
            r.finish_reason = reason
            self._retain_finished(r)
            self._release(r, RequestStatus.FINISHED, reason)
        return RequestOutput(r.request_id, new, finished, reason, list(r.output) if finished else None,
                             stop_reason=r.sampler.stop_reason, logprobs=lps, text=r.sampler.text)

    def _retain_finished(self, r: Request) -> None:
        """Index the full pages of everything the request fed (prompt + answer) and its last decode state."""
        self.cache.retain_finished(r)

    # -- loops ------------------------------------------------------------------------------------------------
    def stream(self) -> Iterator[RequestOutput]:
        """Step until nothing is left to run, yielding every new token (and every failure) as it is produced.

        Raises :class:`EngineStalledError` when requests are waiting but no step can make progress (nothing
        runs, nothing is admitted): the engine is left as it is (release or abort requests, then stream again)."""
        while self.has_unfinished():
            before = (self.num_forwards, len(self.waiting), len(self.running))
            outs = self.step()
            yield from outs
            if not outs and before == (self.num_forwards, len(self.waiting), len(self.running)):
                held = [r.request_id for r in self.running if r.status == RequestStatus.PREFILLED]
                raise EngineStalledError(
                    f"no progress possible: {len(self.waiting)} request(s) waiting "
                    f"({[r.request_id for r in self.waiting[:4]]}...), none can be admitted "
                    f"({self.scheduler.stall or 'no budget'}) and nothing is running"
                    + (f"; prefilled requests {held} hold rows and pages until release()" if held else ""))

    def generate(self, prompts: Iterable[Sequence[int]], params: SamplingParams | None = None,
                 progress: bool = False, *, pixel_values: Sequence[torch.Tensor | None] | None = None,
                 image_grid_thw: Sequence[torch.Tensor | None] | None = None, **sampling) -> list[list[int]]:
        """Run a batch of prompts to completion; returns the generated ids per prompt, in order (with
        ``n > 1``: a list of the n samples' ids per prompt). ``pixel_values`` / ``image_grid_thw``: one entry per
        prompt, each what :meth:`add_request` takes for that prompt (None: a text prompt).

        Every prompt is checked before any is queued (an invalid one raises and queues none). If some requests
        fail inside a step the others still run to completion, then :class:`RequestFailedError` names the failed
        ones; on any other error (a stall, an interrupt) this call's unfinished requests are aborted."""
        prompts = list(prompts)
        pixels = self._per_prompt("pixel_values", pixel_values, len(prompts))
        grids = self._per_prompt("image_grid_thw", image_grid_thw, len(prompts))
        groups: list[list[Request]] = []
        for i, p in enumerate(prompts):
            try:
                groups.append(self._make_requests(p, params, None, (), False, sampling, pixel_values=pixels[i],
                                                  image_grid_thw=grids[i]))
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from e
        reqs = [r for g in groups for r in g]
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
        return [g[0].output if g[0].parent is None else [r.output for r in g] for g in groups]

    @staticmethod
    def _per_prompt(name: str, values, num_prompts: int) -> list:
        """``generate()``'s per-prompt image argument as a list of ``num_prompts`` entries (None: no images)."""
        if values is None:
            return [None] * num_prompts
        if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
            raise TypeError(f"{name} must be a list with one entry (a tensor or None) per prompt, got "
                            f"{type(values).__name__}")
        if len(values) != num_prompts:
            raise ValueError(f"{name} has {len(values)} entries for {num_prompts} prompts: give one per prompt "
                             f"(None for a text prompt)")
        return list(values)

    def warmup(self, prompt_len: int = 96, batch_sizes: Sequence[int] | None = None) -> float:
        """Run the step shapes serving will meet before the first request: for every batch size (default
        1 … ``max_num_seqs``) a prefill of ``prompt_len``-token prompts, then decode rows — verify windows of every
        draft length with a drafter — so kernel compilation and autotuning happen here, not in the first users'
        requests. The engine is left as it was (no requests, an empty prefix index, zeroed statistics). Returns
        the seconds spent (also in ``metrics()["warmup_s"]``)."""
        if self.requests or self.waiting or self.running:
            raise RuntimeError("warmup() runs on an idle engine (before any request is added)")
        t0 = time.perf_counter()
        sizes = list(batch_sizes) if batch_sizes is not None else list(range(1, self.config.max_num_seqs + 1))
        g = torch.Generator().manual_seed(0)
        gamma = self.default_num_spec if self.drafter is not None else 0
        for b in sizes:
            prompts = [torch.randint(0, self.mcfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(b)]
            if self.multimodal is not None:  # text prompts: no image / video placeholders
                ph = {self.multimodal.config.image_token_id, self.multimodal.config.video_token_id}
                prompts = [[0 if t in ph else t for t in p] for p in prompts]
            for n_spec in sorted({0, gamma} | set(range(1, gamma + 1, max(1, gamma // 3)))):
                if n_spec and self.drafter is None:
                    continue
                ids = [self.add_request(p, max_new_tokens=n_spec + 3, ignore_eos=True,
                                        num_speculative_tokens=n_spec if self.drafter is not None else None)
                       for p in prompts]
                list(self.stream())
                for rid in ids:
                    del self.requests[rid]
        if self.prefix is not None:
            self.prefix.clear()
        self.num_steps = self.num_forwards = self.prompt_tokens = self.generated_tokens = 0
        self.spec_rounds = self.spec_drafted = self.spec_accepted = 0
        self.scheduler.num_preemptions = 0
        self.cache.reset_stats()
        self.start_time = None
        if self.pools.device.type == "cuda":
            torch.cuda.synchronize(self.pools.device)
        self.warmup_s = time.perf_counter() - t0
        return self.warmup_s

    # -- metrics ------------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Counters and latencies since the engine started, as a flat dict:

        - requests: ``requests``, ``finished``, ``aborted``, ``failed``; ``steps``, ``forwards``;
        - latency (seconds): ``ttft_mean_s``, ``ttft_p50_s``, ``ttft_p95_s`` (arrival to first token),
          ``tpot_mean_s`` (per output token after the first); ``warmup_s``;
        - tokens: ``generated_tokens``, ``prompt_tokens``, ``computed_prompt_tokens`` (prompt tokens actually run:
          the rest came from the prefix cache), ``throughput_tok_s`` (generated tokens per second of wall time),
          ``preemptions``, ``recomputed_tokens``;
        - with a drafter: ``spec_rounds``, ``spec_drafted``, ``spec_accepted``, ``spec_acceptance_rate``,
          ``spec_acceptance_length`` (tokens per verify window, bonus included);
        - with prefix caching: ``cache_hit_rate`` (fraction of prompt tokens served from the cache), ``cache_hits``,
          ``cache_queries``.

        Example::

            m = engine.metrics()
            print(f"{m['throughput_tok_s']:.0f} tok/s, TTFT p95 {m['ttft_p95_s'] * 1e3:.0f} ms")
        """
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
             "steps": self.num_steps, "forwards": self.num_forwards, "rows_moved": self.cache.rows_moved,
             "ttft_mean_s": sum(ttft) / len(ttft) if ttft else 0.0, "ttft_p50_s": pct(ttft, 0.5),
             "ttft_p95_s": pct(ttft, 0.95), "tpot_mean_s": sum(tpot) / len(tpot) if tpot else 0.0,
             "generated_tokens": self.generated_tokens, "prompt_tokens": self.prompt_tokens,
             "computed_prompt_tokens": self.cache.computed_prompt_tokens,
             "throughput_tok_s": self.generated_tokens / wall if wall > 0 else 0.0,
             "preemptions": self.scheduler.num_preemptions, "recomputed_tokens": self.cache.recomputed_tokens,
             "warmup_s": self.warmup_s}
        if self.drafter is not None:
            m.update(spec_rounds=self.spec_rounds, spec_drafted=self.spec_drafted, spec_accepted=self.spec_accepted,
                     spec_acceptance_rate=self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0,
                     spec_acceptance_length=((self.spec_accepted + self.spec_rounds) / self.spec_rounds
                                             if self.spec_rounds else 0.0))
        if self.prefix is not None:
            st = self.prefix.stats()
            m.update(cache_hit_rate=st["token_hit_rate"], cache_hits=st["hits"], cache_queries=st["queries"])
        return m
