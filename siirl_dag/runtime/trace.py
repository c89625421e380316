"""A run's timeline in the Trace Event format (opens in Perfetto and chrome://tracing): one process
per mesh, one thread per rank, a span for every node execution; the driver's own work (weight sync,
checkpoints, validation, data loading) on a track of its own. Times are wall clock, so ranks on one
machine line up."""

from __future__ import annotations

import json
import time
from pathlib import Path

DRIVER = "driver"


class Trace:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self._pids: dict[str, int] = {}
        self._tids: set = set()

    def span(self, track: str, thread: str, name: str, start: float, end: float, **args) -> None:
        """One span; `start`/`end` in seconds of time.time()."""
        pid = self._pid(track)
        if (pid, thread) not in self._tids:
            self._tids.add((pid, thread))
            self.events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": thread, "args": {"name": thread}})
        self.events.append({"ph": "X", "name": name, "pid": pid, "tid": thread, "ts": start * 1e6,
                            "dur": max(end - start, 0.0) * 1e6, "args": args})

    def driver(self, name: str, start: float, **args) -> None:
        """A span of the driver's, from `start` until now."""
        self.span(DRIVER, DRIVER, name, start, time.time(), **args)

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
        tmp.replace(path)
        return path

    def _pid(self, track: str) -> int:
        if track not in self._pids:
            self._pids[track] = len(self._pids) + 1
            self.events.append({"ph": "M", "name": "process_name", "pid": self._pids[track], "args": {"name": track}})
        return self._pids[track]
