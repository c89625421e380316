"""`validate`: check a pipeline and print its summary (or, via the caller, every problem)."""

from __future__ import annotations

import json
import sys

from siirl_dag.config import Pipeline, load_pipeline
from siirl_dag.graph import phases_of
from siirl_dag.weight_sync.routes import routes


def summary(pipe: Pipeline) -> str:
    c = pipe.cluster
    lines = [f"pipeline '{pipe.name}' ({pipe.file}) is valid",
             f"  cluster: {c.describe()}; runtime: {pipe.runtime.backend}",
             f"  data: {pipe.data.train_batch_size} prompts/step, prompt <= {pipe.data.max_prompt_length}, "
             f"response <= {pipe.data.max_response_length} tokens"]
    for m in pipe.meshes.values():
        extra = f" colocated with {m.colocate_with}" if m.colocate_with else ""
        size = f" ({pipe.plan.meshes[m.name].dims.world_size} devices)" if pipe.plan else ""
        lines.append(f"  mesh {m.name}: {m.alloc}{size}{extra}")
    lines.append("  nodes (execution order):")
    paths = routes(pipe)
    for n in pipe.nodes.values():
        where = f" [{n.strategy} @ {n.mesh}]" if n.strategy else " [cpu]"
        deps = f" <- {', '.join(n.deps)}" if n.deps else ""
        sync = f"; weights from {n.weights_from} ({paths[n.id].path})" if n.id in paths else ""
        produces = ", ".join(pipe.produces(n.id)) or "(metrics)"
        lines.append(f"    {n.id}: {n.kind}{where}{deps} -> {produces}{sync}")
    phases = phases_of(pipe)
    if phases:
        lines.append("  " + phases.describe(list(pipe.nodes), pipe.data.train_batch_size))
    if pipe.memory:
        lines += ["  " + line for line in pipe.memory.lines()]
    return "\n".join(lines)


def main(args) -> int:
    pipe = load_pipeline(args.pipeline, args.overrides)
    if args.json:
        print(json.dumps({"valid": True, "pipeline": pipe.to_json(), "warnings": [w.to_json() for w in pipe.warnings]}, indent=2))
        return 0
    for w in pipe.warnings:
        print(str(w), file=sys.stderr)
    print(summary(pipe))
    return 0
