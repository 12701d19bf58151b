"""Caches: the contiguous hybrid cache used by the model (paged pools and prefix reuse build on it)."""

from .hybrid import CacheFullError, HybridCache, KDAState, MLAState
from .paged import HybridPools, PagedCache
from .prefix import PrefixCache, PrefixMatch
from .retention import Interval, LRU, Marconi, MarconiEviction, PromptBoundaries, ReplayBoundary
from .states import StatePool

__all__ = ["CacheFullError", "HybridCache", "KDAState", "MLAState",
           "HybridPools", "PagedCache", "PrefixCache", "PrefixMatch", "StatePool",
           "Interval", "LRU", "Marconi", "MarconiEviction", "PromptBoundaries", "ReplayBoundary"]
