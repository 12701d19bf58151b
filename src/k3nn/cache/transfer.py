"""Prefill/decode disaggregation: move a prefilled request's cache to another engine (process, GPU, host).

The prefill side runs a request with ``prefill_only=True``: it computes N−1 prompt tokens and holds them.
:func:`export_request_state` then describes two views of that request (reference/hybrid_cache.md §6–7.6):

* token-level MLA latent pages covering [0, N−1) (per MLA layer ``[n_pages, 64, r + dr]``), and
* request-level KDA state after exactly N−1 tokens (per KDA layer recurrent ``[H, K, V]`` fp32, layout "HKV",
  and conv ``[W-1, 3·H·D]``, token-major, channels q|k|v),

plus a JSON manifest (config fingerprint, layouts, dtypes, token count, prompt ids and block hashes). The
request's pages and row stay pinned until the returned :class:`Lease` is released (after the decoder confirms).
:func:`import_request_state` checks the manifest against the receiving engine and starts the request there: its
first step recomputes the last prompt token on top of the N−1 state (never on a state that already contains
it: KDA updates are not idempotent) and samples the first token.

Transport: :func:`send_request_state` / :func:`recv_request_state` carry manifest + tensors over
``torch.distributed`` point-to-point (gloo: CPU tensors, NCCL: CUDA tensors); :func:`acknowledge` tells the
prefill side it may release. Another engine (NIXL, Mooncake) can move the same tensors: the manifest lists
every tensor's name, shape and dtype in order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine, SamplingParams

__all__ = ["RequestState", "Lease", "export_request_state", "import_request_state", "send_request_state",
           "recv_request_state", "acknowledge", "config_fingerprint", "MANIFEST_VERSION"]

MANIFEST_VERSION = 1


def config_fingerprint(config) -> str:
    """sha256 of the config's canonical JSON (every architectural field)."""
    d = config.to_dict()
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


class Lease:
    """Pins an exported request's pages and KDA row on the prefill engine until :meth:`release`."""

    def __init__(self, engine: "Engine", request_id: str):
        self.engine, self.request_id, self.released = engine, request_id, False

    def release(self) -> None:
        if not self.released:
            self.engine.release(self.request_id)
            self.released = True

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class RequestState:
    manifest: dict[str, Any]
    tensors: list[torch.Tensor]  # in manifest["tensors"] order
    lease: Lease | None = field(default=None, repr=False)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"manifest names an unknown dtype {name!r}")
    return dt


def export_request_state(engine: "Engine", request_id: str) -> RequestState:
    """Manifest + tensor copies of a PREFILLED request (added with ``prefill_only=True`` and stepped until its
    status is ``prefilled``); the request stays pinned until ``state.lease.release()``."""
    from ..engine.request import RequestStatus

    req = engine.requests.get(request_id)
    if req is None:
        raise KeyError(f"unknown request {request_id!r}")
    if req.status != RequestStatus.PREFILLED:
        raise ValueError(f"request {request_id!r} is {req.status.value}; export needs a prefill_only request that "
                         f"has finished its prefill (status 'prefilled')")
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
    manifest = {
        "version": MANIFEST_VERSION,
        "config_fingerprint": config_fingerprint(cfg),
        "request_id": request_id,
        "num_tokens": n,
        "prompt": list(req.prompt),
        "block_hashes": [k.hex() for k in req.keys],
        "mla": {"layers": pools.mla_layer_ids, "block_size": pools.block_size, "num_pages": len(pages),
                "row_dim": pools.row_dim, "latent_dim": cfg.kv_lora_rank, "rope_dim": cfg.qk_rope_head_dim,
                "dtype": _dtype_name(pools.dtype), "layout": "[page, token, latent|rope]"},
        "kda": {"layers": pools.running.layer_ids, "recurrent_shape": [H, D, D],
                "recurrent_dtype": _dtype_name(pools.running.recurrent[0].dtype) if rec else None,
                "recurrent_layout": "HKV", "conv_shape": [W - 1, 3 * H * D],
                "conv_dtype": _dtype_name(pools.dtype), "conv_layout": "token-major, channels q|k|v"},
        "tensors": entries,
    }
    return RequestState(manifest, tensors, Lease(engine, request_id))


