"""In-process continuous batching over the paged hybrid cache.

One :meth:`Engine.step`:

1. **Schedule** (token budget per step): every request with one token left to feed (decodes, and prompts
   whose last token is all that is left) gets its decode tokens first — 1, or with a drafter a verify window of
   1 + n drafts — and the pages they need (oldest first; when the pool runs out the newest running request is
   **preempted**: its prompt + output pages are indexed for reuse, its row and pages freed, and it is re-queued
   at the front to be recomputed from prompt + output with the same generator: identical output). The prefill
   budget is what remains — ``adaptive``: ``max_num_batched_tokens − max(reserve_per_seq · decodes, decode
   tokens)`` (so a lone request is not cut into several forwards); ``fixed``: ``max_num_batched_tokens −
   reserve_per_seq · max_num_seqs`` (a reservation for the largest batch, the pre-adaptive vLLM behaviour).
   Partial prefills continue first (FCFS), then waiting requests are admitted while rows, pages and budget last;
   one that does not fit the free pages yet does not block smaller ones behind it (none are admitted in a step
   that preempted). A split chunk ends on a 64-token boundary.
2. **Admit**: prefix lookup (pages + KDA snapshot at L ≤ N−1), copy the snapshot into the request's running row
   (copy-on-write), share the pages, allocate the pages of the rest of what it feeds before its first sample
   (keeping ``watermark`` of the pool free for the running requests to grow into), plan snapshot positions
   (retention policy).
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
that belongs to one request (admission, snapshot plan, sampling — NaN logits included —, stop check, commit) ends
that request FAILED with its reason, an error in a forward ends the requests of that forward, and the engine
keeps serving the rest; :meth:`Engine.stream` raises :class:`EngineStalledError` rather than spin when nothing
can progress.
"""

from __future__ import annotations

import itertools
import logging
import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from ..cache.hybrid import CacheFullError
from ..cache.paged import HybridPools, PagedHybridCache, pool_sizes_for_budget
from ..cache.prefix import PrefixCache, PrefixMatch, block_hashes, extra_block_keys
from ..cache.retention import EvictionPolicy, PlanInput, RetentionPolicy, make_retention
from ..generation import GenerationConfig
from ..spec.generate import SpecOptions
from ..spec.verify import rejection_accept
from .request import ImageInputs, Request, RequestOutput, RequestStatus, SamplingParams, TokenLogprobs, _int
from .sampling import RequestSampler
from .speculative import DraftRow, KDAReplay, as_engine_drafter

__all__ = ["Engine", "EngineConfig", "EngineStalledError", "RequestFailedError"]

log = logging.getLogger(__name__)

_DONE = (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED)


