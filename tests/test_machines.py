"""Which Ray node stands for each plan machine (pure logic over `ray.nodes()` dicts; the real
cluster is in test_multinode)."""

from __future__ import annotations

import socket

import pytest

from siirl_dag.errors import PipelineError
from siirl_dag.placement.plan import ClusterSpec as Cluster
from siirl_dag.runtime import machines


def node(node_id: str, address: str = "10.0.0.1", alive: bool = True, **resources) -> dict:
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": address, "NodeManagerPort": 1, "Resources": resources}


def test_the_driver_node_first_then_by_address_and_only_nodes_with_room():
    nodes = [node("c", "10.0.0.3", GPU=8, CPU=32), node("head", "10.0.0.9", CPU=8), node("b", "10.0.0.2", GPU=8, CPU=32),
             node("a", "10.0.0.2", GPU=8, CPU=32, alive=False), node("small", "10.0.0.1", GPU=4, CPU=32)]
    chosen = machines.choose(nodes, Cluster(2, 8, "cuda"), 1, driver_node="c")
    assert [(m.index, m.node_id) for m in chosen] == [(0, "c"), (1, "b")]
    assert str(chosen[1]) == "machine 1 (Ray node b at 10.0.0.2)"


def test_too_few_nodes_is_one_message_with_what_the_cluster_has():
    with pytest.raises(PipelineError) as exc:
        machines.choose([node("aaaaaaaaaa", GPU=8, CPU=8), node("bbbbbbbbbb", GPU=4, CPU=8)], Cluster(2, 8, "cuda"), 1, None)
    assert str(exc.value).startswith("the pipeline needs 2 machine(s) with 8 GPU and 8 CPU each")
    assert "the Ray cluster has 1 such node(s) (aaaaaaaa at 10.0.0.1: GPU 8, CPU 8; bbbbbbbb at 10.0.0.1: GPU 4, CPU 8)" in str(exc.value)


def test_one_cpu_node_stands_for_every_machine():
    chosen = machines.choose([node("solo", CPU=2)], Cluster(2, 2, "cpu"), 1, "solo")
    assert [m.node_id for m in chosen] == ["solo", "solo"]


def test_a_node_is_lost_when_ray_says_so_or_its_raylet_does_not_answer():
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: refuses
    up = machines.Machine(0, "up", "127.0.0.1", listening.getsockname()[1])
    gone = machines.Machine(1, "gone", "127.0.0.1", closed.getsockname()[1])
    dead = machines.Machine(2, "dead", "127.0.0.1", listening.getsockname()[1])
    nodes = [node("up"), node("gone"), node("dead", alive=False)]
    assert machines.lost([up, gone, dead], nodes) == [gone, dead]
    listening.close()
    closed.close()
