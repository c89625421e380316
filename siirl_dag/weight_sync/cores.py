"""A sync runs between steps, while the other ranks of its machine wait: its copies and re-packs may
borrow their cores (the driver says how many, `WeightSync._cores`). oneDNN's re-pack and the copy into
row blocks run about 1.5-2x faster on two cores than on one."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch


@contextlib.contextmanager
def borrowed(cores: int | None) -> Iterator[None]:
    """Meanwhile run `cores` threads (at most as many as this process may run on); None: as is."""
    if not cores:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(min(cores, len(os.sched_getaffinity(0))))
    try:
        yield
    finally:
        torch.set_num_threads(before)
