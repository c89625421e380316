"""Many multi-turn trajectories in flight: the model's turns on the engine, tool calls in a pool.

Token in, token out: a trajectory is the prompt's ids and then exactly the ids the engine generated,
each followed by the tokens of its tools' answers (tokenized once, `tool_calls.Observations`); the
next turn's prompt is that list as it stands, never re-tokenized text. The mask marks the model's
tokens (1) apart from the tools' (0), which are attended to but never trained on. While some
trajectories wait for their tools, the engine keeps generating the others; a tool that takes longer
than `tool_timeout_s` answers with an error and the trajectory goes on. That time counts from the
moment the calls are handed to the pool, waiting for a free worker included: a tool reads what is left
(`tool_calls.time_left`, as the python sandbox does) and a late call that has not started is dropped, so
no tool runs past its trajectory's timeout when the pool is saturated.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from nodes.tool_calls import Answer, Call, Observations, make_call, parse_calls
from siirl_dag.registry import Tool


class TurnEngine(Protocol):
    """What the loop needs of a rollout engine (siirl_dag.strategies.vllm.turns.Turns)."""

    def add(self, key: int, token_ids: list[int], max_tokens: int, seed: int | None) -> None: ...
    def step(self) -> list[tuple[int, Any]]: ...  # finished turns: (key, Sample)
    @property
    def busy(self) -> bool: ...


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int
    max_tokens_per_turn: int
    budget: int  # response tokens of a trajectory in all, the tools' included (data.max_response_length)
    tool_timeout_s: float
    tool_workers: int


@dataclass
class Trajectory:
    prompt_index: int
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # the response: the model's tokens and the tools'
    mask: list[int] = field(default_factory=list)  # 1: the model's, 0: a tool's
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: list[float] = field(default_factory=list)
    finish_reason: str = "stop"
    ended_with_eos: bool = False  # its last turn (the chat template closes such a turn differently)

    def extend(self, ids: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(model)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


def run(engine: TurnEngine, prompts: list[list[int]], n: int, tools: dict[str, Tool], limits: AgentLimits,
        tokenizer: Any, seed: int | None) -> list[Trajectory]:
    """`n` trajectories per prompt (adjacent), each to its end: a turn without a tool call, the turn
    limit or the token budget."""
    observe = Observations(tokenizer)
    trajectories = [Trajectory(i, list(p)) for i, p in enumerate(prompts) for _ in range(n)]
    turn_seed = (lambda k, t: None) if seed is None else (lambda k, t: seed + k * limits.max_turns + t)  # noqa: E731

    def next_turn(k: int) -> None:
        t = trajectories[k]
        engine.add(k, t.prompt_ids + t.ids, min(limits.max_tokens_per_turn, limits.budget - len(t.ids)), turn_seed(k, t.turns))

    for k in range(len(trajectories)):
        next_turn(k)
    pending: dict[Future, tuple[int, float]] = {}
    pool = ThreadPoolExecutor(limits.tool_workers, thread_name_prefix="tool")
    try:
        while engine.busy or pending:
            if engine.busy:
                for k, sample in engine.step():
                    calls = _turn(trajectories[k], sample, tokenizer, limits)
                    if calls:
                        began = time.monotonic()
                        pending[pool.submit(_call_all, calls, tools, began + limits.tool_timeout_s)] = (k, began)
            else:
                wait(list(pending), timeout=_next_deadline(pending, limits.tool_timeout_s), return_when=FIRST_COMPLETED)
            for future, (k, began) in list(pending.items()):
                late = time.monotonic() - began > limits.tool_timeout_s
                if not (future.done() or late):
                    continue
                del pending[future]  # a late tool stops at its deadline; its answer is not waited for
                answers = future.result() if future.done() else \
                    [Answer(f"error: no answer within {limits.tool_timeout_s:g} s", True, limits.tool_timeout_s)]
                future.cancel()  # a late call still queued never starts
                if _observe(trajectories[k], answers, observe, limits):
                    next_turn(k)
    finally:  # a late tool's thread is not waited for
        pool.shutdown(wait=False, cancel_futures=True)
    return trajectories


def _turn(t: Trajectory, sample: Any, tokenizer: Any, limits: AgentLimits) -> list[Call]:
    """Append a finished turn; the calls to make, or [] when the trajectory is done."""
    t.extend(list(sample.token_ids), True, list(sample.logprobs))
    t.turns += 1
    t.finish_reason = sample.finish_reason
    calls = parse_calls(tokenizer.decode(sample.token_ids, skip_special_tokens=False))
    if not calls or t.turns >= limits.max_turns or len(t.ids) >= limits.budget:
        return []
    t.tool_calls += len(calls)
    t.ended_with_eos = bool(sample.token_ids) and sample.token_ids[-1] == tokenizer.eos_token_id
    return calls


def _call_all(calls: list[Call], tools: dict[str, Tool], deadline: float) -> list[Answer]:
    return [make_call(c, tools, deadline) for c in calls]


def _observe(t: Trajectory, answers: list[Answer], observe: Observations, limits: AgentLimits) -> bool:
    """Append the tools' answers; whether the trajectory takes another turn."""
    t.tool_errors += sum(a.error for a in answers)
    t.tool_seconds += [a.seconds for a in answers]
    ids = observe.token_ids([a.text for a in answers], t.ended_with_eos)
    room = limits.budget - len(t.ids)
    t.extend(ids[:room], False)
    if len(ids) >= room:  # no room left for the model to answer
        t.finish_reason = "length"
        return False
    return True


def _next_deadline(pending: dict, timeout: float) -> float:
    return max(min(began for _, began in pending.values()) + timeout - time.monotonic(), 0.0) + 0.01


def metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """agent/turns/{mean,max}, agent/tool_calls/mean, agent/tool_errors/mean, agent/tool_time_s/mean."""
    n, seconds = max(len(trajectories), 1), [s for t in trajectories for s in t.tool_seconds]
    return {"agent/turns/mean": sum(t.turns for t in trajectories) / n,
            "agent/turns/max": float(max((t.turns for t in trajectories), default=0)),
            "agent/tool_calls/mean": sum(t.tool_calls for t in trajectories) / n,
            "agent/tool_errors/mean": sum(t.tool_errors for t in trajectories) / n,
            "agent/tool_time_s/mean": sum(seconds) / len(seconds) if seconds else 0.0}
