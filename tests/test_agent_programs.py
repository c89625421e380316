"""Agent programs (`params.agent_command`) as processes, without an engine (these make no calls): what a
program leaves running, a sample it never reads, its scratch directory, a late one. The calls a program
makes are tested through the endpoint (test_agent_endpoint.py)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from types import SimpleNamespace

from nodes.agents import runners

SAMPLE = {"_base_url": "http://127.0.0.1:9/episodes/0/v1", "model": "policy", "prompt": "Q", "messages": []}


def episode(index: int = 0) -> SimpleNamespace:
    return SimpleNamespace(index=index, key=f"sk-episode-{index}")


def run(script: str, index: int = 0, timeout_s: float = 30.0) -> runners.Outcome:
    service = SimpleNamespace(end=lambda e: None)
    return asyncio.run(runners.run_episode(runners.command_agent(["sh", "-c", script]), episode(index), SAMPLE,
                                           timeout_s, service))


def gone(pid: int) -> bool:
    """Not running: no such process, or one that died and awaits its reaping."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith(("Z", "X"))
    except OSError:
        return True


def test_a_program_done_with_its_episode_is_not_waited_on_for_what_it_left_running(tmp_path):
    """A background job holding the program's stdout (a server, a shell's `&`) neither holds the episode
    until its timeout nor outlives it."""
    pid_file = tmp_path / "pid"
    began = time.monotonic()
    outcome = run(f"cat > /dev/null; sleep 60 & echo $! > {pid_file}; echo 0.5")
    assert outcome.status == "ok" and outcome.reward == 0.5, outcome.error
    assert time.monotonic() - began < 10
    pid = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is sent; its delivery is the kernel's
        if gone(pid):
            break
        time.sleep(0.1)
    assert gone(pid)


def test_a_programs_reward_is_read_whatever_it_did_with_its_stdin_and_scratch_directory():
    """Exited before the sample was written, closed its stdin unread, removed its TMPDIR."""
    outcomes = [run("echo 1"), run("exec 0<&-; echo '{\"reward\": 2}'"), run('rm -rf "$TMPDIR"; echo 3')]
    assert [(o.status, o.reward) for o in outcomes] == [("ok", 1.0), ("ok", 2.0), ("ok", 3.0)]


def test_each_episode_has_a_scratch_directory_of_its_own_removed_when_it_ends(tmp_path):
    """TMPDIR: a new directory per episode (where `mktemp`, Python's tempfile put their files), gone after
    the episode, whether the program returned, failed or was late."""
    seen = []
    for index, (script, status) in enumerate([("echo 1", "ok"), ("exit 3", "failed"), ("sleep 30", "timeout")]):
        where = tmp_path / f"where-{index}"
        outcome = run(f"echo $TMPDIR > {where}; mktemp > /dev/null; {script}", index, timeout_s=2.0)
        assert outcome.status == status
        scratch = where.read_text().strip()
        seen.append(scratch)
        assert f"episode-{index}-" in scratch and not os.path.exists(Path(scratch).parent)
    assert len(set(seen)) == 3
