"""/dev/shm housekeeping: files named after the process that made them outlive it when it ends
without removing them (killed, or a destructor that never ran), and hold memory until the machine
restarts."""

from __future__ import annotations

import os
import re
from contextlib import suppress

SHM_DIR = "/dev/shm"


def sweep_dead(pattern: str) -> None:
    """Remove the files of SHM_DIR whose whole name matches `pattern`, whose first group is the pid of
    the process that made the file, when no process of that pid runs (a reused pid keeps its file)."""
    with suppress(OSError):
        for name in os.listdir(SHM_DIR):
            match = re.fullmatch(pattern, name)
            if match and not os.path.exists(f"/proc/{match.group(1)}"):
                with suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, name))
