"""ROLL's spelling, accepted inside a pipeline as an alternative: `strategy_args` and `device_mapping`.

`strategy_args: {strategy_name: megatron_train, strategy_config: {...}}` becomes `strategy` +
`options`; a node's `device_mapping` becomes a mesh of its own, sized from the parallel options.
What ROLL's keys mean is the ROLL importer's (`importers.roll_keys`): here they are only moved,
their positions with them, so problems still name FILE:LINE.
"""

from __future__ import annotations

from siirl_dag.config import schema
from siirl_dag.errors import Problem
from siirl_dag.importers.roll_keys import STRATEGY_NAMES, allocation, parse_device_list
from siirl_dag.placement.rules import option_sizes, parallel_sizes


def _bad_sizes(strategy: str, options: dict, base: tuple) -> list[Problem]:
    """A problem at each parallel size that is not a positive integer (it would size the device_mapping mesh)."""
    return [Problem(base + ("options", key), f"{value!r} is not a parallel size; expected an integer >= 1 (it sizes "
                                             "the mesh of device_mapping)")
            for key in option_sizes(strategy) if (value := options.get(key)) is not None
            and not (schema.is_int(value) and value >= 1)]


def normalize(doc: dict, positions: dict) -> list[Problem]:
    """Rewrite ROLL spellings in place (positions follow the moved keys); return problems found."""
    problems: list[Problem] = []
    meshes = doc.get("meshes")
    if isinstance(meshes, dict):
        for name, mesh in meshes.items():
            if isinstance(mesh, dict) and "devices" in mesh:
                try:
                    mesh["devices"] = parse_device_list(mesh["devices"])
                except ValueError as exc:
                    problems.append(Problem(("meshes", name, "devices"), str(exc)))
    nodes = doc.get("nodes")
    if not isinstance(nodes, list):
        return problems
    for i, node in enumerate(nodes):
        if not isinstance(node, dict):
            continue
        base = ("nodes", i)
        args = node.get("strategy_args")
        if isinstance(args, dict) and isinstance(args.get("strategy_name"), str):
            name = args["strategy_name"]
            if name not in STRATEGY_NAMES:
                problems.append(Problem(base + ("strategy_args", "strategy_name"), f"ROLL strategy '{name}' has no strategy "
                                        f"in this engine; expected one of: {', '.join(STRATEGY_NAMES)}"))
                continue
            if "strategy" in node or "options" in node:
                problems.append(Problem(base + ("strategy_args",), "both strategy_args and strategy/options are given; "
                                        "expected one spelling"))
                continue
            node["strategy"] = STRATEGY_NAMES[name]
            node["options"] = args.get("strategy_config") or {}
            positions[base + ("strategy",)] = positions.get(base + ("strategy_args", "strategy_name"), positions.get(base))
            for key, pos in list(positions.items()):
                if key[: len(base) + 2] == base + ("strategy_args", "strategy_config"):
                    positions[base + ("options",) + key[len(base) + 2:]] = pos
            del node["strategy_args"]
        if "device_mapping" in node:
            strategy, options = node.get("strategy", "megatron"), node.get("options")
            options = options if isinstance(options, dict) else {}
            bad = _bad_sizes(strategy, options, base)
            if bad:
                problems += bad
                continue
            try:
                devices = parse_device_list(node.pop("device_mapping"))
                if "mesh" in node:
                    raise ValueError("both mesh and device_mapping are given; expected one of them")
                alloc = allocation(strategy, parallel_sizes(strategy, options), len(devices))
            except ValueError as exc:
                problems.append(Problem(base + ("device_mapping",), str(exc)))
                continue
            mesh_name = node.get("id", f"node{i}")
            doc.setdefault("meshes", {})
            if isinstance(doc["meshes"], dict):
                doc["meshes"][mesh_name] = {"alloc": alloc, "devices": devices}
                positions[("meshes", mesh_name)] = positions.get(base + ("device_mapping",), positions.get(base))
            node["mesh"] = mesh_name
            positions[base + ("mesh",)] = positions.get(base + ("device_mapping",), positions.get(base))
    return problems
