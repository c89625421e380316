"""Weight sync trainer -> rollout on a model big enough to matter, against a memcpy of the same bytes.

    python scripts/bench_weight_sync.py [--json] [--hidden 1024] [--layers 4] [--experts 0] [--bucket-mb 32]
        [--train d1] [--gen d1] [--path auto|shared_memory|process_group] [--repeats 8] [--no-verify] [--lora 16]
    python scripts/bench_weight_sync.py --delta [--json] [--lrs 1e-6,2e-4] [--hidden 1024] [--layers 4] ...

Builds a random Qwen2-style model (fp32; Qwen3-MoE with --experts), starts the real Runtime (Ray,
Megatron trainer, vLLM rollout) twice, with the rollout colocated on the trainer's ranks and on a mesh
of its own, and syncs the weights `--repeats` times (the first, reported apart, is a warm-up). Prints,
per layout, the path the sync took, the median (and best) sync time, the bytes (every rollout engine
gets all of them: with `--gen d2` they move twice), the median ratio of each sync to a
single-threaded memcpy of its bytes in this process timed just before it (targets: <= 3x colocated,
<= 5x separate; a shared VM drifts during a run, and both sides of a ratio drift together), for
separate meshes two memcpys in two processes at once (the floor of the pipe's copy in and copy out),
the verification's share of the sync (the trainer's sampling plus the rollout's sampling and check;
target < 5%), and the per-stage breakdown: gather (the trainer collecting its shards and stages to
one rank), convert (into HF's layout: splitting fused q/k/v and gate/up), send (the trainer handing
buckets over, including any wait for a slower reader), load (vLLM's loader), wait (the rollout idle
for lack of a bucket; export and load overlap bucket by bucket), handoff (colocated: all of it).

`--delta`: weight_sync.mode=delta on separate meshes with a bfloat16 model (Megatron trains
in bf16, fp32 master weights): per learning rate of `--lrs` (the 8B graph's 1e-6, the demo's 2e-4),
a fresh run takes `--repeats` training steps (Adam; with rewards all zero on a random model the
gradient is the entropy bonus's), each followed by the delta sync and by a full sync of the same
version over the same ranks (a plain path), and reports bytes and seconds of both; bit_exact: every
delta sync verified (CRC32 of each rebuilt bucket, the fingerprints) and the bytes the rollout rank
holds equal the trainer's (SHA-256 of both). The JSON document is the output's last line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

from siirl_dag.cli.json_stdout import json_stdout  # noqa: E402

PIPELINE = """\
name: bench-weight-sync
cluster: {{nodes: 1, devices_per_node: {devices}, device: cpu}}
models: {{policy: {{path: {model}, dtype: {dtype}{lora}}}}}
data: {{train_files: unused.parquet, train_batch_size: 4, max_prompt_length: 16, max_response_length: 8}}
meshes:
  train: "megatron:{train}"
  gen: {gen}
nodes:
  - {{id: rollout, kind: rollout, mesh: gen, model: policy, weights_from: actor_update,
     options: {{dtype: float32, kv_cache_gb: 0.1, max_model_len: 64, enforce_eager: true}}}}
  - {{id: reward, kind: reward, deps: [rollout]}}
  - {{id: advantage, kind: advantage, deps: [reward]}}
  - {{id: old_logprob, kind: logprob, deps: [rollout], mesh: train, model: policy, params: {{output: old_logprobs}}}}
  - {{id: actor_update, kind: actor_update, deps: [advantage, old_logprob], mesh: train, model: policy,
     {update}}}
