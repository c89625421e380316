"""What a GPU run did, from its TensorBoard events (flushed every step, so a run cut short still
tells its finished steps): steps, seconds per step by node, the log-prob agreement between the
rollout engine and the trainer, each mesh's peak memory, the score; and, given the device memory
sampled by nvidia-smi during the run and `plan`'s output, the device's peak against the plan's.

    python scripts/gpu_run_summary.py TENSORBOARD_DIR [--memory-csv gpu_memory.csv] [--plan plan.out] [--json]

scripts/gpu_checks.sh runs it after graphs/gpu1_grpo.yaml.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

SHOWN = ("training/rollout_logprob_diff_mean", "training/rollout_logprob_diff_max", "critic/score/mean",
         "response_length/mean", "actor/grad_norm", "perf/throughput")


def scalars(folder: str) -> dict[str, dict[int, float]]:
    """Every scalar of the run's events: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def summarize(series: dict[str, dict[int, float]]) -> dict:
    """Steps >= 1 only (0 is the validation before training); means over steps 2+, the first step
    carrying the engines' warm-up."""
    steps = sorted({s for values in series.values() for s in values if s >= 1})
    later = steps[1:] or steps

    def mean(tag: str) -> float | None:
        values = [series[tag][s] for s in later if s in series.get(tag, {})]
        return round(statistics.mean(values), 4) if values else None

    timings = {tag.removeprefix("timing_s/"): mean(tag) for tag in sorted(series) if tag.startswith("timing_s/")}
    out = {"steps": len(steps),
           "seconds_per_step": {node: s for node, s in timings.items() if s is not None},
           "peak_gb": {tag.split("/")[1]: round(max(series[tag].values()), 2) for tag in series
                       if tag.startswith("memory/") and tag.endswith("/peak_gb")}}
    for tag in SHOWN:
        if tag in series:
            values = [series[tag][s] for s in steps if s in series[tag]]
            out[tag] = {"first": round(values[0], 5), "last": round(values[-1], 5), "max": round(max(values), 5)}
    return out


def device_peak_gib(csv: Path) -> float | None:
    """The largest memory.used (MiB) in nvidia-smi's `timestamp, memory.used` lines, in GiB."""
    used = [float(line.split(",")[1]) for line in csv.read_text().splitlines() if line.count(",") == 1]
    return round(max(used) / 1024, 2) if used else None


def plan_fullest_gib(plan: Path) -> float | None:
    """`plan`'s 'fullest device: D, X GiB while ...' figure."""
    match = re.search(r"fullest device: \S+ ([\d.]+) GiB", plan.read_text())
    return float(match.group(1)) if match else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tensorboard_dir")
    p.add_argument("--memory-csv", type=Path)
    p.add_argument("--plan", type=Path)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if not Path(a.tensorboard_dir).is_dir():
        sys.exit(f"{a.tensorboard_dir}: no such folder (the run wrote no events)")
    out = summarize(scalars(a.tensorboard_dir))
    if a.memory_csv and a.memory_csv.is_file():
        out["device_peak_gib"] = device_peak_gib(a.memory_csv)
    if a.plan and a.plan.is_file():
        out["plan_fullest_gib"] = plan_fullest_gib(a.plan)
    print(json.dumps(out, indent=None if a.json else 1))


if __name__ == "__main__":
    main()
