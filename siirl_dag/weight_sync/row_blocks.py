"""Row blocks: a copy of a 2D weight laid out the way oneDNN packs fp32 linear weights on x86 CPUs.

`packed[i, k, j] == weight[i * block + j, k]` (`packed` is [N // block, K, block]). A rollout that
computes from such a copy can have a weight sync write it in place, like a plain parameter, instead
of re-packing after every update: the keeper replays the loader's copies into it (`direct`), and
an engine that loaded the plain weight itself rearranges it here.

The rearrangement is a transposition of every block, which torch's eager copy does element by
element (about 4x a memcpy); compiled, it runs at about 1.4x (192 MiB: 14 ms on two cores, 21 on one).
"""

from __future__ import annotations

import functools

import torch


_COMPILED_FROM = 1 << 20  # elements; below, the eager copy costs less than compiling it (small models)


def copy_into(packed: torch.Tensor, src: torch.Tensor) -> None:
    """Write `src` ([rows, cols], any strides) into `packed`, a [rows // w, cols, w] view of row
    blocks (any strides: w is less than the block for a part of one, see `pieces`)."""
    if src.shape != (packed.shape[0] * packed.shape[2], packed.shape[1]):
        raise ValueError(f"{tuple(src.shape)} does not fit row blocks of {tuple(packed.shape)}")
    copy = _compiled() if src.numel() >= _COMPILED_FROM else _copy
    copy(packed.as_subclass(torch.Tensor), src.as_subclass(torch.Tensor))  # torch.compile runs a
    # parameter subclass (vLLM's) eagerly


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
    """Compiled on first use, for any shape (a few seconds, once per process and stride pattern)."""
    return torch.compile(_copy, dynamic=True)
