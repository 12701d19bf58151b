"""In-process continuous batching over the paged hybrid cache.

One :meth:`Engine.step`:

1. **Schedule** (:mod:`k3nn.engine.scheduler`): the decodes (1 token, or with a drafter a verify window of
   1 + n drafts) and their pages first, preempting the newest running request when the pool runs out; the prefill
   chunks within the token budget that remains (``adaptive`` or ``fixed``).
2. **Admit** (:mod:`k3nn.engine.cache_manager`): each newly scheduled request gets a running slot (kept while it
   runs: forwards address KDA state by slot, nothing is moved), its cached prefix (pages + KDA snapshot,
   copy-on-write), the pages of what it feeds before its first sample (keeping ``watermark`` of the pool free) and
   its planned snapshot positions (retention policy); its sampling parameters go to the device table.
3. **Draft** (with a drafter): the decode rows' drafts (greedy rows batched, sampling rows each from its own
   generator; :mod:`k3nn.engine.speculative`).
4. **Run** (:mod:`k3nn.engine.runner`): the decode and verify rows as one forward — on a GPU a replayed CUDA graph
   of the padded batch size, captured by :meth:`Engine.warmup` — and the prefill chunks as another (on the CPU,
   short chunks share the decodes' forward); the step's metadata is staged with one host-to-device copy; right-
   padded rows end in their exact KDA state, and planned snapshots are exported inside the same pass.
5. **Draw** on the device for every row of a forward at once (per-row sampling parameters, counter-based seeds),
   accept the verify windows (greedy matches or lossless rejection sampling) and commit their KDA state; one copy
   brings the tokens to the host. Then **commit**: index the new full pages and snapshots (visible to lookups from
   the next step on), check stop conditions (:class:`~k3nn.engine.sampling.RequestSampler`: eos, stop ids and
   strings, length, the detokenised text), finish requests, free their rows and pages.

Failures: :meth:`Engine.add_request` checks every argument (nothing is queued on error); inside a step, an error
that belongs to one request (admission, its images in the vision tower, snapshot plan, sampling — NaN logits
included —, stop check, commit) ends that request FAILED with its reason, an error in a forward ends the requests of
that forward, and the engine keeps serving the rest; :meth:`Engine.step` (and so :meth:`Engine.stream`) raises
:class:`EngineStalledError` rather than spin when nothing can progress.
"""

from __future__ import annotations

import itertools
import secrets
import time
from typing import Iterable, Iterator, Sequence

import torch

from ..cache.hybrid import CacheFullError
from ..cache.paged import HybridPools, pool_sizes_for_budget
from ..cache.prefix import PrefixCache
from ..cache.retention import make_retention
from ..generation import GenerationConfig
from ..hf_surface import has_adapters
from ..spec.generate import SpecOptions
from .cache_manager import CacheManager
from .config import EngineConfig, EngineStalledError, RequestFailedError
from .images import check_images, encode_images, feeds_images, image_block_keys, image_embeds
from .request import (ImageInputs, Request, RequestOutput, RequestStatus, SamplingParams, TokenLogprobs, _int,
                      per_prompt, token_ids)
from ..runtime.sampling import SamplingTable
from .runner import Draws, ForwardOut, ModelRunner, RowWork, padding_groups
from .sampling import RequestSampler
from .scheduler import Scheduler, TokenBudget
from .overlap import Deferred, OverlapSteps
from .speculative import as_engine_drafter, draft, greedy_round
from .warmup import WarmupRequests

__all__ = ["Engine", "EngineConfig", "EngineStalledError", "RequestFailedError"]

_DONE = (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED)


