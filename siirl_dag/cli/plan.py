"""`plan`: where every rank of every mesh runs (or, with --alloc, a parsed allocation string)."""

from __future__ import annotations

import json
import sys

from siirl_dag.config import load_pipeline, schedule
from siirl_dag.dataflow import read_via_from
from siirl_dag.errors import ConfigError
from siirl_dag.graph import phases_of
from siirl_dag.placement import allocation_world_size, component_to_json, parse_allocation
from siirl_dag.runtime.fan_out import leaders
from siirl_dag.trainer import timings
from siirl_dag.weight_sync.routes import routes_json


def _alloc(spec: str, as_json: bool) -> int:
    components = parse_allocation(spec, ("--alloc",))
    result = {"components": [component_to_json(c) for c in components], "world_size": allocation_world_size(components)}
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        for c in result["components"]:
            print(", ".join(f"{k}={v}" for k, v in c.items()))
        print(f"world_size={result['world_size']}")
    return 0


def _does(pipe, n) -> str | None:
    """What the node's params make it do, where its kind says (an agent's, say)."""
    return pipe.does(n.id)


def _shared(pipe, node) -> str:
    """A node that computes with a trainer's engine with its adapters off holds no weights of its own."""
    if node.params.get("adapters", True):
        return ""
    owner = next((n.id for n in pipe.nodes.values() if pipe.kinds[n.id].trains and n.id != node.id
                  and (n.mesh, n.model, n.strategy) == (node.mesh, node.model, node.strategy)), None)
    return f"; adapters off on {owner}'s engine: no weights of its own" if owner else "; adapters off"


def _routes(pipe, node) -> str:
    """Routing replay: which node records the experts each token is routed to, and which replay them."""
    if "routed_experts" in pipe.produces(node.id):
        return "; records the experts each token is routed to"
    if "routed_experts" in pipe.consumes(node.id):
        source = next((n for n in pipe.nodes if "routed_experts" in pipe.produces(n)), "?")
        return f"; routes each token through the experts {source} recorded"
    return ""


def _reads(pipe, node) -> str:
    """What it reads from the nodes it names (`from`, then `inputs`), and the policy its metrics go under
    when several train."""
    via = "".join(f"; reads from {src}: {', '.join(keys)}" for src, keys in read_via_from(pipe, node.id).items())
    bound = ", ".join(f"{k} <- {src}.{key}" for k, (src, key) in node.inputs.items())
    policy = pipe.metric_prefix(node.id)
    return via + (f"; reads {bound}" if bound else "") + (f"; metrics under '{policy}'" if policy else "")


def _fanned(pipe) -> list[tuple[str, int, int]]:
    """(mesh, ranks, leaders) of each mesh whose ranks the driver calls through leaders (runtime.fan_out)."""
    if not pipe.plan or pipe.runtime.backend != "ray":
        return []
    worlds = [(name, m.dims.world_size) for name, m in pipe.plan.meshes.items() if m.colocated_with is None]
    return [(name, world, n) for name, world in worlds if (n := leaders(world, pipe.runtime.fan_out))]


def main(args) -> int:
    if args.alloc:
        if args.pipeline:
            raise ConfigError("give either a pipeline or --alloc, not both", ("--alloc",))
        return _alloc(args.alloc, args.json)
    if not args.pipeline:
        raise ConfigError("expected a pipeline YAML file or --alloc SPEC", ("pipeline",))
    pipe = load_pipeline(args.pipeline, args.overrides)
    if args.json:
        ahead = schedule.generating_nodes(pipe) if pipe.runtime.schedule != "sync" else ()
        print(json.dumps({"valid": True, "plan": pipe.plan.to_json() if pipe.plan else None,
                          "nodes": {n.id: {"strategy": n.strategy, "mesh": n.mesh, "serves": pipe.serves.get(n.id),
                                           "does": _does(pipe, n),
                                           "from": read_via_from(pipe, n.id),
                                           "inputs": {k: f"{src}.{key}" for k, (src, key) in n.inputs.items()}}
                                    for n in pipe.nodes.values()},
                          "policies": list(pipe.policies),
                          "memory": pipe.memory.to_json() if pipe.memory else None,
                          "weight_sync": routes_json(pipe), "warnings": [w.to_json() for w in pipe.warnings],
                          "leaders": {mesh: n for mesh, _, n in _fanned(pipe)},
                          "schedule": {"name": pipe.runtime.schedule, "staleness": pipe.runtime.staleness,
                                       "ahead": [n for n in pipe.nodes if n in ahead],
                                       "depth": schedule.depth(pipe.runtime)},
                          "timings": timings.read(pipe.out_dir)}, indent=2))
        return 0
    for w in pipe.warnings:
        print(str(w), file=sys.stderr)
    print(f"pipeline '{pipe.name}': {pipe.cluster.describe()}")
    for n in pipe.nodes.values():
        where = f"{n.strategy} on mesh '{n.mesh}' ({pipe.meshes[n.mesh].alloc})" if n.strategy else "cpu (driver side)"
        print(f"  {n.id:<16} {n.kind:<14} {where}{_shared(pipe, n)}{_routes(pipe, n)}{_reads(pipe, n)}")
        if does := _does(pipe, n):
            print(f"  {'':<16} {'':<14} {does}")
    for name, model in pipe.models.items():
        if model.lora:
            print(f"  model {name}: LoRA rank {model.lora.rank}, alpha {model.lora.alpha:g} on "
                  f"{', '.join(sorted(model.lora.targets))}; the base frozen")
    for r in routes_json(pipe):
        print(f"  weights {r['trainer']} -> {r['rollout']}: {r['path']} ({r['reason']}); {r['payload_reason']}; "
              f"{r['mode']} ({r['mode_reason']})")
    if ahead := schedule.describe(pipe):
        print(f"  {ahead}")
    for mesh, world, n in _fanned(pipe):
        print(f"  calls to mesh '{mesh}' ({world} ranks): through {n} leaders, one per {pipe.runtime.fan_out} ranks "
              "(runtime.fan_out)")
    phases = phases_of(pipe)
    if phases:
        print("  " + phases.describe(list(pipe.nodes), pipe.data.train_batch_size))
    if pipe.plan:
        print()
        print(pipe.plan.table())
    if pipe.memory:
        print()
        print("\n".join(pipe.memory.lines()))
    if pipe.plan and (last := timings.read(pipe.out_dir)):
        print()
        print("\n".join(timings.lines(pipe, last)))
    return 0