runtime: {{backend: ray, weight_sync_bucket_mb: {bucket_mb}, weight_sync_path: {path}, verify_sync: {verify}}}
weight_sync: {{mode: {mode}}}
"""
UPDATE = "params: {mini_batch_size: 4}"  # the syncs alone: no step is trained
ADAM_STEP = "options: {lr: %g, micro_batch_size: 4}, params: {mini_batch_size: 4, entropy_coeff: 0.5}"
STAGES = ("sync/gather_s", "sync/convert_s", "sync/send_s", "sync/load_s", "sync/wait_s", "sync/handoff_s")


def best_s(run, repeats: int, before=lambda: None) -> float:
    """The shortest of `repeats` timings of `run()`; `before` runs ahead of each, untimed."""
    best = float("inf")
    for _ in range(repeats):
        before()
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best


class Memcpy:
    """A single-threaded copy of `nbytes` (the ranks run one thread each), timed best of `repeats`;
    the buffers are made once and stay warm, so each timing is the copy alone."""

    def __init__(self, nbytes: int):
        self.src = torch.ones(nbytes, dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # touch both

    def best_s(self, repeats: int = 3, before=lambda: None) -> float:
        """`before` runs ahead of each copy, untimed (two processes meet at a barrier there)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return best_s(lambda: self.dst.copy_(self.src), repeats, before)
        finally:
            torch.set_num_threads(threads)


def _copy_in_lockstep(nbytes: int, barrier, results, repeats: int) -> None:
    results.put(Memcpy(nbytes).best_s(repeats, before=barrier.wait))


def concurrent_memcpy_s(nbytes: int, processes: int = 2, repeats: int = 5) -> float:
    """Best-of time of one copy of `nbytes` while another process copies as much at the same moment:
    what a separate-mesh sync's two copies (the trainer's in, the rollout's out) cost at best here."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_copy_in_lockstep, args=(nbytes, barrier, results, repeats)) for _ in range(processes)]
    for p in procs:
        p.start()
    times = [results.get() for _ in procs]
    for p in procs:
        p.join()
    return max(times)


def run_layout(model: str, layout: str, args, tmp: Path) -> dict:
    from siirl_dag.config import load_pipeline
    from siirl_dag.placement.allocation import parse_allocation
    from siirl_dag.runtime import Runtime

    world = parse_allocation(f"megatron:{args.train}")[0].dims.world_size
    rollout = parse_allocation(f"vllm:{args.gen}")[0].dims if layout == "separate" else None
    gen = '{alloc: "vllm:d%d", colocate_with: train}' % world if layout == "colocated" else f'"vllm:{args.gen}"'
    f = tmp / f"{layout}.yaml"
    lora = f", lora: {{rank: {args.lora}, target_modules: [all-linear]}}" if getattr(args, "lora", 0) else ""
    f.write_text(PIPELINE.format(devices=world + (rollout.world_size if rollout else 0), model=model, train=args.train,
                                 gen=gen, bucket_mb=args.bucket_mb, path=args.path, verify=str(not args.no_verify).lower(),
                                 lora=lora, dtype="float32", update=UPDATE, mode="full"))
    runs, copies = [], []
    with Runtime(load_pipeline(f, []), progress=lambda *_: None) as rt:
        # syncs as after every update: the version moves on, the rollout falls behind
        def sync() -> dict:
            rt.versions.trainer["actor_update"] += 1
            return rt.sync_weights()

        warmup = sync()  # the start-up sync made the pipe; this one pays first uses of its buffers
        memcpy = Memcpy(warmup["sync/bytes"])
        for _ in range(args.repeats - 1):  # each after a memcpy of its bytes, so drift cancels in the ratio
            copies.append(memcpy.best_s())
            runs.append(sync())
        route = rt.routes["rollout"]
    times = [r["timing_s/sync_weights"] for r in runs]
    total, nbytes = statistics.median(times), warmup["sync/bytes"]
    verify = [(r.get("sync/fingerprint_s", 0) + r.get("sync/verify_s", 0)) / r["timing_s/sync_weights"] for r in runs]
    out = {"layout": layout, "train": args.train, "gen": args.gen if layout == "separate" else None, "path": route.path,
           "engines": rollout.dp if rollout else world,  # each gets the whole model (its TP ranks a shard each)
           "bytes": nbytes, "buckets": warmup.get("sync/buckets"), "sync_s": round(total, 4), "sync_min_s": round(min(times), 4),
           "memcpy_s": round(statistics.median(copies), 4),
           "ratio_to_memcpy": round(statistics.median(t / c for t, c in zip(times, copies)), 2),
           "target_ratio": 3.0 if layout == "colocated" else 5.0, "sync_GBps": round(nbytes / total / 1e9, 3),
           "warmup_sync_s": round(warmup["timing_s/sync_weights"], 3),
           "verify_share": None if args.no_verify or layout == "colocated" else round(statistics.median(verify), 4)}
    if layout == "separate":
        out["concurrent_memcpy_s"] = round(concurrent_memcpy_s(nbytes), 4)
    out["stages_s"] = {k.removeprefix("sync/").removesuffix("_s"): round(statistics.median(r[k] for r in runs), 4)
                       for k in STAGES if k in runs[0]}
    return out


def _held(worker, pipe: str) -> tuple:
    """A delta pipe's version and a digest of the bytes it holds (what the engine was last given)."""
    import hashlib

    end = worker.pipes[pipe]
    return end.version, hashlib.sha256(b"".join(b.tobytes() for b in end.bases)).hexdigest()


