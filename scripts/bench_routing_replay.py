"""Routing replay against none: how far the trainer's log-probs are from those of the engine that
sampled, on a tiny MoE.

    python scripts/bench_routing_replay.py [--json] [--sampler vllm|hf] [--experts 8] [--layers 4] [--rows 16]

The sampler computes in bfloat16, the trainer (one Megatron rank in this process) in float32. With
`--sampler vllm` (the default) vLLM prefills each row alone and its routers' choices are taken
through their capture hook (`set_capture_fn`): this works on CPU, where vLLM's own routed-experts
output (which a run's rollout uses) needs the GPU-only model runner V2. `--sampler hf` uses HF
transformers. Prints the share of (token, layer) routes the sampler chose differently from
Megatron's own, and the mean and max |log-prob difference| over response tokens: Megatron routing
by itself, and replaying the sampler's routes.
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


def vllm_routes(path: str, batch: dict) -> tuple:
    """As hf_routes, from vLLM in bfloat16: each row prefilled alone (prompt log-probs, one forward),
    its routers' top-k ids captured per layer."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.vllm.rollout import VllmRollout

    engine = VllmRollout(RankContext(0), {"path": path}, {"dtype": "bfloat16", "max_model_len": 256, "kv_cache_gb": 0.25,
                                                          "enforce_eager": True, "enable_prefix_caching": False})
    captured: dict[int, torch.Tensor] = {}
    engine.llm.collective_rpc(_capture_routes, args=(captured,))
    B, T = batch["input_ids"].shape
    R = batch["responses"].shape[1]
    config = engine.llm.llm_engine.model_config.hf_config
    routes = torch.zeros(B, T, config.num_hidden_layers, config.num_experts_per_tok, dtype=torch.uint8)
    logprobs = torch.zeros(B, R)
    for row in range(B):
        real = batch["attention_mask"][row].bool()
        ids = batch["input_ids"][row][real].tolist()
        captured.clear()
        [out] = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(
            max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
        start = int((~real[:T - R]).sum())  # left padding of the prompt
        for layer, chosen in captured.items():
            routes[row, start:start + len(ids), layer] = chosen[:len(ids)].to(torch.uint8)
        n = int(batch["response_mask"][row].sum())
        logprobs[row, :n] = torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[len(ids) - n:],
                                                                          ids[len(ids) - n:])])
    engine.close()
    return routes, logprobs


def _capture_routes(worker, captured: dict) -> None:
    """Runs in vLLM's worker (in process): each MoE layer's router hands its top-k ids to `captured`."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    for module in worker.model_runner.get_model().modules():
        if isinstance(module, MoERunner):
            module.router.set_capture_fn(lambda ids, layer=module.layer_id: captured.__setitem__(layer, ids.clone()))


def measure(sampler: str, experts: int, layers: int, rows: int, length: int) -> dict:
    import torch
    import torch.distributed as dist

    from bench_megatron import make_batch
    from make_tiny_model import make_tiny_model
    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    path = make_tiny_model(tempfile.mkdtemp(prefix="bench-r3-"), "qwen3_moe", num_layers=layers, num_experts=experts)
    batch = make_batch(rows, length // 2, length // 2, 64)
    own, _ = hf_routes(path, batch, torch.float32)
    sampled, sampled_lp = vllm_routes(path, batch) if sampler == "vllm" else hf_routes(path, batch, torch.bfloat16)
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
    return {"sampler": sampler, "experts": experts, "topk": int(own.shape[-1]), "layers": layers, "tokens": int(mask.sum()),
            "routes_flipped": float((own.sort(-1).values != sampled.sort(-1).values).any(-1).float().mean()),
            "mean_abs_diff_without": float(gap_free.mean()), "max_abs_diff_without": float(gap_free.max()),
            "mean_abs_diff_replayed": float(gap_replayed.mean()), "max_abs_diff_replayed": float(gap_replayed.max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--sampler", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=48, help="prompt + response tokens per row")
    args = p.parse_args()
    with json_stdout(args.json) as emit:
        r = measure(args.sampler, args.experts, args.layers, args.rows, args.length)
        if args.json:
            emit(r)
            return
    print(f"tiny MoE ({r['experts']} experts, top-{r['topk']}, {r['layers']} layers), {r['tokens']} response tokens; "
          f"{r['sampler']} (bf16) vs Megatron (fp32): {100 * r['routes_flipped']:.1f}% of routes differ")
    print(f"  |log-prob difference| without replay: mean {r['mean_abs_diff_without']:.4f}, "
          f"max {r['max_abs_diff_without']:.4f}")
    print(f"  replaying the sampler's routes:       mean {r['mean_abs_diff_replayed']:.4f}, "
          f"max {r['max_abs_diff_replayed']:.4f}")

if __name__ == "__main__":
    main()
