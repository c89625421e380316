"""Which rows each consumer rank reads from which producer shard.

Rows of a step have one global order. Every node's output is a list of shards, each covering a
contiguous row range; a consumer with a different data-parallel size gets its own contiguous ranges
and reads the overlapping pieces of the producer shards (split/concat along the batch). Forward-only
nodes get ranges balanced by token count; training nodes get equal row counts, because every
data-parallel rank must run the same number of micro batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class Shard:
    """One piece of a node's output: `ref` (an ObjectRef or an in-process wire dict) for rows [start, stop)."""

    ref: Any
    start: int
    stop: int


def equal_ranges(num_rows: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges whose sizes differ by at most one row (earlier ranges take the extra rows)."""
    base, extra = divmod(num_rows, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def balanced_ranges(tokens: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges with close token sums: each cut at the prefix sum nearest k/parts of the total
    (the earlier one on a tie), never before the previous cut."""
    prefix = np.concatenate([[0], np.cumsum(np.asarray(tokens, dtype=np.int64))])
    n = len(prefix) - 1
    targets = prefix[-1] * np.arange(1, parts) / parts
    i = np.searchsorted(prefix, targets)
    back = (i > 0) & (targets - prefix[np.maximum(i - 1, 0)] <= prefix[np.minimum(i, n)] - targets)
    cuts = [0, *np.maximum.accumulate(np.minimum(i - back, n)).tolist(), n] if parts > 1 else [0, n]
    return list(zip(cuts[:-1], cuts[1:]))


def split(shards: Sequence[Shard], ranges: Sequence[tuple[int, int]]) -> list[list[tuple[Any, int, int]]]:
    """Per range of `ranges` (contiguous, in row order), the (ref, local_start, local_stop) pieces of
    `shards` (in row order) that cover it: one walk over both, so a node's plan costs its producer's
    shards plus its own ranks, not their product."""
    out, i = [], 0
    for start, stop in ranges:
        while i < len(shards) and shards[i].stop <= start:
            i += 1
        got, j = [], i
        while j < len(shards) and shards[j].start < stop:
            lo, hi = max(start, shards[j].start), min(stop, shards[j].stop)
            if lo < hi:
                got.append((shards[j].ref, lo - shards[j].start, hi - shards[j].start))
            j += 1
        out.append(got)
    return out
