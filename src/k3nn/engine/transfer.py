"""Prefill/decode disaggregation: move a prefilled request's cache to another engine (process, GPU, host).

The prefill side runs a request with ``prefill_only=True``: it computes N−1 prompt tokens and holds them.
:func:`export_request_state` then describes two views of that request (reference/hybrid_cache.md §6–7.6):

* token-level MLA latent pages covering [0, N−1) (per MLA layer ``[n_pages, 64, r + dr]``), and
* request-level KDA state after exactly N−1 tokens (per KDA layer recurrent ``[H, K, V]`` fp32, layout "HKV",
  and conv ``[W-1, 3·H·D]``, token-major, channels q|k|v),

plus a JSON manifest (config fingerprint, layouts, dtypes, token count, prompt ids, block hashes, digest; for a
prompt with images, each image's content key and token count).

**Images.** The block hashes of a prompt with images mix in each image's content key (sha256 of its pixels and
grid), so the decode side keys the pages as the prefill side did and two images behind the same token ids
never share pages. The manifest names the images by content key only: the decode side passes the same
``pixel_values`` / ``image_grid_thw`` to :func:`import_request_state`, which checks they hash to the manifest's
keys (it runs the vision tower only if the last prompt token, the one it recomputes, is an image token).

**Leases.** The request's pages and row stay pinned until the returned :class:`Lease` is released (after the
decoder confirms) or expires: every lease has a deadline (``lease_timeout_s``, default 600 s, on the
``time.monotonic()`` clock; :meth:`Lease.renew` moves it) and :func:`expire_leases` (meant to run once per
``Engine.step()``, before scheduling) frees every request whose lease ran out. :meth:`Lease.release` is idempotent: it returns
False when the lease already ended or the request is no longer held (aborted, failed, released).

**Integrity.** :func:`import_request_state` trusts nothing in the manifest. Before the receiving engine
allocates anything it checks the version, the config fingerprint, layers and layouts, that ``num_tokens`` is
N−1 for the shipped prompt, that ``block_hashes`` equal the hashes of the prompt under this engine's prefix
salt (a prompt edited under stale hashes would otherwise index pages of one prompt under another's keys),
that the images given to the import have the manifest's content keys, that the pages cover exactly
``ceil(num_tokens / block_size)`` pages, that every tensor's name, shape and dtype match both the manifest's list
and this engine's layout, and finally the digest. Any disagreement is a
ValueError naming it. If ``Engine.adopt`` itself fails (no free row or pages), whatever it left behind is
undone (rows, pages, snapshot slots, a half-registered request), so a failed import leaves the engine as it
was, apart from prefix entries evicted to make room.

**Digest** (``manifest["digest"]``, sha256): one part over the canonical JSON of the prompt ids and
``num_tokens``, one part per tensor over its name, shape, dtype and bytes (C order), and ``value`` = sha256 of
the part digests in manifest order. Per-tensor parts name the tensor that disagrees and let the tensors be
hashed in parallel. Cost: every shipped byte is read once more on each side — copied to host memory in
64 MiB chunks (a device→host copy for CUDA tensors) and hashed at sha256 speed, about 1.5 GB/s per core
(threads over tensors when the state exceeds 256 MiB). For K3 (bf16) a request ships 27 KiB per token of
latent pages plus 0.45 GB of KDA state: a 128k-token request is ~4 GB, ~2.7 s of sha256 on one core per
side, divided by the threads the host can give (the KDA state alone is ~0.3 s on one core).
The digest guards against corruption and mismatched halves of a transfer, not against a forger (anyone who can
edit the manifest can recompute it).

Transport: :func:`send_request_state` / :func:`recv_request_state` carry manifest + tensors over
``torch.distributed`` point-to-point (gloo: CPU tensors, NCCL: CUDA tensors); :func:`acknowledge` tells the
prefill side it may release. Another engine (NIXL, Mooncake) can move the same tensors: the manifest lists
every tensor's name, shape and dtype in order.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import time
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..cache.prefix import block_hashes

if TYPE_CHECKING:  # pragma: no cover
    from .request import ImageInputs, SamplingParams

__all__ = ["RequestState", "Lease", "export_request_state", "import_request_state", "expire_leases", "leases",
           "state_digest", "send_request_state", "recv_request_state", "acknowledge", "config_fingerprint",
           "MANIFEST_VERSION", "DEFAULT_LEASE_TIMEOUT_S"]

MANIFEST_VERSION = 3  # 2: digest, lease deadline; 3: image content keys
DEFAULT_LEASE_TIMEOUT_S = 600.0
_HASH_CHUNK_BYTES = 64 << 20
_PARALLEL_HASH_BYTES = 256 << 20
_MLA_LAYOUT = "[page, token, latent|rope]"
_CONV_LAYOUT = "token-major, channels q|k|v"


def config_fingerprint(config) -> str:
    """sha256 of the config's canonical JSON (every architectural field)."""
    d = config.to_dict()
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


