"""ROLL's spelling, accepted as an alternative: `strategy_args` and `device_mapping`.

`strategy_args: {strategy_name: megatron_train, strategy_config: {...}}` becomes `strategy` +
`options`; a node's `device_mapping` becomes a mesh of its own, sized from the parallel options.
Device lists such as `list(range(0,32))` are parsed, never evaluated (ROLL `eval`s them).
"""

from __future__ import annotations

import ast
import re
from collections import Counter

from siirl_dag.config import schema
from siirl_dag.errors import Problem
from siirl_dag.placement.allocation import spell
from siirl_dag.placement.rules import option_sizes
from siirl_dag.registry import STRATEGIES

# ROLL strategy name -> ours (`StrategySpec.aliases`), our own names too
ROLL_STRATEGIES = {**{alias: s.name for s in STRATEGIES.values() for alias in s.aliases}, **{s: s for s in STRATEGIES}}

_RANGE = re.compile(r"^\s*(?:list\s*\(\s*)?range\s*\(\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?(?:,\s*(-?\d+)\s*)?\)\s*\)?\s*$", re.ASCII)
_SPAN = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$", re.ASCII)


def _max_devices() -> int:
    """The devices of the largest cluster the schema allows: no longer list can fit."""
    cluster = schema.load_schema("pipeline.schema.json")["properties"]["cluster"]["properties"]
    return cluster["nodes"]["maximum"] * cluster["devices_per_node"]["maximum"]


def parse_device_list(value) -> list[int]:
    """A list of device indices from a YAML list or a string; raises ValueError with what is accepted."""
    expected = "expected a list of device indices, 'list(range(a, b))', '[0, 1]', '0,1,2' or 'a-b'"
    text = str(value)
    if isinstance(value, list):
        if not all(schema.is_int(v) and v >= 0 for v in value):
            raise ValueError(f"{value!r} holds something other than non-negative integers; {expected}")
        devices = value
    elif m := _RANGE.match(text):
        a, b, s = m.groups()
        args = [int(a)] if b is None else [int(a), int(b)] + ([int(s)] if s else [])
        if len(args) == 3 and args[2] == 0:
            raise ValueError(f"'{text}' has step 0; {expected}")
        devices = range(*args)
    elif m := _SPAN.match(text):
        devices = range(int(m.group(1)), int(m.group(2)) + 1)
    elif re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*,?\s*", text, re.ASCII):
        devices = [int(x) for x in text.split(",") if x.strip()]
    else:
        try:
            literal = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"cannot read device list '{text}'; {expected}") from None
        if not isinstance(literal, (list, tuple)):
            raise ValueError(f"cannot read device list '{text}'; {expected}")
        return parse_device_list(list(literal))
    limit = _max_devices()
    if devices[limit:]:  # a range's length, never built (len() itself overflows past 2**63)
        raise ValueError(f"'{text}' names more than {limit} devices, the most a cluster may have; {expected}")
    if not devices or min(devices) < 0:
        raise ValueError(f"'{text}' gives no valid device indices; {expected}")
    twice = sorted(d for d, n in Counter(devices).items() if n > 1)
    if twice:
        raise ValueError(f"'{text}' names device(s) {', '.join(map(str, twice))} more than once; expected each device once")
    return list(devices)


def _parallel_sizes(strategy: str, options: dict, base: tuple) -> tuple[dict[str, int], list[Problem]]:
    """tp, pp, cp, ep as a ROLL strategy_config writes them (1 where absent or null), and a problem
    at each size that is not a positive integer (it would size the device_mapping mesh)."""
    sizes, problems = dict.fromkeys(("tp", "pp", "cp", "ep"), 1), []
    for key, attr in option_sizes(strategy).items():
        value = options.get(key)
        if attr not in sizes or value is None:
            continue
        if schema.is_int(value) and value >= 1:
            sizes[attr] = value
        else:
            problems.append(Problem(base + ("options", key), f"{value!r} is not a parallel size; expected an integer "
                                                              ">= 1 (it sizes the mesh of device_mapping)"))
    return sizes, problems


def _alloc_from_options(strategy: str, sizes: dict[str, int], n_devices: int) -> str:
    """The allocation string that parallel sizes imply on n_devices devices."""
    tp, pp, cp, ep = sizes["tp"], sizes["pp"], sizes["cp"], sizes["ep"]
    per_replica = tp * pp * cp
    if n_devices % per_replica:
        raise ValueError(f"{n_devices} devices do not split into replicas of tp {tp} x pp {pp} x cp {cp} = {per_replica}; "
                         f"expected a multiple of {per_replica}")
    return spell(strategy, n_devices // per_replica, tp, pp, cp, ep)


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
            if name not in ROLL_STRATEGIES:
                problems.append(Problem(base + ("strategy_args", "strategy_name"), f"ROLL strategy '{name}' has no strategy "
                                        f"in this engine; expected one of: {', '.join(ROLL_STRATEGIES)}"))
                continue
            if "strategy" in node or "options" in node:
                problems.append(Problem(base + ("strategy_args",), "both strategy_args and strategy/options are given; "
                                        "expected one spelling"))
                continue
            node["strategy"] = ROLL_STRATEGIES[name]
            node["options"] = args.get("strategy_config") or {}
            positions[base + ("strategy",)] = positions.get(base + ("strategy_args", "strategy_name"), positions.get(base))
            for key, pos in list(positions.items()):
                if key[: len(base) + 2] == base + ("strategy_args", "strategy_config"):
                    positions[base + ("options",) + key[len(base) + 2:]] = pos
            del node["strategy_args"]
        if "device_mapping" in node:
            strategy, options = node.get("strategy", "megatron"), node.get("options")
            sizes, bad = _parallel_sizes(strategy, options if isinstance(options, dict) else {}, base)
            if bad:
                problems += bad
                continue
            try:
                devices = parse_device_list(node.pop("device_mapping"))
                if "mesh" in node:
                    raise ValueError("both mesh and device_mapping are given; expected one of them")
                alloc = _alloc_from_options(strategy, sizes, len(devices))
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
