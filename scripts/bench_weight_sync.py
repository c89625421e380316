"""Weight sync trainer -> rollout on a model big enough to matter, against a memcpy of the same bytes.

    python scripts/bench_weight_sync.py [--json] [--hidden 1024] [--layers 4] [--experts 0] [--bucket-mb 32]
        [--train d1] [--gen d1] [--transport object_store|collective] [--repeats 6] [--plain-weights] [--channel-only]

Builds a random Qwen2-style model (fp32; Qwen3-MoE with --experts), starts the real Runtime (Ray, Megatron trainer, vLLM rollout)
twice, with the rollout colocated on the trainer's rank and on a mesh of its own, and syncs the
weights `--repeats` times (the first two, reported apart, are warm-ups: the first sync records the rollout's
loader, the second is the first on the fast path). Prints, per layout, the median (and best) sync time, the
bytes exported (every rollout engine gets all of them: with `--gen d2` they move twice), the median ratio of each sync to a single-threaded memcpy of its bytes in this process
timed just before it (target <= 3x; a shared VM drifts during a run, and both sides of a ratio drift together),
with packed weights also the same tensors copied alone into the rollout's layout (row blocks: the
floor of a packed sync), for separate meshes two memcpys in two processes at once (a floor for the channel's two copies),
and the per-stage breakdown: gather (the trainer collecting its shards and stages to one rank),
convert (into HF's layout: splitting fused q/k/v and gate/up; one walk with the gather), send (the trainer handing buckets over: the object-store write or the broadcast, and
any wait for a slower consumer), load (vLLM taking the tensors, incl. its CPU repacking, on the rollout
rank's share of its machine's cores: the other ranks wait), and wait
(rollout idle for lack of a bucket; export and load overlap bucket by bucket). Separate meshes over
the object store write straight into the rollout's parameters after the first sync (unless
--channel-only): write is the trainer's copies, load the rollout's finish (the repack) after them.
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
models: {{policy: {{path: {model}, dtype: float32}}}}
data: {{train_files: unused.parquet, train_batch_size: 4, max_prompt_length: 16, max_response_length: 8}}
meshes:
  train: "megatron:{train}"
  gen: {gen}
nodes:
  - {{id: rollout, kind: rollout, mesh: gen, model: policy, weights_from: actor_update,
     options: {{dtype: float32, kv_cache_gb: 0.1, max_model_len: 64, enforce_eager: true, cpu_packed_weights: {packed}}}}}
  - {{id: reward, kind: reward, deps: [rollout]}}
  - {{id: advantage, kind: advantage, deps: [reward]}}
  - {{id: old_logprob, kind: logprob, deps: [rollout], mesh: train, model: policy, params: {{output: old_logprobs}}}}
  - {{id: actor_update, kind: actor_update, deps: [advantage, old_logprob], mesh: train, model: policy,
     params: {{mini_batch_size: 4}}}}
runtime: {{backend: ray, weight_sync_bucket_mb: {bucket_mb}}}
"""
STAGES = ("sync/gather_s", "sync/convert_s", "sync/send_s", "sync/write_s", "sync/load_s", "sync/wait_s", "sync/handoff_s")


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


