"""Which rows each consumer rank reads from which producer shard.

Rows of a step have one global order. Every node's output is a list of shards, each covering a
contiguous row range; a consumer with a different data-parallel size gets its own contiguous ranges
and reads the overlapping pieces of the producer shards (split/concat along the batch). Forward-only
nodes get ranges balanced by token count; training nodes get equal row counts, because every
data-parallel rank must run the same number of micro batches.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Sequence


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
    """Contiguous ranges with close token sums: each cut at the prefix sum nearest k/parts of the total."""
    prefix = list(accumulate(tokens, initial=0))
    n, cuts = len(tokens), [0]
    for k in range(1, parts):
        target = prefix[-1] * k / parts
        i = bisect_left(prefix, target)
        if i > n or (i > 0 and target - prefix[i - 1] <= prefix[i] - target):
            i -= 1
        cuts.append(min(max(i, cuts[-1]), n))
    cuts.append(n)
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
