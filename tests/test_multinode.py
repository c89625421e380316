"""A real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head without
devices, and nodes of 2 CPU rank slots each). A run attached with --address places each plan
machine on its own node, keeps tensor-parallel groups inside one, sends LoRA adapters from the
trainer's machine to the rollout's (process_group), and leaves the cluster running; the resumed run
calls every rank through a leader on the rank's machine (runtime.fan_out 1);
losing a node mid-run stops the run with one message naming the machine, its ranks and the step,
leaves no rank process behind, and the same command resumes once the cluster has the devices again."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_e2e import PIPELINE as E2E_PIPELINE
from test_e2e import QUICK

ROOT = Path(__file__).resolve().parents[1]
# the e2e pipeline on 2 machines of 2 devices, training LoRA adapters: they travel between machines
PIPELINE = E2E_PIPELINE.replace("{{nodes: 1,", "{{nodes: 2,").replace(
    "{{policy: {{path: {model}, dtype: float32}}}}",
    "{{policy: {{path: {model}, dtype: float32, lora: {{rank: 8, alpha: 16, target_modules: [all-linear]}}}}}}")
MESHES = """\
  train: megatron:d1t2                            # machine 0: one tensor-parallel pair
  ref: {alloc: "megatron:d1t2", colocate_with: train}
  gen: vllm:d2                                    # machine 1: two engines"""
STEPS = ("trainer.total_steps=6", "trainer.save_freq=1")
MACHINES = re.compile(r"\[runtime\] machines: (.*)")


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    head = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [head.add_node(num_cpus=2) for _ in range(2)]
    head.wait_for_nodes()
    yield head, nodes
    head.shutdown()


def pipeline(folder: Path, model, data) -> str:
    return PIPELINE.format(devices=2, model=model, data=data, meshes=MESHES, out=folder, backend="ray")


def start(folder: Path, address: str, name: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
    """The run, its stderr in a file (read while it runs), its stdout the JSON of its steps."""
    err = folder / f"{name}.err"
    with open(folder / f"{name}.out", "w") as out, open(err, "w") as errors:
        proc = subprocess.Popen([sys.executable, "-m", "siirl_dag.main", str(folder / "pipeline.yaml"), "--address", address,
                                 "--json", *QUICK, *STEPS, *overrides], stdout=out, stderr=errors, text=True, cwd=ROOT)
    return proc, err


def wait_for(condition, proc: subprocess.Popen, err: Path, timeout: float = 300):
    end = time.monotonic() + timeout
    while not (found := condition()):
        assert proc.poll() is None, err.read_text()[-3000:]
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)
    return found


def raylet_pids(head) -> set[int]:
    return {info.process.pid for node in head.list_all_nodes() for info in node.all_processes.get("raylet", [])}


def rank_processes(raylets: set[int]) -> list[psutil.Process]:
    """The rank workers started by these raylets (Ray hands each worker its raylet's pid), not those of
    another test's cluster running beside this one."""
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [""])[0].startswith("ray::RankWorker"):
            try:
                if int(proc.environ().get("RAY_RAYLET_PID", -1)) in raylets:
                    out.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
                continue
    return out


def node_ids_of_machines(stderr: str) -> list[str]:
    (line,) = MACHINES.findall(stderr)
    return re.findall(r"Ray node (\w+) at", line)


def test_plan_keeps_tensor_parallel_groups_inside_machines(tmp_path, capsys):
    from siirl_dag.main import main

    (tmp_path / "p.yaml").write_text(pipeline(tmp_path, "m", "d"))
    assert main(["plan", str(tmp_path / "p.yaml"), "--json"]) == 0
    meshes = {m["name"]: m for m in json.loads(capsys.readouterr().out)["plan"]["meshes"]}
    assert [r["machine"] for r in meshes["train"]["ranks"]] == [0, 0]  # the TP pair on one machine
    assert [r["machine"] for r in meshes["gen"]["ranks"]] == [1, 1]