# -- leases ---------------------------------------------------------------------------------------------------


def _timeout(timeout_s: Any, name: str = "lease_timeout_s") -> float | None:
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds or None, got {type(timeout_s).__name__}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"{name} must be a finite number of seconds > 0 (None: never expires), got {timeout_s}")
    return float(timeout_s)


class Lease:
    """Pins an exported request's pages and KDA row on the prefill engine until :meth:`release` or expiry.

    ``expires_at``: deadline on the ``time.monotonic()`` clock (None: never expires). ``released``: the lease
    ended (released, expired, or the request ended some other way); ``end_reason`` says which ("released",
    "expired", "gone"). A new lease joins the engine's registry (:func:`leases`), which :func:`expire_leases`
    walks, so a lease whose holder vanished (a decoder that died) still expires. The lease refers to its engine
    weakly: the registry never keeps an engine alive."""

    def __init__(self, engine: "Engine", request_id: str, timeout_s: float | None = DEFAULT_LEASE_TIMEOUT_S,
                 now: float | None = None):
        timeout = _timeout(timeout_s, "timeout_s")
        live = engine.leases
        old = live.get(request_id)
        if old is not None and old._held():
            raise ValueError(f"request {request_id!r} is already exported under a live lease (expires_at "
                             f"{old.expires_at}); release it or reuse that state")
        self._engine = weakref.ref(engine)
        self.request_id = request_id
        self._request = engine.requests[request_id]
        self.released = False
        self.end_reason: str | None = None
        self.expires_at: float | None = None
        self._deadline(timeout, now)
        live[request_id] = self

    @property
    def engine(self) -> "Engine | None":
        """The prefill engine (None once it was garbage-collected)."""
        return self._engine()

    def _deadline(self, timeout_s: float | None, now: float | None) -> None:
        now = time.monotonic() if now is None else now
        self.expires_at = None if timeout_s is None else now + timeout_s

    def _held(self) -> bool:
        """The engine still holds the exported request (prefilled, the same request object)."""
        from .request import RequestStatus

        engine = self.engine
        req = engine.requests.get(self.request_id) if engine is not None else None
        return req is self._request and req.status == RequestStatus.PREFILLED

    def _end(self, reason: str) -> bool:
        """Free the request if the engine still holds it; True if this call freed it."""
        held, engine = self._held(), self.engine
        if held:
            engine.release(self.request_id)  # raises before the lease is marked ended
        self.released, self.end_reason = True, reason if held else "gone"
        live = engine.leases if engine is not None else None
        if live is not None and live.get(self.request_id) is self:
            del live[self.request_id]
        return held

    def is_expired(self, now: float | None = None) -> bool:
        """The lease ran out: it was ended by expiry, or it is live and ``now`` is past its deadline."""
        if self.released:
            return self.end_reason == "expired"
        now = time.monotonic() if now is None else now
        return self.expires_at is not None and now >= self.expires_at

    @property
    def expired(self) -> bool:
        """:meth:`is_expired` now."""
        return self.is_expired()

    def release(self) -> bool:
        """Free the pinned request; returns True if this call freed it. Idempotent: False (and nothing happens)
        when the lease already ended or the request was aborted, failed or released through the engine."""
        if self.released:
            return False
        return self._end("released")

    def renew(self, timeout_s: float | None = DEFAULT_LEASE_TIMEOUT_S, now: float | None = None) -> None:
        """Move the deadline to ``now + timeout_s`` (None: never expires). Raises ValueError when the lease
        already ended or its deadline has passed (the pages may be gone: export again)."""
        t = _timeout(timeout_s, "timeout_s")
        if not self.released and not self._held():
            self._end("gone")
        if self.released:
            raise ValueError(f"lease of request {self.request_id!r} already ended ({self.end_reason}); "
                             f"it cannot be renewed")
        if self.is_expired(now):
            raise ValueError(f"lease of request {self.request_id!r} expired at {self.expires_at:.3f} (monotonic); "
                             f"it cannot be renewed")
        self._deadline(t, now)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = self.end_reason if self.released else f"live, expires_at={self.expires_at}"
        return f"Lease({self.request_id!r}, {state})"


