"""The user's agents, one run per episode: a Python `solve(client, sample)`, a program (programs.py), or
an environment driven by the engine's own loop. Whatever an agent does (raises, hangs, exits non-zero,
prints garbage) costs its episode only: the run goes on."""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import sysconfig
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from nodes.agents import is_async
from nodes.agents.episode import Episode
from nodes.agents import openai_api
from nodes.agents.openai_api import Request
from nodes.agents.server import Endpoint
from nodes.agents.service import Service

HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the agents' modules: never the agent's own line
REWARD_SHAPE = "a number, null, or {\"reward\": number or null, \"info\": {...}}"


@dataclass
class Outcome:
    status: str  # "ok", "failed" (raised, exited non-zero, returned something else than a reward), "timeout"
    reward: float | None = None
    info: dict = field(default_factory=dict)
    error: str = ""


Agent = Callable[[Episode, dict], Awaitable[Any]]


async def run_episode(agent: Agent, episode: Episode, sample: dict, timeout_s: float, service: Service) -> Outcome:
    """One episode to its end, within `timeout_s`; its key is revoked after."""
    task = asyncio.ensure_future(agent(episode, sample))
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            return Outcome("timeout", error=f"no result within timeout_s = {timeout_s:g} s")
        returned = task.result()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the agent's failure is its episode's
        return Outcome("failed", error=_described(exc))
    finally:
        task.cancel()  # a late agent is stopped (one that ignores it is left to itself)
        service.end(episode)
    try:
        return Outcome("ok", *reward_of(returned))
    except ValueError as exc:  # what it returned: no line of the engine's to point at
        return Outcome("failed", error=str(exc))


def reward_of(value: Any) -> tuple[float | None, dict]:
    """(reward, info) from what an agent returned; ValueError for anything else."""
    info = {}
    if isinstance(value, dict):
        if "reward" not in value or not isinstance(value.get("info", {}), dict):
            raise ValueError(f"the agent returned {brief(value)}; expected {REWARD_SHAPE}")
        value, info = value["reward"], value.get("info", {})
    if value is None:
        return None, info
    if not isinstance(value, (int, float)):
        raise ValueError(f"the agent returned {brief(value)}; expected {REWARD_SHAPE}")
    try:
        reward = float(value)
    except OverflowError:  # an integer past a float's range
        reward = math.inf
    if not math.isfinite(reward):
        raise ValueError(f"the agent returned the reward {reward} (or one past a float's range); expected a finite number")
    return reward, info


def python_agent(solve: Callable, endpoint: Endpoint) -> Agent:
    """`solve(client, sample)` with an `openai` client at the episode's own address and key, its calls
    answered in this process (Endpoint.transport): `async def solve` gets an `AsyncOpenAI` on this event
    loop; a synchronous `def solve` (a harness written without asyncio) an `OpenAI`, on a thread of the
    episode's own (one that never returns holds only itself)."""
    import httpx
    import openai

    if is_async(solve):
        transport = endpoint.transport()

        async def run(episode: Episode, sample: dict) -> Any:
            # an HTTP client of its own, as the agent may close it
            async with httpx.AsyncClient(transport=transport, timeout=None) as http:
                client = openai.AsyncOpenAI(base_url=sample["_base_url"], api_key=episode.key, http_client=http,
                                            max_retries=0)
                return await solve(client, public_sample(sample))

        return run

    async def run_in_thread(episode: Episode, sample: dict) -> Any:
        transport = endpoint.thread_transport(asyncio.get_running_loop())

        def run() -> Any:
            with httpx.Client(transport=transport, timeout=None) as http:
                client = openai.OpenAI(base_url=sample["_base_url"], api_key=episode.key, http_client=http, max_retries=0)
                result = solve(client, public_sample(sample))
            if inspect.isawaitable(result):
                getattr(result, "close", lambda: None)()
                raise TypeError("solve returned an awaitable, though it is not an async function (a decorator may "
                                "hide its async def); expected solve declared async def, or a def returning a reward")
            return result

        thread = ThreadPoolExecutor(1, thread_name_prefix=f"agent-{episode.index}")
        try:
            return await asyncio.get_running_loop().run_in_executor(thread, run)
        finally:
            thread.shutdown(wait=False)  # a late one is left to itself

    return run_in_thread


