"""Decode weight preparation: several projections of one input as one GEMM.

At decode a token row meets many small projections (KDA: q, k, v, gate, f, β — six GEMMs of one row each); with
their weights concatenated along the output dim it is one GEMM and one weight read. A :class:`Packed` is that
concatenation, built by the layers' ``prepare_decode()`` (a copy: the packed projections' weights are held twice
while it lives) and rebuilt when a source weight changes (``.to()``, ``load_state_dict``, an in-place update).
Projections with forward hooks (tensor-parallel all-reduce) are never packed: a GEMM on their weight would skip
the hook.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from .. import ops

__all__ = ["Packed", "pack_linears", "hooked"]


def hooked(mod: nn.Module) -> bool:
    """``mod`` has forward (pre-)hooks, e.g. tensor parallelism's all-reduce: a packed GEMM would skip them, so
    such projections are not packed."""
    return bool(mod._forward_hooks or mod._forward_pre_hooks)


class Packed:
    """``weight``: the tensors ``sources()`` returns (looked up at every use, so a replaced parameter is seen)
    concatenated along dim 0 (``build`` overrides how); ``sizes``: the row count of each group, for splitting
    the GEMM's output."""

    def __init__(self, sources: Callable[[], Sequence[torch.Tensor]],
                 sizes: Callable[[], Sequence[int]] | None = None, build=None):
        self.sources = sources
        self.build = build or (lambda ts: torch.cat(ts, 0))
        self._sizes = sizes or (lambda: [t.shape[0] for t in self.sources()])
        self._key = None
        self.weight = self._rebuild()

    def _key_of(self):
        return tuple((t.data_ptr(), t._version, t.shape, t.device, t.dtype) for t in self.sources())

    def _rebuild(self) -> torch.Tensor:
        with torch.no_grad():
            self.weight = self.build([t.detach() for t in self.sources()]).contiguous()
        self.sizes = list(self._sizes())
        self._key = self._key_of()
        return self.weight

    def get(self) -> torch.Tensor:
        """The packed tensor, rebuilt first if a source changed."""
        return self.weight if self._key == self._key_of() else self._rebuild()

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One GEMM ``x Wᵀ`` (:func:`k3nn.ops.linear`: the skinny GEMM at decode sizes) split into the groups'
        outputs (views of one buffer)."""
        w = self.get()
        return list(ops.linear(x, w).split(self.sizes, -1))


def pack_linears(groups: Sequence[Sequence[nn.Linear]]) -> Packed | None:
    """One :class:`Packed` over ``groups`` of linears (each group one slice of the output), or None when one of
    them has a bias or hooks, or their weights differ in dtype or device."""
    mods = [m for g in groups for m in g]
    if any(not isinstance(m, nn.Linear) or m.bias is not None or hooked(m) for m in mods):
        return None
    if len({(m.weight.dtype, m.weight.device) for m in mods}) != 1 or mods[0].weight.device.type == "meta":
        return None
    return Packed(lambda: [m.weight for m in mods], lambda: [sum(m.weight.shape[0] for m in g) for g in groups])
