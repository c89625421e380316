"""`scripts/bench_agent.py --overhead`: the agent endpoint's cost against the engine's own loop, and the overlap
of 64 concurrent episodes (see bench_agent.py). Also the agents these run beside the demo's: the same agent
with its client over HTTP (`over_http`), one that thinks between its calls (`paced`), and one that keeps
its process busy before each call (`busy`: the demo's rollout in one agents' process, then spread over two)."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

PROMPTS, N, MAX_TURNS, TOKENS_PER_TURN = 16, 8, 2, 96
PACED_TURNS, PACE_S = 4, 2.0
BUSY_S, PROCESSES = 0.02, (1, 2)  # the busy agents' CPU before each call; agents' processes compared
OVERHEAD_BAR = 1.15  # the endpoint's rollout time over the engine's own loop's


async def over_http(client, sample: dict) -> dict:
    """The demo's agent (nodes/demo_agents.py) with a client of its own over the endpoint's HTTP port, as a
    client an agent makes from its base URL (LangChain's, say) or an agent program reaches it; the client
    handed to an agent answers in-process instead."""
    import httpx
    import openai

    from nodes.demo_agents import solve

    async with httpx.AsyncClient(trust_env=False, verify=False, timeout=None) as http:
        return await solve(openai.AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key, http_client=http,
                                              max_retries=0), sample)


async def busy(client, sample: dict) -> dict:
    """The demo's agent with BUSY_S of its own Python before each call (a framework's, a harness's)."""
    from nodes.demo_agents import solve

    create = client.chat.completions.create

    async def thinking_first(**kwargs):
        began = time.thread_time()
        while time.thread_time() - began < BUSY_S:
            pass
        return await create(**kwargs)

    client.chat.completions.create = thinking_first
    return await solve(client, sample)


async def paced(client, sample: dict) -> dict:
    """An agent that thinks between its calls: PACED_TURNS turns, PACE_S seconds apart (a tool, a person)."""
    began, messages = time.monotonic(), list(sample["messages"])
    for _ in range(PACED_TURNS):
        reply = await client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=4)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        await asyncio.sleep(PACE_S)
    return {"reward": 0.0, "info": {"seconds": time.monotonic() - began}}


def overhead(task: Path, rounds: int, threads: int, quiet: bool, agent_processes: int | str = "auto") -> dict:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import pyarrow.parquet as pq
    import torch

    from nodes import agent_loop
    from nodes.agents import agent_processes as resolved
    from nodes.agents import rollout
    from nodes.tools import resolve_tool
    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.samples import prompt_token_ids
    from siirl_dag.strategies.vllm.rollout import VllmRollout

    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU the engine's compute leaves the agents the CPU
    agent_processes = resolved(agent_processes, device, PROMPTS * N)  # as the node resolves it
    engine = VllmRollout(RankContext(rank=0, device=device), str(task / "model"), {
        "dtype": "float32", "kv_cache_gb": 1, "gpu_memory_utilization": 0.3, "enforce_eager": True, "n": N,
        "temperature": 0.7, "chat_template": True})
    rows = pq.read_table(task / "train.parquet").to_pylist()[:PROMPTS]
    samples = [{"model": "policy", "prompt": r["prompt"], "messages": [{"role": "user", "content": r["prompt"]}],
                "ground_truth": r["reward_model"]["ground_truth"], "data_source": r["data_source"],
                "extra_info": r["extra_info"]} for r in rows]
    tools = {"calculator": resolve_tool("calculator")}
    limits = agent_loop.AgentLimits(MAX_TURNS, TOKENS_PER_TURN, 128, 10.0, 8)

    def endpoint(agent: str, concurrency: int, count: int = PROMPTS, n: int = N, processes: int = 1
                 ) -> tuple[float, rollout.Finished]:
        params = {"agent": agent, "max_turns": PACED_TURNS, "max_tokens_per_turn": TOKENS_PER_TURN,
                  "concurrency": concurrency, "agent_processes": processes, "timeout_s": 120.0, "max_request_mb": 8, "host": None, "env_kwargs": {}}
        ctx = SimpleNamespace(engine=engine, node=SimpleNamespace(id="agent", model="policy", params=params),
                              data=SimpleNamespace(max_prompt_length=40, max_response_length=128), validating=False, seed=3)
        began = time.perf_counter()
        finished = rollout.run(ctx, samples[:count], n)
        return time.perf_counter() - began, finished

    def direct() -> float:  # the prompts rendered in it, as the tool loop's node renders them in its rollout
        began = time.perf_counter()
        prompts = [prompt_token_ids(engine.tokenizer, s["prompt"], True, [t.spec() for t in tools.values()]) for s in samples]
        agent_loop.run(engine.turns({}, 128, ["</tool_call>"]), prompts, N, tools, limits, engine.tokenizer, 3)
        return time.perf_counter() - began

    # the demo agent's processes (`params.agent_processes`) are kept from rollout to rollout: started here, imports made
    endpoint("nodes.demo_agents:solve", PROMPTS * N, processes=agent_processes)
    pairs = []
    for _ in range(rounds):
        through, finished = endpoint("nodes.demo_agents:solve", PROMPTS * N, processes=agent_processes)
        http, _ = endpoint("bench_agent_overhead:over_http", PROMPTS * N, processes=agent_processes)
        own = direct()
        pairs.append({"endpoint_s": round(through, 3), "over_http_s": round(http, 3), "direct_s": round(own, 3),
                      "ratio": round(through / own, 3), "ratio_over_http": round(http / own, 3),
                      "calls": sum(e.turns for e in finished.episodes), "peak_in_flight": finished.peak_in_flight})
        if not quiet:
            print(pairs[-1], flush=True)
    wall, finished = endpoint("bench_agent_overhead:paced", 64, count=8, n=8)
    durations = [o.info["seconds"] for o in finished.outcomes if o.status == "ok"]
    spread = {}
    for processes in PROCESSES:
        endpoint("bench_agent_overhead:busy", PROMPTS * N, count=processes, n=1, processes=processes)  # all started
        spread[f"processes_{processes}_s"] = round(endpoint("bench_agent_overhead:busy", PROMPTS * N, processes=processes)[0], 3)
    engine.close()
    ratio = statistics.median(p["ratio"] for p in pairs)
    return {"bar": OVERHEAD_BAR, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "threads": threads, "agent_processes": agent_processes, "ratio_median": ratio, "met": ratio <= OVERHEAD_BAR,
            "ratio_over_http_median": statistics.median(p["ratio_over_http"] for p in pairs), "pairs": pairs,
            "busy_agents": {"cpu_s_per_call": BUSY_S, **spread},
            "overlap": {"episodes": len(durations), "turns_each": PACED_TURNS, "pace_s": PACE_S, "wall_s": round(wall, 2),
                        "episode_s_sum": round(sum(durations), 1), "overlap": round(sum(durations) / wall, 1),
                        "peak_in_flight": finished.peak_in_flight}}

