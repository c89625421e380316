"""The `python` tool: run untrusted code in a bubblewrap sandbox and answer with what it printed.

The code runs as an unprivileged user of its own in its own user (no nested ones), PID, IPC, UTS,
cgroup and network namespaces (no network at all, not even the loopback where Ray listens), on a
read-only root with a read-only /usr, a /dev of null, zero, full, random and urandom only, and a
private, size-capped /tmp as its only writable place; with an empty environment, a seccomp deny list
(io_uring, bpf, keyctl, memfd, shared memory, mounts, namespaces, ptrace, ...), and limits on CPU time,
address space, processes, open files, file size and output (`sandbox_policy` holds them all; what it
does not protect against: docs/AGENTS_SANDBOX.md). The program reaches the sandbox as a read-only
file, never on argv, so its length is not bounded by the argv limit. Whatever happens, the answer is a
string (the output, or what stopped it) and no process is left behind: the sandbox's PID namespace
dies with it.

    run(code: str, timeout_s: float = 5.0) -> str
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
from pathlib import Path

from nodes.tool_calls import time_left
from nodes.tools import sandbox_policy as policy
from siirl_dag.registry import tool

TIMEOUT_S = 5.0
MAX_OUTPUT = 16 * 1024  # characters answered; the rest is cut off (and the code stopped)


def available() -> str | None:
    """None when the sandbox can run here, else why not and how to install what is missing."""
    return policy.missing()


def run(code: str, timeout_s: float = TIMEOUT_S) -> str:
    """Run `code` with Python in the sandbox; its stdout and stderr, or why it stopped, as a string."""
    missing = available()
    if missing:
        return f"error: the python tool cannot run here: {missing}"
    program = code.encode("utf-8", "surrogatepass")
    if len(program) > policy.MAX_CODE:
        return f"error: the program has {len(program)} bytes; at most {policy.MAX_CODE} are run"
    fds = (policy.memfd("code", program), policy.memfd("seccomp", policy.seccomp_filter()))
    try:
        proc = subprocess.Popen(policy.command(*fds), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, preexec_fn=lambda: policy.limit(timeout_s),
                                start_new_session=True, close_fds=True, pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)
    out, why = bytearray(), None
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                why = f"stopped after {timeout_s:g} s (time limit)"
                break
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if not ready:
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            out += chunk
            if len(out) > MAX_OUTPUT * 4:  # bytes; decoded and cut below
                why = f"stopped: output above {MAX_OUTPUT} characters"
                break
    finally:
        _kill(proc)
    text = out.decode("utf-8", "replace")
    if len(text) > MAX_OUTPUT:
        text, why = text[:MAX_OUTPUT], why or f"output cut at {MAX_OUTPUT} characters"
    code_ = proc.returncode
    if why is None and code_ not in (0, None):
        why = f"exit status {code_}" if code_ > 0 else f"killed by signal {-code_} ({_signal_name(-code_)})"
    return text + (f"\n[{why}]" if why else "")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown"


def _kill(proc: subprocess.Popen) -> None:
    """Stop the sandbox and reap it: bwrap's child first (the PID namespace's init: everything inside
    dies with it), so bwrap itself reaps it and exits; killed first, bwrap would leave it a zombie."""
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        children = []
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    proc.stdout.close()


@tool("python", description="Run Python 3 code in a sandbox (no network, no files outside its own /tmp) and "
      "answer with what it printed.", available=available,
      parameters={"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"],
                  "additionalProperties": False})
def python(code: str) -> str:
    """Limits: TIMEOUT_S of time (less when the caller's deadline is nearer), and those of sandbox_policy:
    MEMORY_BYTES of address space per process, MAX_PROCESSES processes, MAX_FILES open files, TMP_BYTES
    of /tmp, MAX_CODE bytes of program, MAX_OUTPUT characters of answer."""
    return run(code, time_left(TIMEOUT_S))
