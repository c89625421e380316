"""`run` (the default command): validate, start the workers, train, report before/after validation."""

from __future__ import annotations

import json
import sys

from siirl_dag.config import load_pipeline
from siirl_dag.runtime import PipelineError
from siirl_dag.trainer.loop import Trainer


def main(args) -> int:
    pipe = load_pipeline(args.pipeline, args.overrides, for_run=True)
    for w in pipe.warnings:
        print(str(w), file=sys.stderr)
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print  # --json: stdout holds only the JSON
    trainer = Trainer(pipe, address=args.address, progress=say)
    say(f"[run] '{pipe.name}': {trainer.total_steps} steps, {pipe.cluster.describe()}, runtime {pipe.runtime.backend}")
    try:
        history = trainer.fit()
    except PipelineError as exc:
        print(f"[run] failed: {exc}", file=sys.stderr)
        return 1
    before, after = history.get("val_before", {}), history.get("val_last", {})
    for key in sorted(set(before) | set(after)):
        say(f"[run] {key}: before {before.get(key, float('nan')):.3f} -> after {after.get(key, float('nan')):.3f}")
    if args.json:
        print(json.dumps(history, indent=2))
    return 0
