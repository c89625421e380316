"""The user's own agents in an agent_rollout: an OpenAI-compatible endpoint served from the rollout's
engine (server.py, service.py, openai_api.py), token-faithful episodes (episode.py), the agents run
per episode (runners.py; programs: programs.py), and the rollout that ties them together (rollout.py, rows.py). Here: what the
node (nodes/agent_rollout.py, read by `plan`) and its rollout share, without importing the endpoint."""

# episodes lost, and calls answered with an error (rows.metrics): on the console's line of each step too
FAILED, TIMEOUTS, REFUSED = "agent/failed", "agent/timeouts", "agent/calls_refused"

# agent_processes: auto, by the engine's device. On a CPU the engine's threads take the rank's cores; on a
# GPU the engine waits on the agents' Python instead (docs/BENCHMARKS.md: busy agents in one process and in
# two, on an H200), and a GPU machine has the cores to spread them over.
AUTO_PROCESSES = {"cpu": 1, "cuda": 4}


def is_async(solve) -> bool:
    """Whether a Python agent is `async def solve` (run on the agents' event loop with an AsyncOpenAI) or a
    synchronous `def solve` (run in a thread with an OpenAI client)."""
    import inspect

    return inspect.iscoroutinefunction(solve) or inspect.iscoroutinefunction(getattr(solve, "__call__", None))


def agent_processes(asked: int | str, device: str, concurrency: int) -> int:
    """The agents' processes an engine on `device` runs its episodes in (`params.agent_processes`): never
    more than the episodes in flight (`concurrency`), which they share (rollout.py; `plan` says it too)."""
    return min(AUTO_PROCESSES[device] if asked == "auto" else asked, concurrency)
