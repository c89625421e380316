"""Routing replay (R3) against none: how far the trainer's log-probs are from those of the forward
that sampled, on a tiny MoE.

    python scripts/bench_routing_replay.py [--json] [--experts 8] [--layers 4] [--rows 16] [--length 48]

The sampling forward is HF transformers in bfloat16 (a stand-in for the rollout engine: vLLM records
routes only on GPUs), the trainer one Megatron rank in float32 in this process. Prints the share of
(token, layer) routes the bfloat16 forward chose differently from float32, and the mean and max
|log-prob difference| over response tokens: Megatron routing by itself, and replaying the sampler's
routes. The numbers of vLLM on a GPU against Megatron come from tests/test_cuda.py.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from siirl_dag.cli.json_stdout import json_stdout  # noqa: E402


def hf_routes(path: str, batch: dict, dtype) -> tuple:
    """The experts HF's forward in `dtype` routes each token to ([B, T, layers, topk] uint8, vLLM's
    layout) and its log-probs of the response tokens [B, R] (0 on padding)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], output_router_logits=True)
    B, T = batch["input_ids"].shape
    k = model.config.num_experts_per_tok
    routes = torch.stack([lg.float().view(B, T, -1).topk(k, dim=-1).indices for lg in out.router_logits], 2)
    P = T - batch["responses"].shape[1]
    lp = out.logits.float()[:, P - 1:-1].log_softmax(-1).gather(-1, batch["responses"][..., None])[..., 0]
    return routes.to(torch.uint8), lp * batch["response_mask"]


def measure(experts: int, layers: int, rows: int, length: int) -> dict:
    import torch
    import torch.distributed as dist

    from bench_megatron import make_batch
    from make_tiny_model import make_tiny_model
    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    path = make_tiny_model(tempfile.mkdtemp(prefix="bench-r3-"), "qwen3_moe", num_layers=layers, num_experts=experts)
    batch = make_batch(rows, length // 2, length // 2, 64)
    own, _ = hf_routes(path, batch, torch.float32)
    sampled, sampled_lp = hf_routes(path, batch, torch.bfloat16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    engine = MegatronEngine(RankContext(0), {"path": path}, {})
    free = engine.compute_logprobs(batch)["logprobs"]
    replayed = engine.compute_logprobs({**batch, "routed_experts": sampled}, replay_routes=True)["logprobs"]
    dist.destroy_process_group()
    mask = batch["response_mask"].bool()
    gap_free, gap_replayed = (free - sampled_lp).abs()[mask], (replayed - sampled_lp).abs()[mask]
    return {"experts": experts, "topk": int(own.shape[-1]), "layers": layers, "tokens": int(mask.sum()),
            "routes_flipped": float((own.sort(-1).values != sampled.sort(-1).values).any(-1).float().mean()),
            "mean_abs_diff_without": float(gap_free.mean()), "max_abs_diff_without": float(gap_free.max()),
            "mean_abs_diff_replayed": float(gap_replayed.mean()), "max_abs_diff_replayed": float(gap_replayed.max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=48, help="prompt + response tokens per row")
    args = p.parse_args()
    with json_stdout(args.json) as emit:
        r = measure(args.experts, args.layers, args.rows, args.length)
        if args.json:
            emit(r)
            return
    print(f"tiny MoE ({r['experts']} experts, top-{r['topk']}, {r['layers']} layers), {r['tokens']} response tokens; "
          f"bf16 sampler vs fp32 Megatron: {100 * r['routes_flipped']:.1f}% of routes differ")
    print(f"  |log-prob difference| without replay: mean {r['mean_abs_diff_without']:.4f}, "
          f"max {r['max_abs_diff_without']:.4f}")
    print(f"  replaying the sampler's routes:       mean {r['mean_abs_diff_replayed']:.4f}, "
          f"max {r['max_abs_diff_replayed']:.4f}")

if __name__ == "__main__":
    main()
