"""What slime, NeMo-RL and OpenRLHF say alike, read once: the trainer's devices and the rollout's (on the
same devices, or beside them), the samples of an optimizer step as prompts, the loggers.

Each peer gives the training's devices (nodes x GPUs per node), the rollout's engines (their count or
their GPUs, each engine's tensor parallel size) and whether both share the devices. Colocated, the
rollout mesh is `colocate_with: actor`; apart, the cluster holds both, the rollout's devices after
the trainer's, and the run stays synchronous unless the peer's schedule says otherwise.
"""

from __future__ import annotations

import math

from siirl_dag.importers.source import Source
from siirl_dag.placement.allocation import spell as allocation
from siirl_dag.trainer.trackers import TRACKERS


def cluster(train_devices: int, per_node: int, gen_devices: int, colocated: bool) -> dict:
    """The cluster of a run whose trainer has `train_devices` and whose rollout has `gen_devices` (on the
    same ones when colocated, else beside them), `per_node` devices a node."""
    total = train_devices + (0 if colocated else gen_devices)
    return {"nodes": max(math.ceil(total / per_node), 1), "devices_per_node": per_node, "device": "cuda"}


def actor_mesh(src: Source, key: str, devices: int, sizes: dict[str, int]) -> str:
    """The trainer's Megatron allocation over `devices`; a problem at `key` where its sizes do not divide them."""
    replica = sizes["tp"] * sizes["pp"] * sizes["cp"]
    if devices % replica:
        src.problem(key, f"{devices} devices do not split into replicas of t{sizes['tp']} x p{sizes['pp']} x "
                         f"c{sizes['cp']} = {replica}; expected sizes whose product divides {devices}")
    return allocation("megatron", max(devices // replica, 1), **sizes)


def rollout_mesh(src: Source, key: str, devices: int, tp: int, colocated: int | None) -> dict | str:
    """vLLM engines of `tp` devices over the rollout's `devices`, on the actor's `colocated` devices or apart
    (None); a problem at `key` where they do not divide, or do not cover the actor's."""
    if tp < 1 or devices % tp:
        src.problem(key, f"{devices} devices do not split into vLLM engines of {tp}; expected a divisor of {devices}")
    elif colocated and devices != colocated:
        src.problem(key, f"the rollout's {devices // tp} engine(s) of {tp} hold {devices} devices, colocated with the "
                         f"trainer's {colocated}; expected engines x tensor parallel size = {colocated}")
    alloc = allocation("vllm", max(devices // max(tp, 1), 1), tp=max(tp, 1))
    return {"alloc": alloc, "colocate_with": "actor"} if colocated else alloc


def prompts_per_step(src: Source, key: str, samples: int | None, n: int) -> int | None:
    """An optimizer step of `samples` samples as prompts (our mini_batch_size); a problem at `key` where
    they are not whole groups of n."""
    if samples is None:
        return None
    if samples % n:
        src.problem(key, f"an optimizer step of {samples} samples is not whole groups of {n} samples per prompt; "
                         f"expected a multiple of {n}")
    return max(samples // n, 1)


def loggers(src: Source, **on: str | None) -> list[str] | None:
    """`console` and the trackers whose keys are set (tracker name -> source key, e.g. wandb='--use-wandb'),
    also by a value only running the script gives (an API key from the environment)."""
    names = [name for name, key in on.items() if key and src.has(key) and (key in src.unresolved or src.value(key))]
    for key in on.values():
        if key and src.has(key):
            src.taken.add(key)
    return ["console", *[n for n in names if n in TRACKERS]] if names else None


def hide(src: Source, key: str) -> None:
    """A secret (an API key) is not repeated in the audit: its value reads as hidden."""
    if src.has(key) and key not in src.unresolved and isinstance(src.value(key), str):
        src.keys[key] = ("(hidden)", src.line(key))
