"""A CPU rank's malloc keeps the memory a step frees for the next (runtime/host_malloc.py): a block of
a layer's activations comes from the heap, not a mapping of its own, and stays with the heap when freed."""

from __future__ import annotations

import subprocess
import sys

BLOCK = """
import ctypes, sys
from siirl_dag.runtime import host_malloc
kept = host_malloc.keep_freed_memory() if sys.argv[1] == "kept" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
block = libc.malloc(24 << 20)
end = libc.sbrk(0)
libc.free(ctypes.c_void_p(block))
print(kept, block < end, libc.sbrk(0) == end)
"""


def _block(mode: str) -> list[str]:
    """(mallopt applied, the 24 MB block on the heap, the heap as large after its free)"""
    return subprocess.run([sys.executable, "-c", BLOCK, mode], capture_output=True, text=True, check=True).stdout.split()


def test_freed_activations_stay_with_the_heap():
    assert _block("default")[:2] == ["None", "False"]  # glibc: mapped on its own, unmapped when freed
    assert _block("kept") == ["True", "True", "True"]
