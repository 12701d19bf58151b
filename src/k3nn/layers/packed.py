"""Decode weight preparation: several projections of one input as one GEMM.

At decode a token row meets many small projections (KDA: q, k, v, gate, f, β — six GEMMs of one row each); with
their weights concatenated along the output dim it is one GEMM and one weight read (a prompt's forward uses the
same GEMM once the weights are packed: one launch instead of six, and x read once). A :class:`Packed` is that
concatenation, built by the layers' ``prepare_decode()``. It holds no second copy: the projections' parameters
become views of their rows of the packed buffer (the same parameter objects, so optimizers and references keep
them), and an in-place update of a projection is an update of the buffer. A parameter replaced since (``.to()``,
``load_state_dict(assign=True)``, sharding) is seen at the next use, which packs again. Projections with forward
hooks (tensor-parallel all-reduce) are never packed: a GEMM on their weight would skip the hook.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from .. import ops
from .linear import hooked

__all__ = ["Packed", "pack_linears", "plain", "unpack"]


class Packed:
    """``weight``: the tensors ``sources()`` returns (looked up at every use, so a replaced parameter is seen), each
    flattened to rows (``[n, -1]``) and concatenated along dim 0; every source is then re-pointed at its rows of
    ``weight`` (``.data``: a view of the same shape). ``sizes``: the row count of each group, for splitting the
    GEMM's output."""

    def __init__(self, sources: Callable[[], Sequence[torch.Tensor]],
                 sizes: Callable[[], Sequence[int]] | None = None):
        self.sources = sources
        self._sizes = sizes or (lambda: [t.shape[0] for t in self.sources()])
        self.weight = self._rebuild()

    def _rebuild(self) -> torch.Tensor:
        # outside inference mode: the sources become views of this buffer and must stay usable by autograd
        ts = list(self.sources())
        if not all(plain(t) for t in ts):
            raise TypeError("packed projections cannot follow parameters that became tensor subclasses (DTensor "
                            "after fully_shard or a DeviceMesh tensor parallel): call model.prepare_decode(False) "
                            "before sharding")
        with torch.inference_mode(False), torch.no_grad():
            self.weight = torch.cat([t.detach().reshape(t.shape[0], -1) for t in ts], 0)
            self._layout, row = [], 0
            for t in ts:
                t.data = self.weight[row:row + t.shape[0]].view(t.shape)
                self._layout.append((t.data_ptr(), tuple(t.shape)))
                row += t.shape[0]
        self.sizes = list(self._sizes())
        return self.weight

    def shared(self) -> bool:
        """Every source is still its rows of ``weight`` (same address, shape, dtype and device)."""
        w = self.weight
        ts = self.sources()
        return len(ts) == len(self._layout) and all(
            t.data_ptr() == ptr and tuple(t.shape) == shape and t.dtype == w.dtype and t.device == w.device
            for t, (ptr, shape) in zip(ts, self._layout))

    def unpack(self) -> None:
        """Give every source still sharing ``weight`` its own storage again (a copy of its rows): what
        ``prepare_decode(False)`` does, so the parameters no longer share memory (huggingface_hub's
        ``save_torch_state_dict`` refuses views of a larger buffer; safetensors' ``save_file`` takes disjoint ones;
        ``save_pretrained`` copies them one shard at a time)."""
        w = self.weight
        with torch.inference_mode(False), torch.no_grad():
            for t in self.sources():
                if t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr():
                    t.data = t.data.clone()

    def get(self) -> torch.Tensor:
        """The packed tensor, packed again first if a source was replaced."""
        return self.weight if self.shared() else self._rebuild()

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One GEMM ``x Wᵀ`` (:func:`k3nn.ops.linear`: the skinny GEMM at decode sizes) split into the groups'
        outputs (views of one buffer)."""
        w = self.get()
        return list(ops.linear(x, w).split(self.sizes, -1))


def unpack(*packs: Packed | None) -> None:
    """:meth:`Packed.unpack` of each packing given (None: nothing packed there): a layer's ``prepare_decode(False)``."""
    for p in packs:
        if p is not None:
            p.unpack()


def plain(t: torch.Tensor) -> bool:
    """``t`` holds a plain tensor, not a subclass (a DTensor of ``fully_shard`` or a DeviceMesh tensor parallel):
    only plain tensors can be re-pointed at a packed buffer."""
    return type(t.data) is torch.Tensor


def pack_linears(groups: Sequence[Sequence[nn.Linear]]) -> Packed | None:
    """One :class:`Packed` over ``groups`` of linears (each group one slice of the output), or None when one of
    them has a bias or hooks, or their weights differ in dtype or device or are not plain tensors."""
    mods = [m for g in groups for m in g]
    if any(not isinstance(m, nn.Linear) or m.bias is not None or hooked(m) or not plain(m.weight) for m in mods):
        return None
    if len({(m.weight.dtype, m.weight.device) for m in mods}) != 1 or mods[0].weight.device.type == "meta":
        return None
    return Packed(lambda: [m.weight for m in mods], lambda: [sum(m.weight.shape[0] for m in g) for g in groups])
