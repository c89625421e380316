"""Agent programs (`params.agent_command`) as processes, without an engine (these make no calls): what a
program leaves running, a sample it never reads, its scratch directory, a late one, an agents' process
stopped under its programs. The calls a program makes are tested through the endpoint
(test_agent_endpoint.py)."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from nodes.agents import programs, runners

SAMPLE = {"_base_url": "http://127.0.0.1:9/episodes/0/v1", "model": "policy", "prompt": "Q", "messages": []}


def episode(index: int = 0) -> SimpleNamespace:
    return SimpleNamespace(index=index, key=f"sk-episode-{index}")


def run(script: str, index: int = 0, timeout_s: float = 30.0, sample: dict = SAMPLE) -> runners.Outcome:
    agent = programs.command_agent(["sh", "-c", script], tempfile.gettempdir())
    return asyncio.run(runners.run_episode(agent, episode(index), sample, timeout_s, SimpleNamespace(end=lambda e: None)))


def gone(pid: int) -> bool:
    """Not running: no such process, or one that died and awaits its reaping."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith(("Z", "X"))
    except OSError:
        return True


def test_a_program_done_with_its_episode_is_not_waited_on_for_what_it_left_running(tmp_path):
    """A background job holding the program's stdout (a server, a shell's `&`) neither holds the episode
    until its timeout nor outlives it; nor does one in a session of its own (a harness's command run
    with start_new_session, a daemon), out of the program's process group."""
    began = time.monotonic()
    outcome = run(f"cat > /dev/null; sleep 60 & echo $! > {tmp_path}/job; setsid sleep 61 & echo $! > {tmp_path}/own; "
                  "sleep 0.2; echo 0.5")
    assert outcome.status == "ok" and outcome.reward == 0.5, outcome.error
    assert time.monotonic() - began < 10
    for name in ("job", "own"):
        pid = int((tmp_path / name).read_text())
        for _ in range(50):  # SIGKILL is sent; its delivery is the kernel's
            if gone(pid):
                break
            time.sleep(0.1)
        assert gone(pid), name


@pytest.mark.parametrize("then, status", [("echo 1", "ok"), ("sleep 30", "timeout")])
def test_what_a_program_started_goes_with_its_episode_even_having_cleared_its_environment(tmp_path, then, status):
    """A daemon that left the program's session and cleared its environment on the way (`env -i`, a
    double fork) carries neither the program's group nor the episode's mark: it is found all the same,
    the program returned or late."""
    daemon = f"env -i /bin/sh -c '(setsid sleep 62 & echo $! > {tmp_path}/pid) &'; sleep 0.2; "
    outcome = run(daemon + then, timeout_s=3.0)
    assert outcome.status == status, outcome.error
    pid = int((tmp_path / "pid").read_text())
    for _ in range(50):
        if gone(pid):
            break
        time.sleep(0.1)
    assert gone(pid)


def test_a_program_runs_as_a_shell_would_start_it_and_ends_as_it_did():
    """Signals the run's Python ignores (SIGPIPE) are the program's default again; a program killed by a
    signal is told so; one that is not there is told by its name."""
    sigpipe = 1 << (13 - 1)
    outcome = run("mask=$(sed -n 's/^SigIgn:\\s*//p' /proc/$$/status); echo $(( 0x$mask & %d ))" % sigpipe)
    assert (outcome.status, outcome.reward) == ("ok", 0.0), outcome.error
    assert run("kill -9 $$").error == "RuntimeError: sh exited with status -9: (nothing on stderr)"
    agent = programs.command_agent(["no-such-program-here"], tempfile.gettempdir())
    lost = asyncio.run(runners.run_episode(agent, episode(), SAMPLE, 10.0, SimpleNamespace(end=lambda e: None)))
    assert lost.error == ("RuntimeError: no-such-program-here exited with status 127: no-such-program-here: "
                          "No such file or directory")


def test_a_keeper_leaves_what_it_may_not_kill_and_waits_only_for_the_rest(monkeypatch):
    """A process of another user's below a program (one it ran with sudo) cannot be killed: the keeper
    kills the rest and ends, rather than waiting on it (the kernel's answers stood in for)."""
    from nodes.agents import subreaper

    left, waited = {11, 12, 13}, []

    def kill(pid: int, sig: int) -> None:
        if pid == 11:
            raise PermissionError(1, "Operation not permitted")
        left.discard(pid)

    monkeypatch.setattr(subreaper, "children", lambda me: sorted(left))
    monkeypatch.setattr(subreaper.os, "kill", kill)
    monkeypatch.setattr(subreaper.os, "waitpid", lambda pid, options: waited.append(options) or (0 if options else 12, 0))
    subreaper.kill_all_left(1)
    assert left == {11} and waited == [0, subreaper.os.WNOHANG]