def _check_manifest(engine: "Engine", m: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    if m.get("version") != MANIFEST_VERSION:
        raise ValueError(f"manifest version {m.get('version')!r} is not supported (expected {MANIFEST_VERSION})")
    fp = config_fingerprint(engine.mcfg)
    if m.get("config_fingerprint") != fp:
        raise ValueError("manifest config fingerprint does not match this engine's model config: the state was "
                         "produced by a different architecture")
    pools = engine.pools
    if m["mla"]["layers"] != pools.mla_layer_ids or m["kda"]["layers"] != pools.running.layer_ids:
        raise ValueError("manifest layer lists do not match this engine's model")
    if m["mla"]["row_dim"] != pools.row_dim or m["kda"]["recurrent_layout"] != "HKV":
        raise ValueError("manifest layouts do not match this engine's cache")
    if len(tensors) != len(m["tensors"]):
        raise ValueError(f"manifest lists {len(m['tensors'])} tensors, got {len(tensors)}")
    for t, e in zip(tensors, m["tensors"]):
        if list(t.shape) != e["shape"]:
            raise ValueError(f"tensor {e['name']}: shape {tuple(t.shape)} != manifest {e['shape']}")
    if not 0 <= m["num_tokens"] < len(m["prompt"]):
        raise ValueError(f"manifest num_tokens {m['num_tokens']} must be below the prompt length {len(m['prompt'])}")


def import_request_state(engine: "Engine", state: RequestState, params: "SamplingParams | None" = None,
                         request_id: str | None = None) -> str:
    """Start the transferred request on ``engine`` (block size may differ from the sender's only if both are
    64; pages are re-laid out token by token otherwise). Returns the new request id."""
    m, ts = state.manifest, state.tensors
    _check_manifest(engine, m, ts)
    by_name = {e["name"]: t for e, t in zip(m["tensors"], ts)}
    pools = engine.pools
    n = m["num_tokens"]
    pages = []
    for layer in pools.mla_layer_ids:
        p = by_name[f"mla.{layer}.pages"]
        bs = m["mla"]["block_size"]
        if bs != pools.block_size:  # re-page: flatten tokens, cut to n, pad to our page size
            flat = p.reshape(-1, p.shape[-1])[:n]
            pad = pools.pages_for(n) * pools.block_size - n
            flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[-1])])
            p = flat.view(-1, pools.block_size, flat.shape[-1])
        pages.append(p.to(pools.device))
    rec = [by_name[f"kda.{layer}.recurrent"].to(pools.device) for layer in pools.running.layer_ids]
    conv = [by_name[f"kda.{layer}.conv"].to(pools.device) for layer in pools.running.layer_ids]
    return engine.adopt(m["prompt"], n, pages, rec, conv, params, request_id)


# -- torch.distributed transport --------------------------------------------------------------------------------
def _wire_device(group) -> torch.device:
    import torch.distributed as dist

    return torch.device("cpu") if dist.get_backend(group) == "gloo" else torch.device("cuda", torch.cuda.current_device())


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
    """Receive what :func:`send_request_state` sent from rank ``src``."""
    import torch.distributed as dist

    dev = _wire_device(group)
    n = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.recv(n, src, group=group)
    payload = torch.empty(int(n), dtype=torch.uint8, device=dev)
    dist.recv(payload, src, group=group)
    manifest = json.loads(bytes(payload.cpu().tolist()).decode())
    tensors = []
    for e in manifest["tensors"]:
        t = torch.empty(e["shape"], dtype=_dtype(e["dtype"]), device=dev)
        dist.recv(t, src, group=group)
        tensors.append(t.to(device))
    return RequestState(manifest, tensors)


def acknowledge(src: int, ok: bool = True, group=None) -> None:
    """Tell the sender the import finished (it then releases its pin)."""
    import torch.distributed as dist

    dist.send(torch.tensor([1 if ok else 0], dtype=torch.int64, device=_wire_device(group)), src, group=group)
