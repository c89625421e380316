"""The link between the agents' process and the rank's engine: pickled messages over a socket pair,
framed as multiprocessing's Connection frames them (a 4-byte length, then the pickle).

The agents (and their endpoint) run in a process of their own (worker.py), so that their Python (the
`openai` client's, a framework's) runs beside the engine's on another core instead of taking turns
with it, and so that whatever an agent does cannot stall or break the rank. The rank's vLLM engine
is driven only by the rank's own thread (it is not thread-safe): `serve` adds the turns the agents ask
for and steps the engine while any is in flight. Neither side ever blocks on a send while the other
waits to send too: the rank sends from a thread of its own, the agents through their event loop.

    agents -> rank: ("add", key, context ids, max_tokens, seed, stop, top_logprobs), ("abort", key),
                    ("finished", results), ("failed", traceback)   (a rank may serve several such processes:
                    `params.agent_processes`)
    rank -> agents: ("done", key, Turn), ("refused", key, why) (the engine would not take the turn: a
                    token id out of its vocabulary, say; that call's 400), ("rollout", spec), ("exit",)
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import queue
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as ready
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the agents' process imports no torch
    from siirl_dag.strategies.vllm.turns import Turns


@dataclass
class Turn:
    """A finished turn as the agents get it (plain lists: no torch on their side)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    top_logprobs: list | None


class AgentsGone(RuntimeError):
    """The agents' process closed its end (it exited, or was killed)."""


class TurnRefused(ValueError):
    """The engine would not take a turn (its request checks refused it): the call's own fault."""


class RankEnd:
    """The rank's end: receives on the calling thread, sends from a thread of its own."""

    def __init__(self, conn: Connection):
        self.conn, self._out = conn, queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_all, name="agents-link", daemon=True)
        self._sender.start()

    def send(self, message: tuple) -> None:
        self._out.put(message)

    def _send_all(self) -> None:
        while (message := self._out.get()) is not None:
            try:
                self.conn.send(message)
            except OSError:  # the agents' process is gone; `serve` finds out reading
                return

    def close(self) -> None:
        self._out.put(None)
        self.conn.close()


def serve(links: list[RankEnd], turns: Turns, deadline: float, tell: Callable[[list], None] | None = None
          ) -> tuple[list, int] | None:
    """Generate the turns the agents' processes ask for until each has sent its results: (their results,
    by link; the most turns in flight at once); None if `deadline` (time.monotonic()) came first.
    AgentsGone if one exited. A turn's key on the engine is (link, the key its process gave).
    `tell`: hands each round's adds and aborts to the engine's other tensor-parallel ranks (`follow`), which
    must be given the same turns in the same order, and step when this one does."""
    conns, results, live, peak = [link.conn for link in links], [None] * len(links), set(), 0
    refusals = _refusals()
    try:
        while time.monotonic() < deadline:
            wait, commands = 0 if turns.busy else 0.05, []  # idle: wait for the agents; generating: take what is there
            while readable := ready([c for c, r in zip(conns, results) if r is None], wait):
                wait = 0
                for conn in readable:
                    i, message = conns.index(conn), conn.recv()
                    if message[0] == "finished":
                        results[i] = message[1]
                    elif message[0] == "failed":
                        raise RuntimeError(f"the agents' rollout failed in their process:\n{message[1]}")
                    else:
                        message = (message[0], (i, message[1]), *message[2:])  # its key on the engine
                        try:
                            changed = _apply(turns, live, message)
                        except refusals as exc:  # the engine's request checks refused an add: that call fails
                            if message[0] != "add":
                                raise
                            links[i].send(("refused", message[1][1], f"{type(exc).__name__}: {exc}"))
                            continue
                        if changed:
                            commands.append(message)
                if all(r is not None for r in results):
                    return results, peak
            if tell is not None and (commands or turns.busy):
                tell(commands)
            peak = max(peak, len(live))
            if turns.busy:
                for key, sample in turns.step():
                    live.discard(key)
                    links[key[0]].send(("done", key[1], Turn(list(sample.token_ids), list(sample.logprobs),
                                                             sample.finish_reason, sample.text, sample.top_logprobs)))
        return None
    except (EOFError, OSError) as exc:
        raise AgentsGone(f"an agents' process is gone ({type(exc).__name__})") from None
    finally:
        for key in live:
            turns.abort(key)


def _refusals() -> tuple[type[BaseException], ...]:
    """What an engine raises for a request it will not take: vLLM's client errors (ValueError in older vLLMs)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)


def follow(turns: Turns, hear: Callable[[], list | None]) -> None:
    """A tensor-parallel rank of the engine, but its first: the first's adds and aborts, round by round
    (`hear`; None: the rollout is over), each round a step when there is a turn in flight, as the first does."""
    live: set = set()
    try:
        while (commands := hear()) is not None:
            for message in commands:
                _apply(turns, live, message)
            if turns.busy:
                for key, _ in turns.step():
                    live.discard(key)
    finally:
        for key in live:
            turns.abort(key)


def _apply(turns: Turns, live: set, message: tuple) -> bool:
    """An agents' add or abort on the engine; whether it changed anything."""
    if message[0] == "add":
        turns.add(*message[1:])
        live.add(message[1])
        return True
    if message[0] == "abort" and message[1] in live:
        live.discard(message[1])
        turns.abort(message[1])
        return True
    return False


class AgentsEnd:
    """The agents' end, on their event loop: `generate` asks the rank for a turn and waits for it;
    `messages` yields what the rank sends."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._keys = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}

    def send(self, message: tuple) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        size = len(payload)
        header = struct.pack("!i", size) if size <= 0x7FFFFFFF else struct.pack("!iQ", -1, size)
        self._writer.write(header + payload)

    async def receive(self) -> tuple:
        """The rank's next message; EOFError when its end closed."""
        try:
            (size,) = struct.unpack("!i", await self._reader.readexactly(4))
            if size == -1:
                (size,) = struct.unpack("!Q", await self._reader.readexactly(8))
            return pickle.loads(await self._reader.readexactly(size))
        except asyncio.IncompleteReadError:
            raise EOFError from None

    async def generate(self, context: list[int], max_tokens: int, seed: int | None, stop: list[str],
                       top_logprobs: int) -> Any:
        """The turn the engine samples after `context`."""
        key = next(self._keys)
        future = self._waiting[key] = asyncio.get_running_loop().create_future()
        self.send(("add", key, context, max_tokens, seed, stop, top_logprobs))
        try:
            return await future
        except asyncio.CancelledError:
            if self._waiting.pop(key, None) is not None:
                self.send(("abort", key))
            raise

    def received(self, key: int, sample: Any) -> None:
        future = self._waiting.pop(key, None)
        if future is not None and not future.done():
            future.set_result(sample)

    def refused(self, key: int, why: str) -> None:
        future = self._waiting.pop(key, None)
        if future is not None and not future.done():
            future.set_exception(TurnRefused(why))

    def forget(self) -> None:
        """A rollout is over: nothing waits any more."""
        for future in self._waiting.values():
            future.cancel()
        self._waiting.clear()
