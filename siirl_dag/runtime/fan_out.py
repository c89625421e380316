"""Calls to a large mesh's ranks through leaders (`runtime.fan_out`): the driver sends one call per
block of ranks to that block's leader, which calls its ranks and answers for all of them, so the
driver's calls per step grow with the blocks, not the ranks (a Ray driver spends 0.4-1 ms of CPU per
actor call, and the MoE graph at 4,096 ranks makes 12,290 a step: docs/ARCHITECTURE.md, "Leaders").

The driver's side (`FanOut`) keeps each call made to a fanned rank in its block's round and sends the
rounds when the driver next waits for anything: the calls the dispatcher makes to a node's ranks, one
after another, leave as one call per block. Every call to a fanned rank goes through its leader, so a
rank runs its calls in the order the driver made them, as Ray runs one caller's calls (a weight sync's
parts after the node dispatched before it). A call's answer is its last return; the returns before it
(a node's output shard) stay references, owned by the leader, kept where the rank stored them, and
reach the driver as `Held` entries of one list per round: the driver borrows one reference a round,
not one a shard (each borrowed reference costs it ~30 us of Ray's bookkeeping). A leader hands its
ranks the references a `Held` stands for; a rank called directly brings them itself (`values`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable


def leaders(world: int, size: int) -> int:
    """The leaders a group of `world` ranks is called through at runtime.fan_out `size` (0: directly)."""
    return 0 if not size or world <= size else -(-world // size)


@dataclass(frozen=True)
class Failed:
    """A call that raised (or was not waited for after another call of its round raised): getting
    `ref` raises that call's error, as the rank raised it."""

    ref: Any


@dataclass(frozen=True)
class Held:
    """A shard a leader's round returned: entry `index` of the list of references `refs` stands for."""

    refs: Any
    index: int


def hold(returns: list[list]) -> list[list]:
    """Per call, its references in one object (put here, owned by the caller) as `Held` entries."""
    import ray

    flat = [ref for refs in returns for ref in refs]
    if not flat:
        return [[] for _ in returns]
    listed, out, at = ray.put(flat), [], 0
    for refs in returns:
        out.append([Held(listed, at + i) for i in range(len(refs))])
        at += len(refs)
    return out


async def _references(args: list) -> dict:
    """The references behind the `Held` entries of `args`, per list object."""
    lists = list(dict.fromkeys(a.refs for a in args if isinstance(a, Held)))
    return dict(zip(lists, await asyncio.gather(*lists))) if lists else {}


def values(shards: tuple) -> tuple:
    """`shards` with each `Held` one brought here (a rank called directly, reading a leader's shards)."""
    import ray

    held = [i for i, s in enumerate(shards) if isinstance(s, Held)]
    if not held:
        return shards
    lists = list(dict.fromkeys(shards[i].refs for i in held))
    refs = dict(zip(lists, ray.get(lists)))
    out = list(shards)
    for i, value in zip(held, ray.get([refs[shards[i].refs][shards[i].index] for i in held])):
        out[i] = value
    return tuple(out)


class RankLeader:
    """A Ray actor (async: it takes a round while another waits) calling a block of ranks. Ray does not
    promise to start an async actor's calls in the order they were made, so the rounds are numbered and
    each is sent to the ranks after the one before it."""

    def __init__(self, ranks: list):
        self.ranks, self.next, self.turn = ranks, 0, asyncio.Condition()
        self.methods: dict[tuple, Any] = {}  # (rank index, method, num_returns) -> its bound method

    def method(self, index: int, name: str, num_returns: int):
        """A rank's method with its returns set, made once (`.options` costs about a third of a call)."""
        key = (index, name, num_returns)
        if key not in self.methods:
            self.methods[key] = getattr(self.ranks[index], name).options(num_returns=num_returns)
        return self.methods[key]

    async def call(self, number: int, calls: list[tuple]) -> list[list]:
        """Round `number` of `calls`: (rank index, method name, args, kwargs, num_returns). Per call, its
        returns: the last one's value (or `Failed`), the others as `Held` references. Returns at the
        first failure: the other parts of a weight sync may wait for the failed one forever."""
        returns = []
        async with self.turn:
            await self.turn.wait_for(lambda: self.next == number)
            try:  # a shard read from a list that is gone fails the round, not the rounds after it
                held = await _references([a for call in calls for a in call[2]])
                for index, method, args, kwargs, num_returns in calls:
                    args = [held[a.refs][a.index] if isinstance(a, Held) else a for a in args]
                    out = self.method(index, method, num_returns).remote(*args, **kwargs)
                    returns.append(list(out) if num_returns > 1 else [out])
            finally:
                self.next += 1
                self.turn.notify_all()
        tasks = [asyncio.ensure_future(_answer(refs[-1])) for refs in returns]
        pending, failed = set(tasks), None
        while pending and failed is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = next((t.result() for t in done if isinstance(t.result(), Failed)), None)
        for task in pending:
            task.cancel()
        return [shards + [task.result() if task.done() and not task.cancelled() else failed]
                for shards, task in zip(hold([refs[:-1] for refs in returns]), tasks)]


