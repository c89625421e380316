"""glibc's malloc in a rank process that computes on the CPU: freed memory kept for the next step.

A CPU rank allocates and frees the same few-MB activations at every layer of every step. glibc gives
such blocks back to the system as they are freed (the heap's top trimmed past 128 KiB, blocks over
its adaptive mmap threshold unmapped), so the next layer maps them again and touches every page:
megatron-core's forward on the demo took thousands of page faults per call. With the trim and mmap
thresholds raised, the heap keeps those pages (PyTorch's CPU tuning guide reaches the same with
jemalloc or tcmalloc). Blocks over the mmap threshold (32 MiB, glibc's largest) are still mapped and
unmapped: weights and KV caches are allocated once. Not on a GPU, whose activations live in the CUDA
allocator's cache, nor where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit hosts
TRIM_THRESHOLD = 64 << 20  # freed memory the heap may keep at its top


def keep_freed_memory() -> bool:
    """Raise this process's glibc malloc thresholds; False where there is no glibc `mallopt`."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