class Engine(OverlapSteps, WarmupRequests):
    """Continuous-batching generation for a :class:`k3nn.KimiK3` on one device.

    ``add_request(prompt_ids, ...)`` → id; ``step()`` → list of :class:`RequestOutput` (new tokens per request);
    ``stream()`` steps until every request finished; ``generate(prompts)`` → outputs in order; ``metrics()``.
    The policy of a step is the :class:`~k3nn.engine.scheduler.Scheduler`'s (``self.scheduler``: the waiting and
    running queues), the rows and pages the :class:`~k3nn.engine.cache_manager.CacheManager`'s (``self.cache``).

    Built on a :class:`k3nn.KimiK3ForConditionalGeneration`, the engine runs its text model (``self.model``; the
    wrapper is ``self.multimodal``) and ``add_request`` also takes ``pixel_values`` / ``image_grid_thw``
    (:mod:`k3nn.engine.images`: the vision tower runs once per request, in the first forward that feeds one of its
    image tokens; prefix keys mix in a hash of each image).

    The engine prepares the model's weights (:meth:`k3nn.KimiK3.prepare_decode`, unless it holds PEFT adapters):
    each layer's input projections become one GEMM, in its prompts' chunks and in its decode steps. The packed
    buffer holds the parameters themselves (views), so this costs no memory; the model stays prepared.
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
        if not getattr(model, "decode_prepared", True) and not has_adapters(model):
            model.prepare_decode()  # see the class docstring
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
        sink = self.drafter.write if getattr(self.drafter, "graph_safe_write", False) else None
        self.runner = ModelRunner(model, self.pools, max_rows=cfg.max_num_seqs, max_window=1 + self.default_num_spec,
                                  taps=self.drafter.target_layers if self.drafter is not None else None,
                                  pad_id=cfg.pad_token_id, cuda_graphs=cfg.cuda_graphs, tap_sink=sink,
                                  drafter=self.drafter,
                                  boundary_snapshots=self.cache.keeps_decode_state)
        self.sampling = SamplingTable(self.pools.running.num_slots, self.mcfg.vocab_size, device)
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
        self._ahead: Deferred | None = None  # a launched decode step whose draws are not read yet

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
            num_spec = _int("num_speculative_tokens", num_spec, lo=0, hi=self.runner.fused_max - 1)
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
        tokens = self._cache_tokens(len(prompt), params, prefill_only)
        ctx = self.mcfg.max_position_embeddings
        if tokens + 1 > ctx:  # the rope tables, block tables and graphs are sized for the model's context
            raise ValueError(f"request {rid!r}: prompt ({len(prompt)} tokens) + max_new_tokens "
                             f"({params.max_new_tokens}) exceeds the model's context "
                             f"(max_position_embeddings={ctx})")
        need = self.pools.pages_for(tokens)
        if need > self.pools.allocator.num_blocks:
            raise CacheFullError(f"request {rid!r} needs {need} latent pages (prompt {len(prompt)} + "
                                 f"{params.max_new_tokens} new tokens) but the pool has "
                                 f"{self.pools.allocator.num_blocks}; create the engine with more num_pages")
        req = Request(rid, prompt, params, boundaries=bounds, prefill_only=prefill_only)
        req.num_spec = self.default_num_spec if num_spec is None else num_spec
        req.eos_ids = self._eos_ids(params)
        req.seed = self._seed(params)
        req.generator = self._generator(params, req.seed)
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

    @staticmethod
    def _seed(params: SamplingParams) -> int:
        """The request's sampling seed: ``seed`` when set (reproducible: the same tokens whatever the batch), else
        fresh OS randomness (an unset seed never means the same samples for every request)."""
        return int(params.seed) % 2 ** 63 if params.seed is not None else secrets.randbits(63)

    def _generator(self, params: SamplingParams, seed: int) -> torch.Generator | None:
        """A sampling request's generator for its drafter's sampled drafts, seeded from the request's seed."""
        if not params.do_sample:
            return None
        g = torch.Generator(device=self.pools.device)
        g.manual_seed(seed)
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
        return (bool(self.waiting) or self._ahead is not None
                or any(r.status == RequestStatus.RUNNING for r in self.running))

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
        if req.row is not None:
            self.sampling.release(req.row)
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
        req.seed = self._seed(params)
        req.generator = self._generator(params, req.seed)
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

    def _forward(self, rows: Sequence[RowWork], draft_keys: int | None = None,
                 feed: torch.Tensor | None = None, shift: torch.Tensor | None = None) -> ForwardOut:
        """One model forward over ``rows`` (:meth:`ModelRunner.forward <k3nn.engine.runner.ModelRunner.forward>`:
        a replayed CUDA graph for decode / verify rows, eagerly otherwise; ``draft_keys``: a greedy round, drafted
        on the device); with a drafter the tapped hidden states of every fed token go into its paged context.
        Advances each row's ``num_computed`` by what it fed."""
        embeds_fn = None
        if self.multimodal is not None and any(w.req.images is not None for w in rows):
            reqs, nn = [w.req for w in rows], [w.num_new for w in rows]
            embeds_fn = lambda ids: image_embeds(self.multimodal, self.model.model.embed_tokens, reqs, nn,  # noqa: E731
                                                 ids)
        with torch.inference_mode():
            out = self.runner.forward(rows, embeds_fn, draft_keys=draft_keys, feed=feed, shift=shift)
            if self.drafter is not None and self.runner.tap_sink is None:  # else written inside the step
                self.drafter.write(out.hidden, out.meta.positions[:len(rows)], out.meta.slot_mapping[:len(rows)])
        self.num_forwards += 1
        for w in rows:
            w.req.num_computed += w.num_new
            if w.req.first_token_time is None:
                w.req.num_forwards += 1
        return out

    def _bind_rows(self, reqs: Sequence[Request]) -> None:
        """Load the sampling parameters of requests that took a row since their last step (admission, a
        resumed preempted request, an adopted one) into the device sampling table."""
        for r in reqs:
            if r.sampling_row != r.row:
                self.sampling.set_row(r.row, r.params, r.prompt, r.eos_ids or (), r.seed, r.output)
                r.sampling_row = r.row

    def step(self) -> list[RequestOutput]:
        """Schedule, run at most two forwards (decode batch, prefill batch), sample and commit.

        An error that belongs to one request (its admission, vision tower run, snapshot plan, sampling, stop
        check, commit) fails that request alone; an error in a forward fails the requests of that forward. A
        failed request ends FAILED (``finish_reason="error"``, the reason in ``error``), its row, pages and
        snapshots are freed, and its :class:`RequestOutput` comes back from this step; the engine keeps serving
        the others. When requests wait that no step can ever admit (nothing runs or could free a row or pages),
        raises :class:`EngineStalledError` instead of returning an empty step forever."""
        self.expire_leases()
        if self._ahead is not None:  # asynchronous decoding: launch the next step, then read the last one
            return self._advance()
        before = (len(self.waiting), len(self.running))
        decodes, prefills = self.schedule()
        self.num_steps += 1
        outputs, self._failed_outputs = self._failed_outputs, []
        if not decodes and not prefills:
            if not outputs and self.waiting and before == (len(self.waiting), len(self.running)) \
                    and not any(r.status == RequestStatus.RUNNING for r in self.running):
                raise self._stalled()
            return outputs
        self._bind_rows(decodes + [r for r, _ in prefills])
        draft_keys = greedy_round(self, decodes) if self.drafter is not None else None
        if self.drafter is not None and draft_keys is None:
            draft(self.drafter, decodes, self.scheduler.draft_len, self.spec_options.confidence_threshold,
                  self.mcfg.vocab_size)
        dec = [RowWork(r, r.tokens_to_feed(1 + len(r.drafts)), decode=True, verify=bool(r.drafts), sample=True,
                       device_drafts=r.device_drafts if r.drafts else None) for r in decodes]
        pre = [RowWork(r, r.tokens_to_feed(n), sample=r.remaining == n and not r.prefill_only) for r, n in prefills]
        separate = self.runner.static or any(w.verify for w in dec) or \
            (pre and max(w.num_new for w in pre) > self.config.mixed_forward_max_tokens)
        batches = [b for b in ([dec, *padding_groups(pre)] if separate else [dec + pre]) if b]
        if self._deferrable(batches, draft_keys):  # its tokens are read by the next step()
            self._ahead = self._launch_deferred(batches[0], draft_keys=draft_keys)
            outputs, self._failed_outputs = outputs + self._failed_outputs, []
            return outputs
        produced: list[tuple[Request, list[int], list[TokenLogprobs] | None]] = []

        def fail(r: Request, e: Exception, where: str) -> None:
            outputs.append(self._fail(r, e, where))

        for batch in batches:
            if self.multimodal is not None:
                batch = self._encode_images(batch, fail)
            batch, absolute = self.cache.plan_rows(batch, fail)
            if not batch:
                continue
            try:
                out = self._forward(batch, draft_keys if batch and batch[0].decode else None)
                draws = self._draw(batch, out)
            except Exception as e:  # the whole forward: its requests fail, the engine goes on
                self.cache.drop_plans(batch)
                for w in batch:
                    w.req.clear_drafts()
                    fail(w.req, e, "forward")
                continue
            for b, w in enumerate(batch):
                r = w.req
                res = draws[b]
                if isinstance(res, Exception):
                    r.clear_drafts()
                    fail(r, res, "verification" if w.verify else "sampling")
                    continue
                if res is not None:
                    produced.append((r, *res))
            self.cache.commit_rows(batch, absolute, fail)
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

    def _draw(self, batch: Sequence[RowWork], out: ForwardOut) -> list:
        """Per row of a forward: (tokens, logprobs or None) to emit, None (nothing drawn: a prefill chunk that
        does not end the prompt) or the exception that fails that request. Draws on the device
        (:meth:`ModelRunner.sample <k3nn.engine.runner.ModelRunner.sample>`), one host copy; verify rows accept
        their drafts and commit their KDA state there."""
        probs = {b: w.req.draft_probs for b, w in enumerate(batch) if w.verify and w.req.draft_probs is not None}
        want = {b: w.req.params.logprobs for b, w in enumerate(batch)
                if w.sample and w.req.params.logprobs is not None}
        d = self.runner.sample(out, batch, self.sampling, self.spec_options.synthetic_acceptance_length,
                               probs or None, want or None)
        return self._emissions(batch, d)

    def _emissions(self, batch: Sequence[RowWork], d: Draws) -> list:
        """:meth:`_draw`'s per-row results from a forward's draws on the host."""
        res: list = []
        for b, w in enumerate(batch):
            r = w.req
            row = d.packed[b]
            if not w.sample:
                res.append(None)
                continue
            if not w.verify:
                if row[1]:
                    res.append(FloatingPointError("the logits contain NaN or Inf"))
                    continue
                lp = d.logprobs.get(b, [])
                res.append(([row[0]], [TokenLogprobs.from_row(x, r.params.logprobs) for x in lp[:1]] or None))
                continue
            m, nxt, bad = row[2], row[3], row[4]
            n = w.num_new - 1  # the drafts the window fed
            w.kept = m + 1
            if bad:
                res.append(FloatingPointError("the logits of the verify window contain NaN or Inf"))
                continue
            toks = row[5:5 + m] + [int(nxt)]  # the drafts as fed (device drafts come back here)
            r.clear_drafts()
            r.num_computed -= n - m  # keep the pending token + the accepted drafts
            r.spec_rounds += 1
            r.spec_drafted += n
            r.spec_accepted += m
            self.spec_rounds, self.spec_drafted, self.spec_accepted = (
                self.spec_rounds + 1, self.spec_drafted + n, self.spec_accepted + m)
            lp = d.logprobs.get(b, [])
            res.append((toks, [TokenLogprobs.from_row(x, r.params.logprobs) for x in lp[:m + 1]] or None))
        return res

    def _stalled(self) -> "EngineStalledError":
        held = [r.request_id for r in self.running if r.status == RequestStatus.PREFILLED]
        return EngineStalledError(
            f"no progress possible: {len(self.waiting)} request(s) waiting "
            f"({[r.request_id for r in self.waiting[:4]]}...), none can be admitted "
            f"({self.scheduler.stall or 'no budget'}) and nothing is running"
            + (f"; prefilled requests {held} hold rows and pages until release()" if held else ""))

    def _encode_images(self, batch: list[RowWork], fail) -> list[RowWork]:
        """Run the vision tower for the requests of ``batch`` whose chunk feeds an image token of theirs for the
        first time, each request's images on their own, so a tower error fails that request alone (``fail``);
        the rest of ``batch``."""
        ready = []
        for w in batch:
            try:
                if feeds_images(w.req, w.num_new):
                    encode_images(self.multimodal, w.req.images)
            except Exception as e:  # noqa: BLE001 - this request's images: it alone fails
                fail(w.req, e, "vision tower")
                continue
            ready.append(w)
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
            yield from self.step()

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
        pixels = per_prompt("pixel_values", pixel_values, len(prompts))
        grids = per_prompt("image_grid_thw", image_grid_thw, len(prompts))
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

    def warmup(self, prompt_len: int = 96, batch_sizes: Sequence[int] | None = None) -> float:
        """Make serving meet no compile, autotune or capture: run the step shapes requests will bring, then
        capture the decode graphs.

        1. Real requests (then discarded): for a few batch sizes (default 1, 2 and ``max_num_seqs``) prompts of
           ``prompt_len``, ``prompt_len + 1`` and ``prompt_len + 33`` tokens and a prefix hit of the first one,
           decoded for a few steps (with a drafter, verify windows of every draft length): the eager prefill
           kernels compile and tune for the shapes' buckets.
           On CUDA, also one prompt of each power of two from 1 token up to ``max_num_batched_tokens`` (within
           the model's context, :func:`~k3nn.engine.warmup.warmup_prompt_lengths`): the MoE kernels specialise
           on the power-of-two bucket of a step's (token, expert) pairs and on the block size those imply, so
           every step size a request can bring meets a compiled kernel.
        2. A CUDA graph for every padded batch size (1, 2, 4, 8, then steps of 8 up to ``max_num_seqs``) and
           every window width (1; 1 + n drafts with a drafter), each captured over a batch of padding rows (no
           request's state is touched), sharing one memory pool; with a DSpark drafter also each batch size's
           greedy round (verify, acceptance and commit) and its draft graphs for the key buckets of
           :meth:`ModelRunner.draft_key_buckets <k3nn.engine.runner.ModelRunner.draft_key_buckets>`; with
           decode-state retention the acceptance and round graphs also in their variant that exports a page
           boundary's state (:meth:`ModelRunner.commit_windows <k3nn.engine.runner.ModelRunner.commit_windows>`).

        The engine is left as it was (no requests, an empty prefix index, zeroed statistics). Returns the seconds
        spent (also in ``metrics()["warmup_s"]``)."""
        if self.requests or self.waiting or self.running:
            raise RuntimeError("warmup() runs on an idle engine (before any request is added)")
        t0 = time.perf_counter()
        self._run_warmup_requests(prompt_len, batch_sizes)
        self.capture_graphs()
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

    def capture_graphs(self) -> dict:
        """Capture the decode / verify step of every padded batch size and window width (see :meth:`warmup`);
        returns ``{"captured": n, "failed": {key: reason}}``. A no-op off CUDA or with graphs off."""
        r = self.runner
        if not r.graphs.enabled:
            return {"captured": 0, "failed": {}}
        widths = [1] + ([1 + n for n in range(1, self.default_num_spec + 1)] if self.drafter is not None else [])
        with torch.inference_mode():
            for B in reversed(r.batch_sizes):  # largest first: the shared pool is sized by the first capture
                for T in widths:
                    r.capture_padding(B, T, T > 1)
            for B in reversed(r.batch_sizes):
                for L in r.draft_key_buckets(B):
                    r.capture_draft(B, L)
        return {"captured": len(r.graphs.graphs), "failed": dict(r.graphs.failed)}

    # -- metrics ------------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Counters and latencies since the engine started, as a flat dict:

        - requests: ``requests``, ``finished``, ``aborted``, ``failed``; ``steps``, ``forwards``;
        - latency (seconds): ``ttft_mean_s``, ``ttft_p50_s``, ``ttft_p95_s`` (arrival to first token),
          ``tpot_mean_s`` (per output token after the first); ``warmup_s``;
        - tokens: ``generated_tokens``, ``prompt_tokens``, ``computed_prompt_tokens`` (prompt tokens actually run:
          the rest came from the prefix cache), ``throughput_tok_s`` (generated tokens per second of wall time),
          ``preemptions``, ``recomputed_tokens``;
        - CUDA graphs: ``graphs_captured`` (decode / verify step shapes captured), ``graph_capture_failures``
          (shapes that run eagerly; the runner logged why);
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
             "steps": self.num_steps, "forwards": self.num_forwards,
             "ttft_mean_s": sum(ttft) / len(ttft) if ttft else 0.0, "ttft_p50_s": pct(ttft, 0.5),
             "ttft_p95_s": pct(ttft, 0.95), "tpot_mean_s": sum(tpot) / len(tpot) if tpot else 0.0,
             "generated_tokens": self.generated_tokens, "prompt_tokens": self.prompt_tokens,
             "computed_prompt_tokens": self.cache.computed_prompt_tokens,
             "throughput_tok_s": self.generated_tokens / wall if wall > 0 else 0.0,
             "preemptions": self.scheduler.num_preemptions, "recomputed_tokens": self.cache.recomputed_tokens,
             "warmup_s": self.warmup_s, "graphs_captured": len(self.runner.graphs.graphs),
             "graph_capture_failures": len(self.runner.graphs.failed)}
        if self.drafter is not None:
            m.update(spec_rounds=self.spec_rounds, spec_drafted=self.spec_drafted, spec_accepted=self.spec_accepted,
                     spec_acceptance_rate=self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0,
                     spec_acceptance_length=((self.spec_accepted + self.spec_rounds) / self.spec_rounds
                                             if self.spec_rounds else 0.0))
        if self.prefix is not None:
            st = self.prefix.stats()
            m.update(cache_hit_rate=st["token_hit_rate"], cache_hits=st["hits"], cache_queries=st["queries"])
        return m
