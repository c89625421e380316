"""runtime.schedule, measured: the same pipeline under sync and one_step_off, one after the other.

    python scripts/bench_async.py [--json] [--steps 12] [--pipeline graphs/tiny_grpo_cpu.yaml]

Reports the median step time of each schedule (the first step, which generates alone, left out) and
its ratio to max(rollout side, rest of the step) as the sync schedule measures them: the rollout
side is the time of the nodes that run ahead (rollout and its ancestors), the rest the step minus
that. one_step_off can at best reach 1.0x that maximum. Needs the demo task (make demo).
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


def run(path: str, steps: int, schedule: str) -> tuple[list[dict], object]:
    from siirl_dag.config import load_pipeline
    from siirl_dag.trainer.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        pipe = load_pipeline(path, [f"trainer.total_steps={steps}", "trainer.val_before_train=false", "trainer.logger=[]",
                                    "trainer.save_freq=-1", "trainer.export_hf=false", "data.val_files=null",
                                    f"runtime.schedule={schedule}", "runtime.staleness=1",
                                    f"trainer.default_local_dir={tmp}/ckpt"], for_run=True)
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
        sync, pipe = run(a.pipeline, a.steps, "sync")
        ahead = schedule.ahead_nodes(pipe)
        med = lambda steps, key: statistics.median(m.get(key, 0.0) for m in steps)  # noqa: E731
        step_sync = med(sync, "timing_s/step")
        rollout = statistics.median(sum(m.get(f"timing_s/{n}", 0.0) for n in ahead) for m in sync)
        rest = step_sync - rollout
        off, _ = run(a.pipeline, a.steps, "one_step_off")
        step_off = med(off, "timing_s/step")
        bound = max(rollout, rest)
        out = {"pipeline": a.pipeline, "steps_measured": len(sync), "sync_step_s": step_sync,
               "rollout_side_s": rollout, "rest_s": rest, "one_step_off_step_s": step_off,
               "sync_over_bound": step_sync / bound, "one_step_off_over_bound": step_off / bound,
               "speedup": step_sync / step_off, "staleness_max": max(m["async/staleness/max"] for m in off),
               "idle_s": {"sync": {k.split("/")[-1]: med(sync, k) for k in sync[0] if k.startswith("timing_s/idle/")},
                          "one_step_off": {k.split("/")[-1]: med(off, k) for k in off[0] if k.startswith("timing_s/idle/")}}}
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"sync step {step_sync:.3f} s (rollout side {rollout:.3f} s, rest {rest:.3f} s): {out['sync_over_bound']:.2f}x "
          f"max(rollout, rest)")
    print(f"one_step_off step {step_off:.3f} s: {out['one_step_off_over_bound']:.2f}x max(rollout, rest) "
          f"(target <= 1.15x), {out['speedup']:.2f}x faster than sync, staleness <= {out['staleness_max']}")
    for name, idle in out["idle_s"].items():
        print(f"  idle per step, {name}: " + ", ".join(f"{m} {s:.3f} s" for m, s in idle.items()))


if __name__ == "__main__":
    main()
