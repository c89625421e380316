"""Numbers measured once per row of a prompt dataset (a prompt's token count), kept on disk for the
next run. Counting tokens needs the model's tokenizer, whose import alone takes seconds, and a large
data set takes minutes more; a restart on the same files and tokenizer needs neither.

An entry is keyed by everything its numbers depend on: the data files (path, and the stat fields a
write changes, `_stamp`), the prompt column, and what the caller puts in `what` (its tokenizer's
files, a template flag, library versions). A changed file makes a new key; an entry that does not
read back is measured again. The folder: $SIIRL_DAG_CACHE, else $XDG_CACHE_HOME/siirl_dag, else ~/.cache/siirl_dag;
it keeps the KEEP entries used last (a read or a write marks an entry used).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from siirl_dag.data.dataset import PromptDataset

UNMEASURED = -1
KEEP = 32  # entries on disk (8 bytes a row each: a million prompts take 8 MB)
SAY_FROM = 20_000  # rows to measure before it says so (about a second of token counting)
_MEMORY: dict[str, np.ndarray] = {}  # key -> value per row index, for this process


def cache_dir() -> Path:
    if os.environ.get("SIIRL_DAG_CACHE"):
        return Path(os.environ["SIIRL_DAG_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "siirl_dag"


def folder_identity(path: str) -> list | None:
    """(name, `_stamp`) of each file at the top of a local folder; None when `path` is not one (a hub
    id: nothing on disk says when it changed)."""
    if not os.path.isdir(path):
        return None
    return sorted([e.name, *_stamp(e)] for e in os.scandir(path) if e.is_file())


def _stamp(path: str | os.DirEntry) -> list[int]:
    """What changes when a file is written again. Size and modification time alone do not: a file
    regenerated at the same size and copied back with its times (`cp -p`, `rsync -t`, `touch -r`)
    keeps both. The inode and the change time, which no user can set, do change (a rewrite in place
    sets the change time, a replacement makes a new inode); a change of owner or mode costs a
    measurement, never a stale one."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def measured(data: PromptDataset, what: dict | None, measure: Callable[[list[dict]], list[int]], label: str) -> list[int]:
    """`measure(rows)` for every row of `data`, in row order; only rows not measured before under
    the same files and `what` are passed to it. `what` None: remembered in this process only.
    `label` names the numbers in the line said before a long measurement."""
    source = {"files": [[os.path.abspath(f), *_stamp(f)] for f in data.files], "prompt_key": data.prompt_key}
    key = hashlib.sha256(json.dumps([source, what], sort_keys=True).encode()).hexdigest()
    size = 1 + max((row["index"] for row in data.rows), default=-1)
    known = _MEMORY.get(key)
    if known is None and what is not None:
        known = _read(cache_dir() / f"{key}.npy")
    known = _grown(known, size)
    missing = [row for row in data.rows if known[row["index"]] == UNMEASURED]
    if missing:
        if len(missing) >= SAY_FROM:
            kept = f"once: kept in {cache_dir()}" if what is not None else "for this run only"
            print(f"[data] measuring {label} over {len(missing):,} rows ({kept}) ...", file=sys.stderr)
        known[[row["index"] for row in missing]] = measure(missing)
        if what is not None:
            _write(cache_dir() / f"{key}.npy", known)
    _MEMORY[key] = known
    return known[[row["index"] for row in data.rows]].tolist()


def _grown(known: np.ndarray | None, size: int) -> np.ndarray:
    out = np.full(size, UNMEASURED, dtype=np.int64)
    if known is not None:
        n = min(size, len(known))
        out[:n] = known[:n]
    return out


def _read(path: Path) -> np.ndarray | None:
    """A saved entry, or None when there is none or it does not read back as one (measured again)."""
    try:
        known = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    with contextlib.suppress(OSError):  # used: the last to be pruned
        os.utime(path)
    return known if known.ndim == 1 and known.dtype == np.int64 else None


def _write(path: Path, known: np.ndarray) -> None:
    """Saved whole or not at all (a rename); a folder that cannot be written only costs the next run time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, known, allow_pickle=False)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return
    _prune(path.parent)


def _prune(folder: Path) -> None:
    """Only the KEEP entries used last stay."""
    def used(entry: Path) -> float:
        try:
            return entry.stat().st_mtime
        except OSError:  # gone meanwhile (another run pruned it)
            return float("inf")

    for entry in sorted(folder.glob("*.npy"), key=used, reverse=True)[KEEP:]:
        with contextlib.suppress(OSError):
            entry.unlink()
