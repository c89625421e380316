"""What the sandbox tests check after a sandbox has run."""

from __future__ import annotations

import os
from pathlib import Path


def sandbox_processes() -> list[str]:
    """Processes of a sandbox's user, or bwrap's, still alive (none may be)."""
    from nodes.tools import sandbox_policy as policy

    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            owner, cmd = os.stat(f"/proc/{pid}").st_uid, Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (owner >= policy.UID_BASE and os.getuid() == 0) or cmd.startswith(b"bwrap"):
            left.append(f"{pid}: {cmd[:80]!r}")
    return left
