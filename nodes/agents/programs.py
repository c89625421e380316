"""Agent programs (`params.agent_command`): one process per episode, in any language.

The program gets the episode's address and key (OPENAI_BASE_URL / OPENAI_API_KEY, and Anthropic's two)
in the environment the run was started with (its PYTHONPATH, not the run's Python's), the sample as
JSON on stdin (it may leave it unread), and a scratch directory of the episode's own as TMPDIR (and
TMUX_TMPDIR: a terminal multiplexer's server is the episode's too); its last line on stdout is its
reward (JSON). Whatever it leaves running goes with its episode: it runs under a keeper
(nodes/agents/subreaper.py) that adopts all it orphans, however that left (a background job, a command
in a session of its own, a daemon that cleared its environment), and kills what is left once the
program exits or is late; a container is its daemon's, not the episode's. Its stdin, stdout and stderr
are files, not pipes, so nothing it leaves behind holds the episode open, and its reward is what it
wrote by the time it exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
from typing import Any

import psutil

from nodes.agents import subreaper
from nodes.agents.episode import Episode
from nodes.agents.runners import REWARD_SHAPE, Agent, brief, public_sample
from siirl_dag.refs import user_program_env
from siirl_dag.runtime import reaper

KEEP_OUTPUT = 64 * 1024  # bytes of a program's stdout and stderr kept (its last ones)
EPISODE_MARK = "SIIRL_DAG_EPISODE"  # in a program's environment, inherited by what it starts
KEEPER = [sys.executable, "-I", "-S", subreaper.__file__]
LATE_S = 5.0  # a late program's keeper's time to kill it and what it left


def command_agent(argv: list[str], scratch_root: str) -> Agent:
    """`argv` run once per episode (no shell); each episode's files in a directory under `scratch_root`
    (its agents' process's: removed with it, should the process be stopped before its episodes are)."""

    async def run(episode: Episode, sample: dict) -> Any:
        mark = f"{os.getpid()}-{episode.index}-{secrets.token_hex(4)}"
        own = tempfile.mkdtemp(prefix=f"episode-{episode.index}-", dir=scratch_root)
        try:
            scratch = os.path.join(own, "tmp")
            os.mkdir(scratch)
            given = os.path.join(own, "sample.json")
            with open(given, "w") as f:
                json.dump(public_sample(sample), f, default=str)
            env = {**user_program_env(), "OPENAI_BASE_URL": sample["_base_url"], "OPENAI_API_KEY": episode.key,
                   "ANTHROPIC_BASE_URL": sample["_base_url"].removesuffix("/v1"), "ANTHROPIC_API_KEY": episode.key,
                   "TMPDIR": scratch, "TMUX_TMPDIR": scratch, EPISODE_MARK: mark}
            said_at = os.path.join(own, "said")  # the keeper's: stdout's size when the program exited
            with open(given, "rb") as stdin, open(os.path.join(own, "stdout"), "w+b") as out, \
                    open(os.path.join(own, "stderr"), "w+b") as err:
                proc = await asyncio.create_subprocess_exec(*KEEPER, said_at, *argv, stdin=stdin, stdout=out, stderr=err,
                                                            env=env, start_new_session=True)
                try:
                    code = await proc.wait()
                finally:  # returned, failed or late, the episode is over: what the program left running goes with it
                    await _wind_up(proc, said_at, mark)
                said = _said(said_at, out)
                out, err = _tail(out, said), _tail(err, os.fstat(err.fileno()).st_size)
        finally:
            await asyncio.to_thread(shutil.rmtree, own, True)  # off the loop: a checkout's files take a while
        return _reward_line(argv[0], code, out, err, said > KEEP_OUTPUT)

    return run


async def _wind_up(proc: asyncio.subprocess.Process, said_at: str, mark: str) -> None:
    """The program exited, or is late: its keeper kills what it left (the program first, if late). Where the
    keeper did not finish (killed or stopped, or the program never ran), its group and the processes
    carrying the episode's mark are killed instead. Cancelled as it waits (the loop ending), the keeper,
    told already, finishes alone."""
    if proc.returncode is None:
        proc.send_signal(subreaper.LATE)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), LATE_S)
    if not os.path.exists(said_at):
        _kill_group(proc.pid)
        await proc.wait()
        await asyncio.to_thread(stop_marked, mark)


def _reward_line(program: str, code: int, out: bytes, err: bytes, cut: bool) -> Any:
    """What a program that ended with `code` reported: its last line on stdout, as JSON (`cut`: `out` is
    the last KEEP_OUTPUT bytes of more)."""
    if code != 0:
        raise RuntimeError(f"{program} exited with status {code}: {_last_lines(err)}")
    lines = [line for line in out.decode("utf-8", "replace").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{program} printed nothing on stdout (its stderr: {_last_lines(err, 2)}); expected its "
                         f"reward as the last line of stdout: {REWARD_SHAPE}")
    try:
        return json.loads(lines[-1])
    except ValueError:
        kept = f" (of its last {KEEP_OUTPUT // 1024} KiB, all that is read)" if cut and len(lines) == 1 else ""
        raise ValueError(f"{program}'s last line of stdout{kept} is {brief(lines[-1])}; expected {REWARD_SHAPE}") from None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_marked(mark: str, passes: int = 5) -> None:
    """Kill the processes whose environment's mark starts with `mark` (an episode's whole mark; an agents'
    process's pid and a dash: all its episodes'): the programs and what they started, where their keepers
    could not see to it (killed with their agents' process). Again while a pass finds some (one that
    forks as it is looked for)."""
    for _ in range(passes):
        found = [p for token, procs in reaper.marked(EPISODE_MARK).items() if token.startswith(mark) for p in procs]
        for proc in found:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        if not found:
            return


def _said(said_at: str, out: Any) -> int:
    """How much of stdout the program wrote by its exit, as its keeper saw it (else all there is)."""
    try:
        with open(said_at) as f:
            return int(f.read())
    except (OSError, ValueError):
        return os.fstat(out.fileno()).st_size


def _tail(file: Any, size: int) -> bytes:
    """The last KEEP_OUTPUT bytes of the first `size` a program wrote to `file`."""
    file.seek(max(0, size - KEEP_OUTPUT))
    return file.read(min(size, KEEP_OUTPUT))


def _last_lines(err: bytes, n: int = 5) -> str:
    lines = err.decode("utf-8", "replace").strip().splitlines()[-n:]
    return " | ".join(lines) if lines else "(nothing on stderr)"
