"""Separate meshes on one CPU machine, after the first sync: the trainer's rank 0 writes its export
straight into the rollout's parameters, one copy per tensor (through the channel every tensor is
copied twice, into shared memory and out of it into the engine, on the same memory bus).
Colocated meshes on CPU replay the same way in process (`RankSync.handoff`), skipping vLLM's loader
(their parameters move into this process's memory, not a file).

How:
- The rollout moves the parameters its loader writes into one shared-memory file (`Segment`).
- It loads the first sync from the channel as usual while a dispatch mode (`Recorder`) records
  every copy its loader makes into that file: which slice of which incoming tensor lands where
  (an incoming tensor may itself be a view, e.g. of the trainer's fused gate/up weight).
  vLLM's loaders only narrow and copy (fusing q/k/v and gate/up, cutting the rank's TP shard), so
  the record, a `Plan`, is the loader itself, replayable without vLLM.
- The keeper maps the file (`Targets`) and replays the plan on its export at every later sync,
  then puts an end marker into the channel; the rollout ranks, started at the same time, wait
  for it there (no round trip through the driver), finish the load and stamp the version.
- A parameter the rollout computes from through a packed copy in row blocks (`row_blocks`; its CPU
  linear layers) is shared with that copy: its recorded copies are replayed into the copy instead,
  rearranged on the way, so nothing is left to re-pack (its plain weight is then no longer read;
  an embedding's still is, by its lookup, so its copies go to both). A parameter packed in place
  (vLLM's CPU MoE experts) holds its own row blocks: its copies are rearranged within it.
A loader that does anything else to a parameter (a cast, a transpose, arithmetic) makes no plan,
and that pair keeps the channel.

Lifetime: the keeper unlinks the file once it has mapped it, so the memory lives while either
process maps it and is freed with both, whatever ends them. A rollout that shares again (for
another pipe) gets a new file and its parameters move there; the keeper of the older plan still
writes its next sync into the old file, which only the keeper maps by then, the rollout says so
(`RankSync.take`) and the pair records anew. Asking first would cost every sync a round trip.
"""

from __future__ import annotations

import itertools
import os
from collections import defaultdict
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from siirl_dag.weight_sync import row_blocks
from siirl_dag.weight_sync.buckets import Named, nbytes
from siirl_dag.leftovers import SHM_DIR, sweep_dead

_PREFIX = "siirl-weights-"
_ALIGN = 64
_COUNT = itertools.count()
_CONSTANT_WRITES = {torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default}  # e.g. zeroed vocab padding


@dataclass(frozen=True)
class Copy:
    """One copy the loader made: `index` ((start, length) per dim) of an incoming tensor into the
    strided view (`offset`, `size`, `stride`, in elements of `dtype`) of the segment file."""

    index: tuple[tuple[int, int], ...]
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    blocked: bool = False  # into row blocks (`row_blocks.copy_into`): the slice is rearranged


@dataclass
class Plan:
    """What one rollout rank's loader does with an export: every incoming name with its shape and
    dtype (names it skipped included), and its copies into the segment file at `path` (None: a
    segment in this process's memory)."""

    path: str | None
    nbytes: int
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    copies: dict[str, list[Copy]] = field(default_factory=lambda: defaultdict(list))


