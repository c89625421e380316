"""The single controller at scale: the real trainer, schedules, scheduler, dispatcher, re-sharding and
weight-sync paths over thousands of simulated ranks (runtime.backend=simulated), without a device.

    python scripts/bench_control_plane.py [--ranks 128 1024 4096] [--graphs moe dense] [--schedules sync async]
                                          [--steps 6] [--ray-calls 2000] [--json]

Each graph is scaled as a user would: more data-parallel replicas of the rollout and the trainer, and
prompts per step in proportion (the graph's own per device). Each row runs in a fresh process: the
driver's CPU seconds per step (steps after the first, before the last), split per phase and per node,
its calls to ranks per step and its peak resident memory. With --ray-calls, what those calls would
cost a Ray driver, at the CPU per actor call measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def moe(ranks: int) -> tuple[str, int, list[str]]:
    """Qwen3-30B-A3B: half the devices roll out (vLLM TP4), half train (attention TP2 x CP2 x PP4, experts
    EP4 x PP4) with the frozen reference beside the actor; 2 prompts per device, as the graph's 64 on 32."""
    half = ranks // 2
    gen, train = half // 4, half // 16
    fold = f"(attn:d{train}p4t2c2|ffn:d{train}p4t1e4)"
    return "qwen3_30b_a3b_moe.yaml", 2 * ranks, [f"cluster.nodes={ranks // 8}", f"nodes.actor_update.params.mini_batch_size="
                                                 f"{ranks // 2}", f"meshes=vllm[gen]:d{gen}t4 + megatron[actor]:{fold} | "
                                                 f"megatron[ref]:{fold}"]


def dense(ranks: int) -> tuple[str, int, list[str]]:
    """Qwen3-8B: the actor on Megatron TP2 x PP4 with the rollout (vLLM TP2) and reference colocated;
    16 prompts per device, as the graph's 128 on 8. Colocated, it runs sync only."""
    return "qwen3_8b_grpo_megatron.yaml", 16 * ranks, [f"cluster.nodes={ranks // 8}", f"meshes.actor=megatron:d{ranks // 8}t2p4",
                                                       f"meshes.gen.alloc=vllm:d{ranks // 2}t2",
                                                       f"meshes.ref.alloc=megatron:d{ranks // 8}t2p4",
                                                       f"nodes.actor_update.params.mini_batch_size={2 * ranks}"]


GRAPHS = {"moe": moe, "dense": dense}
COLOCATED = {"dense"}  # its rollout shares the trainer's devices: async is refused there, sync only


