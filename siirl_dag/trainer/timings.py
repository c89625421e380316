"""A run's time per step, by node and by mesh, kept in its output folder (timings.json) so that `plan`
can say what the next run of the same pipeline should take per step and which mesh holds it up.

Medians over the run's steps after its first (the first pays for warm-up); a mesh's busy time is the
step less its `timing_s/idle/<mesh>` (the time no node ran on its devices).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

FILE = "timings.json"


def measured(steps: dict[int, dict]) -> list[dict]:
    """The metrics of `steps` (step -> its metrics) after the first, in order."""
    return [steps[s] for s in sorted(steps)[1:]]


def median(rows: list[dict], key: str) -> float:
    """A metric's median over `rows` (0 where a row lacks it)."""
    return statistics.median(m.get(key, 0.0) for m in rows)


def summary(pipe, steps: dict[int, dict]) -> dict | None:
    """The medians of `steps` (step -> its metrics) as timings.json holds them; None for under 2 steps."""
    rows = measured(steps)
    if not rows:
        return None
    step = median(rows, "timing_s/step")
    return {"steps": len(rows), "schedule": pipe.runtime.schedule, "step_s": step,
            "sync_weights_s": median(rows, "timing_s/sync_weights"),
            "nodes": {n: median(rows, f"timing_s/{n}") for n in pipe.nodes},
            "busy": {m: step - median(rows, f"timing_s/idle/{m}") for m in pipe.meshes}}


def write(out_dir: Path, pipe, steps: dict[int, dict]) -> None:
    """Record `summary` of `steps` in out_dir/timings.json; nothing for under 2 steps."""
    record = summary(pipe, steps)
    if record is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / FILE).write_text(json.dumps(record, indent=1))


def read(out_dir: Path) -> dict | None:
    """The last run's record, or None (none, or not one this module wrote)."""
    try:
        record = json.loads((out_dir / FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and {"step_s", "nodes", "busy"} <= record.keys() else None


def lines(pipe, record: dict) -> list[str]:
    """For `plan`: per group of meshes sharing devices, its nodes' expected time per step (their medians)
    and what the last run measured busy; the bottleneck; the driver side's nodes."""
    nodes, groups = record["nodes"], {}
    for n in pipe.nodes.values():
        anchor = pipe.plan.meshes[n.mesh].anchor if n.mesh else None
        groups.setdefault(anchor, {})[n.id] = nodes.get(n.id, 0.0)
    driver = groups.pop(None, {})
    out = [f"time per step, from the last run ({pipe.out_dir / FILE}: median of {record['steps']} steps under schedule "
           f"{record.get('schedule', '?')}): {record['step_s']:.3f} s, weight sync {record.get('sync_weights_s', 0):.3f} s"]
    for anchor, parts in groups.items():
        names = " + ".join(m for m in pipe.meshes if pipe.plan.meshes[m].anchor == anchor)
        busy = record["busy"].get(anchor)
        measured = f"; busy {busy:.3f} s, idle {record['step_s'] - busy:.3f} s" if busy is not None else ""
        out.append(f"  mesh {names:<12} {sum(parts.values()):.3f} s ({_parts(parts)}){measured}")
    if driver:
        out.append(f"  {'driver side':<17} {sum(driver.values()):.3f} s ({_parts(driver)})")
    if groups:
        slowest = max(groups, key=lambda m: sum(groups[m].values()))
        out.append(f"  bottleneck: mesh {slowest} (its nodes take {sum(groups[slowest].values()):.3f} s of each step)")
    return out


def _parts(parts: dict) -> str:
    return ", ".join(f"{n} {t:.3f}" for n, t in parts.items()) or "no nodes"
