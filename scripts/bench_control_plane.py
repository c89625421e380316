"""The single controller at scale: the real trainer, schedules, scheduler, dispatcher, re-sharding and
weight-sync paths over thousands of simulated ranks (runtime.backend=simulated), without a device.

    python scripts/bench_control_plane.py [--ranks 128 1024 4096] [--graphs moe dense] [--schedules sync async]
                                          [--steps 6] [--fan-out N] [--ray-calls 2000 [--block 64]] [--json]

Each graph is scaled as a user would: more data-parallel replicas of the rollout and the trainer, and
prompts per step in proportion (the graph's own per device). Each row runs in a fresh process: the
driver's CPU seconds per step (steps after the first, before the last), split per phase and per node,
its calls per step (with runtime.fan_out, a leader's round of a block's calls is one) and the calls
ranks take, and its peak resident memory. With --ray-calls, what those calls would cost a Ray driver,
at the CPU per actor call and per leader's round measured here with real Ray actors.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
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


def measure(graph: str, ranks: int, schedule: str, steps: int, fan_out: int | None) -> dict:
    """One row, in a process of its own: the real trainer over `ranks` simulated ranks."""
    from siirl_dag.config import load_pipeline
    from siirl_dag.trainer.loop import Trainer

    name, prompts, overrides = GRAPHS[graph](ranks)
    folder = Path(tempfile.mkdtemp(prefix="bench_control_plane_"))
    os.chdir(folder)  # the run's outputs (timings, checkpoints) land there
    data, tokenizer = write_task(folder, prompts)
    model = next(iter(load_pipeline(ROOT / "graphs" / name, place=False).models))
    # the model's vocabulary, as its config would give it: the verified syncs' probe runs as it would
    overrides += [f"runtime.fan_out={fan_out}"] if fan_out is not None else []
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
        marks.append((time.process_time() - backend.answer_s, backend.answer_s,
                      {k: getattr(backend, k) for k in ("calls", "direct", "rounds", "fanned", "fanned_shards")},
                      dict(probe.phase), dict(probe.node)))
        return step()

    trainer.train_step = marked
    t = time.perf_counter()
    trainer.fit()
    # the steps between the first and the last; the handles' answers are the ranks' work, not the driver's
    (c0, a0, n0, p0, d0), (c1, a1, n1, p1, d1) = marks[1], marks[-1]
    k = len(marks) - 2
    return {"graph": graph, "ranks": ranks, "schedule": schedule, "steps": k, "place_s": round(placed_s, 3),
            "run_s": round(time.perf_counter() - t, 2), "driver_s_per_step": round((c1 - c0) / k, 4),
            "ranks_answer_s_per_step": round((a1 - a0) / k, 4), "calls_per_step": (n1["calls"] - n0["calls"]) // k,
            "per_step": {key: (n1[key] - n0[key]) // k for key in n1 if key != "calls"}, "fan_out": pipe.runtime.fan_out,
            "largest_round": trainer.rt.backend.round_max,
            "phases_s_per_step": {p: round((p1[p] - p0.get(p, 0.0)) / k, 4) for p in sorted(p1)},
            "nodes_s_per_step": {n: round((d1[n] - d0.get(n, 0.0)) / k, 4) for n in sorted(d1)},
            "driver_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}


class Echo:
    """A rank that answers at once (`ray_costs`)."""

    def run(self, *args):
        return None, {"rows": 0}


class AnsweringLeader:
    """A leader's stand-in that answers a round at once, as `fan_out.RankLeader.call` answers (a call's
    first returns as `Held` references it owns, its last as a value), without calling ranks: the
    driver's CPU for a round is then its own work, not the CPU Ray's core spends while it waits
    (`ray_costs`). Its shards are distinct objects, put ahead (a rank's output is one a call)."""

    def __init__(self, block: int):
        import ray

        self.shards = [ray.put(None) for _ in range(block)]

    def call(self, number, calls):
        from siirl_dag.runtime.fan_out import hold

        held = hold([self.shards[i:i + num_returns - 1] for i, (*_, num_returns) in enumerate(calls)])
        return [refs + [(None, {"rows": 0})] for refs in held]


RUN_ARGS = ("rollout", [([("raw_prompt", "raw_prompt")], [(0, 0, 16)])], 1, False, 7, 0, None, False, {})  # a node's


ACTORS = 16  # the Ray actors `ray_costs` calls (a round of more calls comes back to them in turn)
REPEATS = 5  # passes over the rounds `ray_costs` prices


def ray_costs(calls: int, block: int) -> dict:
    """What calls shaped as a node's (`RankWorker.run`'s arguments) cost on Ray here, in microseconds of
    the driver's CPU: per direct call submitted and collected (`call_us`); through a leader, per round
    sent and answered (`round_us`), per call it holds (`fanned_us`) and the extra of a call returning a
    shard's reference too (`shard_us`: the driver borrows it from the leader). Ray's core also spends
    CPU while the driver waits (`wait_us_per_s`, per second waited): a step waits on its ranks whatever
    it calls, so the round prices come from a leader that answers at once (`AnsweringLeader`), and the
    real leader's wait is reported beside them (`fanned_waiting_us`: per call, with the real leader's
    64 calls one after another on this machine's cores). `leader_us`: the real leader's CPU per call it
    makes (a round's `block` calls take it that long, one after another; leaders run side by side)."""
    import ray

    from siirl_dag.runtime.backends import init_ray, stop_ray
    from siirl_dag.runtime.fan_out import FanOut, RankLeader

    init_ray(num_cpus=1)
    try:
        ranks = [ray.remote(Echo).options(num_cpus=0).remote() for _ in range(ACTORS)]
        ray.get([r.run.remote() for r in ranks])
        real = ray.remote(RankLeader).options(num_cpus=0).remote(ranks)
        answering = ray.remote(AnsweringLeader).options(num_cpus=0).remote(block)
        rounds = max(calls // block, 3)

        def fan_out(leader) -> FanOut:
            fan = FanOut(ACTORS, lambda *_: leader, lambda lead, number, round_: lead.call.remote(number, round_),
                         lambda refs, timeout: ray.get(refs, timeout=timeout))
            for i, r in enumerate(ranks):
                fan.add(r, "bench", i, ACTORS + 1, i)  # one block, of all of them
            return fan

        def cpu_us(one_round, per: int = 1) -> float:
            """The driver's CPU microseconds per round, divided by `per`."""
            one_round()
            t = time.process_time()
            for _ in range(rounds):
                one_round()
            return (time.process_time() - t) / rounds / per * 1e6

        def round_of(fan: FanOut, size: int, num_returns: int):
            targets = [ranks[i % ACTORS] for i in range(size)]
            if num_returns == 1:
                return lambda: fan.get([fan.call(r, "run", RUN_ARGS, {}, 1) for r in targets])
            return lambda: fan.get([fan.call(r, "run", RUN_ARGS, {}, 2)[1] for r in targets])

        def leader_cpu() -> float:
            return ray.get(real.__ray_call__.remote(lambda _: time.process_time()))

        @ray.remote(num_cpus=0)
        def sleeper(seconds):
            time.sleep(seconds)

        bound = [ranks[i % ACTORS].run.options(num_returns=2) for i in range(block)]  # as RayBackend.call keeps them
        direct = cpu_us(lambda: ray.get([b.remote(*RUN_ARGS)[1] for b in bound]), block)
        answers, passes = fan_out(answering), []
        for _ in range(REPEATS):  # interleaved, the medians: the differences are small beside the noise
            one, full, shards = (cpu_us(round_of(answers, size, returns)) for size, returns in ((1, 1), (block, 1), (block, 2)))
            passes.append((one, max(full - one, 0.0) / (block - 1), max(shards - full, 0.0) / block))
        one, fanned, shard = (statistics.median(p[i] for p in passes) for i in range(3))
        waited = cpu_us(lambda: ray.get(sleeper.remote(0.2))) - cpu_us(lambda: ray.get(sleeper.remote(0.0)))
        before, real_fan = leader_cpu(), fan_out(real)
        waiting = cpu_us(round_of(real_fan, block, 1), block)
        leader_us = (leader_cpu() - before) / ((rounds + 1) * block) * 1e6
        return {"call_us": direct, "round_us": one, "fanned_us": fanned, "shard_us": shard, "wait_us_per_s": waited / 0.2,
                "fanned_waiting_us": waiting, "leader_us": leader_us}
    finally:
        stop_ray()


def ray_seconds(per_step: dict, ray: dict) -> float:
    """A step's calls at Ray's cost here (`ray_costs`): the direct ones, the rounds, the calls they hold,
    their shards."""
    return (per_step["direct"] * ray["call_us"] + per_step["rounds"] * ray["round_us"]
            + per_step["fanned"] * ray["fanned_us"] + per_step["fanned_shards"] * ray["shard_us"]) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--graphs", nargs="+", choices=sorted(GRAPHS), default=["moe", "dense"])
    ap.add_argument("--schedules", nargs="+", choices=["sync", "async"], default=["sync", "async"])
    ap.add_argument("--steps", type=int, default=6, help="steps per row; the first and the last are not counted")
    ap.add_argument("--fan-out", type=int, default=None, help="runtime.fan_out (default: the graph's; 0: no leaders)")
    ap.add_argument("--ray-calls", type=int, default=0, metavar="N",
                    help="also time N Ray actor calls here, direct and through a leader, and project each row's calls")
    ap.add_argument("--block", type=int, default=64, help="with --ray-calls: the calls of a leader's round (runtime.fan_out)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--row", nargs=3, metavar=("GRAPH", "RANKS", "SCHEDULE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.row:  # one row, in this fresh process: its peak memory is the row's
        graph, ranks, schedule = args.row
        print(json.dumps(measure(graph, int(ranks), schedule, args.steps, args.fan_out)))
        return
    rows, ray = [], ray_costs(args.ray_calls, args.block) if args.ray_calls else None
    if ray:
        print(f"Ray, the driver's CPU: {ray['call_us']:.0f} us per direct call; through a leader {ray['round_us']:.0f} us "
              f"per round, {ray['fanned_us']:.1f} us per call it holds, +{ray['shard_us']:.0f} us per shard's reference; "
              f"waiting {ray['wait_us_per_s']:.0f} us per second (a round of {args.block} to the real leader, waited "
              f"for: {ray['fanned_waiting_us']:.0f} us per call); the leader's {ray['leader_us']:.0f} us per call it makes")
    for graph in args.graphs:
        for schedule in args.schedules:
            for ranks in args.ranks if not (schedule == "async" and graph in COLOCATED) else ():
                fan_out = [] if args.fan_out is None else ["--fan-out", str(args.fan_out)]
                out = subprocess.run([sys.executable, __file__, "--row", graph, str(ranks), schedule, "--steps",
                                      str(args.steps), *fan_out], capture_output=True, text=True, check=True).stdout
                row = json.loads(out.splitlines()[-1])
                if ray:
                    row["ray"] = {k: round(v, 1) for k, v in ray.items()}
                    row["ray_calls_s_per_step"] = round(ray_seconds(row["per_step"], ray), 3)
                rows.append(row)
                n = row["per_step"]
                print(f"{graph:5} {schedule:5} {ranks:6} ranks: {row['driver_s_per_step']:.3f} s/step, "
                      f"{row['calls_per_step']} calls/step ({n['direct']} direct, {n['rounds']} rounds of up to "
                      f"{row['largest_round']} holding {n['fanned']}), peak {row['driver_peak_gib']:.2f} GiB"
                      + (f"; on Ray the calls: {row['ray_calls_s_per_step']:.3f} s/step" if ray else ""))
                print("   phases: " + ", ".join(f"{p} {s:.3f}" for p, s in row["phases_s_per_step"].items()))
                print("   nodes:  " + ", ".join(f"{n} {s:.3f}" for n, s in row["nodes_s_per_step"].items()), flush=True)
    if args.json:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