def write_task(folder: Path, rows: int) -> tuple[Path, Path]:
    """`rows` prompts of the demo task (the reward grades its data source), and a tokenizer to count
    their tokens with (no model's weights: the ranks have no engine)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from make_demo_task import DATA_SOURCE, prompt_of
    from make_tiny_model import make_tokenizer

    make_tokenizer().save_pretrained(folder / "tokenizer")
    pairs = [(i % 100, i // 100 % 100) for i in range(rows)]
    pq.write_table(pa.table({"prompt": [prompt_of(a, b) for a, b in pairs], "data_source": [DATA_SOURCE] * rows,
                             "reward_model": [{"style": "rule", "ground_truth": str(a + b)} for a, b in pairs],
                             "extra_info": [{"index": i} for i in range(rows)]}), folder / "train.parquet")
    return folder / "train.parquet", folder / "tokenizer"


class Probe:
    """Wraps functions of the driver to sum their CPU seconds per phase and per node (less the handles'
    answers, which stand for the ranks' work)."""

    def __init__(self):
        self.phase, self.node = defaultdict(float), defaultdict(float)
        self.backend = None  # the run's SimulatedBackend, once made

    def clock(self) -> float:
        return time.process_time() - (self.backend.answer_s if self.backend else 0.0)

    def wrap(self, owner, name: str, phase: str, node_arg: int | None = None) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t = self.clock()
            try:
                return inner(*args, **kwargs)
            finally:
                took = self.clock() - t
                self.phase[phase] += took
                if node_arg is not None:
                    self.node[getattr(args[node_arg], "node", args[node_arg])] += took

        setattr(owner, name, timed)

    def install(self) -> None:
        from siirl_dag.runtime import dispatch, scheduler
        from siirl_dag.runtime.simulated import SimulatedBackend
        from siirl_dag.trainer.logger import MetricsLogger
        from siirl_dag.weight_sync.syncs import WeightSyncs

        made = SimulatedBackend.__init__

        def kept(backend, *args):
            made(backend, *args)
            self.backend = backend

        SimulatedBackend.__init__ = kept
        for name in ("equal_ranges", "balanced_ranges", "split"):  # inside dispatch: counted in both
            self.wrap(dispatch, name, "reshard_plans")
        self.wrap(dispatch.Runtime, "dispatch", "dispatch", node_arg=1)
        self.wrap(dispatch.Runtime, "finish", "collect", node_arg=1)
        self.wrap(SimulatedBackend, "wait", "waits")
        self.wrap(scheduler.Scheduler, "dispatch_ready", "schedule")
        self.wrap(WeightSyncs, "start", "sync_routes")
        self.wrap(WeightSyncs, "_wait", "sync_routes")
        self.wrap(MetricsLogger, "log", "logging")


def measure(graph: str, ranks: int, schedule: str, steps: int) -> dict:
    """One row, in a process of its own: the real trainer over `ranks` simulated ranks."""
    from siirl_dag.config import load_pipeline
    from siirl_dag.trainer.loop import Trainer

    name, prompts, overrides = GRAPHS[graph](ranks)
    folder = Path(tempfile.mkdtemp(prefix="bench_control_plane_"))
    os.chdir(folder)  # the run's outputs (timings, checkpoints) land there
    data, tokenizer = write_task(folder, prompts)
    model = next(iter(load_pipeline(ROOT / "graphs" / name, place=False).models))
    # the model's vocabulary, as its config would give it: the verified syncs' probe runs as it would
    overrides += [f"models.{model}.path={tokenizer}", f"models.{model}.override_config.vocab_size=151936",
                  f"data.train_batch_size={prompts}", "runtime.backend=simulated", f"runtime.schedule={schedule}", f"data.train_files={data}",
                  "data.val_files=null", f"trainer.total_steps={steps}", "trainer.total_epochs=1", "trainer.save_freq=0",
                  "trainer.test_freq=0", "trainer.resume_mode=disable", "trainer.logger=[tensorboard]",
                  f"trainer.default_local_dir={folder}/ckpt", f"trainer.tensorboard_dir={folder}/tb"]
    t = time.perf_counter()
    pipe = load_pipeline(ROOT / "graphs" / name, overrides, for_run=True)
    placed_s = time.perf_counter() - t
    probe, marks = Probe(), []
    probe.install()
    trainer = Trainer(pipe, progress=lambda *_: None)
    step = trainer.train_step

    def marked():
        backend = trainer.rt.backend
        marks.append((time.process_time() - backend.answer_s, backend.answer_s, backend.calls, dict(probe.phase),
                      dict(probe.node)))
        return step()

    trainer.train_step = marked
    t = time.perf_counter()
    trainer.fit()
    # the steps between the first and the last; the handles' answers are the ranks' work, not the driver's
    (c0, a0, n0, p0, d0), (c1, a1, n1, p1, d1) = marks[1], marks[-1]
    k = len(marks) - 2
    return {"graph": graph, "ranks": ranks, "schedule": schedule, "steps": k, "place_s": round(placed_s, 3),
            "run_s": round(time.perf_counter() - t, 2), "driver_s_per_step": round((c1 - c0) / k, 4),
            "ranks_answer_s_per_step": round((a1 - a0) / k, 4), "calls_per_step": (n1 - n0) // k,
            "phases_s_per_step": {p: round((p1[p] - p0.get(p, 0.0)) / k, 4) for p in sorted(p1)},
            "nodes_s_per_step": {n: round((d1[n] - d0.get(n, 0.0)) / k, 4) for n in sorted(d1)},
            "driver_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}


class Echo:
    """A rank that answers at once (`ray_call_us`)."""

    def run(self, *args):
        return None, {"rows": 0}


def ray_call_us(calls: int) -> float:
    """The driver's CPU microseconds per Ray actor call shaped as a node's (`RankWorker.run`'s arguments,
    two returns), submitted and collected: what each call a simulated step counts costs a Ray driver."""
    import ray

    from siirl_dag.runtime.backends import init_ray, stop_ray

    init_ray(num_cpus=1)
    try:
        actor = ray.remote(Echo).remote()
        args = ("rollout", [([("raw_prompt", "raw_prompt")], [(0, 0, 16)])], 1, False, 7, 0, None, False, {})
        ray.get(actor.run.remote())
        t = time.process_time()
        ray.get([actor.run.options(num_returns=2).remote(*args)[1] for _ in range(calls)])
        return (time.process_time() - t) / calls * 1e6
    finally:
        stop_ray()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--graphs", nargs="+", choices=sorted(GRAPHS), default=["moe", "dense"])
    ap.add_argument("--schedules", nargs="+", choices=["sync", "async"], default=["sync", "async"])
    ap.add_argument("--steps", type=int, default=6, help="steps per row; the first and the last are not counted")
    ap.add_argument("--ray-calls", type=int, default=0, metavar="N",
                    help="also time N Ray actor calls here, and project each row's calls at that cost")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--row", nargs=3, metavar=("GRAPH", "RANKS", "SCHEDULE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.row:  # one row, in this fresh process: its peak memory is the row's
        graph, ranks, schedule = args.row
        print(json.dumps(measure(graph, int(ranks), schedule, args.steps)))
        return
    rows, call_us = [], ray_call_us(args.ray_calls) if args.ray_calls else None
    if call_us:
        print(f"Ray: {call_us:.0f} us of the driver's CPU per actor call (submitted and collected)")
    for graph in args.graphs:
        for schedule in args.schedules:
            for ranks in args.ranks if not (schedule == "async" and graph in COLOCATED) else ():
                out = subprocess.run([sys.executable, __file__, "--row", graph, str(ranks), schedule, "--steps",
                                      str(args.steps)], capture_output=True, text=True, check=True).stdout
                row = json.loads(out.splitlines()[-1])
                if call_us:
                    row["ray_call_us"] = round(call_us, 1)
                    row["ray_calls_s_per_step"] = round(row["calls_per_step"] * call_us / 1e6, 3)
                rows.append(row)
                print(f"{graph:5} {schedule:5} {ranks:6} ranks: {row['driver_s_per_step']:.3f} s/step, "
                      f"{row['calls_per_step']} calls/step, peak {row['driver_peak_gib']:.2f} GiB")
                print("   phases: " + ", ".join(f"{p} {s:.3f}" for p, s in row["phases_s_per_step"].items()))
                print("   nodes:  " + ", ".join(f"{n} {s:.3f}" for n, s in row["nodes_s_per_step"].items()), flush=True)
    if args.json:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
