"""What a long-lived process keeps between requests, bounded here (docs/execution.md#memory):

- oneDNN compiles kernels for each shape it runs (the packed linears: one set per row count and weight shape, ~0.6 MB
  on an AVX2 CPU) and keeps them in two caches, its own and that of PyTorch's ideep layer, of 1,024 entries each by
  default. A process meeting new prompt lengths and tree sizes grew by up to ~600 MB that way. Loading a target
  (models.apply_environment_defaults) sets both (KERNEL_CACHE_VARIABLES) to KERNEL_CACHE_ENTRIES, enough for every
  shape a decoding step reuses; the caches read the setting when the first kernel is made, and a value the user set
  wins.
- Memory freed during a request (activations, logits, the request's KV cache, evicted kernels) stays with the C
  allocator, fragmented, and the resident size creeps up. `release_freed_memory` hands it back to the system
  (glibc's `malloc_trim`; elsewhere nothing), once per request: ~8 ms on the 2-core EPYC.
"""

from __future__ import annotations

import ctypes
import functools
import sys

KERNEL_CACHE_ENTRIES = 256  # set when a target is loaded, before its weights are packed (models.py)
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc; other C libraries have no such call
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Return the C allocator's free memory to the system; False where that cannot be done (not glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
