"""Load compressed-tensors MXFP4 routed experts into k3nn's stacked expert buffers, one expert at a time.

Checkpoint keys (per expert j, per projection p ∈ {w1, w3, w2}):
``{prefix}.experts.{j}.{p}.weight_packed`` u8 [N, K/2] and ``{prefix}.experts.{j}.{p}.weight_scale`` u8 [N, K/32].
The loader copies those bytes straight into :class:`~k3nn.layers.moe.Experts`' ``{p}_packed`` / ``{p}_scale``
buffers (MXFP4 experts), or dequantizes one expert at a time into ``{p}`` (bf16/fp32 experts), so no bf16
copy of all experts ever exists.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from .mxfp4 import check_mxfp4, mxfp4_dequantize

__all__ = ["load_compressed_experts", "compressed_expert_keys"]

_PROJ = ("w1", "w3", "w2")


def compressed_expert_keys(prefix: str, num_experts: int) -> list[str]:
    """Every checkpoint key the loader will ask for (handy for strict missing/unexpected checks)."""
    pre = f"{prefix}." if prefix else ""
    return [f"{pre}experts.{j}.{p}.{t}" for j in range(num_experts) for p in _PROJ
            for t in ("weight_packed", "weight_scale")]


@torch.no_grad()
def load_compressed_experts(experts: torch.nn.Module, get: Callable[[str], torch.Tensor], prefix: str = "",
                            expert_ids: Iterable[int] | None = None, local_offset: int = 0) -> list[str]:
    """Fill ``experts`` (a stacked :class:`~k3nn.layers.moe.Experts`) from a key → tensor getter.

    ``get(key)`` returns the checkpoint tensor (e.g. ``safe_open(...).get_tensor``); it is called once per key,
    so only one expert's tensors are alive at a time. ``expert_ids`` selects global experts (default: all of
    ``experts``, offset by ``local_offset`` for expert parallelism: global id ``local_offset + i`` goes to
    slot i). Returns the keys read. Shapes and dtypes are checked; a mismatch raises naming the key.
    """
    E = experts.num_experts
    ids = list(range(local_offset, local_offset + E)) if expert_ids is None else list(expert_ids)
    pre = f"{prefix}." if prefix else ""
    read: list[str] = []
    for slot, j in enumerate(ids):
        if not 0 <= slot < E:
            raise ValueError(f"load_compressed_experts: {len(ids)} expert ids for {E} expert slots")
        for p in _PROJ:
            kp, ks = f"{pre}experts.{j}.{p}.weight_packed", f"{pre}experts.{j}.{p}.weight_scale"
            packed, scale = get(kp), get(ks)
            read += [kp, ks]
            check_mxfp4(packed, scale, what=f"{kp} / {ks}")
            if experts.mxfp4:
                dst_p, dst_s = getattr(experts, f"{p}_packed")[slot], getattr(experts, f"{p}_scale")[slot]
                if packed.shape != dst_p.shape or scale.shape != dst_s.shape:
                    raise ValueError(f"{kp}: checkpoint packed {tuple(packed.shape)} / scale {tuple(scale.shape)} "
                                     f"but the module expects {tuple(dst_p.shape)} / {tuple(dst_s.shape)}")
                dst_p.copy_(packed)
                dst_s.copy_(scale)
            else:
                dst = getattr(experts, p)
                logical = (*packed.shape[:-1], packed.shape[-1] * 2)
                if tuple(dst.shape[1:]) != logical:
                    raise ValueError(f"{kp}: checkpoint logical shape {logical} but the module expects "
                                     f"{tuple(dst.shape[1:])}")
                dst.data[slot].copy_(mxfp4_dequantize(packed.to(dst.device), scale.to(dst.device), dst.dtype))
    return read
