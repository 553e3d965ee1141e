"""What a long-lived process keeps between requests, bounded here (docs/execution.md#memory):

- oneDNN compiles kernels for each shape it runs (the packed linears: one set per row count and weight shape, ~0.6 MB
  on an AVX2 CPU) and keeps them in two caches, its own and that of PyTorch's ideep layer, of 1,024 entries each by
  default. A process meeting new prompt lengths and tree sizes grew by up to ~600 MB that way. Loading a target
  (models.apply_environment_defaults) sets both (KERNEL_CACHE_VARIABLES) to KERNEL_CACHE_ENTRIES, enough for the
  shapes a decoding step reuses; the caches read the setting when the first kernel is made, and a value the user set
  wins. At 256 entries a server's batched trees (four requests, `auto`) filled them for its first ~450 requests, the
  heap in use growing 230 -> 270 MB; at 64, 192 -> 199 MB by request 250, as fast (154 s against 150 s for 450
  requests) and with single-request `auto` as fast (62.8-66.3 tokens/s against 60.9-65.7, 8 MT-bench prompts)
  (probes on the 2-core EPYC, 2026-11-27).
- Memory freed during a request (activations, logits, the request's KV cache, evicted kernels) stays with the C
  allocator, fragmented, and the resident size creeps up. `release_freed_memory` hands it back to the system
  (glibc's `malloc_trim`; elsewhere nothing), once per request: ~8 ms on the 2-core EPYC.
- glibc serves a large block from its heap, not from a mapping of its own, once a block that size was freed (its
  mmap threshold rises with what is freed, up to 32 MB): a server's tensors of a few MB (a step's logits, a row's
  cache storage) then land among small long-lived blocks, and what it keeps between requests swung by ±25 MB with
  what ran last (the serve soak, 2026-11-27). `fix_mmap_threshold` pins the threshold, so such blocks are mappings
  of their own, returned to the system as they are freed; the server sets it (selfspec/serve/scheduler.py). At
  512 KB every prefill chunk's activations (128 x 1,536 floats: 786 KB) were fresh mappings faulted in again, and a
  128-position chunk took 114-131 ms against 90-97 with glibc's own threshold; at 4 MB, 91-101 ms, and the engine at
  four requests ran 2% faster (18.36-18.41 s against 18.72-18.86 for 32 requests, alternating processes, 2-core Zen 5,
  2026-11-29), while a step's logits beyond 4 MB (from 21 rows up) and a row's storage stay mappings.
- A large tensor's first writes fault its pages in one at a time, and in a process holding a model (a few GB
  resident) the faults from two threads (a parallel `zeros`) serialise badly: the batch engine's cache storage,
  [30, 4, 3, 690, 64] floats (64 MB), took 86-97 ms to zero against 11-13 ms in a fresh process (1 thread: 19 ms);
  in the engine its 8 reservations over 32 requests cost 0.5 s of 19 s (2-core Zen 5, 2026-11-29). `populated_zeros`
  maps such a tensor with its pages filled in by the kernel at once (zeroed, MAP_POPULATE): 17-22 ms.
- A decoding step streams every weight once, and on 4 KB pages that walk also misses the TLB every 4 KB: on the 2-core
  EPYC (Zen 5) all of SmolLM2's float32 products at one row took 12.3 ms from weights on 2 MB pages against 13.2 ms on
  4 KB pages (median of 9, a probe, 2026-11-27). `into_huge_pages` lays a model's tensors out in one mapping advised
  for transparent huge pages (Linux, where THP is `always` or `madvise`); loading a CPU target does it
  (models.py).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys

import torch

KERNEL_CACHE_ENTRIES = 64  # set when a target is loaded, before its weights are packed (models.py)
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


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = (
    4 * 1024 * 1024
)  # blocks from this size up are mappings of their own (glibc's default floor: 128 KB)


def fix_mmap_threshold(size: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold at `size` bytes for this process (no dynamic rise); False where it cannot be set
    (not glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, size))


HUGE_PAGE = 2 * 2**20
TENSOR_ALIGNMENT = 64  # bytes: a cache line, and a multiple of every dtype's size


POPULATE_BYTES = 1 << 20  # tensors this large or larger are mapped populated (`populated_zeros`)


def populated_zeros(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A zero tensor of `shape` with `like`'s dtype and device; on a Linux CPU and from POPULATE_BYTES up, in an
    anonymous mapping of its own whose pages the kernel fills in when it is made (zeroed: nothing to write), instead of
    one fault per 4 KB page at the first writes. The mapping is unmapped when the tensor and its views are freed."""
    nbytes = like.element_size()
    for size in shape:
        nbytes *= size
    populate = getattr(mmap, "MAP_POPULATE", None)
    if like.device.type != "cpu" or nbytes < POPULATE_BYTES or populate is None:
        return like.new_zeros(shape)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    except (OSError, ValueError):
        return like.new_zeros(shape)
    return torch.frombuffer(region, dtype=like.dtype).view(shape)  # keeps `region` alive while any view of it does


def into_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Contiguous copies of `tensors` (CPU), one after another in a single anonymous mapping advised for transparent
    huge pages and starting on a 2 MB boundary; None where that cannot be had (not Linux, no MADV_HUGEPAGE, the
    mapping refused), and the caller copies as it would otherwise. The mapping lives as long as any copy does."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE") or not tensors:
        return None
    offsets, size = [], 0
    for tensor in tensors:
        size = -(-size // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
        offsets.append(size)
        size += tensor.numel() * tensor.element_size()
    try:
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the pages are huge from the start
    except (OSError, ValueError):
        return None
    arena = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive while any view of it does
    start = -arena.data_ptr() % HUGE_PAGE
    copies = []
    for tensor, offset in zip(tensors, offsets, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        copy = arena[start + offset : start + offset + nbytes].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies.append(copy)
    return copies
