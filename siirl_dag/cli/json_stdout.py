"""`--json`: stdout carries the JSON document and nothing else, for `| jq` and other programs.

Much writes to a run's stdout that is not ours to silence: vLLM's logger (whose handler holds the
stream it found at import), prints from C code, and the worker logs Ray forwards to the driver
(its stdout lines to the driver's `sys.stdout`). So for the duration, the process's stdout, the
file descriptor as well as `sys.stdout`, is pointed at stderr, and the document goes to the real one.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def json_stdout(enabled: bool = True, indent: int | None = 2) -> Iterator[Callable[[Any], None]]:
    """Yields `emit(document)`, which writes the document as JSON to the real stdout (on one line with
    `indent` None). Enabled, all other output to stdout meanwhile goes to stderr; not enabled, nothing
    is redirected."""
    if not enabled:
        yield lambda document: print(json.dumps(document, indent=indent))
        return
    sys.stdout.flush()
    real = os.fdopen(os.dup(1), "w")
    before, sys.stdout = sys.stdout, sys.stderr  # (line-buffered: lines show as they come)
    os.dup2(2, 1)
    try:
        yield lambda document: print(json.dumps(document, indent=indent), file=real, flush=True)
    finally:
        before.flush()  # what a library wrote to the stream it held goes to stderr, like the rest
        os.dup2(real.fileno(), 1)
        sys.stdout = before
        real.close()
