"""Host memory: have glibc's malloc keep what a CPU training step frees.

glibc hands a freed block back to the kernel when it was mapped on its own (above the mmap
threshold) or once enough free memory sits at the top of the heap (the trim threshold); the
next allocation of that size then page-faults every page in again. A training step allocates
and frees the same large blocks every time (activations, gradient buckets), so on CPU it can
pay those faults each step. ZeRO-2 is hit hardest: its gradient buckets are allocated when
backward starts filling them and freed once reduced (stage 2 keeps only the shard), so every
step faults in a whole gradient's worth of pages, and it is not alone: distllm's step at
stage 0 pays too. The figures (``distllm train`` at dp2 with and without it, and where the
time went) are in ``bench/results/cpu-zen4-20261203/keep-freed-memory/``.

:func:`keep_freed_memory` raises both thresholds, as jemalloc or tcmalloc keep freed memory
by default; ``distllm train`` calls it on CPU (``--no-keep-freed-memory`` to leave glibc's
defaults), and ``distllm bench`` for every variant it times. GPU memory is the caching
allocator's: this changes nothing there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)
_KEEP_BYTES = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory in this process (trim and mmap thresholds of
    1 GiB) instead of returning it to the kernel, so that a step's allocations do not
    page-fault on memory the previous step freed. Once per process; True if set, False where
    the C library is not glibc (nothing changes there)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES)) and bool(
        mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES))
