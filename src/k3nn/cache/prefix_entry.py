"""One node of the prefix index: a full 64-token block, its latent page and an optional KDA snapshot.

Shared by the index (:mod:`.prefix`) and the eviction policies (:mod:`.retention`), which order entries.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrefixEntry"]


@dataclass(eq=False)
class PrefixEntry:
    key: bytes
    parent: "PrefixEntry | None"
    end: int  # tokens covered: the prefix [0, end)
    page: int  # latent page of tokens [end - unit, end) (one reference held by the index)
    snapshot: int | None = None  # KDA snapshot slot: the state after `end` tokens
    children: int = 0
    last_access: int = 0

    def snapshot_parent_len(self) -> int:
        p = self.parent
        while p is not None and p.snapshot is None:
            p = p.parent
        return 0 if p is None else p.end