class LayoutCopy:
    """A packed sync's floor: the model's tensors copied alone, warm, with `threads` (the cores the
    sync's writer borrows, `weight_sync.cores`), into the layout the rollout computes from: a linear
    layer's weight (q/k/v and gate/up fused, as vLLM holds them) into its row blocks, a transposition
    of every block; the embedding into its plain weight too (its lookup reads it); the rest a copy."""

    FUSED = {"q_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj")}

    def __init__(self, model: str, threads: int, engines: int = 1):
        from safetensors.torch import load_file

        from siirl_dag.strategies.vllm.cpu_compat import row_block_size

        weights, self.threads, self.copies = load_file(Path(model) / "model.safetensors"), threads, []
        tied = "lm_head.weight" not in weights
        for name, t in weights.items():
            module = name.split(".")[-2]
            if any(module in parts[1:] for parts in self.FUSED.values()) and t.dim() == 2:
                continue  # copied with the first of its fused parts
            if module in self.FUSED and t.dim() == 2:
                t = torch.cat([weights[name.replace(module, part)] for part in self.FUSED[module]])
            block = row_block_size(*t.shape) if t.dim() == 2 else None
            embedding = module == "embed_tokens"
            for _ in range(engines):  # separate meshes: the keeper writes into every rollout engine
                if block is None or embedding:
                    self.copies.append((t, torch.empty_like(t), False))
                if block is not None and (tied or not embedding):
                    self.copies.append((t, torch.empty(t.shape[0] // block, t.shape[1], block), True))
        self.best_s()  # builds the row-block kernel if need be, touches the memory

    def best_s(self, repeats: int = 3) -> float:
        from siirl_dag.weight_sync import row_blocks
        from siirl_dag.weight_sync.cores import borrowed

        def copy_all():
            for src, dst, blocked in self.copies:
                row_blocks.copy_into(dst, src) if blocked else dst.copy_(src)

        with borrowed(self.threads):
            return best_s(copy_all, repeats)


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
    from siirl_dag.weight_sync import WeightSync

    world = parse_allocation(f"megatron:{args.train}")[0].world_size
    rollout = parse_allocation(f"vllm:{args.gen}")[0] if layout == "separate" else None
    gen = '{alloc: "vllm:d%d", colocate_with: train}' % world if layout == "colocated" else f'"vllm:{args.gen}"'
    devices = world + (rollout.world_size if rollout else 0)  # a core each: a sync's writer borrows them all
    f = tmp / f"{layout}.yaml"
    f.write_text(PIPELINE.format(devices=devices, model=model, train=args.train,
                                 gen=gen, bucket_mb=args.bucket_mb, packed=str(not args.plain_weights).lower()))
    runs, copies, floors = [], [], []
    # a dense model's only: an MoE model's experts go into the CPU MoE kernel's row blocks, not modelled here
    floor = None if args.plain_weights or args.experts else LayoutCopy(model, devices, rollout.dp if rollout else 1)
    with Runtime(load_pipeline(f, []), progress=lambda *_: None) as rt:
        sync = WeightSync(rt, direct=not args.channel_only)
        # the first sync pays one-time costs (first object-store use, imports, recording the loader), the
        # second the first use of the fast path; each later one is preceded by a
        # memcpy of its bytes, so the machine's drift during the run cancels in the ratio
        warmups = [sync("actor_update", "rollout", v, transport=args.transport) for v in range(1, min(args.repeats, 2) + 1)]
        warmup = warmups[0]
        nbytes = warmup["sync/bytes"]
        memcpy = Memcpy(nbytes)
        for version in range(3, args.repeats + 1):
            copies.append(memcpy.best_s())
            if floor:
                floors.append(floor.best_s())
            runs.append(sync("actor_update", "rollout", version, transport=args.transport))
    runs, copies = (runs, copies) if runs else (warmups[-1:], [memcpy.best_s()])
    times = [r["timing_s/sync_weights"] for r in runs]
    total, copy = statistics.median(times), statistics.median(copies)
    ratio = statistics.median(t / c for t, c in zip(times, copies))
    how = None if layout == "colocated" else args.transport + ("" if args.channel_only or args.transport != "object_store"
                                                                else " + direct writes")
    out = {"layout": layout, "train": args.train, "gen": args.gen if layout == "separate" else None, "transport": how,
           "engines": rollout.dp if rollout else world,  # each gets the whole model (its TP ranks a shard each)
           "bytes": nbytes, "buckets": warmup.get("sync/buckets"), "sync_s": round(total, 4), "sync_min_s": round(min(times), 4),
           "memcpy_s": round(copy, 4), "ratio_to_memcpy": round(ratio, 2), "target_ratio": 3.0,
           "sync_GBps": round(nbytes / total / 1e9, 3), "first_syncs_s": [round(w["timing_s/sync_weights"], 3) for w in warmups]}
    if floors:
        out["layout_copy_s"] = round(statistics.median(floors), 4)
        out["layout_copy_ratio"] = round(statistics.median(f / c for f, c in zip(floors, copies)), 2)
        out["layout_copy_threads"] = devices
    if layout == "separate":
        out["concurrent_memcpy_s"] = round(concurrent_memcpy_s(nbytes), 4)
    out["stages_s"] = {k.removeprefix("sync/").removesuffix("_s"): round(statistics.median(r[k] for r in runs), 4)
                       for k in STAGES if k in runs[0]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=0, help="an MoE model (Qwen3-MoE) with this many experts per layer")
    ap.add_argument("--bucket-mb", type=float, default=32)
    ap.add_argument("--train", default="d1", help="the trainer's allocation, e.g. d1, t2, p2")
    ap.add_argument("--gen", default="d1", help="the rollout's allocation on separate meshes, e.g. d1, d2, t2")
    ap.add_argument("--transport", choices=("object_store", "collective"), default="object_store")
    ap.add_argument("--layouts", default="colocated,separate")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--channel-only", action="store_true",
                    help="separate meshes over the object store: every sync through the shared-memory channel "
                         "(by default only the first, then the trainer writes into the rollout's parameters)")
    ap.add_argument("--plain-weights", action="store_true",
                    help="vLLM option cpu_packed_weights: false (updates copy into place; slower decoding)")
    args = ap.parse_args()
    from make_tiny_model import make_tiny_model

    with json_stdout(args.json) as emit, tempfile.TemporaryDirectory() as tmp:
        heads = args.hidden // 64
        model = make_tiny_model(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers,
                                num_heads=heads, num_kv_heads=max(1, heads // 4), intermediate_size=args.hidden * 3,
                                arch="qwen3_moe" if args.experts else "qwen2", num_experts=args.experts)
        results = [run_layout(model, layout, args, Path(tmp)) for layout in args.layouts.split(",")]
        params = results[0]["bytes"] // 4  # fp32
        if args.json:
            emit({"model": {"hidden": args.hidden, "layers": args.layers, "experts": args.experts, "params": params},
                  "bucket_mb": args.bucket_mb,
                  "cpu_packed_weights": not args.plain_weights, "results": results})
            return
    experts = f", {args.experts} experts per layer" if args.experts else ""
    print(f"model: hidden {args.hidden}, {args.layers} layers{experts}, {params / 1e6:.1f}M params (fp32); "
          f"buckets of {args.bucket_mb} MB; vLLM weights {'plain' if args.plain_weights else 'packed'} on CPU")
    for r in results:
        stages = ", ".join(f"{k} {1000 * v:.0f}" for k, v in r["stages_s"].items())
        how = ", ".join([f"train {r['train']}"] + ([f"rollout {r['gen']}"] if r["gen"] else []) +
                        ([r["transport"], f"{r['buckets']} buckets"] if r["transport"] else []))
        into = f" into each of {r['engines']} engines" if r["engines"] > 1 else ""
        print(f"{r['layout']:>9} ({how}): {r['bytes'] / 2**20:.0f} MiB{into} in {1000 * r['sync_s']:.0f} ms "
              f"(median; best {1000 * r['sync_min_s']:.0f}) = "
              f"{r['ratio_to_memcpy']:.1f}x memcpy ({1000 * r['memcpy_s']:.0f} ms; target <= 3x); stages ms: {stages}")
        print(f"{'':>11}first syncs (warm-ups): " + ", ".join(f"{1000 * t:.0f} ms" for t in r["first_syncs_s"]))
        if "layout_copy_s" in r:
            print(f"{'':>11}the same tensors copied alone into the rollout's packed layout{into}, on "
                  f"{r['layout_copy_threads']} core(s): {1000 * r['layout_copy_s']:.0f} ms = {r['layout_copy_ratio']:.1f}x "
                  "memcpy (the floor of a packed sync here)")
        if "concurrent_memcpy_s" in r:
            print(f"{'':>11}two processes copying as much at once: {1000 * r['concurrent_memcpy_s']:.0f} ms each "
                  "(the trainer's copy in and the rollout's copy out overlap at best this fast here)")


if __name__ == "__main__":
    main()
