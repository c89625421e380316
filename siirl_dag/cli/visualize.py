"""`visualize`: draw a pipeline's graph or placement into a file; the extension picks the format.
With `--view timeline` it draws a run instead: RUN_DIR (or its trace.json) written with --trace.

A pipeline whose only errors come from placement (too few devices, options that do not fit a
mesh) still gets its graph drawn, those errors shown as warnings: the picture helps fix them.
The placement view has nothing to draw then, so it fails like `validate`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from siirl_dag.config import Pipeline, load_pipeline
from siirl_dag.errors import ConfigError
from siirl_dag.visualize import output_format, write, write_timeline


def _load(args) -> Pipeline:
    try:
        return load_pipeline(args.pipeline, args.overrides)
    except ConfigError as exc:
        # `place=False` (load_pipeline's keyword that skips placement) is what lets the graph be drawn anyway.
        if args.view == "placement":
            raise
        try:
            pipe = load_pipeline(args.pipeline, args.overrides, place=False)
        except ConfigError:
            raise exc from None  # not only placement: exactly what `validate` reports
        unplaced = [replace(p, severity="warning", message=f"{p.message} (drawn without placement)")
                    for p in exc.problems if p.severity == "error"]
        pipe.warnings = unplaced + pipe.warnings
        return pipe


def _timeline(args) -> int:
    if args.overrides:
        raise ConfigError(f"the timeline view draws a finished run; overrides ({' '.join(args.overrides)}) have "
                          "nothing to change there", ("overrides",))
    path, tl = write_timeline(args.pipeline, args.output)
    if args.json:
        print(json.dumps({"output": str(path), "view": "timeline", "trace": str(tl.source), "rows": tl.rows,
                          "steps": {step: {"seconds": round(s.end - s.start, 4), "critical_path": [c.name for c in s.critical]}
                                    for step, s in tl.steps.items()}}, indent=2))
    else:
        print(f"wrote {path} (timeline of {tl.source}: {len(tl.steps)} step(s), {len(tl.rows)} track(s))")
    return 0


def main(args) -> int:
    if args.view == "timeline":
        return _timeline(args)
    fmt = output_format(args.output)
    pipe = _load(args)
    path = write(pipe, args.output, args.view)
    if args.json:
        print(json.dumps({"output": str(path), "format": fmt, "view": args.view, "placed": pipe.plan is not None,
                          "warnings": [w.to_json() for w in pipe.warnings]}, indent=2))
        return 0
    for w in pipe.warnings:
        print(str(w), file=sys.stderr)
    print(f"wrote {path} ({args.view} view, .{fmt})")
    return 0
