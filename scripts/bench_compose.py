"""The composed CPU graphs as shipped, each run once and judged by its bar (issue #45):

- tiny_judge_cpu: the rule-based validation accuracy rises by >= 0.05 with the judge as the only reward;
- tiny_distill_cpu: the reverse KL of the last 3 steps is <= 0.7 x that of the first 3;
- tiny_two_agents_cpu: the system's (the reviewer's final answer) validation accuracy rises by >= 0.05.

    python scripts/bench_compose.py [--json] [--graph judge|distill|two_agents ...] [key=value ...]

Each is `python -m siirl_dag.main graphs/tiny_<name>_cpu.yaml` with its outputs in a fresh temporary
folder; needs data/demo (make demo) and data/compose (python scripts/make_compose_task.py data/compose).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graph_run import run_graph  # noqa: E402
from siirl_dag.cli.json_stdout import json_stdout  # noqa: E402


def rise(history: dict, key: str) -> tuple[float, float]:
    before = history["val_before"][key]
    after = history["steps"][str(max(map(int, history["steps"])))][key]
    return before, after


def judge(overrides: list[str]) -> dict:
    history, wall = run_graph("tiny_judge_cpu", overrides)
    before, after = rise(history, "val-core/demo/arith/acc")
    steps = list(history["steps"].values())
    mean = lambda key: statistics.mean(m[key] for m in steps if key in m)  # noqa: E731
    return {"val_acc_before": before, "val_acc_after": after, "rise": after - before, "bar": 0.05,
            "met": after - before >= 0.05, "judge_score_mean": mean("judge/score/mean"),
            "rule_score_mean": mean("critic/score/mean"), "parse_failures_per_step": mean("judge/parse_failures"),
            "step_s": statistics.median(m["timing_s/step"] for m in steps), "wall_s": wall}


def distill(overrides: list[str]) -> dict:
    history, wall = run_graph("tiny_distill_cpu", overrides)
    kl = [history["steps"][k]["distill/reverse_kl"] for k in sorted(history["steps"], key=int)]
    first, last = statistics.mean(kl[:3]), statistics.mean(kl[-3:])
    before, after = rise(history, "val-core/demo/arith/acc")
    return {"reverse_kl_first3": first, "reverse_kl_last3": last, "ratio": last / first, "bar": 0.7,
            "met": last <= 0.7 * first, "val_acc_before": before, "val_acc_after": after,
            "step_s": statistics.median(m["timing_s/step"] for m in history["steps"].values()), "wall_s": wall}


def two_agents(overrides: list[str]) -> dict:
    history, wall = run_graph("tiny_two_agents_cpu", overrides)
    before, after = rise(history, "reviewer/val-core/demo/arith/acc")
    solver = rise(history, "solver/val-core/demo/arith/acc")
    return {"system_val_acc_before": before, "system_val_acc_after": after, "rise": after - before, "bar": 0.05,
            "met": after - before >= 0.05, "solver_val_acc_before": solver[0], "solver_val_acc_after": solver[1],
            "step_s": statistics.median(m["timing_s/step"] for m in history["steps"].values()), "wall_s": wall}


GRAPHS = {"judge": judge, "distill": distill, "two_agents": two_agents}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--graph", action="append", choices=list(GRAPHS), help="one graph (repeatable); default: all")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every graph (trainer.seed=2, ...)")
    args = ap.parse_args()
    with json_stdout(args.json) as emit:
        report = {}
        for name in args.graph or list(GRAPHS):
            report[name] = GRAPHS[name](args.overrides)
            if not args.json:
                print(name, json.dumps(report[name], indent=1), flush=True)
        if args.json:
            emit(report)


if __name__ == "__main__":
    main()
