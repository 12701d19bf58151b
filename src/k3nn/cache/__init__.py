"""Caches: the contiguous hybrid cache used by the model (paged pools and prefix reuse build on it)."""

from .hybrid import CacheFullError, HybridCache, KDAState, MLAState

__all__ = ["CacheFullError", "HybridCache", "KDAState", "MLAState"]
