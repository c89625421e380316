"""`--json` promises stdout holds the JSON document alone, whoever else writes to stdout meanwhile."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import logging, os, subprocess, sys
    from siirl_dag.cli.json_stdout import json_stdout

    held = logging.StreamHandler(sys.stdout)  # a library's logger that took the stream at import (vLLM's)
    log = logging.getLogger("lib")
    log.addHandler(held)
    print("before")
    with json_stdout({enabled}) as emit:
        print("print")
        log.warning("logger")
        os.write(1, b"file descriptor\\n")  # C code
        subprocess.run(["echo", "child process"])  # e.g. a worker started meanwhile
        emit({{"steps": {{"1": 0.5}}}})
        print("after emit")
    print("after")
""")


def run(enabled: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD.format(enabled=enabled)], capture_output=True, text=True,
                          timeout=60, check=True)


def test_json_mode_sends_everything_else_to_stderr_and_restores_stdout_after():
    res = run(True)
    assert res.stdout == "before\n" + json.dumps({"steps": {"1": 0.5}}, indent=2) + "\nafter\n"
    for line in ("print", "logger", "file descriptor", "child process", "after emit"):
        assert line in res.stderr.splitlines()


def test_without_json_nothing_is_redirected():
    res = run(False)
    lines = res.stdout.splitlines()
    assert {"before", "print", "logger", "file descriptor", "child process", "after emit", "after"} <= set(lines)
    assert res.stderr == ""