def test_a_program_gets_the_pythonpath_the_run_was_started_with_not_the_runs_own(monkeypatch, tmp_path):
    """The run's processes import from its Python's sys.path (stdlib included), which a program in
    another Python cannot import: the program gets the run's PYTHONPATH as it was started, or none."""
    from siirl_dag.refs import importing_env

    for started_with in ("", str(tmp_path)):
        monkeypatch.setenv("PYTHONPATH", started_with)
        monkeypatch.delenv("SIIRL_DAG_USER_PYTHONPATH", raising=False)
        for key, value in importing_env().items():  # as the agents' process is started
            monkeypatch.setenv(key, value)
        assert os.environ["PYTHONPATH"] != started_with
        seen = tmp_path / "seen"
        outcome = run(f'echo "${{PYTHONPATH-unset}}" > {seen}; env | grep -c SIIRL_DAG_USER >> {seen}; echo 1')
        assert outcome.status == "ok", outcome.error
        assert seen.read_text().split() == [started_with or "unset", "0"]


def test_a_programs_reward_is_read_whatever_it_did_with_its_stdin_and_scratch_directory():
    """Exited before reading its sample, closed its stdin unread, removed its TMPDIR, left a child holding
    its stdin while its sample is larger than a pipe holds."""
    outcomes = [run("echo 1"), run("exec 0<&-; echo '{\"reward\": 2}'"), run('rm -rf "$TMPDIR"; echo 3'),
                run("sleep 30 & echo 4", sample={**SAMPLE, "prompt": "Q" * 2**20}, timeout_s=10.0)]
    assert [(o.status, o.reward) for o in outcomes] == [("ok", 1.0), ("ok", 2.0), ("ok", 3.0), ("ok", 4.0)]


def test_the_reward_is_what_the_program_wrote_by_its_exit_not_what_it_left_running_wrote_after(tmp_path):
    """A server it started in a session of its own, logging to the stdout it inherited once the program
    has gone (while the episode's leftovers are looked for), does not replace the reward."""
    outcome = run("setsid sh -c 'while kill -0 $0 2>/dev/null; do sleep 0.01; done; sleep 0.05; while :; do echo beat; "
                  "done' $$ & echo 0.5")
    assert (outcome.status, outcome.reward) == ("ok", 0.5), outcome.error


def test_a_reward_past_a_floats_range_loses_its_episode_only():
    outcome = run("echo 1" + "0" * 400)
    assert outcome.status == "failed" and "expected a finite number" in outcome.error


def test_a_programs_fault_is_told_by_what_it_did_not_by_an_engine_line():
    assert run("echo oops >&2; exit 3").error == "RuntimeError: sh exited with status 3: oops"
    assert run('echo \'{"reward": 1}\' >&2').error == (
        'ValueError: sh printed nothing on stdout (its stderr: {"reward": 1}); expected its reward as the last line of '
        'stdout: a number, null, or {"reward": number or null, "info": {...}}')


def test_each_episode_has_a_scratch_directory_of_its_own_removed_when_it_ends(tmp_path):
    """TMPDIR: a new directory per episode (where `mktemp`, Python's tempfile put their files), gone after
    the episode, whether the program returned, failed or was late."""
    seen = []
    # time enough to start and return on a busy machine (two test workers on two cores), the late one to start
    for index, (script, status, timeout_s) in enumerate([("echo 1", "ok", 20.0), ("exit 3", "failed", 20.0),
                                                         ("sleep 30", "timeout", 5.0)]):
        where = tmp_path / f"where-{index}"
        outcome = run(f'echo $TMPDIR > {where}; [ "$TMUX_TMPDIR" = "$TMPDIR" ] || exit 9; mktemp > /dev/null; {script}', index,
                      timeout_s=timeout_s)
        assert outcome.status == status
        scratch = where.read_text().strip()
        seen.append(scratch)
        assert f"episode-{index}-" in scratch and not os.path.exists(Path(scratch).parent)
    assert len(set(seen)) == 3


@pytest.mark.engines  # an agents' process of its own: too slow for `make test-fast`
def test_an_agents_process_killed_under_its_programs_leaves_nothing_of_theirs(tiny_model_dir, tmp_path):
    """An agents' process stopped mid-rollout (killed: past its episodes' timeouts, or from outside) cannot
    see to its programs; the rank that started it stops them, and what they started, and removes their files."""
    import signal

    from nodes.agents.episode import Limits
    from nodes.agents.rollout import AgentsProcess
    from nodes.agents.worker import RolloutSpec

    process = AgentsProcess(tiny_model_dir)
    script = f"setsid sleep 60 & echo $! > {tmp_path}/$$; sleep 60"
    params = {"agent": None, "agent_command": ["sh", "-c", script], "env": None, "concurrency": 2, "timeout_s": 120.0,
              "max_request_mb": 1, "host": None, "env_kwargs": {}}
    sample = {"model": "policy", "prompt": "Q", "messages": [{"role": "user", "content": "Q"}], "ground_truth": "",
              "data_source": "test", "extra_info": {}}
    process.link.send(("rollout", RolloutSpec(params, [sample], 2, [0, 1], Limits(64, 64, 2, 8), "policy", 1)))
    for _ in range(600):  # the process imports, then starts both programs
        if len(list(tmp_path.iterdir())) == 2 and all(p.read_text().strip() for p in tmp_path.iterdir()):
            break
        time.sleep(0.1)
    started = [int(p.name) for p in tmp_path.iterdir()] + [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(started) == 4 and os.listdir(process.scratch)
    os.kill(process.proc.pid, signal.SIGKILL)
    process.stop()
    time.sleep(0.2)
    assert [pid for pid in started if not gone(pid)] == [] and not os.path.exists(process.scratch)
