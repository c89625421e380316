"""Which Ray node stands for each machine of the plan, and which of them a run has lost.

`plan` numbers machines 0..nodes-1; on Ray each becomes one node with room for a machine's devices
(`devices_per_node` GPUs, or as many rank slots of `cpus_per_rank` CPUs): the driver's own node
first when it has that room, then the others by address. Every rank of machine m is pinned to its
node (placement-group bundles with a node label), so tensor-parallel groups, which `plan` keeps
inside a machine, stay inside a node. A single-node Ray (this machine) stands for every machine of
a CPU plan, as before. Works on the dicts of `ray.nodes()`, so it is tested without a cluster.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from siirl_dag.errors import PipelineError

NODE_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class Machine:
    index: int
    node_id: str
    address: str
    port: int = 0  # its raylet's

    def answers(self, timeout_s: float = 2.0) -> bool:
        """Whether its raylet accepts a connection: a lost node refuses or times out at once, while Ray's
        health checks take about 15 s to declare it dead."""
        try:
            socket.create_connection((self.address, self.port), timeout=timeout_s).close()
            return True
        except OSError:
            return False

    def __str__(self) -> str:
        return f"machine {self.index} (Ray node {self.node_id[:8]} at {self.address})"


def bundle(cluster, cpus_per_rank: float) -> dict[str, float]:
    """The resources one rank's device takes: a GPU and a CPU, or `cpus_per_rank` CPUs."""
    return {"GPU": 1, "CPU": 1} if cluster.device == "cuda" else {"CPU": cpus_per_rank}


def room(cluster, cpus_per_rank: float) -> dict[str, float]:
    """The resources one machine's devices take on a node."""
    return {k: v * cluster.devices_per_node for k, v in bundle(cluster, cpus_per_rank).items()}


def choose(nodes: list[dict], cluster, cpus_per_rank: float, driver_node: str | None) -> list[Machine]:
    """A node per machine, or PipelineError saying what the Ray cluster lacks."""
    alive = [n for n in nodes if n.get("Alive")]
    need = room(cluster, cpus_per_rank)
    fits = [n for n in alive if all(n["Resources"].get(k, 0) >= v for k, v in need.items())]
    fits.sort(key=lambda n: (n["NodeID"] != driver_node, n["NodeManagerAddress"], n["NodeID"]))
    if len(fits) >= cluster.nodes:
        chosen = fits[: cluster.nodes]
    elif len(alive) == 1 and cluster.device == "cpu":  # one machine stands for all: resources checked by the placement groups
        chosen = alive * cluster.nodes
    else:
        have = "; ".join(f"{n['NodeID'][:8]} at {n['NodeManagerAddress']}: "
                         + ", ".join(f"{k} {n['Resources'].get(k, 0):g}" for k in need) for n in alive) or "none alive"
        raise PipelineError(f"the pipeline needs {cluster.nodes} machine(s) with {_spell(need)} each (cluster.nodes x "
                            f"devices_per_node); the Ray cluster has {len(fits)} such node(s) ({have}). Add nodes "
                            "(`ray start --address ...` on each), or lower cluster.nodes")
    return [Machine(i, n["NodeID"], n["NodeManagerAddress"], n.get("NodeManagerPort", 0)) for i, n in enumerate(chosen)]


def _spell(resources: dict[str, float]) -> str:
    return " and ".join(f"{v:g} {k}" for k, v in resources.items())


def lost(machines: list[Machine], nodes: list[dict]) -> list[Machine]:
    """The machines whose node Ray has declared dead, or whose raylet no longer answers."""
    alive = {n["NodeID"] for n in nodes if n.get("Alive")}
    return [m for m in machines if m.node_id not in alive or not m.answers()]


def describe(machines: list[Machine]) -> str:
    return ", ".join(str(m) for m in machines)