def leases(engine: "Engine") -> dict[str, Lease]:
    """The live leases of ``engine`` (request id → lease; a copy)."""
    return dict(engine.leases)


def expire_leases(engine: "Engine", now: float | None = None) -> list[str]:
    """Release every lease of ``engine`` whose deadline is ≤ ``now`` (``time.monotonic()`` when None); returns
    the request ids it freed. Leases whose request ended some other way (aborted, failed) are dropped
    silently. Meant to be called once per ``Engine.step()``: O(1) when the engine has no leases, else O(live
    leases). The same as ``engine.expire_leases(now)``, which the engine calls itself."""
    return engine.expire_leases(now)


# -- manifest ---------------------------------------------------------------------------------------------------
@dataclass
class RequestState:
    """What :func:`export_request_state` returns and :func:`import_request_state` takes: the ``manifest`` (a JSON-able
    dict: config fingerprint, layouts, token ids, block hashes, page and state tensor descriptions, a digest), the
    ``tensors`` it describes (latent pages per MLA layer, KDA state per KDA layer; in ``manifest["tensors"]`` order),
    and on the exporting side the :class:`Lease` that pins the request until released."""

    manifest: dict[str, Any]
    tensors: list[torch.Tensor]  # in manifest["tensors"] order
    lease: Lease | None = field(default=None, repr=False)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _dtype(name: Any, what: str = "manifest dtype") -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"{what} names an unknown dtype {name!r}")
    return dt


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _header_digest(prompt: Sequence[int], num_tokens: int) -> bytes:
    return hashlib.sha256(_canonical({"num_tokens": int(num_tokens), "prompt": [int(t) for t in prompt]})).digest()


