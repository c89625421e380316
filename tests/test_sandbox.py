"""The python tool's sandbox (bubblewrap), tried with escapes: each is contained, answered as a
string in bounded time, and leaves no process behind."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from nodes.tools import python_sandbox
from nodes.tools import sandbox_policy as policy

pytestmark = pytest.mark.skipif(python_sandbox.available() is not None,
                                reason=f"no sandbox here: {python_sandbox.available()}")


def sandbox_processes() -> list[str]:
    """Processes of a sandbox's user, or bwrap's, still alive (none may be)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            owner, cmd = os.stat(f"/proc/{pid}").st_uid, Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (owner >= policy.UID_BASE and os.getuid() == 0) or cmd.startswith(b"bwrap"):
            left.append(f"{pid}: {cmd[:80]!r}")
    return left


def run(code: str, timeout_s: float = 3.0) -> tuple[str, float]:
    began = time.monotonic()
    answer = python_sandbox.run(code, timeout_s)
    took = time.monotonic() - began
    assert isinstance(answer, str) and took < timeout_s + 3, (answer[-300:], took)
    assert not sandbox_processes(), sandbox_processes()
    return answer, took


def test_runs_code_and_answers_with_its_output():
    assert run("print(sum(range(10)))")[0] == "45\n"
    answer, _ = run("raise ValueError('boom')")
    assert "ValueError: boom" in answer and "[exit status 1]" in answer


def test_an_endless_loop_is_stopped_at_its_time_limit():
    answer, took = run("while True: pass", timeout_s=2.0)
    assert "time limit" in answer and took >= 2.0


def test_a_fork_bomb_hits_the_process_limit():
    answer, _ = run("import os\nwhile True:\n    os.fork()")
    assert "Resource temporarily unavailable" in answer or "time limit" in answer


def test_an_8_gib_allocation_fails_inside():
    assert "MemoryError" in run("x = bytearray(8 * 2**30)")[0]


def test_writes_stay_in_its_own_tmp(tmp_path):
    outside = tmp_path / "escape.txt"
    answer, _ = run(f"open('/tmp/inside.txt', 'w').write('ok'); print(open('/tmp/inside.txt').read())\n"
                    f"open({str(outside)!r}, 'w').write('escaped')")
    assert answer.startswith("ok\n") and "Error" in answer and not outside.exists()


def test_no_network_not_even_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    port, accepted = server.getsockname()[1], []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    answer, _ = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
    server.close()
    assert "ConnectionRefusedError" in answer or "OSError" in answer, answer
    assert not accepted


def test_the_parents_environment_is_not_there(monkeypatch):
    monkeypatch.setenv("SIIRL_SECRET_TOKEN", "hunter2")
    answer, _ = run("import os; print(sorted(os.environ))")
    assert "SIIRL_SECRET_TOKEN" not in answer and "hunter2" not in answer


def test_a_100_mb_print_is_cut():
    answer, _ = run("print('x' * 100_000_000)")
    assert len(answer) < python_sandbox.MAX_OUTPUT + 200 and "output" in answer.splitlines()[-1]


def test_killing_the_parent_kills_nothing_outside():
    answer, _ = run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)")
    assert isinstance(answer, str)  # and this test process is still here to check it


def test_the_tool_is_registered_with_its_schema():
    from siirl_dag.registry import resolve_tool

    tool = resolve_tool("python")
    assert tool.parameters["required"] == ["code"] and tool.fn(code="print(6*7)") == "42\n"