def prompts(first: int, n: int = 4):
    from siirl_dag.runtime import Batch

    ids = range(first, first + n)
    return Batch(meta={"raw_prompt": [f"Q: {i}+{i + 1}=? A:" for i in ids], "uid": [str(i) for i in ids],
                       "data_source": ["demo/arith"] * n, "ground_truth": [str(2 * i + 1) for i in ids]})


def run_delta(model: str, lr: float, args, tmp: Path) -> dict:
    """One run at `lr`: after each training step a delta sync, then a full one of the same version."""
    import dataclasses

    from siirl_dag.config import load_pipeline
    from siirl_dag.runtime import Runtime

    f = tmp / f"delta-{lr:g}.yaml"
    f.write_text(PIPELINE.format(devices=2, model=model, train="d1", gen='"vllm:d1"', bucket_mb=args.bucket_mb,
                                 path=args.path, verify="true", lora="", dtype="bfloat16", update=ADAM_STEP % lr,
                                 mode="delta"))
    rows = []
    with Runtime(load_pipeline(f, []), progress=lambda *_: None) as rt:
        delta = rt.weight_syncs.paths["rollout"]
        full = type(delta)(dataclasses.replace(delta.pair, delta=False))
        ends = [w for w, _ in rt.roles["actor_update"][:1] + rt.roles["rollout"]]
        nodes = [n for n in rt.pipe.nodes if n != "rollout"]
        for step in range(1, args.repeats + 1):
            rt.run_step(prompts(4 * step), step=step, nodes=["rollout", *nodes])
            stats = rt.sync_weights(step)
            trainer, rollout = rt.backend.get([w.__ray_call__.remote(_held, delta.name) for w in ends])
            t0 = time.perf_counter()
            plain = full.sync(step)
            rows.append({"delta_bytes": stats["sync/sent_bytes"], "full_bytes": plain["sync/bytes"],
                         "delta_s": stats["timing_s/sync_weights"], "full_s": time.perf_counter() - t0,
                         "encode_s": stats["sync/encode_s"], "decode_s": stats["sync/decode_s"],
                         "bit_exact": trainer == rollout and trainer[0] == step and stats["sync/delta_fallback"] == 0
                         and stats["sync/delta_buckets"] == stats["sync/buckets"]})
        full.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "bit_exact"}
    return {"lr": lr, "steps": len(rows), "delta_bytes": int(max(r["delta_bytes"] for r in rows)),
            "full_bytes": int(med["full_bytes"]), "ratio": round(max(r["delta_bytes"] for r in rows) / med["full_bytes"], 4),
            **{k: round(med[k], 4) for k in ("delta_s", "full_s", "encode_s", "decode_s")},
            "bit_exact": all(r["bit_exact"] for r in rows)}