def _tensor_digest(name: str, t: torch.Tensor) -> bytes:
    """sha256 of name, shape, dtype and the C-order bytes (hashed in chunks copied to host memory)."""
    h = hashlib.sha256(_canonical({"dtype": _dtype_name(t.dtype), "name": name, "shape": list(t.shape)}))
    flat = t.detach().reshape(-1)
    step = max(1, _HASH_CHUNK_BYTES // max(1, flat.element_size()))
    for i in range(0, flat.numel(), step):
        h.update(flat[i:i + step].cpu().contiguous().view(torch.uint8).numpy())
    return h.digest()


def state_digest(prompt: Sequence[int], num_tokens: int, names: Sequence[str],
                 tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The manifest's ``digest`` entry: ``{"algorithm": "sha256", "value": hex, "parts": {part: hex}}`` with parts
    ``"prompt"`` (prompt ids + num_tokens) and one per tensor name; ``value`` hashes the part digests in order."""
    if len(names) != len(tensors):
        raise ValueError(f"state_digest: {len(names)} names for {len(tensors)} tensors")
    total = sum(t.numel() * t.element_size() for t in tensors)
    if total >= _PARALLEL_HASH_BYTES and len(tensors) > 1:  # hashlib and the copies release the GIL
        with ThreadPoolExecutor(max_workers=min(len(tensors), os.cpu_count() or 1)) as ex:
            parts = list(ex.map(_tensor_digest, names, tensors))
    else:
        parts = [_tensor_digest(n, t) for n, t in zip(names, tensors)]
    parts = [_header_digest(prompt, num_tokens)] + parts
    return {"algorithm": "sha256", "value": hashlib.sha256(b"".join(parts)).hexdigest(),
            "parts": {k: p.hex() for k, p in zip(["prompt", *names], parts)}}


def _prompt_hashes(engine: "Engine", prompt: Sequence[int], unit: int, images: "ImageInputs | None" = None
                   ) -> list[str]:
    """Chained block hashes of ``prompt`` in ``unit``-token blocks under ``engine``'s prefix salt, mixing in the
    content keys of the prompt's ``images`` (hex)."""
    from .images import image_block_keys

    pc = engine.prefix
    if images is None and pc is not None and pc.unit == unit:
        keys = pc.hashes(prompt)
    else:
        keys = block_hashes(prompt, unit, pc.salt if pc is not None else b"",
                            extra_keys=image_block_keys(images, unit))
    return [k.hex() for k in keys]


def export_request_state(engine: "Engine", request_id: str,
                         lease_timeout_s: float | None = DEFAULT_LEASE_TIMEOUT_S) -> RequestState:
    """Manifest + tensor copies of a PREFILLED request (added with ``prefill_only=True`` and stepped until its
    status is ``prefilled``); the request stays pinned until ``state.lease.release()`` or until the lease
    expires (``lease_timeout_s`` seconds from now; None: never). One live lease per request: export again
    only after it ended."""
    from .request import RequestStatus

    timeout = _timeout(lease_timeout_s)
    req = engine.requests.get(request_id)
    if req is None:
        raise KeyError(f"unknown request {request_id!r}")
    if req.status != RequestStatus.PREFILLED:
        raise ValueError(f"request {request_id!r} is {req.status.value}; export needs a prefill_only request that "
                         f"has finished its prefill (status 'prefilled')")
    old = engine.leases.get(request_id)
    if old is not None and old._held():  # checked again by Lease(): fail before copying anything
        raise ValueError(f"request {request_id!r} is already exported under a live lease (expires_at "
                         f"{old.expires_at}); release it or reuse that state")
    pools, cfg = engine.pools, engine.mcfg
    n = req.num_computed
    pages = req.blocks[:pools.pages_for(n)]
    tensors: list[torch.Tensor] = []
    entries: list[dict[str, Any]] = []

    def add(name: str, t: torch.Tensor) -> None:
        tensors.append(t.contiguous())
        entries.append({"name": name, "shape": list(t.shape), "dtype": _dtype_name(t.dtype)})

    for layer, data in zip(pools.mla_layer_ids, pools.read_pages(pages) if pages else
                           [p[:0] for p in pools.pages]):
        data = data.clone()
        tail = n - (len(pages) - 1) * pools.block_size if pages else 0
        if pages and tail < pools.block_size:
            data[-1, tail:] = 0  # never ship stale rows of the partial last page
        add(f"mla.{layer}.pages", data)
    rec, conv = pools.running.read(req.row)
    for layer, r, c in zip(pools.running.layer_ids, rec, conv):
        add(f"kda.{layer}.recurrent", r)
        add(f"kda.{layer}.conv", c)
    H, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    prompt = list(req.prompt)
    keys = [k.hex() for k in req.keys] if engine.prefix is not None and req.keys else \
        _prompt_hashes(engine, prompt, pools.block_size, req.images)
    images = [] if req.images is None else [{"content_key": k.hex(), "num_tokens": n}
                                            for k, n in zip(req.images.content_keys, req.images.sizes)]
    manifest = {
        "version": MANIFEST_VERSION,
        "config_fingerprint": config_fingerprint(cfg),
        "request_id": request_id,
        "num_tokens": n,
        "prompt": prompt,
        "block_hashes": keys,
        "images": images,
        "mla": {"layers": pools.mla_layer_ids, "block_size": pools.block_size, "num_pages": len(pages),
                "row_dim": pools.row_dim, "latent_dim": cfg.kv_lora_rank, "rope_dim": cfg.qk_rope_head_dim,
                "dtype": _dtype_name(pools.dtype), "layout": _MLA_LAYOUT},
        "kda": {"layers": pools.running.layer_ids, "recurrent_shape": [H, D, D],
                "recurrent_dtype": _dtype_name(pools.running.recurrent[0].dtype) if rec else None,
                "recurrent_layout": "HKV", "conv_shape": [W - 1, 3 * H * D],
                "conv_dtype": _dtype_name(pools.dtype), "conv_layout": _CONV_LAYOUT},
        "tensors": entries,
        "digest": state_digest(prompt, n, [e["name"] for e in entries], tensors),
    }
    return RequestState(manifest, tensors, Lease(engine, request_id, timeout))


def _get(m: Any, path: str, kind: type | tuple[type, ...] | None = None) -> Any:
    """``m[a][b]...`` for ``path`` "a.b", ValueError naming the field when it is missing or of the wrong type."""
    cur = m
    for key in path.split("."):
        if not isinstance(cur, dict) or key not in cur:
            raise ValueError(f"manifest is missing field {path!r}")
        cur = cur[key]
    if kind is not None and (not isinstance(cur, kind) or (kind is int and isinstance(cur, bool))):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValueError(f"manifest field {path!r} must be a {want}, got {type(cur).__name__}")
    return cur


def _check_manifest(engine: "Engine", state: Any, pixel_values: torch.Tensor | None = None,
                    image_grid_thw: torch.Tensor | None = None) -> tuple[list[int], int]:
    """Every check of an incoming state against itself, the images given with it and ``engine`` (module
    docstring); returns the prompt and num_tokens. Reads the engine, changes nothing."""
    if not isinstance(state, RequestState):
        raise TypeError(f"state must be a RequestState, got {type(state).__name__}")
    m, ts = state.manifest, state.tensors
    if not isinstance(m, dict):
        raise ValueError(f"state.manifest must be a dict, got {type(m).__name__}")
    if m.get("version") != MANIFEST_VERSION:
        raise ValueError(f"manifest version {m.get('version')!r} is not supported (expected {MANIFEST_VERSION})")
    if _get(m, "config_fingerprint", str) != config_fingerprint(engine.mcfg):
        raise ValueError("manifest config fingerprint does not match this engine's model config: the state was "
                         "produced by a different architecture")
    pools, cfg = engine.pools, engine.mcfg
    kda_layers = pools.running.layer_ids
    if _get(m, "mla.layers", list) != pools.mla_layer_ids or _get(m, "kda.layers", list) != kda_layers:
        raise ValueError(f"manifest layer lists (MLA {m['mla']['layers']}, KDA {m['kda']['layers']}) do not match "
                         f"this engine's model (MLA {pools.mla_layer_ids}, KDA {kda_layers})")
    for path, want in (("mla.row_dim", pools.row_dim), ("mla.latent_dim", cfg.kv_lora_rank),
                       ("mla.rope_dim", cfg.qk_rope_head_dim), ("mla.layout", _MLA_LAYOUT),
                       ("kda.recurrent_layout", "HKV"), ("kda.conv_layout", _CONV_LAYOUT)):
        if _get(m, path) != want:
            raise ValueError(f"manifest {path} {_get(m, path)!r} does not match this engine's cache ({want!r})")
    H, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    rec_shape, conv_shape = [H, D, D], [W - 1, 3 * H * D]
    if kda_layers:
        for path, want in (("kda.recurrent_shape", rec_shape), ("kda.conv_shape", conv_shape)):
            if _get(m, path) != want:
                raise ValueError(f"manifest {path} {_get(m, path)} does not match this engine's KDA state {want}")

    # prompt, token count and block hashes
    prompt = _get(m, "prompt", list)
    V = cfg.vocab_size
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < V]
    if not prompt or bad:
        raise ValueError(f"manifest prompt must be a non-empty list of token ids in [0, {V}), got "
                         f"{'an empty list' if not prompt else f'{bad[:4]}'}")
    prompt = [int(t) for t in prompt]
    n = _get(m, "num_tokens", int)
    if n != len(prompt) - 1:
        raise ValueError(f"manifest num_tokens {n} is inconsistent with its prompt of {len(prompt)} tokens: an "
                         f"exported request holds exactly N−1 = {len(prompt) - 1} computed tokens")
    bs = _get(m, "mla.block_size", int)
    if bs < 1:
        raise ValueError(f"manifest mla.block_size must be >= 1, got {bs}")
    images = _check_images(engine, m, prompt, pixel_values, image_grid_thw)
    hashes = _get(m, "block_hashes", list)
    want_hashes = _prompt_hashes(engine, prompt, bs, images)
    if hashes != want_hashes:
        k = next((i for i, (a, b) in enumerate(zip(hashes, want_hashes)) if a != b), min(len(hashes), len(want_hashes)))
        raise ValueError(f"manifest block_hashes do not match its prompt (first difference at block {k}: "
                         f"{len(hashes)} hashes shipped, {len(want_hashes)} computed from the prompt under this "
                         f"engine's prefix salt): the prompt was altered after hashing, or the salts differ")

    # pages and the tensor list
    n_pages = pools.pages_for(n) if bs == pools.block_size else -(-n // bs)
    if _get(m, "mla.num_pages", int) != n_pages:
        raise ValueError(f"manifest mla.num_pages {m['mla']['num_pages']} does not cover num_tokens {n}: "
                         f"{n} tokens take {n_pages} pages of {bs}")
    mla_dt = _dtype(_get(m, "mla.dtype"), "manifest mla.dtype")
    conv_dt = _dtype(_get(m, "kda.conv_dtype"), "manifest kda.conv_dtype") if kda_layers else None
    rec_dt = _dtype(_get(m, "kda.recurrent_dtype"), "manifest kda.recurrent_dtype") if kda_layers else None
    expect = [(f"mla.{l}.pages", [n_pages, bs, pools.row_dim], mla_dt, "mla.dtype") for l in pools.mla_layer_ids]
    for l in kda_layers:
        expect += [(f"kda.{l}.recurrent", rec_shape, rec_dt, "kda.recurrent_dtype"),
                   (f"kda.{l}.conv", conv_shape, conv_dt, "kda.conv_dtype")]
    entries = _get(m, "tensors", list)
    if not isinstance(ts, (list, tuple)):
        raise ValueError(f"state.tensors must be a list of tensors, got {type(ts).__name__}")
    if len(ts) != len(entries):
        raise ValueError(f"manifest lists {len(entries)} tensors, got {len(ts)}: a tensor was lost or added")
    if len(entries) != len(expect):
        raise ValueError(f"manifest lists {len(entries)} tensors, this engine's layout needs {len(expect)} "
                         f"({', '.join(e[0] for e in expect)})")
    for i, (e, t, (name, shape, dt, declared)) in enumerate(zip(entries, ts, expect)):
        if not isinstance(e, dict) or set(e) < {"name", "shape", "dtype"}:
            raise ValueError(f"manifest tensors[{i}] must be a dict with name, shape and dtype, got {e!r}")
        if e["name"] != name:
            raise ValueError(f"manifest tensors[{i}] is {e['name']!r}, expected {name!r} (tensors go MLA pages per "
                             f"layer, then recurrent and conv per KDA layer)")
        if not isinstance(e["shape"], (list, tuple)) or list(e["shape"]) != shape:
            raise ValueError(f"tensor {name}: manifest shape {e['shape']} != {shape}, what this engine's layout "
                             f"requires (num_tokens {n})")
        if e["dtype"] != _dtype_name(dt):
            raise ValueError(f"tensor {name}: manifest dtype {e['dtype']!r} != {_dtype_name(dt)!r} declared in "
                             f"manifest {declared}")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensor {name}: expected a torch.Tensor, got {type(t).__name__}")
        if list(t.shape) != shape:
            raise ValueError(f"tensor {name}: shape {tuple(t.shape)} != manifest {shape}")
        if t.dtype != dt:
            raise ValueError(f"tensor {name}: dtype {_dtype_name(t.dtype)} != manifest {_dtype_name(dt)}")

    # digest (last: it reads every byte)
    d = _get(m, "digest", dict)
    if d.get("algorithm") != "sha256":
        raise ValueError(f"manifest digest algorithm {d.get('algorithm')!r} is not supported (expected 'sha256')")
    names = [e["name"] for e in entries]
    shipped = _get(m, "digest.parts", dict)
    if sorted(shipped) != sorted(["prompt", *names]):
        raise ValueError(f"manifest digest parts {sorted(shipped)} do not name the prompt and every tensor")
    got = state_digest(prompt, n, names, list(ts))
    bad = [k for k in ["prompt", *names] if shipped[k] != got["parts"][k]]
    if bad:
        what = ", ".join("the prompt ids / num_tokens" if k == "prompt" else f"tensor {k!r}" for k in bad)
        raise ValueError(f"digest mismatch: {what} {'differ' if len(bad) > 1 or bad == ['prompt'] else 'differs'} "
                         f"from what the sender hashed (corrupted in transit or edited after export)")
    if d.get("value") != got["value"]:
        raise ValueError("digest mismatch: the manifest's digest value does not match its parts")
    return prompt, n



class _AdoptGuard:
    """What ``Engine.adopt`` may take (a row, pages, snapshot slots, a registered request), recorded before the
    call, so a failed call is undone whether or not adopt cleans up after itself (it is meant to be atomic; this
    is the second line). Costs one pass over the page and snapshot pools and the engine's requests."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.ids = set(engine.requests)
        self.owners = list(engine.row_owner)
        self.excess = self._excess()

    def _excess(self) -> tuple[list[int], list[int]]:
        """Per page and per snapshot slot: references the allocator counts beyond those held by requests and the
        prefix index (a reference taken by a failed adopt shows up here; evictions cancel out)."""
        e = self.engine
        reqs = {id(r): r for r in e.requests.values()}
        for r in [*e.running, *e.row_owner]:
            if r is not None:
                reqs.setdefault(id(r), r)
        pages, slots = Counter(), Counter()
        for r in reqs.values():
            pages.update(r.blocks)
            snap = getattr(r, "decode_snap", None)
            if snap is not None:
                slots[snap[1]] += 1
            if getattr(r, "spare_snap", None) is not None:
                slots[r.spare_snap] += 1
        if e.prefix is not None:
            for ent in e.prefix.entries.values():
                pages[ent.page] += 1
                if ent.snapshot is not None:
                    slots[ent.snapshot] += 1
        alloc, snaps = e.pools.allocator, e.pools.snapshots
        return ([alloc.refcount(b) - pages[b] for b in range(alloc.num_blocks)],
                [snaps.refcount(s) - slots[s] for s in range(snaps.num_slots)])

    def undo(self) -> list[str]:
        """Remove a request the failed call registered, free the rows, pages and slots it took; what was done."""
        e, done = self.engine, []
        for rid in [r for r in e.requests if r not in self.ids]:
            req = e.requests[rid]
            try:
                e.abort(rid)  # frees its row, pages and snapshot
            except Exception as exc:  # the checks below still free what it holds
                done.append(f"abort({rid!r}) raised {type(exc).__name__}: {exc}")
            del e.requests[rid]
            for queue in (e.running, e.waiting):
                if req in queue:
                    queue.remove(req)
            done.append(f"removed the half-imported request {rid!r}")
        registered = {id(r) for r in e.requests.values()}
        for row, owner in enumerate(e.row_owner):
            if owner is not None and id(owner) not in registered and row < len(self.owners) \
                    and self.owners[row] is None:
                e.row_owner[row] = None
                done.append(f"freed running row {row}")
        for r in [r for r in e.running if id(r) not in registered]:
            e.running.remove(r)
        pages, slots = self._excess()
        leaked = [b for b, (x0, x1) in enumerate(zip(self.excess[0], pages)) for _ in range(x1 - x0)]
        leaked_slots = [s for s, (x0, x1) in enumerate(zip(self.excess[1], slots)) for _ in range(x1 - x0)]
        if leaked:
            e.pools.allocator.free(leaked)
            done.append(f"freed {len(leaked)} leaked page reference(s)")
        if leaked_slots:
            e.pools.snapshots.free(leaked_slots)
            done.append(f"freed {len(leaked_slots)} leaked snapshot slot reference(s)")
        return done


def _check_images(engine: "Engine", m: dict, prompt: list[int], pixel_values, image_grid_thw
                  ) -> "ImageInputs | None":
    """The images given to the import, checked against the prompt and against the manifest's content keys."""
    shipped = _get(m, "images", list)
    if any(not isinstance(e, dict) or not isinstance(e.get("content_key"), str) for e in shipped):
        raise ValueError(f"manifest images must be a list of {{'content_key': hex, 'num_tokens': int}}, got "
                         f"{shipped!r}")
    if shipped and pixel_values is None and image_grid_thw is None:
        raise ValueError(f"the state was prefilled with {len(shipped)} image(s): pass the prompt's pixel_values / "
                         f"image_grid_thw to import_request_state (their content keys are checked against the "
                         f"manifest's)")
    from .images import check_images

    images = check_images(engine.multimodal, type(engine.model).__name__, prompt, pixel_values, image_grid_thw)
    got = [] if images is None else [{"content_key": k.hex(), "num_tokens": n}
                                     for k, n in zip(images.content_keys, images.sizes)]
    if got != shipped:
        k = next((i for i, (a, b) in enumerate(zip(got, shipped)) if a != b), min(len(got), len(shipped)))
        raise ValueError(f"the images given ({len(got)}) are not those the state was prefilled with "
                         f"({len(shipped)}): image {k} differs (content key or token count)")
    return images


def import_request_state(engine: "Engine", state: RequestState, params: "SamplingParams | None" = None,
                         request_id: str | None = None, *, pixel_values: torch.Tensor | None = None,
                         image_grid_thw: torch.Tensor | None = None) -> str:
    """Check ``state`` against itself and ``engine`` (every check of the module docstring, before anything is
    allocated; ValueError naming what disagrees), then start the transferred request there. Returns the new
    request id. A prompt with images needs the ``pixel_values`` / ``image_grid_thw`` it was prefilled with. The
    sender's block size may differ from this engine's: pages are then re-laid out token by token. If
    ``Engine.adopt`` raises (CacheFullError: no free row or pages), nothing it took is kept."""
    prompt, n = _check_manifest(engine, state, pixel_values, image_grid_thw)
    m = state.manifest
    by_name = {e["name"]: t for e, t in zip(m["tensors"], state.tensors)}
    pools = engine.pools
    bs = m["mla"]["block_size"]
    pages = []
    for layer in pools.mla_layer_ids:
        p = by_name[f"mla.{layer}.pages"]
        if bs != pools.block_size:  # re-page: flatten tokens, cut to n, pad to our page size
            flat = p.reshape(-1, p.shape[-1])[:n]
            pad = pools.pages_for(n) * pools.block_size - n
            flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[-1])])
            p = flat.view(-1, pools.block_size, flat.shape[-1])
        pages.append(p.to(pools.device))
    rec = [by_name[f"kda.{layer}.recurrent"].to(pools.device) for layer in pools.running.layer_ids]
    conv = [by_name[f"kda.{layer}.conv"].to(pools.device) for layer in pools.running.layer_ids]
    guard = _AdoptGuard(engine)
    try:
        return engine.adopt(prompt, n, pages, rec, conv, params, request_id, pixel_values=pixel_values,
                            image_grid_thw=image_grid_thw)
    except BaseException as exc:
        done = guard.undo()
        if done:
            exc.add_note("import_request_state undid what Engine.adopt left behind: " + "; ".join(done))
        raise