async def _answer(ref):
    try:
        return await ref
    except Exception:  # noqa: BLE001 - the rank's error (or its death), raised at the driver from `ref`
        return Failed(ref)


@dataclass(eq=False)
class Round:
    """The calls made to one block's ranks since the driver last waited; `ref`: its leader's answer, once sent."""

    block: tuple
    calls: list = field(default_factory=list)
    ref: Any = None


@dataclass(frozen=True, eq=False)
class Fanned:
    """One return of one call of a round (the driver's reference to it; compared by identity)."""

    round: Round
    call: int
    item: int


class FanOut:
    """The driver's side: which ranks report through a leader, their rounds, and the answers.

    `size`: ranks per leader; a group of `size` ranks or fewer is called directly. `make_leader(workers,
    device)` starts a block's leader (near its first rank's device); `send(leader, number, calls)` sends
    a block's round `number` and returns its reference; `get(refs, timeout)` brings answers."""

    def __init__(self, size: int, make_leader: Callable, send: Callable, get: Callable):
        self.size, self.make_leader, self.send, self._get = size, make_leader, send, get
        self.place: dict[int, tuple[tuple, int]] = {}  # id(worker) -> (its block, its index there)
        self.blocks: dict[tuple, list] = {}  # block -> [(worker, device)]
        self.leaders: dict[tuple, Any] = {}
        self.rounds: dict[tuple, Round] = {}  # the rounds not sent yet
        self.sent: dict[tuple, int] = {}  # rounds sent per block
        self.made: dict[tuple[str, int], int] = {}  # workers added per (group, rank): a restarted group's are new

    def add(self, worker, group: str, rank: int, world: int, device: int | None) -> None:
        """Record a new worker; it reports through a leader when its group is larger than `size` (a group
        made again after a restart gets blocks, and leaders, of its own)."""
        if device is None or not leaders(world, self.size):
            return
        generation = self.made[group, rank] = self.made.get((group, rank), 0) + 1
        block = (group, generation, rank // self.size)
        members = self.blocks.setdefault(block, [])
        self.place[id(worker)] = (block, len(members))
        members.append((worker, device))

    def fanned(self, worker) -> bool:
        return id(worker) in self.place

    def call(self, worker, method: str, args: tuple, kwargs: dict, num_returns: int):
        """The call kept in its block's round; its returns' handles (one, or a list of `num_returns`)."""
        block, index = self.place[id(worker)]
        round_ = self.rounds.get(block)
        if round_ is None:
            round_ = self.rounds[block] = Round(block)
        round_.calls.append((index, method, args, kwargs, num_returns))
        handles = [Fanned(round_, len(round_.calls) - 1, item) for item in range(num_returns)]
        return handles if num_returns > 1 else handles[0]

    def flush(self) -> None:
        """Send every round kept (the driver is about to wait)."""
        rounds, self.rounds = self.rounds, {}
        for block, round_ in rounds.items():
            if block not in self.leaders:
                workers = [w for w, _ in self.blocks[block]]
                self.leaders[block] = self.make_leader(workers, self.blocks[block][0][1])
            number = self.sent[block] = self.sent.get(block, -1) + 1
            round_.ref = self.send(self.leaders[block], number, round_.calls)

    def waitable(self, ref):
        """What the backend waits on for `ref`: its round's answer for a handle, else `ref` itself."""
        return ref.round.ref if isinstance(ref, Fanned) else ref

    def get(self, refs: list, timeout: float | None = None) -> list:
        """Each of `refs` (handles and the backend's own references, in any mix) brought here: a handle's
        answer, or the reference an output stays behind (a failed call raises its error)."""
        self.flush()
        waited = list(dict.fromkeys(self.waitable(r) for r in refs))
        values = dict(zip(waited, self._get(waited, timeout)))
        out = []
        for ref in refs:
            if not isinstance(ref, Fanned):
                out.append(values[ref])
                continue
            value = values[ref.round.ref][ref.call][ref.item]
            if isinstance(value, Failed):
                self._get([value.ref], None)  # raises the call's error
            out.append(value)
        return out
