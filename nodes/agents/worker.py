"""The agents' process of one agent_rollout node on one rank: `python -m nodes.agents.worker FD TOKENIZER
SCRATCH`, FD one end of a socket pair whose other end the rank holds (engine_link), SCRATCH the folder
its agent programs' episodes keep their files in. It lives as long as the rank (a
user's module is imported once, its state kept between steps) and runs one rollout at a time: the
endpoint, n episodes per sample, `concurrency` at once, each to its end or its timeout; then it sends
back what each episode left (episode.EpisodeRecord) and how it ended (runners.Outcome). It exits when
the rank's end closes, stopping the agent programs it started.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from dataclasses import dataclass
import socket
import traceback
from typing import Any

from nodes.agents import programs, runners
from nodes.agents.engine_link import AgentsEnd
from nodes.agents.episode import Episode, Limits
from nodes.agents.server import Endpoint
from nodes.agents.service import Service
from nodes.chat_render import ChatRender
from siirl_dag.refs import user_ref


@dataclass
class RolloutSpec:
    params: dict  # the node's params (`concurrency`: this process's share)
    samples: list[dict]  # one per prompt (rollout.samples_of)
    n: int  # episodes per sample
    episodes: list[int]  # the rollout's episodes this process runs (episode k is of sample k // n)
    limits: Limits
    model: str  # the name agents pass as `model`
    seed: int | None


class Agents:
    """What is kept between rollouts: the link, the tokenizer (the user's modules stay imported)."""

    def __init__(self, link: AgentsEnd, tokenizer_path: str, scratch: str):
        from transformers import AutoTokenizer

        self.turns, self.scratch = link, scratch  # scratch: the folder its agent programs' episodes' files go in
        self.render = ChatRender(AutoTokenizer.from_pretrained(tokenizer_path))

    async def rollout(self, spec: RolloutSpec) -> tuple[list, list]:
        p = spec.params
        service = Service(self.turns, self.render, spec.model, spec.limits, spec.seed)
        episodes = [service.open(k, k // spec.n) for k in spec.episodes]
        outcomes: list[runners.Outcome | None] = [None] * len(episodes)
        endpoint = Endpoint(service, p["host"] or "127.0.0.1", p["max_request_mb"]) if p.get("env") is None else None
        if endpoint is not None:
            await endpoint.start()
        try:
            agent = self._agent(p, service, endpoint)
            gate = asyncio.Semaphore(p["concurrency"])

            async def one(k: int, episode: Episode) -> None:
                async with gate:
                    sample = spec.samples[episode.prompt_index]
                    if endpoint is not None:
                        sample = {**sample, "_base_url": endpoint.base_url(episode.index)}
                    outcomes[k] = await runners.run_episode(agent, episode, sample, p["timeout_s"], service)

            started = []
            try:
                for k, episode in enumerate(episodes):  # one at a time, each let run a step before the next
                    started.append(asyncio.ensure_future(one(k, episode)))  # starts: the first turns reach the
                    await asyncio.sleep(0)  # engine while later episodes still build theirs, not after all of them
                await asyncio.gather(*started)
            finally:  # a rollout stopped while they start leaves none running
                for task in started:
                    task.cancel()
        finally:
            self.turns.forget()
            if endpoint is not None:
                await endpoint.stop()
        return [e.record() for e in episodes], outcomes

    def _agent(self, p: dict, service: Service, endpoint: Endpoint | None) -> runners.Agent:
        if p.get("agent"):
            return runners.python_agent(user_ref(p["agent"], "agent", {}), endpoint)
        if p.get("agent_command"):
            return programs.command_agent(p["agent_command"], self.scratch)
        env_class, kwargs = user_ref(p["env"], "environment", {}), dict(p["env_kwargs"])
        return runners.env_agent(lambda: env_class(**kwargs), service)


async def serve(fd: int, tokenizer_path: str, scratch: str) -> None:
    """Rollouts as the rank sends them, until its end closes or it says exit."""
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=fd))
    link = AgentsEnd(reader, writer)
    agents, specs = Agents(link, tokenizer_path, scratch), asyncio.Queue()
    gone = asyncio.get_running_loop().create_future()

    async def read() -> None:
        try:
            while (message := await link.receive())[0] != "exit":
                if message[0] == "done":
                    link.received(message[1], message[2])
                elif message[0] == "refused":
                    link.refused(message[1], message[2])
                elif message[0] == "rollout":
                    specs.put_nowait(message[1])
        except EOFError:
            pass
        gone.set_result(None)

    reading = asyncio.ensure_future(read())
    while True:
        next_spec = asyncio.ensure_future(specs.get())
        await asyncio.wait({next_spec, gone}, return_when=asyncio.FIRST_COMPLETED)
        if gone.done():
            next_spec.cancel()
            break
        try:
            link.send(("finished", await _until(agents.rollout(next_spec.result()), gone)))
        except _Gone:
            break
        except Exception:  # noqa: BLE001 - not an agent's failure (each is its episode's): the rollout's
            link.send(("failed", traceback.format_exc()))
        await writer.drain()
    reading.cancel()


class _Gone(Exception):
    pass


async def _until(work, gone: asyncio.Future) -> Any:
    """`work`'s result, unless the rank goes first (then it is cancelled: its agents' programs stopped)."""
    task = asyncio.ensure_future(work)
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=5)
        raise _Gone
    return task.result()


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:  # vLLM's own dependency: a faster event loop for the agents' sockets
        from uvloop import run
    except ImportError:
        from asyncio import run
    scratch = sys.argv[3]
    try:
        run(serve(int(sys.argv[1]), sys.argv[2], scratch))
    finally:  # its programs' episodes removed their own folders; the rank removes it if this one is killed
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
