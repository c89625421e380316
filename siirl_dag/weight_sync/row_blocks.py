"""Row blocks: a copy of a 2D weight laid out the way oneDNN packs fp32 linear weights on x86 CPUs.

`packed[i, k, j] == weight[i * block + j, k]` (`packed` is [N // block, K, block]). A rollout that
computes from such a copy can have a weight sync write it in place, like a plain parameter, instead
of re-packing after every update: the keeper replays the loader's copies into it (`direct`), and
an engine that loaded the plain weight itself rearranges it here.

The rearrangement is a transposition of every block, which torch's eager copy does element by
element (2.3-5x a memcpy). `row_blocks.cpp` does it in 16x16 tiles with streaming stores: 1.0-1.7x
a memcpy on one core, 0.6-1.0x on two (a 2-core Xeon VM, 11-1187 MiB weights,
scripts/bench_row_blocks.py). It is built with torch's extension builder on first use (about a
second, once per machine: cached, and locked while building so that ranks starting together build
it once); where that fails (no C++ compiler) the copies fall back to torch's, with one warning.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

# elements: from here two threads pay (when the sync lends two cores), and streaming stores too (the
# destination is not read first; below, a weight's blocks may still be in the cache, where ordinary
# stores are faster). Measured on a 2-core Xeon: 2 MiB copies at 1.2x a memcpy on one thread, 1.06x on
# two; 12 MiB: 1.5x with ordinary stores, 1.05x streamed
_THREADED_FROM = 1 << 19
_STREAMED_FROM = 1 << 20


def copy_into(packed: torch.Tensor, src: torch.Tensor) -> None:
    """Write `src` ([rows, cols], any strides) into `packed`, a [rows // w, cols, w] view of row
    blocks (any strides: w is less than the block for a part of one, see `pieces`), on as many
    threads as torch may use (`cores.borrowed`)."""
    if src.shape != (packed.shape[0] * packed.shape[2], packed.shape[1]):
        raise ValueError(f"{tuple(src.shape)} does not fit row blocks of {tuple(packed.shape)}")
    kernel = _kernel() if _fits_kernel(packed, src) else None
    if kernel is None:
        copy_with_torch(packed, src)
        return
    blocks, cols, w = packed.shape
    threads = max(1, min(torch.get_num_threads(), blocks)) if packed.numel() >= _THREADED_FROM else 1
    stream = int(packed.numel() >= _STREAMED_FROM)
    args = (src.data_ptr(), src.stride(0), packed.data_ptr(), packed.stride(0), packed.stride(1))
    bounds = [blocks * i // threads for i in range(threads + 1)]
    pool = _pool(os.getpid())
    others = [pool.submit(kernel, *args, b0, b1, cols, w, stream) for b0, b1 in zip(bounds[1:-1], bounds[2:])]
    kernel(*args, bounds[0], bounds[1], cols, w, stream)  # ctypes lets go of the GIL meanwhile
    for other in others:
        other.result()


def copy_with_torch(packed: torch.Tensor, src: torch.Tensor) -> None:
    """The same copy by torch (element by element): where the kernel does not apply or cannot be built."""
    packed.copy_(src.unflatten(0, (-1, packed.shape[2])).transpose(1, 2))


def pieces(row: int, rows: int, cols: int, row_length: int, block: int) -> list[tuple[int, int, tuple, tuple, int]]:
    """Rows [row, row + rows) by `cols` columns of a weight with rows of `row_length`, in its row
    blocks: per piece (whole blocks, or part of one at either end), (first row relative to `row`,
    rows, then size, stride and offset from the blocks' first element of the view `copy_into` writes)."""
    out, r, end = [], row, row + rows
    while r < end:
        first, width = divmod(r, block)
        n = min(block - width, end - r) if width or end - r < block else (end - r) // block * block
        size = (n // block, cols, block) if n % block == 0 and not width else (1, cols, n)
        out.append((r - row, n, size, (row_length * block, block, 1), first * row_length * block + width))
        r += n
    return out


def _fits_kernel(packed: torch.Tensor, src: torch.Tensor) -> bool:
    """The kernel copies 4-byte elements on the CPU along unit-stride rows of `src` and blocks of `packed`."""
    return (packed.dtype == src.dtype == torch.float32 and packed.device.type == src.device.type == "cpu"
            and packed.stride(2) == 1 and src.stride(1) == 1)


@functools.cache
def _kernel():
    """The built copy (a ctypes function), or None (with a warning) where it cannot be built."""
    from torch.utils import cpp_extension

    source = Path(__file__).with_suffix(".cpp")
    try:
        library = cpp_extension.load("siirl_row_blocks", [str(source)], extra_cflags=["-O3"], is_python_module=False)
        kernel = ctypes.CDLL(library).siirl_copy_into_row_blocks
    except (OSError, RuntimeError) as e:
        print(f"[weight sync] could not build {source.name} ({str(e).splitlines()[0]}): copying into row blocks "
              "with torch instead, 2-4x slower", file=sys.stderr, flush=True)
        return None
    i64 = ctypes.c_int64
    kernel.argtypes = [ctypes.c_void_p, i64, ctypes.c_void_p, i64, i64, i64, i64, i64, i64, ctypes.c_int]
    kernel.restype = None
    return kernel


@functools.cache
def _pool(pid: int) -> ThreadPoolExecutor:
    """The threads beside the caller's (started as needed, so as many as this process may run on);
    per process id, as a forked child has none of its parent's threads."""
    return ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0)), thread_name_prefix="row-blocks")
