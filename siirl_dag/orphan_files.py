"""Files that outlive the process that made them: left when it ends without removing them (killed,
or a destructor that never ran). In /dev/shm they hold memory until the machine restarts; elsewhere
(sockets in the temp folder) they pile up."""

from __future__ import annotations

import os
import re
import shutil
from contextlib import contextmanager, suppress
from typing import Callable, Iterator

SHM_DIR = "/dev/shm"
RAY_SEMAPHORES = r"sem\.(?:obj|hdr)(\d+)-\d+"  # a channel buffer's two, named after its raylet's pid


def sweep_dead(pattern: str, folder: str = SHM_DIR) -> None:
    """Remove the entries (files, or folders with what they hold) of `folder` whose whole name matches
    `pattern`, whose first group is the pid of the process that made the entry, when no process of
    that pid runs (a reused pid keeps its entry)."""
    with suppress(OSError):
        for name in os.listdir(folder):
            match = re.fullmatch(pattern, name)
            if match and not os.path.exists(f"/proc/{match.group(1)}"):
                path = os.path.join(folder, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with suppress(OSError):
                        os.unlink(path)


def own_folder(prefix: str, base: str) -> str:
    """A folder of this process's own under `base` (`prefix` + pid), made if missing; those of processes
    that have ended are swept first."""
    sweep_dead(rf"{re.escape(prefix)}(\d+)", base)
    path = os.path.join(base, f"{prefix}{os.getpid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


@contextmanager
def created(folder: str, found: list[str], keep: Callable[[str], bool] = lambda name: True) -> Iterator[None]:
    """Record into `found` the paths of the entries of `folder` made meanwhile whose names `keep`
    accepts (a library that leaves them behind, for `remove` once it is done)."""
    names = lambda: set(os.listdir(folder)) if os.path.isdir(folder) else set()  # noqa: E731
    before = names()
    try:
        yield
    finally:
        found.extend(os.path.join(folder, name) for name in sorted(names() - before) if keep(name))


def remove(paths: list[str]) -> None:
    """Unlink `paths` (those already gone too) and forget them."""
    for path in paths:
        with suppress(FileNotFoundError):
            os.unlink(path)
    paths.clear()