def main_delta(args, model: str, tmp: Path) -> None:
    with json_stdout(args.json, indent=None) as emit:
        results = [run_delta(model, float(lr), args, tmp) for lr in args.lrs.split(",")]
        params = results[0]["full_bytes"] // 2  # bf16
        print(f"model: hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f}M params (bf16); "
              f"buckets of {args.bucket_mb} MB; path {args.path}; {args.repeats} Adam step(s) per lr")
        for r in results:
            print(f"  lr {r['lr']:g}: delta {r['delta_bytes'] / 2**20:.2f} MiB of {r['full_bytes'] / 2**20:.1f} MiB "
                  f"({100 * r['ratio']:.1f}%) in {1000 * r['delta_s']:.0f} ms (encode {1000 * r['encode_s']:.0f}, "
                  f"decode {1000 * r['decode_s']:.0f}) vs full {1000 * r['full_s']:.0f} ms; bit-exact {r['bit_exact']}")
        emit({"model": {"hidden": args.hidden, "layers": args.layers, "params": params, "dtype": "bfloat16"},
              "bucket_mb": args.bucket_mb, "path": args.path, "results": results,
              "delta_bytes": max(r["delta_bytes"] for r in results), "full_bytes": results[0]["full_bytes"],
              "delta_s": max(r["delta_s"] for r in results), "full_s": max(r["full_s"] for r in results),
              "bit_exact": all(r["bit_exact"] for r in results)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=0, help="an MoE model (Qwen3-MoE) with this many experts per layer")
    ap.add_argument("--bucket-mb", type=float, default=32)
    ap.add_argument("--train", default="d1", help="the trainer's allocation, e.g. d1, t2, p2")
    ap.add_argument("--gen", default="d1", help="the rollout's allocation on separate meshes, e.g. d1, d2, t2")
    ap.add_argument("--path", choices=("auto", "shared_memory", "process_group"), default="auto",
                    help="runtime.weight_sync_path between separate meshes")
    ap.add_argument("--layouts", default="colocated,separate")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--no-verify", action="store_true", help="runtime.verify_sync: false")
    ap.add_argument("--lora", type=int, default=0, help="train rank-N adapters on every projection (0: the whole model)")
    ap.add_argument("--delta", action="store_true", help="delta against full sync, bf16, after Adam steps at --lrs")
    ap.add_argument("--lrs", default="1e-6,2e-4", help="--delta: the learning rates (the 8B graph's, the demo's)")
    args = ap.parse_args()
    from make_tiny_model import make_tiny_model

    with json_stdout(args.json) as emit, tempfile.TemporaryDirectory() as tmp:
        heads = args.hidden // 64
        model = make_tiny_model(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers,
                                num_heads=heads, num_kv_heads=max(1, heads // 4), intermediate_size=args.hidden * 3,
                                arch="qwen3_moe" if args.experts else "qwen2", num_experts=args.experts)
        if args.delta:
            return main_delta(args, model, Path(tmp))
        results = [run_layout(model, layout, args, Path(tmp)) for layout in args.layouts.split(",")]
        params = results[0]["bytes"] // 4  # fp32
        if args.json:
            emit({"model": {"hidden": args.hidden, "layers": args.layers, "experts": args.experts, "params": params},
                  "bucket_mb": args.bucket_mb, "verify_sync": not args.no_verify, "results": results})
            return
    experts = f", {args.experts} experts per layer" if args.experts else ""
    print(f"model: hidden {args.hidden}, {args.layers} layers{experts}, {params / 1e6:.1f}M params (fp32); "
          f"buckets of {args.bucket_mb} MB; verify_sync {not args.no_verify}")
    for r in results:
        stages = ", ".join(f"{k} {1000 * v:.0f}" for k, v in r["stages_s"].items())
        how = ", ".join([f"train {r['train']}"] + ([f"rollout {r['gen']}"] if r["gen"] else []) + [r["path"]] +
                        ([f"{r['buckets']} buckets"] if r["buckets"] else []))
        into = f" into each of {r['engines']} engines" if r["engines"] > 1 else ""
        print(f"{r['layout']:>9} ({how}): {r['bytes'] / 2**20:.0f} MiB{into} in {1000 * r['sync_s']:.0f} ms "
              f"(median; best {1000 * r['sync_min_s']:.0f}) = {r['ratio_to_memcpy']:.1f}x memcpy "
              f"({1000 * r['memcpy_s']:.0f} ms; target <= {r['target_ratio']:.0f}x); stages ms: {stages}")
        print(f"{'':>11}warm-up sync: {1000 * r['warmup_sync_s']:.0f} ms" +
              (f"; verification {100 * r['verify_share']:.1f}% of the sync (target < 5%)" if r["verify_share"] is not None else ""))
        if "concurrent_memcpy_s" in r:
            print(f"{'':>11}two processes copying as much at once: {1000 * r['concurrent_memcpy_s']:.0f} ms each "
                  "(the trainer's copy in and the rollout's copy out overlap at best this fast here)")


if __name__ == "__main__":
    main()
