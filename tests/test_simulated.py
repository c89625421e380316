"""runtime.backend=simulated: a run over handles takes the steps a real run takes (the same nodes, rows
and weight versions, and the same syncs), and the re-sharding plan it measures at scale is exact."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from siirl_dag.runtime.reshard import Shard, balanced_ranges, split

ROOT = Path(__file__).resolve().parents[1]


def test_split_gives_each_range_the_overlapping_pieces_of_the_shards():
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, 60), rng.randint(0, 8)))
        bounds = list(zip([0, *cuts], [*cuts, 60]))
        shards = [Shard(i, a, b) for i, (a, b) in enumerate(bounds)]
        marks = sorted(rng.choices(range(61), k=rng.randint(0, 6)))
        ranges = list(zip([0, *marks], [*marks, 60]))
        want = [[(s.ref, max(lo, s.start) - s.start, min(hi, s.stop) - s.start) for s in shards
                 if max(lo, s.start) < min(hi, s.stop)] for lo, hi in ranges]
        assert split(shards, ranges) == want


def test_balanced_ranges_cut_at_the_prefix_sums_nearest_each_share():
    def reference(tokens, parts):  # each cut in turn, as the definition says
        prefix = [sum(tokens[:i]) for i in range(len(tokens) + 1)]
        cuts = [0]
        for k in range(1, parts):
            target = prefix[-1] * k / parts
            best = min(range(len(prefix)), key=lambda i: (abs(prefix[i] - target), i))
            cuts.append(min(max(best, cuts[-1]), len(tokens)))
        return list(zip(cuts, cuts[1:] + [len(tokens)]))

    rng = random.Random(1)
    for _ in range(300):
        tokens = [rng.choice([1, 3, 8, 40]) for _ in range(rng.randint(0, 30))]
        parts = rng.randint(1, 9)
        assert balanced_ranges(tokens, parts) == reference(tokens, parts), (tokens, parts)


def structure(tmp_path: Path, model: str, data: Path, backend: str) -> dict:
    """The tiny demo for three steps on `backend`: each node run (its mesh, step, rows, weights version)
    and each weight sync (its pair, step, version), as its trace records them."""
    out = tmp_path / backend
    out.mkdir()
    cmd = [sys.executable, "-m", "siirl_dag.main", str(ROOT / "graphs" / "tiny_grpo_cpu.yaml"), "--verbose",
           f"models.policy.path={model}", f"data.train_files={data}/train.parquet", "data.val_files=null",
           "trainer.total_steps=3", "trainer.save_freq=0", "trainer.test_freq=0", "trainer.logger=[console]",
           "trainer.trace=true", f"runtime.backend={backend}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=out, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    (trace,) = out.glob("outputs/*/*/trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    events = [e for e in events if e["ph"] == "X"]
    runs = sorted((tracks[e["pid"]], e["name"], e["args"]["step"], e["args"]["rows"], e["args"]["weights_version"])
                  for e in events if "rows" in e["args"])
    syncs = sorted((e["name"], e["args"]["step"], e["args"]["version"]) for e in events if e["name"].startswith("sync "))
    return {"runs": runs, "syncs": syncs}


@pytest.mark.engines
def test_a_simulated_rank_answers_every_call_as_a_real_rank_takes_it():
    """The driver calls a simulated rank with the arguments it gives a real one (RankWorker's sync and
    step methods): a parameter added on one side only fails here, not at 1,024 simulated ranks."""
    import inspect

    import ray

    from siirl_dag.runtime.simulated import SimulatedRank
    from siirl_dag.runtime.worker import RankWorker

    ray.remote(RankWorker)  # as the driver does: Ray adds its tracing keyword to the class's own signatures

    def parameters(method) -> list[str]:
        return [name for name in inspect.signature(method).parameters if name != "_ray_trace_ctx"]

    shared = [name for name in vars(SimulatedRank) if not name.startswith("_") and callable(getattr(RankWorker, name, None))]
    assert {"open_pipe", "send_weights", "receive_weights", "run"} <= set(shared)
    for name in shared:
        assert parameters(getattr(RankWorker, name)) == parameters(getattr(SimulatedRank, name)), name


@pytest.mark.engines  # the real side runs vLLM and Megatron in process
def test_a_simulated_run_takes_the_steps_of_a_real_one(tmp_path, tiny_model_dir, demo_data):
    real = structure(tmp_path, tiny_model_dir, demo_data, "local")
    simulated = structure(tmp_path, tiny_model_dir, demo_data, "simulated")
    assert len(real["runs"]) >= 3 * 5 and real["syncs"]  # every node of every step, and the syncs between them
    assert simulated == real
