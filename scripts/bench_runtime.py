"""The engine's own overhead per step: a DAG of no-op nodes moving realistic batches
(256 samples x 1k tokens by default) through Ray (or in-process), without any model.

    python scripts/bench_runtime.py [--json] [--backend ray|local] [--samples 256] [--tokens 1024] [--steps 5]

Prints ms per step and per node; compare with the demo step (scripts/bench.py) for the fraction.
Targets: < 5 ms per node and < 2% of a demo step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from siirl_dag.registry import STRATEGIES, node_kind  # noqa: E402
from siirl_dag.strategies.base import Strategy  # noqa: E402

TOKEN_KEYS = ("input_ids", "attention_mask", "response_mask")
VOCAB = 151_936  # Qwen's: token ids travel as int32, as they would in a real run


class NoopEngine(Strategy):
    """No model: the benchmark measures the runtime, not a strategy."""


def _tokens(rows: int, tokens: int, made: dict = {}) -> dict:  # noqa: B006 - the per-process cache
    """Made once per process: the nodes stand for no work at all."""
    if (rows, tokens) not in made:
        made[rows, tokens] = {"input_ids": torch.randint(0, VOCAB, (rows, tokens)),
                              "attention_mask": torch.ones(rows, tokens, dtype=torch.long),
                              "response_mask": torch.ones(rows, tokens // 2, dtype=torch.long)}
    return made[rows, tokens]


@node_kind("bench_gen", consumes=("raw_prompt",), produces=TOKEN_KEYS, strategies=("megatron",), expands=True)
def bench_gen(batch, ctx):
    n, tokens = ctx.params["n"], ctx.params["tokens"]
    index = torch.arange(batch.num_rows).repeat_interleave(n)
    rows = len(index)
    return ctx.expand(index, _tokens(rows, tokens))


@node_kind("bench_fwd", consumes=TOKEN_KEYS, produces=lambda p: (p["out"],), strategies=("megatron",))
def bench_fwd(batch, ctx):
    return {ctx.params["out"]: torch.zeros(batch.num_rows, batch["response_mask"].shape[1])}


@node_kind("bench_cpu", consumes=("a", "response_mask"), produces=("adv",))
def bench_cpu(batch, ctx):
    return {"adv": batch["a"]}


@node_kind("bench_train", consumes=TOKEN_KEYS + ("adv", "b"), produces=(), strategies=("megatron",), trains=True)
def bench_train(batch, ctx):
    return {}


PIPELINE = """\
name: bench-runtime
cluster: {{nodes: 1, devices_per_node: 5, device: cpu}}
models: {{m: {{path: unused}}}}
data: {{train_files: unused.parquet, train_batch_size: {prompts}}}
runtime: {{backend: {backend}, cpus_per_rank: 0.25}}
meshes: {{gen: "megatron:d{dp}", train: "megatron:d{dp}", ref: "megatron:d1"}}
nodes:
  - {{id: gen, kind: bench_gen, mesh: gen, model: m, params: {{n: 8, tokens: {tokens}}}}}
  - {{id: old, kind: bench_fwd, deps: [gen], mesh: train, model: m, params: {{out: a}}}}
  - {{id: ref, kind: bench_fwd, deps: [gen], mesh: ref, model: m, params: {{out: b}}}}
  - {{id: adv, kind: bench_cpu, deps: [old]}}
  - {{id: update, kind: bench_train, deps: [adv, ref, gen], mesh: train, model: m}}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--backend", choices=("ray", "local"), default="ray")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    from siirl_dag.config import load_pipeline
    from siirl_dag.runtime import Batch, Runtime

    STRATEGIES["megatron"] = replace(STRATEGIES["megatron"], engine=f"{Path(__file__).stem}:NoopEngine")
    dp = 1 if args.backend == "local" else 2
    prompts = args.samples // 8
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "bench.yaml"
        f.write_text(textwrap.dedent(PIPELINE.format(prompts=prompts, backend=args.backend, dp=dp, tokens=args.tokens)))
        pipe = load_pipeline(f)
    source = Batch(meta={"raw_prompt": [f"p{i}" for i in range(prompts)], "uid": [str(i) for i in range(prompts)]})
    times = []
    with Runtime(pipe, progress=lambda *_: None) as rt:
        rt.run_step(source, step=0)  # warm-up: imports, first object-store use
        for step in range(1, args.steps + 1):
            t = time.perf_counter()
            rt.run_step(source, step=step)
            times.append(time.perf_counter() - t)
    step_ms = 1000 * statistics.median(times)
    result = {"backend": args.backend, "samples": args.samples, "tokens": args.tokens, "nodes": len(pipe.nodes),
              "step_ms": round(step_ms, 2), "per_node_ms": round(step_ms / len(pipe.nodes), 2), "target_per_node_ms": 5.0}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.backend}: {len(pipe.nodes)} no-op nodes, {args.samples} samples x {args.tokens} tokens: "
              f"{step_ms:.1f} ms/step, {step_ms / len(pipe.nodes):.1f} ms/node (target < 5 ms/node)")


if __name__ == "__main__":
    main()