def env_agent(make_env: Callable[[], Any], service: Service) -> Agent:
    """An environment's episode: reset(sample) gives the first observation (None: the sample's prompt), each
    model turn goes to step(text) -> (observation, reward, done) (a gymnasium 5-tuple works too), each
    observation comes back as the next message; the episode's reward is the sum of the steps'. Its
    methods run on a thread of the episode's own."""

    async def run(episode: Episode, sample: dict) -> Any:
        loop = asyncio.get_running_loop()
        thread = ThreadPoolExecutor(1, thread_name_prefix=f"env-{episode.index}")

        def call(fn, *args):
            return loop.run_in_executor(thread, fn, *args)

        try:
            env = await call(make_env)
            try:
                return await _steps(env, episode, sample, call, service)
            finally:
                close = getattr(env, "close", None)
                if callable(close):
                    await call(close)
        finally:
            thread.shutdown(wait=False)  # a late one is left to itself

    return run


async def _steps(env: Any, episode: Episode, sample: dict, call: Callable, service: Service) -> float:
    """An environment's turns until it is done or the episode has no turn left: the sum of its rewards."""
    messages = observation_messages(await call(env.reset, public_sample(sample))) or list(sample["messages"])
    total = 0.0
    while True:
        turns = episode.turns
        answer = await service.chat(episode, Request(messages=messages))
        if episode.turns == turns:  # no turn or no room left
            return total
        reply = answer["choices"][0]["message"]
        obs, reward, done = step_result(await call(env.step, reply["content"]))
        total += reward
        if done:
            return total
        messages += [reply, *observation_messages(obs)]


def observation_messages(obs: Any) -> list[dict]:
    """An observation as chat messages: text becomes a user message; a message or a list of them as given."""
    if obs is None:
        return []
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}]
    items = [obs] if isinstance(obs, dict) else obs
    if isinstance(items, list):
        try:
            return [openai_api.message(m, i) for i, m in enumerate(items)]
        except openai_api.ApiError as exc:
            raise ValueError(f"the environment's observation: {exc.message}") from None
    raise ValueError(f"the environment returned the observation {brief(obs)}; expected text, a message "
                     "{'role': ..., 'content': ...} or a list of them")


def step_result(result: Any) -> tuple[Any, float, bool]:
    """step()'s (observation, reward, done), from the gym 3- or 4-tuple or gymnasium's 5-tuple."""
    if isinstance(result, tuple) and len(result) in (3, 4, 5):
        obs, reward, *flags = result
        done = bool(flags[0]) or (len(result) == 5 and bool(flags[1]))
        try:
            value = float(reward)
        except (TypeError, ValueError):
            value = math.nan
        if math.isfinite(value):
            return obs, value, done
    raise ValueError(f"the environment's step returned {brief(result)}; expected (observation, reward, done) "
                     "with a finite reward")


def public_sample(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if not k.startswith("_")}


def _described(exc: BaseException) -> str:
    """The exception and where in the agent it was raised: the last frame of the user's code, not of a
    library it called (the `openai` client raising on a 404, say) nor of these modules (a program's
    fault is told by its message)."""
    frames = traceback.extract_tb(exc.__traceback__)
    libraries = tuple(sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib")) + (HERE,)
    own = [f for f in frames if not f.filename.startswith(libraries)]
    where = f" (at {own[-1].filename}:{own[-1].lineno})" if own else ""
    return f"{type(exc).__name__}: {exc}{where}"


def brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:120] + "..."