# -- torch.distributed transport --------------------------------------------------------------------------------
def _wire_device(group) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def send_request_state(state: RequestState, dst: int, group=None, wait_ack: bool = True) -> None:
    """Send manifest + tensors to rank ``dst``. With ``wait_ack`` block until the receiver calls
    :func:`acknowledge`, then release the lease (a failed import raises here and keeps the pin)."""
    import torch.distributed as dist

    dev = _wire_device(group)
    payload = torch.frombuffer(bytearray(json.dumps(state.manifest).encode()), dtype=torch.uint8)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=dev), dst, group=group)
    dist.send(payload.to(dev), dst, group=group)
    for t in state.tensors:
        dist.send(t.to(dev).contiguous(), dst, group=group)
    if wait_ack:
        ack = torch.zeros(1, dtype=torch.int64, device=dev)
        dist.recv(ack, dst, group=group)
        if int(ack) != 1:
            raise RuntimeError(f"rank {dst} could not import the request state (ack {int(ack)}); it stays pinned")
        if state.lease is not None:
            state.lease.release()


def recv_request_state(src: int, group=None, device: torch.device | str = "cpu") -> RequestState:
    """Receive what :func:`send_request_state` sent from rank ``src`` (as sent: :func:`import_request_state`
    checks it)."""
    import torch.distributed as dist

    dev = _wire_device(group)
    n = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.recv(n, src, group=group)
    payload = torch.empty(int(n), dtype=torch.uint8, device=dev)
    dist.recv(payload, src, group=group)
    manifest = json.loads(payload.cpu().numpy().tobytes().decode())
    tensors = []
    for i, e in enumerate(_get(manifest, "tensors", list)):
        shape = e.get("shape") if isinstance(e, dict) else None
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise ValueError(f"received manifest tensors[{i}] has no valid shape: {e!r}")
        t = torch.empty(shape, dtype=_dtype(e.get("dtype"), f"received manifest tensors[{i}]"), device=dev)
        dist.recv(t, src, group=group)
        tensors.append(t.to(device))
    return RequestState(manifest, tensors)


def acknowledge(src: int, ok: bool = True, group=None) -> None:
    """Tell the sender the import finished (it then releases its pin)."""
    import torch.distributed as dist

    dist.send(torch.tensor([1 if ok else 0], dtype=torch.int64, device=_wire_device(group)), src, group=group)
