"""runtime.schedule, measured: the same pipeline under sync, one_step_off, async (staleness 2) and
async with partial rollouts (segments of 4 tokens), one after the other.

    python scripts/bench_async.py [--json] [--steps 12] [--pipeline graphs/tiny_grpo_cpu.yaml]

Reports the median step time of each schedule (the first step, which generates alone, and the last,
which trains alone, left out) and its ratio to max(rollout side, rest of the step) as the sync
schedule measures them: the rollout side is the time of the nodes that run ahead (rollout and its
ancestors), the rest the step minus that. A schedule that overlaps them can at best reach 1.0x that
maximum. Needs the demo task (make demo).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from siirl_dag.cli.json_stdout import json_stdout  # noqa: E402


SCHEDULES = {  # label -> overrides
    "sync": ["runtime.schedule=sync"],
    "one_step_off": ["runtime.schedule=one_step_off", "runtime.staleness=1"],
    "async": ["runtime.schedule=async", "runtime.staleness=2"],
    "async+partial": ["runtime.schedule=async", "runtime.staleness=2", "runtime.partial_rollout=true",
                      "runtime.partial_rollout_tokens=4"],
}


def run(path: str, steps: int, schedule: str) -> tuple[list[dict], object]:
    from siirl_dag.config import load_pipeline
    from siirl_dag.trainer.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        pipe = load_pipeline(path, [f"trainer.total_steps={steps}", "trainer.val_before_train=false", "trainer.logger=[]",
                                    "trainer.save_freq=-1", "trainer.export_hf=false", "data.val_files=null",
                                    *SCHEDULES[schedule], f"trainer.default_local_dir={tmp}/ckpt"], for_run=True)
        history = Trainer(pipe, progress=lambda *_: None).fit()
    # the first step generates alone; the last trains alone (nothing left to generate ahead)
    return [history["steps"][s] for s in sorted(history["steps"], key=int)[1:-1]], pipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--pipeline", default=str(ROOT / "graphs" / "tiny_grpo_cpu.yaml"))
    a = ap.parse_args()
    from siirl_dag.config import schedule

    with json_stdout(a.json):
        runs = {}
        for name in SCHEDULES:
            runs[name], pipe = run(a.pipeline, a.steps, name)
        med = lambda steps, key: statistics.median(m.get(key, 0.0) for m in steps)  # noqa: E731
        ahead, sync = schedule.generating_nodes(pipe), runs["sync"]
        rollout = statistics.median(sum(m.get(f"timing_s/{n}", 0.0) for n in ahead) for m in sync)
        rest = med(sync, "timing_s/step") - rollout
        bound = max(rollout, rest)
        out = {"pipeline": a.pipeline, "steps_measured": len(sync), "rollout_side_s": rollout, "rest_s": rest,
               "schedules": {name: {"overrides": SCHEDULES[name], "step_s": med(steps, "timing_s/step"),
                                    "over_bound": med(steps, "timing_s/step") / bound,
                                    "speedup": med(sync, "timing_s/step") / med(steps, "timing_s/step"),
                                    "staleness_max": max(m.get("async/staleness/max", 0) for m in steps),
                                    "mixed_samples": statistics.mean(m.get("async/partial/mixed", 0.0) for m in steps),
                                    "idle_s": {k.split("/")[-1]: med(steps, k) for k in steps[0] if k.startswith("timing_s/idle/")}}
                             for name, steps in runs.items()}}
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"rollout side {rollout:.3f} s, rest {rest:.3f} s (medians under sync)")
    for name, r in out["schedules"].items():
        idle = ", ".join(f"{m} {s:.3f} s" for m, s in r["idle_s"].items())
        print(f"{name:>13}: step {r['step_s']:.3f} s = {r['over_bound']:.2f}x max(rollout, rest), "
              f"{r['speedup']:.2f}x sync, samples <= {r['staleness_max']} versions old, {r['mixed_samples']:.0%} over two "
              f"versions or more; idle per step: {idle}")


if __name__ == "__main__":
    main()
