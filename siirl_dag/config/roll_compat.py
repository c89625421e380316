"""ROLL's spelling, accepted as an alternative: `strategy_args` and `device_mapping`.

`strategy_args: {strategy_name: megatron_train, strategy_config: {...}}` becomes `strategy` +
`options`; a node's `device_mapping` becomes a mesh of its own, sized from the parallel options.
Device lists such as `list(range(0,32))` are parsed, never evaluated (ROLL `eval`s them).
"""

from __future__ import annotations

import ast
import re

from siirl_dag.errors import Problem

# ROLL strategy name -> (our strategy, allocation backend)
ROLL_STRATEGIES = {"megatron_train": "megatron", "megatron_infer": "megatron", "vllm": "vllm", "megatron": "megatron"}

_RANGE = re.compile(r"^\s*(?:list\s*\(\s*)?range\s*\(\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?(?:,\s*(-?\d+)\s*)?\)\s*\)?\s*$")
_SPAN = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def parse_device_list(value) -> list[int]:
    """A list of device indices from a YAML list or a string; raises ValueError with what is accepted."""
    expected = "expected a list of device indices, 'list(range(a, b))', '[0, 1]', '0,1,2' or 'a-b'"
    if isinstance(value, list):
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            return list(value)
        raise ValueError(f"{value!r} holds something other than non-negative integers; {expected}")
    text = str(value)
    if m := _RANGE.match(text):
        a, b, s = m.groups()
        args = [int(a)] if b is None else [int(a), int(b)] + ([int(s)] if s else [])
        if len(args) == 3 and args[2] == 0:
            raise ValueError(f"'{text}' has step 0; {expected}")
        devices = list(range(*args))
    elif m := _SPAN.match(text):
        devices = list(range(int(m.group(1)), int(m.group(2)) + 1))
    elif re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*,?\s*", text):
        devices = [int(x) for x in text.split(",") if x.strip()]
    else:
        try:
            literal = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"cannot read device list '{text}'; {expected}") from None
        if not isinstance(literal, (list, tuple)):
            raise ValueError(f"cannot read device list '{text}'; {expected}")
        return parse_device_list(list(literal))
    if not devices or min(devices) < 0:
        raise ValueError(f"'{text}' gives no valid device indices; {expected}")
    return devices


def _alloc_from_options(strategy: str, options: dict, n_devices: int) -> str:
    """The allocation string a ROLL strategy_config implies on n_devices devices."""
    if strategy == "megatron":
        tp = options.get("tensor_model_parallel_size", 1)
        pp = options.get("pipeline_model_parallel_size", 1)
        cp = options.get("context_parallel_size", 1)
        ep = options.get("expert_model_parallel_size", 1)
    else:
        tp, pp, cp, ep = options.get("tensor_parallel_size", 1), options.get("pipeline_parallel_size", 1), 1, 1
    per_replica = tp * pp * cp
    if n_devices % per_replica:
        raise ValueError(f"{n_devices} devices do not split into replicas of tp {tp} x pp {pp} x cp {cp} = {per_replica}; "
                         f"expected a multiple of {per_replica}")
    dims = f"d{n_devices // per_replica}t{tp}p{pp}" + (f"c{cp}" if cp > 1 else "") + (f"e{ep}" if ep > 1 else "")
    return f"{strategy}:{dims}"


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
            try:
                devices = parse_device_list(node.pop("device_mapping"))
                if "mesh" in node:
                    raise ValueError("both mesh and device_mapping are given; expected one of them")
                alloc = _alloc_from_options(node.get("strategy", "megatron"), node.get("options") or {}, len(devices))
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
