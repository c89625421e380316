"""Row blocks: a copy of a 2D weight laid out the way oneDNN packs fp32 linear weights on x86 CPUs.

`packed[i, k, j] == weight[i * block + j, k]` (`packed` is [N // block, K, block]). A rollout that
computes from such a copy can have a weight sync write it in place, like a plain parameter, instead
of re-packing after every update: the keeper replays the loader's copies into it (`direct`), and
an engine that loaded the plain weight itself rearranges it here.

The rearrangement is a transposition of every block, which torch's eager copy does element by
element (about 4x a memcpy). Compiled for its columns and strides, with only the number of blocks
left symbolic, inductor tiles it with vectorised 16x16 transposes: 184 MiB in 10-16 ms on two cores
(memcpy: 10-11), 17-19 on one. Compiled for any shape it cannot tile: 17-23 ms on two cores.
"""

from __future__ import annotations

import functools
import sys

import torch


# elements: below, compiling does not pay. Measured on the slower host: a (1024, 128) weight (the fused
# gate/up of the tiny test and demo models) copies in 0.17 ms eager against 0.30 compiled, and the first
# compile in a process took 6-9 s; from about 2 MiB the compiled copy is faster (4 MiB: 2.1 ms vs 2.7)
_COMPILED_FROM = 1 << 19
_KERNELS = 64  # a model has a few kinds of weight (columns, and strides if a view of a fused one)


def copy_into(packed: torch.Tensor, src: torch.Tensor) -> None:
    """Write `src` ([rows, cols], any strides) into `packed`, a [rows // w, cols, w] view of row
    blocks (any strides: w is less than the block for a part of one, see `pieces`)."""
    if src.shape != (packed.shape[0] * packed.shape[2], packed.shape[1]):
        raise ValueError(f"{tuple(src.shape)} does not fit row blocks of {tuple(packed.shape)}")
    packed, src = packed.as_subclass(torch.Tensor), src.as_subclass(torch.Tensor)  # torch.compile runs
    # a parameter subclass (vLLM's) eagerly
    if src.numel() < _COMPILED_FROM:
        _copy(packed, src)
        return
    torch._dynamo.maybe_mark_dynamic(packed, 0)  # one kernel per columns, strides and dtype
    torch._dynamo.maybe_mark_dynamic(src, 0)
    with torch._dynamo.config.patch(recompile_limit=_KERNELS):
        _compiled()(packed, src)


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


def _copy(packed: torch.Tensor, src: torch.Tensor) -> None:
    packed.copy_(src.unflatten(0, (-1, packed.shape[2])).transpose(1, 2))


@functools.cache
def _compiled():
    """Compiled on first use of a kind of weight (a few seconds each, once per process; inductor's
    cache on disk shortens it for later processes), so the first sync says why it takes longer."""
    print("[weight sync] compiling the copies into row blocks (seconds, once per process) ...", file=sys.stderr,
          flush=True)
    return torch.compile(_copy, dynamic=False)
