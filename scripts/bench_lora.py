"""LoRA against training the whole model, on the same model and machine.

    python scripts/bench_lora.py [--json] [--hidden 1024] [--layers 4] [--rank 16] [--repeats 8]

Weight sync between separate meshes (the real Runtime: Ray, a Megatron trainer, a vLLM rollout): the
bytes that travel and the median sync time, the whole model's weights against the adapters alone
(which vLLM then applies in memory). Training (one Megatron rank in this process): the step time of
the same batch and the optimizer's state in memory (Adam's moments: the whole model's against the
adapters'), best of `--repeats` steps taken in turn.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from siirl_dag.cli.json_stdout import json_stdout  # noqa: E402


def optimizer_bytes(optimizer) -> int:
    """The bytes of the state a megatron optimizer keeps (Adam's moments), over its chained optimizers."""
    import torch

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(t.numel() * t.element_size() for opt in parts for state in opt.optimizer.state.values()
               for t in state.values() if torch.is_tensor(t) and t.dim() > 0)


def training(model: str, rank: int, repeats: int) -> dict:
    """Step time and optimizer state of the whole model and of rank-`rank` adapters, one rank in process."""
    import torch.distributed as dist

    from bench_megatron import make_batch, pg_loss
    from siirl_dag.models.lora import ATTENTION, MLP, LoraSpec
    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    engines = {"full": MegatronEngine(RankContext(0), {"path": model}, {"lr": 1e-5}),
               "lora": MegatronEngine(RankContext(0), {"path": model, "lora": LoraSpec(rank, 2.0 * rank,
                                                                                      frozenset(ATTENTION + MLP))},
                                      {"lr": 1e-4})}
    batch = make_batch(16, 64, 64, 256)
    best = {k: float("inf") for k in engines}
    for i in range(repeats + 1):  # the first is a warm-up
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.train(batch, pg_loss, 16, 4, entropy=False)
            if i:
                best[name] = min(best[name], time.perf_counter() - t0)
    out = {name: {"step_s": round(best[name], 4), "optimizer_state_bytes": optimizer_bytes(e.train_state.optimizer),
                  "trainable_params": sum(p.numel() for c in e.chunks for p in c.parameters() if p.requires_grad)}
           for name, e in engines.items()}
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    import bench_weight_sync
    from make_tiny_model import make_tiny_model

    with json_stdout(args.json) as emit, tempfile.TemporaryDirectory() as tmp:
        heads = args.hidden // 64
        model = make_tiny_model(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
                                num_kv_heads=max(1, heads // 4), intermediate_size=args.hidden * 3)
        sync = {}
        for name, lora in (("full", 0), ("lora", args.rank)):
            layout = argparse.Namespace(train="d1", gen="d1", bucket_mb=32, path="auto", no_verify=False,
                                        repeats=args.repeats, lora=lora)
            r = bench_weight_sync.run_layout(model, "separate", layout, Path(tmp))
            sync[name] = {"bytes": r["bytes"], "sync_s": r["sync_s"], "path": r["path"]}
        train = training(model, args.rank, args.repeats)
        result = {"model": {"hidden": args.hidden, "layers": args.layers}, "rank": args.rank, "sync": sync,
                  "sync_bytes_ratio": round(sync["lora"]["bytes"] / sync["full"]["bytes"], 4),
                  "sync_time_ratio": round(sync["lora"]["sync_s"] / sync["full"]["sync_s"], 3), "training": train,
                  "step_time_ratio": round(train["lora"]["step_s"] / train["full"]["step_s"], 3),
                  "optimizer_state_ratio": round(train["lora"]["optimizer_state_bytes"] / train["full"]["optimizer_state_bytes"], 4)}
        if args.json:
            emit(result)
            return
    print(f"model hidden {args.hidden}, {args.layers} layers; adapters rank {args.rank} on every projection")
    for name in ("full", "lora"):
        s, t = sync[name], train[name]
        print(f"  {name:>4}: sync {s['bytes'] / 2**20:7.2f} MiB in {1000 * s['sync_s']:6.1f} ms ({s['path']}); "
              f"train step {1000 * t['step_s']:6.1f} ms, optimizer state {t['optimizer_state_bytes'] / 2**20:7.2f} MiB, "
              f"{t['trainable_params'] / 1e6:.2f}M trainable")
    print(f"  lora / full: sync bytes {result['sync_bytes_ratio']}, sync time {result['sync_time_ratio']}, "
          f"step time {result['step_time_ratio']}, optimizer state {result['optimizer_state_ratio']}")


if __name__ == "__main__":
    main()
