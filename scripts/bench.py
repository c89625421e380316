"""The demo pipeline, measured: per-node step breakdown, engine overhead, weight sync, tokens/s;
with --all also the other benchmarks' ratios (validate, plan, runtime, vLLM, Megatron, weight sync, LoRA,
routing replay).

    python scripts/bench.py [--json] [--steps 6] [--pipeline graphs/tiny_grpo_cpu.yaml] [--trace] [--all] [--no-bare]
        [--rounds 1]

Needs the demo task (make demo, or python scripts/make_demo_task.py data/demo).
Engine overhead = step time - (time any node was running + weight sync): what the driver adds
between nodes (data loading, dispatch, collection). Each mesh's busy and idle time per step (meshes
on the same devices count the same). Then, in the same sitting, the same work as a bare torch +
transformers loop on 2 threads (scripts/bench_bare.py) and the demo's step as a multiple of it
(`vs_bare`, the bar of issue #50: <= 1.0); with --rounds N, the median ratio of N pairs run one after
the other (a shared host drifts by 10-20% within minutes). --trace runs the demo again with trainer.trace
and reports the step time with the timeline recorded against without.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from siirl_dag.cli.json_stdout import json_stdout  # noqa: E402

OTHERS = {  # script -> arguments; each prints JSON with --json
    "validate": ["bench_validate.py", "--repeat", "2"],
    "preflight": ["bench_preflight.py", "--repeat", "2"],
    "plan": ["bench_plan.py"],
    "runtime_overhead": ["bench_runtime.py"],
    "vllm_vs_hf": ["bench_vllm.py"],
    "megatron_vs_bare": ["bench_megatron.py"],
    "weight_sync": ["bench_weight_sync.py"],
    "lora": ["bench_lora.py"],
    "routing_replay": ["bench_routing_replay.py"],
}


def demo(path: str, steps: int, trace: bool = False) -> dict:
    from siirl_dag.config import load_pipeline
    from siirl_dag.trainer import timings
    from siirl_dag.trainer.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        pipe = load_pipeline(path, [f"trainer.total_steps={steps}", "trainer.val_before_train=false", "trainer.logger=[]",
                                    "trainer.save_freq=-1", "trainer.export_hf=false", "data.val_files=null",
                                    f"trainer.default_local_dir={tmp}/ckpt", f"trainer.trace={str(trace).lower()}",
                                    f"trainer.log_dir={tmp}/logs"], for_run=True)
        history = Trainer(pipe, progress=lambda *_: None).fit(Path(tmp) / "logs")
    record = timings.summary(pipe, history["steps"])  # medians after the first step (warm-up), as a run keeps them
    med = functools.partial(timings.median, timings.measured(history["steps"]))
    step, overhead = record["step_s"], med("timing_s/engine_overhead")
    meshes = {m: {"nodes": [n for n in pipe.nodes if pipe.nodes[n].mesh == m], "busy_s": busy, "idle_s": step - busy}
              for m, busy in record["busy"].items()}
    return {"pipeline": path, "schedule": pipe.runtime.schedule, "steps_measured": record["steps"], "step_s": step,
            "node_s": record["nodes"], "mesh_s": meshes, "sync_weights_s": record["sync_weights_s"],
            "sync_bytes": med("sync/bytes"), "engine_overhead_s": overhead, "engine_overhead_fraction": overhead / step,
            "tokens_per_s": med("perf/throughput") * pipe.cluster.total, "score_mean": med("critic/score/mean")}


def _script(args: list[str]) -> dict:
    """Another benchmark script's JSON report (or its error)."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / args[0]), "--json", *args[1:]], capture_output=True,
                         text=True, cwd=ROOT)
    return json.loads(res.stdout) if res.returncode == 0 else {"error": res.stderr[-500:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=6, help="steps of the demo (at least 2: the first is warm-up)")
    ap.add_argument("--pipeline", default=str(ROOT / "graphs" / "tiny_grpo_cpu.yaml"))
    ap.add_argument("--all", action="store_true", help="also run the other benchmark scripts")
    ap.add_argument("--trace", action="store_true", help="also the step time with trainer.trace on")
    ap.add_argument("--no-bare", action="store_true", help="skip the bare loop (scripts/bench_bare.py) and the ratio")
    ap.add_argument("--rounds", type=int, default=1, help="demo and bare loop pairs; the ratio is their median")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2: the first step is warm-up, left out of the medians")
    with json_stdout(args.json) as emit:
        report = {"demo": demo(args.pipeline, args.steps)}
        if not args.no_bare:
            bare_loop = ["bench_bare.py", "--threads", "2", "--steps", str(args.steps)]
            report["bare"] = bare = _script(bare_loop)
            rounds = [(report["demo"]["step_s"], bare["runs"][0]["step_s"])] if "runs" in bare else []
            for _ in range(args.rounds - 1 if rounds else 0):  # the host drifts: pairs taken minutes apart
                again = _script(bare_loop)
                if "runs" in again:
                    rounds.append((demo(args.pipeline, args.steps)["step_s"], again["runs"][0]["step_s"]))
            if rounds:
                report["rounds"] = [{"demo_s": d, "bare_s": b, "ratio": d / b} for d, b in rounds]
                report["vs_bare"] = statistics.median(d / b for d, b in rounds)
        if args.trace:
            traced = demo(args.pipeline, args.steps, trace=True)
            report["trace"] = {"step_s": traced["step_s"], "cost_fraction": traced["step_s"] / report["demo"]["step_s"] - 1}
        if args.all:
            for name, args_of in OTHERS.items():
                report[name] = _script(args_of)
        if args.json:
            emit(report)
            return
    d = report["demo"]
    print(f"demo ({d['pipeline']}): {d['step_s']:.3f} s/step, {d['tokens_per_s']:.0f} tokens/s, "
          f"weight sync {1000 * d['sync_weights_s']:.1f} ms ({d['sync_bytes'] / 2**20:.1f} MiB), "
          f"engine overhead {1000 * d['engine_overhead_s']:.1f} ms = {100 * d['engine_overhead_fraction']:.1f}% of a step")
    for node, t in d["node_s"].items():
        print(f"  {node:<14} {1000 * t:8.1f} ms")
    for mesh, m in d["mesh_s"].items():  # meshes sharing devices count the same busy time
        print(f"  mesh {mesh:<9} busy {1000 * m['busy_s']:6.1f} ms, idle {1000 * m['idle_s']:6.1f} ms ({', '.join(m['nodes'])})")
    if "vs_bare" in report:
        bare = report["bare"]["runs"][0]
        print(f"bare loop (scripts/bench_bare.py, 2 threads): {bare['step_s']:.3f} s/step; the demo's step = "
              f"{report['vs_bare']:.2f} x the bare loop's" + (" (median of the rounds)" if len(report["rounds"]) > 1 else ""))
        for r in report["rounds"] if len(report["rounds"]) > 1 else ():
            print(f"  round: demo {r['demo_s']:.3f} s, bare {r['bare_s']:.3f} s = {r['ratio']:.2f}x")
    if "trace" in report:
        print(f"with trainer.trace: {report['trace']['step_s']:.3f} s/step ({100 * report['trace']['cost_fraction']:+.1f}%)")
    for name in OTHERS:
        if name in report:
            print(f"{name}: {json.dumps(report[name])[:300]}")


if __name__ == "__main__":
    main()