class Segment:
    """The rollout's side: `params` moved into one shared-memory file, each in place (`.data`), or,
    for a keeper in the same process (colocated meshes), into one block of its private memory:
    nothing in /dev/shm then, whose size a container may cap at 64 MB.
    `blocked`: (weight, the parameter that holds its row blocks, rows per block, whether the weight
    is read too) among them: copies into the weight (its rows being its last dim's) go into its row
    blocks, and only if it is read into the weight as well. A weight packed in place (vLLM's CPU MoE
    experts) holds its own blocks: the loader writes it plain, the packing follows (see `cpu_compat`)."""

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 blocked: Iterable[tuple[torch.nn.Parameter, torch.nn.Parameter, int, bool]] = (), shared: bool = True):
        params = list({id(p): p for p in params}.values())
        if not params or any(p.device.type != "cpu" or not p.is_contiguous() for p in params):
            raise ValueError("direct writes need contiguous CPU parameters")
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += -(-nbytes(p) // _ALIGN) * _ALIGN
        self.nbytes = max(total, _ALIGN)
        self.path, self.memory = (self._file() if shared else
                                  (None, torch.empty(self.nbytes, dtype=torch.uint8)))  # 64-byte aligned, as torch allocates
        with torch.no_grad():
            for p, offset in zip(params, offsets):
                moved = self.memory[offset:offset + nbytes(p)].view(p.dtype).view(p.shape)
                moved.copy_(p.data)
                p.data = moved
        self.pointer = self.memory.untyped_storage().data_ptr()
        # (first byte, end, columns, rows per block, the blocks' first element, read) per blocked weight
        self._blocked = [(w.storage_offset() * w.element_size(), (w.storage_offset() + w.numel()) * w.element_size(),
                          w.shape[-1], block, b.storage_offset(), read) for w, b, block, read in blocked]

    def _file(self) -> tuple[str, torch.Tensor]:
        sweep_dead(rf"{_PREFIX}(\d+)-\d+")  # files of rollouts that died before a keeper mapped (and unlinked) them
        path = os.path.join(SHM_DIR, f"{_PREFIX}{os.getpid()}-{next(_COUNT)}")
        try:
            fs = os.statvfs(SHM_DIR)
        except OSError:
            raise ValueError(f"no {SHM_DIR} on this machine") from None
        if fs.f_bavail * fs.f_frsize < 2 * self.nbytes:  # a write past a full tmpfs kills the process (SIGBUS)
            raise ValueError(f"{SHM_DIR} has {fs.f_bavail * fs.f_frsize >> 20} MiB free, too little for "
                             f"{self.nbytes >> 20} MiB of parameters")
        return path, torch.from_file(path, shared=True, size=self.nbytes, dtype=torch.uint8)

    def into_row_blocks(self, dst: torch.Tensor) -> tuple[list[tuple[int, int, int, tuple, tuple]], bool] | None:
        """If `dst` lies in a blocked weight: where a copy into it goes in the weight's row blocks,
        per piece (`row_blocks.pieces`: first row of `dst`, rows, then offset, size and stride), and
        whether the weight itself is read (then written too); None for any other parameter."""
        start = dst.storage_offset() * dst.element_size()
        for first, end, row_length, block, blocks, read in self._blocked:
            if first <= start < end:
                if dst.dim() != 2 or dst.stride() != (row_length, 1):
                    raise ValueError("the loader copies into a packed layer's weight other than whole rows of it")
                row, col = divmod((start - first) // dst.element_size(), row_length)
                return [(a, n, blocks + offset + col * block, size, stride)
                        for a, n, size, stride, offset in row_blocks.pieces(row, dst.shape[0], dst.shape[1], row_length, block)], read
        return None

    def unlink(self) -> None:
        if self.path:
            with suppress(FileNotFoundError):
                os.unlink(self.path)


def _written(func, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors `func` writes into (its schema's mutable arguments)."""
    for i, spec in enumerate(func._schema.arguments):
        if spec.alias_info is not None and spec.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(spec.name)
            if isinstance(value, torch.Tensor):
                yield value


@dataclass(frozen=True)
class _Incoming:
    """Where a tensor given to the loader lies in its storage (in elements of its dtype)."""

    name: str
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1

    def slices(self, src: torch.Tensor) -> tuple[tuple[int, int], ...] | None:
        """`src`, a view of the same storage, as (start, length) per dim of this tensor, or None if
        it is not a plain slice of it (this tensor may be any strided view: a split of a fused weight)."""
        if src.dim() != len(self.shape) or src.dtype != self.dtype:
            return None
        starts, rest = [0] * len(self.shape), src.storage_offset() - self.offset
        for d in sorted(range(len(self.shape)), key=self.stride.__getitem__, reverse=True):
            if self.shape[d] > 1 and self.stride[d] > 0:
                starts[d], rest = divmod(rest, self.stride[d])
        for d, (start, size) in enumerate(zip(starts, src.shape)):
            if (size > 1 and src.stride(d) != self.stride[d]) or start < 0 or start + size > self.shape[d]:
                return None
        return tuple(zip(starts, src.shape)) if rest == 0 else None


class Recorder(TorchDispatchMode):
    """Active around the rollout's loader during a channel sync; `plan()` is what it recorded."""

    def __init__(self, segment: Segment):
        super().__init__()
        self.segment = segment
        self._plan = Plan(segment.path, segment.nbytes)
        # storage address -> the tensors arriving in it (a bucket's, or views of the trainer's fused weights)
        self._incoming: dict[int, list[_Incoming]] = defaultdict(list)
        self.problem: str | None = None

    def track(self, named: Iterable[Named]) -> Iterator[Named]:
        """Pass the incoming tensors through, noting where each lies."""
        for name, t in named:
            if name in self._plan.shapes:
                self.problem = self.problem or f"tensor {name!r} arrived twice"
            self._plan.shapes[name] = (tuple(t.shape), t.dtype)
            arrived = _Incoming(name, t.dtype, t.storage_offset(), tuple(t.shape), t.stride())
            others = self._incoming[t.untyped_storage().data_ptr()]  # those it overlaps are gone (a reused buffer)
            others[:] = [o for o in others if o.end <= arrived.offset or arrived.end <= o.offset or o.dtype != t.dtype]
            others.append(arrived)
            yield name, t

    def plan(self) -> Plan | None:
        if self.problem is None and not self._plan.copies:
            self.problem = "the loader copied nothing into the shared parameters"
        return None if self.problem else self._plan

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for dst in _written(func, args, kwargs):
            if dst.untyped_storage().data_ptr() != self.segment.pointer:
                continue
            if func is torch.ops.aten.copy_.default:
                self._record(dst, args[1])
            elif func not in _CONSTANT_WRITES:
                self.problem = self.problem or f"the loader writes a parameter with {func}, not a copy"
        return func(*args, **kwargs)

    def _record(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        given = self._incoming.get(src.untyped_storage().data_ptr(), ()) if isinstance(src, torch.Tensor) else ()
        name, index = next(((t.name, index) for t in given if (index := t.slices(src)) is not None), (None, None))
        if index is None:
            self.problem = self.problem or "the loader copies into a parameter something other than a slice of a tensor it was given"
            return
        try:
            blocked = self.segment.into_row_blocks(dst)
        except ValueError as exc:
            self.problem = self.problem or str(exc)
            return
        pieces, read = blocked or ((), True)
        if read:
            self._plan.copies[name].append(Copy(index, dst.dtype, dst.storage_offset(), tuple(dst.shape), dst.stride()))
        for row, rows, offset, size, stride in pieces:
            (start, _), *rest = index  # the rows of this piece, of the slice copied
            self._plan.copies[name].append(Copy(((start + row, rows), *rest), dst.dtype, offset, size, stride, True))


class Targets:
    """The keeper's side: every rollout rank's plan, with its file mapped here (then unlinked), or
    the one plan of a `segment` in this process."""

    def __init__(self, plans: list[Plan], segment: Segment | None = None):
        self.shapes = plans[0].shapes
        if any(p.shapes != self.shapes for p in plans):
            raise ValueError("rollout ranks recorded different exports")
        self.views: dict[str, list[tuple[tuple[slice, ...], torch.Tensor, bool]]] = defaultdict(list)
        self.paths = [p.path for p in plans if p.path]
        try:
            for plan in plans:
                memory = segment.memory if segment else self._mapped(plan)
                for name, copies in plan.copies.items():
                    for c in copies:
                        dst = memory.view(c.dtype).as_strided(c.size, c.stride, c.offset)
                        self.views[name].append((tuple(slice(s, s + n) for s, n in c.index), dst, c.blocked))
        finally:
            for path in self.paths:
                with suppress(FileNotFoundError):
                    os.unlink(path)

    @staticmethod
    def _mapped(plan: Plan) -> torch.Tensor:
        if os.stat(plan.path).st_size != plan.nbytes:  # torch.from_file would make a new file
            raise ValueError(f"{plan.path} is not the rollout's segment")
        return torch.from_file(plan.path, shared=True, size=plan.nbytes, dtype=torch.uint8)

    def write(self, named: Iterable[Named]) -> int:
        """Replay the plans on an export; returns the bytes exported. An export that differs from the
        recorded one raises (the rollout still refuses to generate until a sync succeeds)."""
        seen, total = set(), 0
        with torch.no_grad():
            for name, t in named:
                if self.shapes.get(name) != (tuple(t.shape), t.dtype) or name in seen:
                    raise RuntimeError(f"the trainer exported {name!r} {tuple(t.shape)} {t.dtype}, which the "
                                       "rollout's recorded load does not expect")
                seen.add(name)
                total += nbytes(t)
                for index, dst, blocked in self.views.get(name, ()):
                    if blocked:
                        row_blocks.copy_into(dst, t[index])
                    else:
                        dst.copy_(t[index])
        if len(seen) != len(self.shapes):
            missing = sorted(set(self.shapes) - seen)
            raise RuntimeError(f"the trainer's export ended without {missing[:3]} ({len(missing)} tensors)")
        return total
