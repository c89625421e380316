"""A run's console: the engine's own lines and the progress bar on the terminal; whatever libraries
print (vLLM, Ray, Megatron, transformers, C code) into the run's log folder, one file per process.

A process is quieted by pointing its stdout and stderr, the file descriptors as well as the Python
streams, at its log file; the driver keeps a duplicate of its terminal for the engine's lines
(`terminal()`). `--verbose` quiets nothing: everything streams to the console as it comes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from pathlib import Path
from typing import Iterator, TextIO

_terminal: TextIO | None = None  # the driver's terminal while it is quiet
WARNING = re.compile(r"WARNING|Warning|\[W\d{4} |\]:W\d{4} ")  # Python, vLLM, Ray, torch's C++ warnings
# a warning of the engine's own packages, as log_format writes it: its time, logger and message
OWN_WARNING = re.compile(r"(\d\d:\d\d:\d\d) WARNING (?:siirl_dag|nodes)(?:\.[\w.]+)?: (.*)")
SHOWN_CHARS = 400  # of the first such warning, on the console


def quieted() -> bool:
    """True in the driver while it is quiet (`quiet`)."""
    return _terminal is not None


def terminal() -> TextIO:
    """Where the engine's own lines and the progress bar go."""
    return _terminal or sys.stderr


def redirect(path: str | Path) -> None:
    """This process's stdout and stderr (descriptors and Python streams) append to `path` from now on
    (its folder made on this machine if missing)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def log_format() -> None:
    """Warnings logged in this process carry their level, logger and time (Python's default prints the
    message alone), so that `warnings_in` counts them and a reader can place them; once per process."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


@contextlib.contextmanager
def quiet(log_dir: Path | None) -> Iterator[None]:
    """Meanwhile, this process's output goes to `log_dir/driver.log` and `terminal()` is the console
    it had; None: nothing changes (--verbose)."""
    global _terminal
    if log_dir is None:
        yield
        return
    saved = [os.dup(1), os.dup(2)]
    _terminal = os.fdopen(os.dup(2), "w", buffering=1)
    redirect(log_dir / "driver.log")
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved_fd in zip((1, 2), saved):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
        _terminal.close()
        _terminal = None


def tail(path: str | Path, lines: int = 20) -> str:
    """The last `lines` lines of a log file ('' if there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return ""


def warnings_in(log_dir: Path) -> tuple[int, str | None]:
    """How many lines of the folder's logs are warnings; and the earliest of the engine's own (a lost
    agent episode's error, say: the libraries' many are not the user's to act on), with its file."""
    count, own = 0, []
    for path in sorted(log_dir.glob("*.log")):
        with open(path, errors="replace") as f:
            for number, line in enumerate(f):
                if WARNING.search(line):
                    count += 1
                    if found := OWN_WARNING.search(line):
                        own.append((found[1], path.name, number, found[2].strip()))
    if not own:
        return count, None
    _, name, _, text = min(own)  # the earliest second; in it, a file's lines in their order
    return count, f"{name}: {text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + ' ...'}"
