"""Batched speculation: several requests' draft trees verified in one target forward (engine.py), over a KV cache
whose rows hold the requests at their own lengths (cache.py)."""

from .cache import RaggedCache, RaggedLayer
from .engine import BatchEngine, BatchRequest, Finished

__all__ = ["BatchEngine", "BatchRequest", "Finished", "RaggedCache", "RaggedLayer"]
