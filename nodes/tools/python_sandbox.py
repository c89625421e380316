"""The `python` tool: run untrusted code in a bubblewrap sandbox and answer with what it printed.

The code runs as an unprivileged user in its own user, PID, IPC, UTS, cgroup and network namespaces
(no network at all, not even the loopback where Ray listens), on a read-only view of the system's
/usr with a private, size-limited /tmp as its only writable place, with an empty environment, and
under limits on CPU time, address space, processes, file size and output. Whatever happens, the
answer is a string (the output, or what stopped it) and no process is left behind: the sandbox's
PID namespace dies with it.

    run(code: str, timeout_s: float = 5.0) -> str
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

from siirl_dag.registry import tool

BWRAP = "bwrap"
INSTALL = "apt-get install bubblewrap"
NOBODY = 65534
MEMORY_BYTES = 512 * 2**20  # address space of each process
MAX_PROCESSES = 16  # beyond the user's own when it has some
TMP_BYTES = 16 * 2**20
MAX_OUTPUT = 16 * 1024  # characters answered; the rest is cut off (and the code stopped)


def available() -> str | None:
    """None when the sandbox can run here, else why not and how to install what is missing."""
    if shutil.which(BWRAP) is None:
        return f"bubblewrap (bwrap) is not installed; install it with: {INSTALL}"
    if _python() is None:
        return "no system Python 3 under /usr for the sandbox; install it with: apt-get install python3"
    return None


def _python() -> str | None:
    return next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)


def _limits(timeout_s: float) -> None:
    """In the child, before bwrap starts: drop to an unprivileged user (root ignores the process
    limit) and set the limits every process inside inherits."""
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (int(timeout_s) + 1, int(timeout_s) + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (TMP_BYTES, TMP_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    own = sum(1 for p in os.listdir("/proc") if p.isdigit() and _owner(p) == os.getuid())
    resource.setrlimit(resource.RLIMIT_NPROC, (own + MAX_PROCESSES, own + MAX_PROCESSES))


def _owner(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def command(code: str) -> list[str]:
    python = _python()
    return [BWRAP, "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev",
            "--size", str(TMP_BYTES), "--tmpfs", "/tmp", "--chdir", "/tmp", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            python, "-I", "-S", "-u", "-c", code]


def run(code: str, timeout_s: float = 5.0) -> str:
    """Run `code` with Python in the sandbox; its stdout and stderr, or why it stopped, as a string."""
    missing = available()
    if missing:
        return f"error: the python tool cannot run here: {missing}"
    proc = subprocess.Popen(command(code), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: _limits(timeout_s), start_new_session=True, close_fds=True)
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
    return run(code)
