"""The batch that flows between nodes: named tensors with a leading row dimension plus per-row
metadata lists (prompt uid, data source, ground truth ...).

A small own type rather than tensordict: the operations the engine needs are select, slice,
concat and merge, and the wire format must be numpy (zero-copy out of the Ray object store).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

_NUMPY_UNSUPPORTED = {torch.bfloat16: torch.int16}  # sent as raw bits, restored on arrival


class Batch(Mapping):
    """rows x (tensors | lists). Every value has the same number of rows."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None = None, meta: Mapping[str, Sequence] | None = None):
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.meta: dict[str, list] = {k: list(v) for k, v in (meta or {}).items()}
        sizes = {k: len(v) for k, v in self.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch values have different row counts: {sizes}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Batch":
        """Tensors (and numpy arrays) become tensors; everything else is per-row metadata."""
        tensors, meta = {}, {}
        for key, value in values.items():
            if isinstance(value, np.ndarray):
                value = torch.from_numpy(value)
            (tensors if isinstance(value, torch.Tensor) else meta)[key] = value
        return cls(tensors, meta)

    def __getitem__(self, key: str):
        return self.tensors[key] if key in self.tensors else self.meta[key]

    def __iter__(self):
        yield from self.tensors
        yield from self.meta

    def __len__(self) -> int:
        """Number of keys (Mapping protocol); rows are `num_rows`."""
        return len(self.tensors) + len(self.meta)

    @property
    def num_rows(self) -> int:
        for value in self.values():
            return len(value)
        return 0

    def select(self, index: Sequence[int] | torch.Tensor) -> "Batch":
        index = torch.as_tensor(index, dtype=torch.long)
        rows = index.tolist()
        return Batch({k: v[index] for k, v in self.tensors.items()}, {k: [v[i] for i in rows] for k, v in self.meta.items()})

    def only(self, keys: Iterable[str]) -> "Batch":
        keys = set(keys)
        return Batch({k: v for k, v in self.tensors.items() if k in keys}, {k: v for k, v in self.meta.items() if k in keys})

    def renamed(self, names: Iterable[tuple[str, str]]) -> "Batch":
        """The keys named in `names` ((key here, key in the result) pairs; one key may take two names)."""
        names = list(names)
        return Batch({new: self.tensors[old] for old, new in names if old in self.tensors},
                     {new: self.meta[old] for old, new in names if old in self.meta})

    def merge(self, other: Mapping[str, Any]) -> "Batch":
        """A new batch with `other`'s keys added (or replaced); row counts must match."""
        extra = other if isinstance(other, Batch) else Batch.from_dict(other)
        if self.num_rows and extra.num_rows and self.num_rows != extra.num_rows and len(extra):
            raise ValueError(f"cannot merge {extra.num_rows} rows into a batch of {self.num_rows}")
        return Batch({**self.tensors, **extra.tensors}, {**self.meta, **extra.meta})

    @staticmethod
    def concat(parts: Sequence["Batch"]) -> "Batch":
        parts = [p for p in parts if p.num_rows]
        if not parts:
            return Batch()
        keys = list(parts[0].keys())
        tensors, meta = {}, {}
        for key in keys:
            if key in parts[0].tensors:
                tensors[key] = _cat_padded([p.tensors[key] for p in parts])
            else:
                meta[key] = [x for p in parts for x in p.meta[key]]
        return Batch(tensors, meta)

    def to_wire(self) -> dict:
        """numpy arrays + lists: cheap to put in, and zero-copy to get out of, the object store."""
        return {"tensors": {k: tensor_to_wire(t) for k, t in self.tensors.items()}, "meta": self.meta}

    @classmethod
    def from_wire(cls, wire: dict, keys: Iterable[str] | None = None, start: int = 0, stop: int | None = None) -> "Batch":
        """Rebuild a batch, or only some keys and rows of it (cut before copying out of the store)."""
        keep = (lambda k: True) if keys is None else set(keys).__contains__
        rows = slice(start, stop)
        return cls({k: tensor_from_wire(a[rows], d) for k, (a, d) in wire["tensors"].items() if keep(k)},
                   {k: v[rows] for k, v in wire["meta"].items() if keep(k)})


def tensor_to_wire(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """(numpy array, dtype name). bfloat16, which numpy lacks, travels as its raw bits; int64 tensors
    (token ids, masks) travel in the narrowest of uint8/int32 that holds their values, exactly."""
    t = t.detach().cpu()
    dtype = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.int64 and t.numel():
        low, high = t.aminmax()
        if low >= 0 and high <= 255:
            t = t.to(torch.uint8)
        elif low >= -(2**31) and high < 2**31:
            t = t.to(torch.int32)
    raw = t.view(_NUMPY_UNSUPPORTED[t.dtype]) if t.dtype in _NUMPY_UNSUPPORTED else t
    return raw.numpy(), dtype


def tensor_from_wire(array, dtype: str, copy: bool = True) -> torch.Tensor:
    """The tensor `tensor_to_wire` sent. Object-store arrays are read-only views of shared memory:
    by default the tensor owns a copy (consumers may write in place); copy=False views the memory,
    for readers that only copy out of it (weight loading)."""
    array = np.asarray(array)
    if dtype == "int64" and array.dtype != np.int64:
        return torch.from_numpy(array.astype(np.int64))  # widening is itself the copy
    if copy and not array.flags.writeable:
        array = array.copy()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(array)
    target = getattr(torch, dtype)
    return t.view(target) if t.dtype != target else t


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along rows; equal trailing shapes are required (the batch layout pads to fixed lengths)."""
    shapes = {tuple(t.shape[1:]) for t in tensors}
    if len(shapes) > 1:
        raise ValueError(f"cannot concatenate tensors of trailing shapes {sorted(shapes)}")
    return torch.cat(tensors, dim=0)


def version_counts(batch: Batch) -> list[tuple[int, int, int]]:
    """(a sample's weights version, its newest token's, rows) over the rows of `batch` that carry
    versions: what a staleness check reads, in a few numbers rather than the rows themselves."""
    if "weights_version" not in batch.tensors or not batch.num_rows:
        return []
    oldest = batch.tensors["weights_version"]
    tokens = batch.tensors.get("token_weights_version")
    newest = tokens.max(dim=1).values if tokens is not None and tokens.shape[1] else oldest
    pairs, counts = torch.stack([oldest, newest], dim=1).unique(dim=0, return_counts=True)
    return [(a, b, c) for (a, b), c in zip(pairs.tolist(), counts.tolist())]


def row_tokens(batch: Batch) -> np.ndarray:
    """Per-row work estimate for balancing (int64): attention tokens when known, else 1 per row. An
    array, not a list: the driver concatenates and sums one per node output, hundreds of thousands of rows."""
    for key in ("attention_mask", "response_mask"):
        if key in batch.tensors:
            return batch.tensors[key].sum(dim=-1).numpy().astype(np.int64)
    return np.ones(batch.num_rows, dtype=np.int64)
