"""Agent programs (`params.agent_command`): one process per episode, in any language.

The program gets the episode's address and key (OPENAI_BASE_URL / OPENAI_API_KEY, and Anthropic's two)
in the environment the run was started with (its PYTHONPATH, not the run's Python's), the sample as
JSON on stdin (it may leave it unread), and a scratch directory of the episode's own as TMPDIR; its
last line on stdout is its reward (JSON). Whatever it leaves running goes with its episode: its process
group, and what left the group (a command run in a session of its own, a daemon) by the mark its
environment carries. Its output goes to files, not pipes, so nothing it leaves holds the episode open.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import tempfile
from typing import Any

import psutil

from nodes.agents.episode import Episode
from nodes.agents.runners import REWARD_SHAPE, Agent, brief, public_sample
from siirl_dag.refs import user_program_env

KEEP_OUTPUT = 64 * 1024  # bytes of a program's stdout and stderr kept (its last ones)
EPISODE_MARK = "SIIRL_DAG_EPISODE"  # in a program's environment, inherited by what it starts


def command_agent(argv: list[str]) -> Agent:
    """`argv` run once per episode (no shell)."""

    async def run(episode: Episode, sample: dict) -> Any:
        mark = f"{os.getpid()}-{episode.index}-{secrets.token_hex(4)}"
        with tempfile.TemporaryDirectory(prefix=f"episode-{episode.index}-", ignore_cleanup_errors=True) as own:
            scratch = os.path.join(own, "tmp")
            os.mkdir(scratch)
            env = {**user_program_env(), "OPENAI_BASE_URL": sample["_base_url"], "OPENAI_API_KEY": episode.key,
                   "ANTHROPIC_BASE_URL": sample["_base_url"].removesuffix("/v1"), "ANTHROPIC_API_KEY": episode.key,
                   "TMPDIR": scratch, EPISODE_MARK: mark}
            with open(os.path.join(own, "stdout"), "w+b") as out, open(os.path.join(own, "stderr"), "w+b") as err:
                proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE, stdout=out, stderr=err,
                                                            env=env, start_new_session=True)
                try:
                    await _send(proc.stdin, json.dumps(public_sample(sample), default=str).encode())
                    code = await proc.wait()
                finally:  # returned, failed or late, the episode is over: what the program left running goes with it
                    _kill_group(proc.pid)
                    await proc.wait()
                    await asyncio.to_thread(_stop_marked, mark)
                out, err = _tail(out), _tail(err)
        return _reward_line(argv[0], code, out, err)

    return run


def _reward_line(program: str, code: int, out: bytes, err: bytes) -> Any:
    """What a program that ended with `code` reported: its last line on stdout, as JSON."""
    if code != 0:
        raise RuntimeError(f"{program} exited with status {code}: {_last_lines(err)}")
    lines = [line for line in out.decode("utf-8", "replace").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{program} printed nothing on stdout (its stderr: {_last_lines(err, 2)}); expected its "
                         f"reward as the last line of stdout: {REWARD_SHAPE}")
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise ValueError(f"{program}'s last line of stdout is {brief(lines[-1])}; expected {REWARD_SHAPE}") from None


async def _send(stdin: asyncio.StreamWriter, data: bytes) -> None:
    """`data` to a program's stdin, then its end; a program that exits without reading it is not at fault."""
    try:
        stdin.write(data)
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_marked(mark: str) -> None:
    """Processes whose environment carries `mark`: what the episode's program started that left its group."""
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(EPISODE_MARK) == mark:
                proc.kill()
        except (psutil.Error, OSError):
            continue


def _tail(file: Any) -> bytes:
    """The last KEEP_OUTPUT bytes a program wrote to `file`."""
    file.seek(max(0, os.fstat(file.fileno()).st_size - KEEP_OUTPUT))
    return file.read()


def _last_lines(err: bytes, n: int = 5) -> str:
    lines = err.decode("utf-8", "replace").strip().splitlines()[-n:]
    return " | ".join(lines) if lines else "(nothing on stderr)"
