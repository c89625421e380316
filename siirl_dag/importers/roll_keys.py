"""ROLL's spellings of a role's devices and strategy, read in one place: by the ROLL importer
(`importers.roll`) and by a pipeline that writes them itself (`config.roll_compat`).

Device lists such as `list(range(0,32))` are parsed, never evaluated (ROLL `eval`s them); strategy
names are the specs' aliases (`megatron_train`); a role's mesh is sized from its strategy_config's
parallel sizes (`placement.rules.parallel_sizes`) over its device list.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from typing import Mapping

from siirl_dag.config import schema
from siirl_dag.placement.allocation import spell
from siirl_dag.registry import STRATEGIES

# ROLL strategy name -> ours (`StrategySpec.aliases`), our own names too
STRATEGY_NAMES = {**{alias: s.name for s in STRATEGIES.values() for alias in s.aliases}, **{s: s for s in STRATEGIES}}

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


def replicas(sizes: Mapping[str, int], n_devices: int) -> int:
    """How many model replicas (data parallel) `sizes` make of n_devices; ValueError if they do not divide."""
    per_replica = sizes["tp"] * sizes["pp"] * sizes["cp"]
    if n_devices % per_replica:
        raise ValueError(f"{n_devices} devices do not split into replicas of tp {sizes['tp']} x pp {sizes['pp']} x "
                         f"cp {sizes['cp']} = {per_replica}; expected a multiple of {per_replica}")
    return n_devices // per_replica


def allocation(strategy: str, sizes: Mapping[str, int], n_devices: int) -> str:
    """The allocation string that parallel sizes imply on n_devices devices (ValueError: they do not divide)."""
    return spell(strategy, replicas(sizes, n_devices), **sizes)
