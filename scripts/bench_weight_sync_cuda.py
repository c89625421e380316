"""Weight sync on a GPU: the trainer's export (Megatron on CUDA) against a device copy of the same bytes.

    python scripts/bench_weight_sync_cuda.py [--json] [--hidden 2048] [--layers 16] [--bf16] [--bucket-mb 512]
        [--repeats 8] [--layouts colocated,separate,vllm]

Builds a random Qwen2-style model, loads it into a real MegatronEngine on the GPU and syncs its weights
into a rollout's parameters `--repeats` times after one warm-up:
- colocated: `weight_sync.stream.handoff` from the engine's export straight into the rollout's parameters,
  in process (one GPU);
- separate: the export cut into buckets (`weight_sync.stream.Buckets`) and broadcast over NCCL
  (`weight_sync.process_group.SyncGroup`) to a second process, which copies each bucket into its
  parameters, on the next GPU (NCCL refuses two ranks on one GPU: with one, this layout says so).
- vllm: the colocated handoff into a real vLLM engine on the same GPU (`VllmRollout`, started with
  dummy weights), its own loader fusing q/k/v and gate/up; then the engine's greedy samples scored
  by Megatron: the log-prob difference of the same weights on both sides (`logprob_diff_after_sync`).
In the first two the rollout is the set of HF-named parameters a rollout engine holds, filled by
copies as vLLM's loader fills its own.
Prints the median sync time, its ratio to a device-to-device copy of the same bytes (target <= 3x),
and the stages: export (gather + convert: the export walked alone, its GPU work finished) and load
(the rest: the copies into the rollout's parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


class Rollout:
    """HF-named parameters on a GPU, loaded by copies (`load_weights` as a rollout engine takes them)."""

    def __init__(self, shapes: dict, device: torch.device):
        self.params = {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()}

    def load_weights(self, named, version, watch=None, cores=None) -> None:
        for name, t in named:
            self.params[name].copy_(t, non_blocking=True)
        torch.cuda.synchronize()


def device_copy_s(nbytes: int, repeats: int) -> float:
    """Median time of one device-to-device copy of `nbytes`."""
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times[1:])


def _engine(model: str, bf16: bool):
    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    return MegatronEngine(RankContext(0, device="cuda"), {"path": model}, {"bf16": bf16})


def colocated(engine, args) -> dict:
    from siirl_dag.weight_sync.stream import handoff

    shapes = {name: (t.shape, t.dtype) for name, t in engine.export_hf_weights(copy=False)}
    rollout = Rollout(shapes, torch.device("cuda"))
    handoff(engine, rollout, 0, "model")  # warm-up
    times, copies, nbytes = [], [], 0
    for version in range(1, args.repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = handoff(engine, rollout, version, "model")
        times.append(time.perf_counter() - t0)
        nbytes = stats["sync/bytes"]
        copies.append(device_copy_s(nbytes, 3))
    for name, t in engine.export_hf_weights(copy=False):
        assert torch.equal(rollout.params[name], t), f"{name} differs after the sync"
    export = statistics.median(_export_s(engine) for _ in range(args.repeats))
    return _result("colocated", "in-process handoff", times, copies, nbytes,
                   {"export": export, "load": statistics.median(times) - export})


def into_vllm(engine, args) -> dict:
    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.vllm.rollout import VllmRollout
    from siirl_dag.weight_sync.stream import handoff

    rollout = VllmRollout(RankContext(0, device="cuda"), args.model, {
        "dtype": "bfloat16" if args.bf16 else "float32", "load_format": "dummy", "max_model_len": 64,
        "enforce_eager": True, "gpu_memory_utilization": args.vllm_memory})
    handoff(engine, rollout, 1, "model")  # warm-up; the dummy weights replaced
    times, copies, nbytes = [], [], 0
    for version in range(2, args.repeats + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = handoff(engine, rollout, version, "model")
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        nbytes = stats["sync/bytes"]
        copies.append(device_copy_s(nbytes, 3))
    batch = rollout.generate(["Q: 12+30=? A:", "Q: 7+58=? A:", "Q: 91+4=? A:", "Q: 33+33=? A:"], {"greedy": True}, 16, 16)
    diff = (engine.compute_logprobs(batch)["logprobs"].cpu() - batch["rollout_logprobs"]).abs()[batch["response_mask"].bool()]
    rollout.close()
    return {**_result("vllm", "in-process handoff into vLLM's loader", times, copies, nbytes, {}),
            "logprob_diff_after_sync": {"mean": round(diff.mean().item(), 5), "max": round(diff.max().item(), 5),
                                        "tokens": diff.numel()}}


def _export_s(engine) -> float:
    from siirl_dag.weight_sync.stream import exported

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in exported(engine, {}, "model"):
        pass
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _reader(port: int, shapes: dict, repeats: int) -> None:
    """The rollout's rank: each sync's buckets copied into its parameters, then the writer's marker,
    which it can only take once those copies are done (so the writer's clock includes them)."""
    from siirl_dag.weight_sync.process_group import SyncGroup

    torch.cuda.set_device(1)
    group = SyncGroup("127.0.0.1", port, 1, 2, "cuda")
    rollout = Rollout(shapes, torch.device("cuda", torch.cuda.current_device()))
    for _ in range(repeats + 1):
        rollout.load_weights((pair for bucket in iter(group.read, None) for pair in bucket), 0)
        group.read()
    group.close()


def separate(engine, args) -> dict:
    import multiprocessing as mp

    from siirl_dag.weight_sync.process_group import SyncGroup
    from siirl_dag.weight_sync.stream import Buckets, exported

    if torch.cuda.device_count() < 2:
        return {"layout": "separate", "not_run": "NCCL needs a GPU per rank ('Duplicate GPU detected' on one)"}
    shapes = {name: (t.shape, t.dtype) for name, t in engine.export_hf_weights(copy=False)}
    port = _free_port()
    reader = mp.get_context("spawn").Process(target=_reader, args=(port, shapes, args.repeats), daemon=True)
    reader.start()
    group = SyncGroup("127.0.0.1", port, 0, 2, "cuda", timeout_s=120)
    times, copies, stats = [], [], {}
    for i in range(args.repeats + 1):
        stats = {}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        buckets = Buckets(exported(engine, stats, "model"), int(args.bucket_mb * 2**20), stats)
        while (bucket := buckets.next()) is not None:
            group.write(bucket)
        group.write(None)
        group.write("loaded")
        torch.cuda.synchronize()  # the marker's broadcast ends once the reader takes it
        if i:
            times.append(time.perf_counter() - t0)
            copies.append(device_copy_s(stats["sync/bytes"], 3))
    reader.join()
    group.close()
    return _result("separate", f"NCCL broadcast, {stats['sync/buckets']} buckets", times, copies,
                   stats["sync/bytes"], {})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(layout, how, times, copies, nbytes, stages) -> dict:
    return {"layout": layout, "transport": how, "bytes": nbytes, "sync_s": round(statistics.median(times), 5),
            "sync_min_s": round(min(times), 5), "device_copy_s": round(statistics.median(copies), 5),
            "ratio_to_device_copy": round(statistics.median(t / c for t, c in zip(times, copies)), 2),
            "target_ratio": 3.0, "sync_GBps": round(nbytes / statistics.median(times) / 1e9, 1),
            "sync_ms_per_GB": round(1000 * statistics.median(times) / (nbytes / 1e9), 2),
            "stages_s": {k: round(v, 5) for k, v in stages.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--bf16", action="store_true", help="train in bfloat16 (the export is then bfloat16)")
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--layouts", default="colocated,separate,vllm")
    ap.add_argument("--vllm-memory", type=float, default=0.2, help="the vllm layout's gpu_memory_utilization")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_weight_sync_cuda.py needs a CUDA GPU; scripts/bench_weight_sync.py measures the CPU sync")
    from make_tiny_model import make_tiny_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    with tempfile.TemporaryDirectory() as tmp:
        heads = args.hidden // 128
        t0 = time.perf_counter()
        model = make_tiny_model(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers,
                                num_heads=heads, num_kv_heads=max(1, heads // 4), intermediate_size=args.hidden * 3)
        engine, args.model = _engine(model, args.bf16), model
        print(f"[bench] model built and loaded in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        runs = {"colocated": colocated, "separate": separate, "vllm": into_vllm}
        results = [runs[layout](engine, args) for layout in args.layouts.split(",")]
    report = {"device": torch.cuda.get_device_name(), "model": {"hidden": args.hidden, "layers": args.layers,
              "dtype": "bfloat16" if args.bf16 else "float32"}, "bucket_mb": args.bucket_mb, "results": results}
    if dist.is_initialized():  # a vLLM engine's shutdown destroys the default group itself
        dist.destroy_process_group()
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['device']}: hidden {args.hidden}, {args.layers} layers, {report['model']['dtype']}")
    for r in results:
        if "not_run" in r:
            print(f"{r['layout']:>11}: not run: {r['not_run']}")
            continue
        stages = ", ".join(f"{k} {1000 * v:.1f}" for k, v in r["stages_s"].items())
        print(f"{r['layout']:>11} ({r['transport']}): {r['bytes'] / 2**20:.0f} MiB in {1000 * r['sync_s']:.1f} ms "
              f"(median; best {1000 * r['sync_min_s']:.1f}; {r['sync_GBps']} GB/s) = {r['ratio_to_device_copy']:.2f}x "
              f"a device copy ({1000 * r['device_copy_s']:.1f} ms; target <= 3x)" + (f"; stages ms: {stages}" if stages else "")
              + (f"; log-prob |megatron - vllm| after it: {r['logprob_diff_after_sync']}" if "logprob_diff_after_sync" in r else ""))


if __name__ == "__main__":
    main()