@pytest.mark.engines
def test_a_lost_node_stops_the_run_and_the_same_command_resumes_across_nodes(tmp_path, cluster, tiny_model_dir, demo_data):
    head, nodes = cluster
    (tmp_path / "pipeline.yaml").write_text(pipeline(tmp_path, tiny_model_dir, demo_data))
    plan = subprocess.run([sys.executable, "-m", "siirl_dag.main", "plan", str(tmp_path / "pipeline.yaml")],
                          capture_output=True, text=True, cwd=ROOT)
    assert "weights actor_update -> rollout: process_group" in plan.stdout and "only the adapters" in plan.stdout
    ckpt = tmp_path / "ckpt"
    proc, err = start(tmp_path, head.address, "lost")
    machines = wait_for(lambda: MACHINES.search(err.read_text()) and node_ids_of_machines(err.read_text()), proc, err)
    wait_for(lambda: list(ckpt.glob("global_step_*")), proc, err)
    (gen_node,) = [n for n in nodes if n.node_id.startswith(machines[1])]
    raylets = raylet_pids(head)  # before one goes: its workers must go too
    assert rank_processes(raylets), "the run's rank workers, found by their raylets"
    head.remove_node(gen_node, allow_graceful=False)
    assert proc.wait(timeout=180) == 1, err.read_text()[-3000:]
    (failure,) = [line for line in err.read_text().splitlines() if line.startswith("[run] failed:")]
    assert re.search(rf"step \d+: lost machine 1 \(Ray node {machines[1]} at [\d.]+\), with ranks gen:0, gen:1\. "
                     r"The run stopped; resume from its last checkpoint", failure), failure
    end = time.monotonic() + 30
    while rank_processes(raylets):  # the rank workers (the surviving node's too) go with the driver
        assert time.monotonic() < end, [p.info["cmdline"] for p in rank_processes(raylets)]
        time.sleep(0.5)
    last = max(int(p.name.removeprefix("global_step_")) for p in ckpt.glob("global_step_*"))

    nodes[nodes.index(gen_node)] = head.add_node(num_cpus=2)  # devices again: the same command resumes
    head.wait_for_nodes()
    # resumed with every rank called through a leader of its own (runtime.fan_out 1), on the rank's machine
    proc, err = start(tmp_path, head.address, "resumed", "runtime.fan_out=1")
    wait_for(lambda: "[runtime] ready" in err.read_text(), proc, err)
    machines = node_ids_of_machines(err.read_text())
    assert sorted(machines) == sorted(n.node_id[:8] for n in nodes)  # each machine its own node, never the head
    assert ranks_per_node(head.address) == {machines[0]: ["train:0", "train:1"], machines[1]: ["gen:0", "gen:1"]}
    assert ranks_per_node(head.address, "RankLeader") == {machines[0]: 2, machines[1]: 2}
    assert proc.wait(timeout=600) == 0, err.read_text()[-3000:]
    assert f"[trainer] resumed from {ckpt / f'global_step_{last}'} at step {last}" in err.read_text()
    assert len(json.loads((tmp_path / "resumed.out").read_text())["steps"]) == 6 - last
    assert not head.head_node.dead_processes() and not any(n.dead_processes() for n in nodes)  # --address: left running


def ranks_per_node(address: str, kind: str = "RankWorker") -> dict:
    """The live rank workers (named mesh:rank by the run), per node; or how many leaders (`RankLeader`)."""
    import ray
    from ray._private.state import actors

    ray.init(address=address, log_to_driver=False)
    try:
        table = actors()
    finally:
        ray.shutdown()
    found: dict[str, list[str]] = {}
    for actor in table.values():
        name = actor["Name"] or ""
        if actor["ActorClassName"] == kind and actor["State"] == "ALIVE" and not name.startswith("__compute__"):
            found.setdefault(actor["Address"]["NodeID"][:8], []).append(name)
    return {node: sorted(names) if kind == "RankWorker" else len(names) for node, names in found.items()}
