"""The agent demos as shipped, at several seeds, and the agent endpoint's overhead.

Learning (default): for each seed, `scripts/make_agent_task.py` (data, model, warm start; `--seed`) in a fresh
temporary folder, then each graph on it with `trainer.seed` (graphs/tiny_agent_tools_cpu.yaml: the engine's
tool loop; graphs/tiny_agent_openai_cpu.yaml: an agent written against the openai client, through the
endpoint); judged by the rise of validation accuracy (one answer per prompt at the graphs' val_temperature;
bar: >= 0.15 at every seed, tool calls made). Run it under ATEN_CPU_CAPABILITY=avx2 too (another CPU's float
paths); the report names the kernels torch used.

Overhead (`--overhead`): in one process, one vLLM engine over a warm-started model, on as many threads as
the demo's rollout rank has (`--threads`, 1), the openai demo's
rollout (16 prompts x 8 episodes: the agent in the agents' process, its calls through the `openai` client
it is handed, answered by the endpoint in that process) against the same episodes driven directly through
the engine (its own tool loop: the same prompts, rendered in it, the calculator between the same two
turns), `--rounds` pairs one after another; bar <= 1.15x. Beside them, the same agent with a client of its
own over the endpoint's HTTP port (`over_http`).
Then the same rollout by agents that spend 20 ms of their own Python before each call, in one agents'
process and spread over two (`params.agent_processes`). Then 64 episodes of 8 s each, one turn every 2 s,
at concurrency 64: their overlap (the sum of their durations over the rollout's wall time; 64 when nothing
is serialized).

    python scripts/bench_agent.py [--json] [--seeds 1 2 3] [--graphs tools openai] [key=value ...]
    python scripts/bench_agent.py --overhead [--json] [--rounds 5] [--model DIR] [--threads 1] [--agent-processes auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graph_run import python, run_graph, steps_in_order, val_curve  # noqa: E402
from siirl_dag.cli.json_stdout import json_stdout  # noqa: E402

BAR, ACC = 0.15, "val-core/demo/agent_sum/acc"
GRAPHS = {"tools": "tiny_agent_tools_cpu", "openai": "tiny_agent_openai_cpu"}
TOOL_CALLS = {"tools": "agent/tool_calls/mean", "openai": "agent/tool_calls/mean"}


def one_seed(seed: int, graphs: list[str], overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        task, began = Path(tmp) / "agent", time.perf_counter()
        python(["scripts/make_agent_task.py", str(task), "--seed", str(seed)])
        warm = json.loads((task / "warm_start.json").read_text())
        warm["wall_s"] = round(time.perf_counter() - began, 1)
        paths = [f"models.policy.path={task / 'model'}", f"data.train_files={task / 'train.parquet'}",
                 f"data.val_files={task / 'test.parquet'}", f"trainer.seed={seed}", "trainer.save_freq=-1",
                 "trainer.export_hf=false"]
        return {"seed": seed, "warm_start": warm,
                **{name: learned(*run_graph(GRAPHS[name], [*paths, *overrides]), name) for name in graphs}}


def learned(history: dict, wall: float, name: str) -> dict:
    steps, curve = steps_in_order(history), val_curve(history, ACC)
    mean = lambda key, part: round(statistics.mean(m[key] for m in part), 3)  # noqa: E731
    before, after = curve["0"], list(curve.values())[-1]
    return {"val_curve": curve, "rise": round(after - before, 3),
            "met": after - before >= BAR and mean(TOOL_CALLS[name], steps[-5:]) > 0.5,
            "tool_calls_first5": mean(TOOL_CALLS[name], steps[:5]), "tool_calls_last5": mean(TOOL_CALLS[name], steps[-5:]),
            "score_first5": mean("critic/score/mean", steps[:5]), "score_last5": mean("critic/score/mean", steps[-5:]),
            "mixed_first5": mean("critic/mixed_groups", steps[:5]),
            "step_s": round(statistics.median(m["timing_s/step"] for m in steps), 2), "rl_wall_s": round(wall, 1)}


def learning(args) -> dict:
    import torch

    report = {"bar": BAR, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "seeds": []}
    for seed in args.seeds:
        report["seeds"].append(one_seed(seed, args.graphs, args.overrides))
        if not args.json:
            print(json.dumps(report["seeds"][-1]), flush=True)
    report["met_at_every_seed"] = all(r[g]["met"] for r in report["seeds"] for g in args.graphs)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--graphs", nargs="+", choices=sorted(GRAPHS), default=sorted(GRAPHS))
    ap.add_argument("--overhead", action="store_true", help="the endpoint's overhead instead of the learning runs")
    ap.add_argument("--rounds", type=int, default=5, help="--overhead: pairs of rollouts")
    ap.add_argument("--model", default=str(ROOT / "data/agent"), help="--overhead: a make_agent_task.py folder")
    ap.add_argument("--threads", type=int, default=1,
                    help="--overhead: the engine's CPU threads (the demo's rollout rank has runtime.cpus_per_rank: 1)")
    ap.add_argument("--agent-processes", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="--overhead: the agents' processes of the endpoint's rollouts (params.agent_processes; "
                         "auto, its default: 1 with the engine on the CPU, 4 with it on a GPU)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the graphs (trainer.total_steps=30, ...)")
    args = ap.parse_args()
    with json_stdout(args.json) as emit:
        if args.overhead:
            from bench_agent_overhead import overhead

            report = overhead(Path(args.model), args.rounds, args.threads, quiet=args.json,
                              agent_processes=args.agent_processes)
        else:
            report = learning(args)
        if args.json:
            emit(report)
        elif args.overhead:
            print(json.dumps(report, indent=1))
        else:
            print(f"rise >= {BAR} at every seed: {report['met_at_every_seed']}")


if __name__ == "__main__":
    main()
