"""One rollout of the user's agents (agent_rollout with `agent`, `agent_command` or `env`), seen from the
rank: the agents run in processes of their own (worker.py; `params.agent_processes` of them, started at
the node's first rollout, kept for the rank's life), the engine in the node's thread, each process
linked to it by engine_link. The rank waits past every episode's own timeout; if the agents' processes
are still not done then (an agent blocking its event loop), or one exits, they are stopped and the
rollout's episodes are lost; the next rollout starts anew.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from nodes import templates
from nodes.agents import agent_processes, engine_link, programs
from nodes.agents.episode import EpisodeRecord, Limits
from nodes.agents.runners import Outcome
from nodes.agents.worker import RolloutSpec
from siirl_dag.refs import importing_env

log = logging.getLogger(__name__)
SHOWN_ERRORS = 3  # lost episodes logged in full per rollout
GRACE_S = 30  # beyond the episodes' timeouts, before the agents' process is stopped


@dataclass
class Finished:
    episodes: list[EpisodeRecord]
    outcomes: list[Outcome]
    peak_in_flight: int  # the most turns the engine held at once


class AgentsProcess:
    """`python -m nodes.agents.worker`, linked to this process by a socket pair; its agent programs' files
    in a scratch folder of its own."""

    def __init__(self, tokenizer_path: str):
        ours, theirs = socket.socketpair()
        env = {**os.environ, **importing_env()}  # what this process imports
        self.scratch = tempfile.mkdtemp(prefix="siirl-agents-")
        self.proc = subprocess.Popen([sys.executable, "-m", "nodes.agents.worker", str(theirs.fileno()), tokenizer_path,
                                      self.scratch], pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self.link = engine_link.RankEnd(Connection(ours.detach()))

    def stop(self) -> None:
        """Ask it to exit (killed if it does not); what its programs left goes too (a process stopped mid-rollout
        could not see to its episodes' ends)."""
        self.link.send(("exit",))
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.link.close()
        programs.stop_marked(f"{self.proc.pid}-")
        shutil.rmtree(self.scratch, ignore_errors=True)


_PROCESSES: dict[tuple[str, str], list[AgentsProcess]] = {}  # (node id, model) -> its agents' processes, in this rank process


def _stop(node: tuple[str, str]) -> None:
    """Stop a node's agents' processes; its next rollout starts new ones."""
    for process in _PROCESSES.pop(node, []):
        process.stop()


@atexit.register
def _stop_all() -> None:
    for processes in _PROCESSES.values():
        for process in processes:
            process.stop()
    _PROCESSES.clear()


def concurrency_shares(concurrency: int, processes: int) -> list[int]:
    """The episodes each agents' process keeps in flight: `concurrency` in all, the first ones taking the remainder."""
    return [concurrency // processes + (i < concurrency % processes) for i in range(processes)]


def spread(episodes: int, shares: list[int]) -> list[list[int]]:
    """The episodes each process runs, in proportion to its share of `concurrency` (so that all run as many
    rounds): episode k to the process that holds place k % concurrency of the shares laid end to end."""
    places = [i for i, share in enumerate(shares) for _ in range(share)]
    out: list[list[int]] = [[] for _ in shares]
    for k in range(episodes):
        out[places[k % len(places)]].append(k)
    return out


def run(ctx: Any, samples: list[dict], n: int) -> Finished:
    """`n` episodes per sample (adjacent), to their ends. A tensor-parallel engine's first rank runs the
    agents and tells its other ranks which turns to add and when to step (they must do as it does);
    every rank returns what the first found."""
    engine = ctx.engine
    turns = engine.turns({"validate": True} if ctx.validating else {}, ctx.data.max_response_length, [])
    ranks = _TensorParallel.of(engine, ctx.rank) if engine.tp > 1 else None
    if ranks is not None and not ranks.first:
        engine_link.follow(turns, ranks.hear)
        if ranks.result is None:
            raise RuntimeError("the agents' rollout failed on the engine's first tensor-parallel rank (its error is there)")
        return ranks.result
    finished = None
    try:
        finished = _lead(ctx, samples, n, turns, ranks.tell if ranks is not None else None)
        return finished
    finally:
        if ranks is not None:
            ranks.end(finished)


def _lead(ctx: Any, samples: list[dict], n: int, turns: Any, tell: Any) -> Finished:
    """The agents' processes (started, or kept from the last rollout) run the episodes, `concurrency` shared
    among them and the episodes in proportion (`spread`); this thread serves their turns."""
    engine, p, data = ctx.engine, ctx.node.params, ctx.data
    node, count = (ctx.node.id, engine.model_path), agent_processes(p["agent_processes"], engine.ctx.device, p["concurrency"])
    kept = []
    for process in _PROCESSES.get(node, []):
        if process.proc.poll() is None:
            kept.append(process)
        else:  # it died (killed from outside, say): what its programs left goes too
            process.stop()
    for process in kept[count:]:
        process.stop()
    processes = _PROCESSES[node] = kept[:count] + [AgentsProcess(engine.model_path) for _ in range(count - len(kept))]
    limits = Limits(data.max_prompt_length, data.max_response_length, p["max_turns"],
                    p["max_tokens_per_turn"] or data.max_response_length)
    episodes = len(samples) * n
    shares = concurrency_shares(p["concurrency"], count)
    spread_out = spread(episodes, shares)
    for process, share, own in zip(processes, shares, spread_out):
        process.link.send(("rollout", RolloutSpec({**p, "concurrency": share}, samples, n, own, limits, ctx.node.model,
                                                  ctx.seed)))
    rounds = max(math.ceil(len(own) / share) for own, share in zip(spread_out, shares))
    deadline = time.monotonic() + rounds * p["timeout_s"] + GRACE_S
    why = ""
    try:
        found = engine_link.serve([process.link for process in processes], turns, deadline, tell)
        why = "the agents' processes did not finish by the rollout's deadline (an agent blocking its event loop?)"
    except engine_link.AgentsGone:
        status = next((process.proc.wait() for process in processes if process.proc.poll() is not None), None)
        found, why = None, f"an agents' process exited (status {status})"
    except BaseException:  # the engine failed: processes still in this rollout must not answer the next one
        _stop(node)
        raise
    if found is None:
        log.error("%s; this rollout's episodes are lost, and the processes are started anew", why)
        _stop(node)
        indexes = [i for i in range(len(samples)) for _ in range(n)]
        return Finished([EpisodeRecord.unheard(k, i) for k, i in enumerate(indexes)],
                        [Outcome("timeout" if "deadline" in why else "failed", error=why) for _ in indexes], 0)
    results, peak = found
    by_index = {record.index: (record, outcome) for records, outcomes in results for record, outcome in zip(records, outcomes)}
    records, outcomes = zip(*(by_index[k] for k in range(episodes)))
    return Finished(list(records), list(outcomes), peak)


class _TensorParallel:
    """An engine's tensor-parallel ranks, over a gloo group of their own: the first tells, the others hear."""

    _made: dict[int, tuple] = {}  # tp -> (this rank's group, its first rank): made once, by every rank at once

    def __init__(self, group: Any, first: int, rank: int):
        self.group, self.leader, self.first, self.result = group, first, rank == first, None

    @classmethod
    def of(cls, engine: Any, rank: int) -> _TensorParallel:
        import torch.distributed as dist

        if engine.tp not in cls._made:  # new_group is collective: every rank of the mesh makes every group
            for first in range(0, dist.get_world_size(), engine.tp):
                group = dist.new_group(list(range(first, first + engine.tp)), backend="gloo")
                if first <= rank < first + engine.tp:
                    cls._made[engine.tp] = (group, first)
        return cls(*cls._made[engine.tp], rank)

    def _broadcast(self, value: Any) -> Any:
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]

    def tell(self, commands: list) -> None:
        self._broadcast(("round", commands))

    def end(self, finished: Finished | None) -> None:
        self._broadcast(("end", finished))

    def hear(self) -> list | None:
        what, value = self._broadcast(None)
        if what == "end":
            self.result = value
            return None
        return value


def samples_of(batch: Any, model: str) -> list[dict]:
    """What an agent is given per prompt: the model's name, the prompt as text and as chat messages, and
    the data row's ground truth, data source and extra_info."""
    out = []
    for i, raw in enumerate(batch["raw_prompt"]):
        messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else [dict(m) for m in raw]
        extra = batch["extra_info"][i] if "extra_info" in batch else None
        out.append({"model": model, "prompt": templates.prompt_text(raw), "messages": messages,
                    "ground_truth": batch["ground_truth"][i], "data_source": batch["data_source"][i],
                    "extra_info": extra or {}})
    return out


def log_failures(finished: Finished, node: str) -> None:
    """The first lost episodes' errors, calls answered empty past the episodes' limits and calls refused, in
    the rank's log."""
    cut = [e for e in finished.episodes if e.past_limits]
    if cut:
        log.warning("%d call(s) of %d episode(s) came past the episode's limits and were answered empty (finish_reason "
                    "length): past nodes.%s.params.max_turns, or without room left in data.max_response_length; raise "
                    "them for longer episodes (agent/calls_past_limits)", sum(e.past_limits for e in cut), len(cut), node)
    refused = [e for e in finished.episodes if e.refused]
    if refused:
        log.warning("%d call(s) of %d episode(s) were answered with an error (agent/calls_refused); the first: %s",
                    sum(e.refused for e in refused), len(refused), refused[0].first_refusal)
    lost = [(e, o) for e, o in zip(finished.episodes, finished.outcomes) if o.status != "ok"]
    for episode, outcome in lost[:SHOWN_ERRORS]:
        log.warning("agent episode %d (prompt %d) lost, %s: %s", episode.index, episode.prompt_index, outcome.status,
                    outcome.error)
    if len(lost) > SHOWN_ERRORS:
        log.warning("... and %d more episodes lost", len(lost) - SHOWN_ERRORS)