def _padded(drafts: list[int], n: int) -> list[int]:
    """A row's drafts padded to the window width of the batch (the pad columns' scores are never read)."""
    return drafts + [0] * (n - len(drafts))


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
    watermark: float = 0.01  # admission keeps this fraction of the pages free for running requests to grow
    num_speculative_tokens: int | None = None  # per-request default with a drafter (None: the drafter's block size)
    spec: SpecOptions | None = None  # confidence_threshold, synthetic_acceptance_length (rollback is replay)

    def validate(self) -> None:
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

    Built on a :class:`k3nn.KimiK3ForConditionalGeneration`, the engine runs its text model (``self.model``; the
    wrapper is ``self.multimodal``) and ``add_request`` also takes ``pixel_values`` / ``image_grid_thw``: the
    vision tower runs once per request, in the first forward that feeds one of its image tokens (not at all when
    the prefix cache already covers every image token), and every forward feeding image positions gets
    ``inputs_embeds`` with the image features at those positions. Prefix keys mix in a sha256 of each image's
    pixels and grid for every 64-token block holding its tokens (same image ⇒ hit, different image ⇒ miss).
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
        self.retention = make_retention(cfg.retention)
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
        self.replay = KDAReplay(model, self.pools)
        self.spec_rounds = self.spec_drafted = self.spec_accepted = 0
        self.num_preemptions = self.recomputed_tokens = 0
        self.warmup_s = 0.0
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admission order (includes PREFILLED requests held for export)
        self.requests: dict[str, Request] = {}
        self.parents: dict[str, list[str]] = {}  # an n > 1 request's id → its samples' ids
        self.leases: dict = {}  # request id → its live P/D lease (k3nn.engine.transfer.Lease)
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
                    num_speculative_tokens: int | None = None, pixel_values: torch.Tensor | None = None,
                    image_grid_thw: torch.Tensor | None = None, **sampling) -> str:
        """Queue a prompt (token ids). ``boundaries``: prompt positions worth a KDA snapshot (turn ends);
        ``prefill_only``: compute N−1 tokens and hold the state for :func:`k3nn.engine.transfer.export_request_state`;
        ``num_speculative_tokens``: drafts per verify window for this request (0: plain decoding; None: the
        engine's default; needs a drafter). ``pixel_values`` [L, C, p, p] / ``image_grid_thw`` [N, 3]: the
        prompt's images as transformers' Kimi K2.5 processor makes them (an engine built on a
        :class:`k3nn.KimiK3ForConditionalGeneration`); their tokens fill the prompt's image tokens in order.
        Their content hashes are taken here; the vision tower runs in the first forward feeding an image token.

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
        images = self._image_inputs(prompt, pixel_values, image_grid_thw)  # shared by an n > 1 request's samples
        if images is not None and prefill_only:
            raise ValueError("prefill_only requests with images are not supported: a P/D manifest keys its pages on "
                             "token ids only, so the decode side could not tell two images apart; run the request "
                             "on one engine (without prefill_only)")
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
        self._attach_images(req, images)
        if self.prefix is not None:
            req.keys = self._block_keys(req, prompt)
        return req

    # -- images ------------------------------------------------------------------------------------------------
    def _image_inputs(self, prompt, pixel_values, image_grid_thw) -> ImageInputs | None:
        """A prompt's images, checked against it (ValueError naming the argument: images for a text-only model,
        ``image_grid_thw`` disagreeing with ``pixel_values``, image tokens without images or more / fewer images
        than the image tokens take), with one content hash per image; None for a text prompt."""
        if self.multimodal is None:
            if pixel_values is not None or image_grid_thw is not None:
                name = "pixel_values" if pixel_values is not None else "image_grid_thw"
                raise ValueError(f"{name}: this engine serves a text-only {type(self.model).__name__}, which takes "
                                 f"no images; build the Engine on a k3nn.KimiK3ForConditionalGeneration")
            return None
        from ..multimodal import image_content_keys

        spans = self.multimodal.image_token_positions(self._token_ids(prompt), pixel_values, image_grid_thw)
        if not spans:
            return None
        px = pixel_values.detach().clone()  # the hash below names these pixels: later edits by the caller can't leak in
        grid = image_grid_thw.detach().to("cpu", copy=True)
        return ImageInputs(px, grid, [p for sp in spans for p in sp], [len(sp) for sp in spans],
                           image_content_keys(px, grid))

    def _attach_images(self, req: Request, images: ImageInputs | None) -> None:
        req.images = images
        if images is None:
            req.image_keys = None
            return
        spans, off = [], 0
        for n, key in zip(images.sizes, images.content_keys):
            spans.append((images.positions[off:off + n], key))
            off += n
        req.image_keys = extra_block_keys(spans, self.pools.block_size)

    def _block_keys(self, req: Request, tokens: Sequence[int], keys: Sequence[bytes] = ()) -> list[bytes]:
        """The chained prefix keys of the full blocks of ``tokens`` (the prompt, or prompt + output), continuing
        ``keys`` (those of the first ``len(keys)`` blocks): token ids and the content hashes of the request's images.
        Every place that keys a request's blocks goes through here, so the keys agree."""
        keys = list(keys)
        return keys + block_hashes(tokens, self.pools.block_size, self.prefix.salt, keys[-1] if keys else None,
                                   len(keys), req.image_keys)

    def _image_features(self, images: ImageInputs) -> torch.Tensor:
        """The projected features of a request's images [Σ n_i, d], running the vision tower the first time."""
        if images.features is None:
            images.features = self.multimodal.image_features(images.pixel_values, images.image_grid_thw)
            images.pixel_values = None
        return images.features

    def _image_embeds(self, reqs: Sequence[Request], num_new: Sequence[int], ids: torch.Tensor) -> torch.Tensor | None:
        """``inputs_embeds`` [B, T, d] for a forward in which some row feeds image tokens: the text embeddings of
        ``ids`` with each such position's row replaced by its image feature (a prefill chunk may begin or end inside
        an image's tokens: row b's column c is prompt position ``num_computed + c``); None when no row does."""
        rows = []
        for b, (r, n) in enumerate(zip(reqs, num_new)):
            im = r.images
            if im is None:
                continue
            lo = r.num_computed
            i0, i1 = bisect_left(im.positions, lo), bisect_left(im.positions, lo + n)
            if i1 > i0:
                rows.append((b, im, lo, i0, i1))
        if not rows:
            return None
        h = self.model.model.embed_tokens(ids)
        for b, im, lo, i0, i1 in rows:
            feats = self._image_features(im)
            cols = torch.tensor(im.positions[i0:i1], device=h.device) - lo
            h[b, cols] = feats[i0:i1].to(h.dtype)
        return h

    def _sampler(self, req: Request) -> RequestSampler:
        return RequestSampler(req.params, req.prompt, vocab_size=self.mcfg.vocab_size, eos_ids=req.eos_ids,
                              device=self.pools.device, generator=req.generator, tokenizer=self.tokenizer)

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

    # -- admission ---------------------------------------------------------------------------------------------
    def _free_row(self) -> int | None:
        for r, o in enumerate(self.row_owner):
            if o is None:
                return r
        return None

    def _watermark_pages(self) -> int:
        """Pages admission leaves free for the running requests to grow into (none when nothing runs)."""
        if not any(r.status == RequestStatus.RUNNING for r in self.running):
            return 0
        return int(self.config.watermark * self.pools.allocator.num_blocks + 0.999999)

    def _admit(self, req: Request) -> bool:
        """Give ``req`` a running row and the pages of what it feeds before its first sample (its prompt; a
        preempted request: prompt + output so far, minus what the prefix index still holds); the pages of the
        tokens it generates are added as it decodes (:meth:`_grow`)."""
        row = self._free_row()
        if row is None:
            self._stall = f"all {len(self.row_owner)} running rows are held"
            return False
        resumed = bool(req.output)
        tokens = req.all_tokens()
        N = len(tokens)
        keys = req.keys
        if resumed and self.prefix is not None:
            keys = self._block_keys(req, tokens, req.keys)
        m = self.prefix.match(tokens, keys, record=False) if self.prefix is not None else PrefixMatch()
        total = self.pools.pages_for(max(N - 1, 1) if req.prefill_only else N)
        need = max(total - len(m.pages), 0)
        alloc = self.pools.allocator
        alloc.incref(m.pages)
        req.blocks = list(m.pages)  # owned from here on: _release frees them if anything below fails
        reserve = self._watermark_pages()
        if alloc.num_free < need + reserve and self.prefix is not None:
            self.prefix.make_room(pages=need + reserve)
        if alloc.num_free < need + reserve:
            alloc.free(m.pages)
            req.blocks = []
            self._stall = (f"request {req.request_id!r} needs {need} free latent pages (+ {reserve} kept free), "
                           f"{alloc.num_free} of {alloc.num_blocks} are free and nothing is running that would "
                           f"release more")
            return False
        req.blocks += alloc.allocate(need)
        req.row = row
        self.row_owner[row] = req
        if m.snapshot is not None:
            self.pools.running.copy_([row], self.pools.snapshots, [m.snapshot])  # copy-on-write
        else:
            self.pools.running.zero_([row])
        req.num_computed = m.hit_len
        req.kv_len = m.kv_len
        req.indexed_blocks = len(m.pages)
        if resumed:
            self.recomputed_tokens += N - m.hit_len
        else:
            req.hit_len = m.hit_len
            self.computed_prompt_tokens += N - m.hit_len
        if self.prefix is not None and not resumed:
            self.prefix.record(m, N)
            req.plan = self.retention.plan(PlanInput(N, m.hit_len, m.kv_len, req.boundaries, self.pools.block_size))
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if req.prefill_only and req.remaining <= 0:
            req.status = RequestStatus.PREFILLED
        return True

    def _grow(self, req: Request, num_tokens: int, protect: Sequence[Request] = ()) -> bool:
        """Make ``req``'s pages cover ``num_tokens`` tokens: free pages, then prefix-index pages, then preempt
        the newest running request (never one in ``protect``; ``req`` itself when it is the newest). Returns
        False when ``req`` itself was preempted."""
        need = self.pools.pages_for(num_tokens) - len(req.blocks)
        alloc = self.pools.allocator
        while need > 0 and alloc.num_free < need:
            if self.prefix is not None and self.prefix.make_room(pages=need):
                break
            victim = next((q for q in reversed(self.running)
                           if q.status == RequestStatus.RUNNING and q not in protect and q is not req), None)
            if victim is None or self.running.index(victim) < self.running.index(req):
                self._preempt(req)
                return False
            self._preempt(victim)
        if need > 0:
            req.blocks += alloc.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: index what ``req`` fed (so its recompute may hit the prefix index), free its
        row, pages and snapshots, and queue it at the front; it resumes from prompt + output with the same
        generator (identical output)."""
        self._retain_finished(req)
        self._free_resources(req)
        req.status = RequestStatus.WAITING
        req.num_computed = req.indexed_blocks = 0
        req.plan, req.drafts, req.draft_probs = [], [], None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)

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
        images = self._image_inputs(prompt, pixel_values, image_grid_thw)
        num_computed = _int("num_computed", num_computed)
        if not 0 <= num_computed < len(prompt):
            raise ValueError(f"adopt: num_computed must be in [0, {len(prompt)}), got {num_computed}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if self.pools.pages_for(len(prompt) + params.max_new_tokens - 1) > self.pools.allocator.num_blocks:
            raise CacheFullError(f"adopt: request {rid!r} (prompt {len(prompt)} + {params.max_new_tokens} new "
                                 f"tokens) can never fit the pool of {self.pools.allocator.num_blocks} pages")
        row = self._free_row()
        if row is None:
            raise CacheFullError(f"adopt: all {len(self.row_owner)} running rows are busy")
        n_src = self.pools.pages_for(num_computed)
        self._check_state_tensors(n_src, pages, recurrent, conv)
        total = self.pools.pages_for(len(prompt))
        if self.pools.allocator.num_free < total and self.prefix is not None:
            self.prefix.make_room(pages=total)
        blocks = self.pools.allocator.allocate(total)  # raises CacheFullError before anything is taken
        try:
            if n_src:
                self.pools.write_pages(blocks[:n_src], [p[:n_src] for p in pages])
            self.pools.running.write(row, recurrent, conv)
        except BaseException:
            self.pools.allocator.free(blocks)
            raise
        req = Request(rid, prompt, params, status=RequestStatus.RUNNING, row=row, blocks=blocks,
                      num_computed=num_computed)
        req.generator = self._generator(params)
        req.eos_ids = self._eos_ids(params)
        req.sampler = self._sampler(req)
        req.num_spec = 0  # the shipped pages carry no drafter context: an adopted request decodes plainly
        self._attach_images(req, images)
        if self.prefix is not None:
            req.keys = self._block_keys(req, prompt)
        self.row_owner[row] = req
        self.requests[rid] = req
        self.running.append(req)
        self.prompt_tokens += len(prompt)
        self.computed_prompt_tokens += len(prompt) - num_computed
        if self.start_time is None:
            self.start_time = time.perf_counter()
        return rid

    def _check_state_tensors(self, n_pages: int, pages, recurrent, conv) -> None:
        """Shapes of a transferred state against this engine's pools (ValueError naming the tensor)."""
        pl = self.pools
        if len(pages) != len(pl.pages):
            raise ValueError(f"adopt: pages must hold one tensor per MLA layer ({len(pl.pages)}), got {len(pages)}")
        for i, (p, ref) in enumerate(zip(pages, pl.pages)):
            if p.dim() != 3 or p.shape[0] < n_pages or tuple(p.shape[1:]) != tuple(ref.shape[1:]):
                raise ValueError(f"adopt: pages[{i}] must be [>= {n_pages}, {ref.shape[1]}, {ref.shape[2]}], got "
                                 f"{tuple(p.shape)}")
        run = pl.running
        for name, got, ref in (("recurrent", recurrent, run.recurrent), ("conv", conv, run.conv)):
            if len(got) != len(ref):
                raise ValueError(f"adopt: {name} must hold one tensor per KDA layer ({len(ref)}), got {len(got)}")
            for j, (t, r) in enumerate(zip(got, ref)):
                if tuple(t.shape) != tuple(r.shape[1:]):
                    raise ValueError(f"adopt: {name}[{j}] must be {tuple(r.shape[1:])}, got {tuple(t.shape)}")

    # -- scheduling ---------------------------------------------------------------------------------------------
    def prefill_budget(self, num_decodes: int, decode_tokens: int = 0) -> int:
        """Tokens left for prefill chunks this step: the step budget minus what the decodes hold
        (``reserve_per_seq`` per decode row — per row of ``max_num_seqs`` with ``budget="fixed"`` — or the
        decodes' actual tokens with their verify windows, whichever is larger)."""
        c = self.config
        held = c.max_num_seqs if c.budget == "fixed" else num_decodes
        return max(c.max_num_batched_tokens - max(c.reserve_per_seq * held, decode_tokens), c.min_prefill_tokens)

    def _chunk(self, req: Request, budget: int) -> int:
        rem = req.remaining
        n = min(rem, budget)
        if n < rem:
            U = self.pools.block_size
            end = (req.num_computed + n) // U * U
            if end > req.num_computed:
                n = end - req.num_computed
        return n

    def _sibling_prefilling(self, req: Request) -> bool:
        """``req`` is a sample of an n > 1 request whose sibling is still prefilling the shared prompt (with
        prefix caching, waiting for it turns the prompt into a hit)."""
        if self.prefix is None or req.parent is None or req.output or req.num_prompt_tokens <= self.pools.block_size:
            return False
        return any(q.parent == req.parent and q.status == RequestStatus.RUNNING and q.remaining > 1
                   for q in self.running)

    def _draft_len(self, req: Request) -> int:
        """Drafts this decode row may verify: its ``num_speculative_tokens``, at most one less than the tokens it
        may still emit (the target's own token always follows the accepted drafts)."""
        if self.drafter is None or req.num_spec <= 0:
            return 0
        return max(0, min(req.num_spec, req.params.max_new_tokens - len(req.output) - 1))

    def schedule(self) -> tuple[list[Request], list[tuple[Request, int]]]:
        """Decide this step's work: (decode requests, [(prefill request, tokens)]).

        Decodes first, oldest first, each given the pages of its tokens this step (its verify window with
        speculation), preempting the newest running request when the pool runs out (:meth:`_grow`); then the
        partial prefills (FCFS) and new admissions within the token budget. A waiting request that does not fit
        the free pages does not block smaller ones behind it; after a preemption nothing new is admitted in the
        same step."""
        active = [r for r in self.running if r.status == RequestStatus.RUNNING]
        preempted = self.num_preemptions
        for r in [r for r in active if r.remaining == 1]:
            if r.status == RequestStatus.RUNNING:
                self._grow(r, r.num_computed + 1 + self._draft_len(r))
        active = [r for r in active if r.status == RequestStatus.RUNNING]
        decodes = [r for r in active if r.remaining == 1]
        budget = self.prefill_budget(len(decodes), sum(1 + self._draft_len(r) for r in decodes))
        prefills: list[tuple[Request, int]] = []
        for r in active:
            if r.remaining > 1 and budget > 0:
                n = self._chunk(r, budget)
                prefills.append((r, n))
                budget -= n
        i = 0
        while i < len(self.waiting) and budget > 0 and self.num_preemptions == preempted:
            req = self.waiting[i]
            if self._sibling_prefilling(req):
                i += 1  # a sibling sample is computing the same prompt: wait one step and share its pages
                continue
            try:
                admitted = self._admit(req)
            except Exception as e:  # this request's admission (prefix match, retention plan): fail it alone
                self._failed_outputs.append(self._fail(req, e, "admission"))
                continue
            if not admitted:
                if self._free_row() is None:
                    break
                i += 1  # too large for the free pages now: smaller requests behind it may fit
                continue
            self.waiting.pop(i)
            if req.status != RequestStatus.RUNNING:
                continue
            if req.remaining == 1:
                if self._grow(req, req.num_computed + 1 + self._draft_len(req)):
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

    def _sample(self, reqs: Sequence[Request], logits: torch.Tensor) -> list[tuple | Exception]:
        """Each request's next token (and its log-probabilities when asked) through its own
        :class:`~k3nn.engine.sampling.RequestSampler` (the logits processors of ``generate()``; plain greedy
        rows: one batched argmax), or the error that fails that request alone (NaN logits, a sampler error)."""
        greedy, nan = torch.stack([logits.argmax(-1), torch.isnan(logits).any(-1).long()]).tolist()  # one sync
        out: list[tuple | Exception] = []
        for b, r in enumerate(reqs):
            if nan[b]:
                out.append(FloatingPointError("the logits contain NaN"))
                continue
            try:
                if r.sampler.plain_greedy:
                    out.append(([int(greedy[b])], None))
                else:
                    tok, lp = r.sampler.choose(logits[b], r.output)
                    out.append(([tok], None if lp is None else [lp]))
            except Exception as e:
                out.append(e)
        return out

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
            embeds = self._image_embeds(reqs, num_new, ids) if self.multimodal is not None else None
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

    # -- speculation --------------------------------------------------------------------------------------------
    def _draft(self, decodes: Sequence[Request]) -> None:
        """Drafts for this step's decode rows (``req.drafts``). Greedy rows of one draft length share one
        drafter call; a sampling row drafts alone, from its own generator. A drafter error costs only the
        speedup: those rows decode plainly this step (logged)."""
        for r in decodes:
            r.drafts, r.draft_probs = [], None
        groups: dict[tuple, list[Request]] = {}
        for r in decodes:
            n = self._draft_len(r)
            if n > 0:
                groups.setdefault((n, r.request_id) if r.params.do_sample else (n,), []).append(r)
        opts, V = self.spec_options, self.mcfg.vocab_size
        for key, group in groups.items():
            n = key[0]
            rows = [DraftRow(r.all_tokens(), r.num_computed, r.blocks, r.params, r.generator) for r in group]
            try:
                with torch.inference_mode():
                    prop = self.drafter.propose(rows, n)
                toks = prop.tokens[:, :n]
                if tuple(toks.shape) != (len(group), n):
                    raise ValueError(f"expected drafts of shape {(len(group), n)}, got {tuple(toks.shape)}")
                lim = [n] * len(group)
                if opts.confidence_threshold > 0 and prop.confidence is not None:
                    ok = (prop.confidence[:, :n] >= opts.confidence_threshold).long().cumprod(1).sum(1)
                    lim = ok.tolist()
                toks_l = toks.tolist()
                if any(not 0 <= t < V for row in toks_l for t in row):
                    raise ValueError(f"draft token ids outside [0, vocab_size={V})")
            except Exception as e:  # noqa: BLE001 - drafting is an optimisation: fall back to plain decoding
                log.warning("engine: drafting failed for %s (%s: %s); decoding them without drafts",
                            [r.request_id for r in group], type(e).__name__, e)
                continue
            for k, r in enumerate(group):
                r.drafts = toks_l[k][:lim[k]]
                if prop.probs is not None and r.drafts:
                    r.draft_probs = prop.probs[k, :lim[k]]

    def _verify(self, reqs: Sequence[Request], hidden: torch.Tensor) -> dict[int, tuple | Exception]:
        """Accept the drafts of the verify rows of one forward: batch row → emitted tokens (accepted drafts +
        the target's token, their log-probabilities or None) or the error that fails that request. Greedy: leading matches of the processed
        scores' argmax; sampling: lossless rejection sampling with the request's generator; with
        ``spec.synthetic_acceptance_length`` a fixed count (benchmarks; not the target's output)."""
        rows = [b for b, r in enumerate(reqs) if r.drafts]
        if not rows:
            return {}
        Tw = 1 + max(len(reqs[b].drafts) for b in rows)
        idx = torch.tensor(rows, device=hidden.device)
        with torch.inference_mode():
            wl = self.model.lm_head(hidden.index_select(0, idx)[:, :Tw]).float()  # [Bv, Tw, V]
        scores = torch.stack([reqs[b].sampler.window_scores(wl[k], reqs[b].output, _padded(reqs[b].drafts, Tw - 1))
                              for k, b in enumerate(rows)])
        amax = torch.cat([scores.argmax(-1), (~torch.isfinite(wl).all(-1)).long()], 1).tolist()  # one sync
        out: dict[int, tuple | Exception] = {}
        L = self.spec_options.synthetic_acceptance_length
        for k, b in enumerate(rows):
            r = reqs[b]
            n = len(r.drafts)
            row = amax[k]
            tgt, nonfinite = row[:Tw], row[Tw:]
            if any(nonfinite[:n + 1]):
                out[b] = FloatingPointError("the logits of the verify window contain NaN or Inf")
                continue
            try:
                limit = torch.tensor([n], device=wl.device)
                if L is not None:
                    m = min(n, max(0, int(L) - 1))
                    nxt = (tgt[m] if not r.params.do_sample else
                           int(r.sampler.pipeline.choose(scores[k, m:m + 1], r.generator)[0]))
                elif r.params.do_sample:
                    d = torch.tensor([r.drafts], device=wl.device)
                    q = None if r.draft_probs is None else r.draft_probs[None]
                    mt, nt = rejection_accept(scores[k:k + 1, :n + 1], d, q, limit, None, r.generator)
                    m, nxt = int(mt[0]), int(nt[0])
                else:
                    m = 0
                    while m < n and r.drafts[m] == tgt[m]:
                        m += 1
                    nxt = tgt[m]
                toks = list(r.drafts[:m]) + [int(nxt)]
                lps = r.sampler.logprobs_of(wl[k, :m + 1], toks) if r.params.logprobs is not None else None
                out[b] = (toks, lps)
            except Exception as e:  # noqa: BLE001 - fails this request alone
                out[b] = e
        return out

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
        self.expire_leases()
        decodes, prefills = self.schedule()
        self.num_steps += 1
        outputs, self._failed_outputs = self._failed_outputs, []
        if not decodes and not prefills:
            return outputs
        if self.drafter is not None:
            self._draft(decodes)
        self._layout([decodes, [r for r, _ in prefills]])
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
                logits, cache, hidden = self._forward(reqs, ns, reqs[0].row, snaps)
            except Exception as e:  # the whole forward: its requests fail, the engine goes on
                self.pools.snapshots.free([s for sn in snaps for _, s in sn])
                for r in reqs:
                    r.drafts, r.draft_probs = [], None
                    fail(r, e, "forward")
                continue
            verified = self._verify(reqs, hidden)
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
                toks = self._sample([reqs[b] for b in done], logits[done])
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
                    self._commit_prefix([r], [sn])
                    self._track_decode_state([r])
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
        keys = self._block_keys(r, fed, r.keys)
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
        """Run a batch of prompts to completion; returns the generated ids per prompt, in order (with
        ``n > 1``: a list of the n samples' ids per prompt).

        Every prompt is checked before any is queued (an invalid one raises and queues none). If some requests
        fail inside a step the others still run to completion, then :class:`RequestFailedError` names the failed
        ones; on any other error (a stall, an interrupt) this call's unfinished requests are aborted."""
        prompts = list(prompts)
        groups: list[list[Request]] = []
        for i, p in enumerate(prompts):
            try:
                groups.append(self._make_requests(p, params, None, (), False, sampling))
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
        self.num_steps = self.num_forwards = self.rows_moved = 0
        self.prompt_tokens = self.generated_tokens = self.computed_prompt_tokens = 0
        self.spec_rounds = self.spec_drafted = self.spec_accepted = 0
        self.num_preemptions = self.recomputed_tokens = 0
        self.start_time = None
        if self.pools.device.type == "cuda":
            torch.cuda.synchronize(self.pools.device)
        self.warmup_s = time.perf_counter() - t0
        return self.warmup_s

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
             "throughput_tok_s": self.generated_tokens / wall if wall > 0 else 0.0,
             "preemptions": self.num_preemptions, "recomputed_tokens": self.recomputed_tokens,
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
