"""Actor-update step: MegatronEngine.train vs a bare megatron-core loop, same model and batch.

The bare loop is what a megatron-core user writes by hand: GPTModel with `labels` (megatron's own
vocab-parallel cross entropy), DDP, `get_megatron_optimizer`, `get_forward_backward_func`, and a
policy-gradient loss over the response tokens. The engine step does the same math through our
batch layout (alignment, micro batches, response log-probs, metrics), with the LM head at the response
positions only (response_head.py; the bare loop's `labels` take every position). Also reports achieved
model FLOP/s (the LM head counted at the response positions) against this machine's measured matmul
FLOP/s (fp32 1024^2 on a CPU, same threads; bf16 8192^2 on a GPU) and, on a GPU, against the chip's
dense bf16 peak (MFU as papers report it).
Times are the best of `--repeats` interleaved runs (the least disturbed on a shared machine).

    python scripts/bench_megatron.py [--hidden-size 256] [--num-layers 4] [--batch 16] [--threads 1] [--json]
    python scripts/bench_megatron.py --preset qwen3_8b_stage --device cuda --no-bare --json
    python scripts/bench_megatron.py --preset qwen3_8b_stage --num-layers 4 --device cuda --no-bare --megatron-local-layers

`--preset qwen3_8b_stage` is one GPU's share of graphs/qwen3_8b_grpo_megatron.yaml's actor (Qwen3-8B's
shape, 36 layers cut into 4 pipeline stages: 9 layers, with the embedding and the LM head, prompt 1024 +
response 2048 tokens) on one GPU without tensor parallelism (the graph's TP2 halves each matmul and adds
its all-reduces: this is the slice's compute without them). bf16, random weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# One GPU's share of the 8B graph's actor (Qwen3-8B: hidden 4096, FFN 12288, 32 heads of 128, 8 KV heads).
PRESETS = {"qwen3_8b_stage": dict(arch="qwen3", hidden_size=4096, intermediate_size=12288, heads=32, kv_heads=8,
                                  head_dim=128, num_layers=9, vocab=151936, batch=8, micro_batch=1,
                                  prompt_len=1024, response_len=2048, bf16=True, repeats=3)}
# Dense bf16 tensor-core peak (H100 SXM and H200 alike: same chip, same clocks), the MFU denominator.
GPU_PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}


def make_model(directory: str, a, device: str) -> str:
    """A random HF checkpoint of the asked shape (Qwen2 by default, `--arch qwen3` for q/k norms)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config_cls, model_cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[a.arch]
    heads = a.heads or a.hidden_size // 32
    config = config_cls(vocab_size=a.vocab, hidden_size=a.hidden_size,
                        intermediate_size=a.intermediate_size or 4 * a.hidden_size, num_hidden_layers=a.num_layers,
                        num_attention_heads=heads, num_key_value_heads=a.kv_heads or max(1, heads // 2),
                        head_dim=a.head_dim or a.hidden_size // heads, tie_word_embeddings=False,
                        max_position_embeddings=max(1024, a.prompt_len + a.response_len))
    with torch.device(device):  # a GPU initialises billions of weights in a blink; a CPU takes a minute
        model = model_cls(config).to(torch.bfloat16 if a.bf16 else torch.float32)
    model.save_pretrained(directory)
    return directory


def make_batch(n: int, prompt: int, response: int, vocab: int) -> dict:
    """Full-length prompts and responses: the bare loop needs no re-alignment to see the same data."""
    import torch

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (n, prompt), generator=g)
    responses = torch.randint(1, vocab, (n, response), generator=g)
    ids = torch.cat([prompts, responses], 1)
    ones = torch.ones_like(ids)
    return {"prompts": prompts, "responses": responses, "input_ids": ids, "attention_mask": ones,
            "position_ids": torch.arange(ids.shape[1]).expand_as(ids).contiguous(),
            "response_mask": torch.ones_like(responses), "advantages": torch.randn(n, response, generator=g)}


def pg_loss(logprobs, entropy, mb, totals):
    mask = mb["response_mask"].float()
    return -(logprobs * mb["advantages"] * mask).sum() / totals.tokens, {}


class BareLoop:
    """A hand-written megatron-core training step on its own copy of the model."""

    def __init__(self, chunks, config, lr: float):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.model = [DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=c)
                      for c in chunks]
        config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, clip_grad=1.0, bf16=config.bf16,
                                                                params_dtype=config.params_dtype), self.model)

    def prepare(self, batch: dict, micro: int, device) -> list[dict]:
        import torch

        ids = batch["input_ids"]
        p = batch["prompts"].shape[1]
        labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
        adv = torch.zeros(ids.shape, dtype=torch.float32)
        adv[:, p - 1:-1] = batch["advantages"]
        mask = torch.zeros(ids.shape, dtype=torch.float32)
        mask[:, p - 1:-1] = batch["response_mask"].float()
        whole = {"ids": ids, "pos": batch["position_ids"], "labels": labels, "adv": adv, "mask": mask}
        return [{k: v[i:i + micro].to(device) for k, v in whole.items()} for i in range(0, len(ids), micro)]

    @staticmethod
    def _forward(data_iterator, model):
        mb = next(data_iterator)
        ce = model(mb["ids"], mb["pos"], None, labels=mb["labels"])  # -log p per position

        def loss(output):
            value = (output * mb["adv"] * mb["mask"]).sum() / mb["mask"].sum()
            return value, {"loss": value.detach().clone()}

        return ce, loss

    def step(self, micro_batches: list[dict], seq: int, micro: int) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=self._forward, data_iterator=iter(micro_batches),
                                    model=self.model, num_microbatches=len(micro_batches), seq_length=seq,
                                    micro_batch_size=micro, forward_only=False)
        self.optimizer.step()


def matmul_flops(device: str, seconds: float = 1.0) -> float:
    """This machine's matmul rate: fp32 1024^2 on a CPU, bf16 8192^2 on a GPU."""
    import torch

    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (1024, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    sync(device)
    return 2 * n ** 3 * count / (time.perf_counter() - start)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def model_flops(spec, tokens: int, seq: int, predicted: int) -> float:
    """6 x (the layers' parameter count) x tokens + causal attention scores/values, forward + backward,
    and the LM head's 6 x h x V at the `predicted` positions only (the response's: what a policy
    update needs, and all the engine computes; the embedding lookup is not a matmul)."""
    h, f, L, v = spec.hidden_size, spec.ffn_hidden_size, spec.num_layers, spec.vocab_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f
    attention = L * q * seq  # QK^T and AV over (causally) half the sequence, as a parameter count
    return 3 * 2 * ((L * per_layer + attention) * tokens + h * v * predicted)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named shape; the flags given beside it win")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--arch", choices=("qwen2", "qwen3"), default="qwen2")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=0, help="0: 4 x hidden")
    p.add_argument("--heads", type=int, default=0, help="0: hidden / 32")
    p.add_argument("--kv-heads", type=int, default=0, help="0: heads / 2")
    p.add_argument("--head-dim", type=int, default=0, help="0: hidden / heads")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--no-bare", action="store_true", help="the engine alone (one copy of the model in memory)")
    p.add_argument("--megatron-local-layers", action="store_true",
                   help="megatron's own local attention and MLP, not the leaner ones the engine builds without TE "
                        "(siirl_dag/strategies/megatron/local_layers.py)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    preset = p.parse_known_args()[0].preset
    if preset:
        p.set_defaults(**PRESETS[preset])
    return p.parse_args()


def main() -> None:
    a = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(a.threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)

    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.megatron import model as model_lib
    from siirl_dag.strategies.megatron import local_layers
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    if a.megatron_local_layers:
        local_layers.use_lean_layers = lambda block_spec: None
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(tmp, a, a.device)
        engine = MegatronEngine(RankContext(0, device=a.device), {"path": path}, {"lr": 1e-5, "bf16": a.bf16})
        if not a.no_bare:
            config = copy.copy(engine.config)  # its own: the schedule reads hooks off the model's config
            bare = BareLoop(model_lib.build_model(engine.spec, config, engine.mesh, engine.device), config, 1e-5)
    batch = make_batch(a.batch, a.prompt_len, a.response_len, a.vocab)
    seq = a.prompt_len + a.response_len

    runs = {
        "engine": lambda: engine.train(batch, pg_loss, a.batch, a.micro_batch, entropy=False),
        "engine_with_entropy": lambda: engine.train(batch, pg_loss, a.batch, a.micro_batch, entropy=True),
    }
    if not a.no_bare:
        micro = bare.prepare(batch, a.micro_batch, engine.device)
        runs["bare"] = lambda: bare.step(micro, seq, a.micro_batch)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():  # warm-up
        fn()
    for _ in range(a.repeats):  # interleaved, so machine load hits all of them alike
        for name, fn in runs.items():
            sync(a.device)
            start = time.perf_counter()
            fn()
            sync(a.device)
            times[name].append(time.perf_counter() - start)
    # Best of the repeats: on a shared machine the minimum is the run least disturbed by others.
    med = {k: min(v) for k, v in times.items()}
    flops = model_flops(engine.spec, a.batch * seq, seq, a.batch * a.response_len)
    peak = max(matmul_flops(a.device, 0.3) for _ in range(5))
    result = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "model": {"arch": a.arch, "hidden": a.hidden_size, "layers": a.num_layers, "vocab": a.vocab,
                  "dtype": "bfloat16" if a.bf16 else "float32",
                  "params": sum(p.numel() for c in engine.chunks for p in c.parameters())},
        "batch": {"rows": a.batch, "seq": seq, "micro_batch": a.micro_batch},
        "threads": a.threads,
        "layers": "megatron-local" if a.megatron_local_layers else "lean (local_layers.py)",
        "step_s": {k: round(v, 4) for k, v in med.items()},
        "step_s_median": {k: round(statistics.median(v), 4) for k, v in times.items()},
        "model_gflop_per_step": round(flops / 1e9, 2),
        "achieved_gflops": {k: round(flops / v / 1e9, 2) for k, v in med.items()},
        "matmul_gflops": round(peak / 1e9, 2),
        "mfu_vs_measured_matmul": {k: round(flops / v / peak, 3) for k, v in med.items()},
    }
    if a.device == "cuda":
        nominal = next((v for k, v in GPU_PEAK_BF16.items() if k in result["device"]), None)
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 1)
        if nominal and a.bf16:
            result["mfu"] = {k: round(flops / v / nominal, 3) for k, v in med.items()}
    if not a.no_bare:
        result.update(engine_over_bare=round(med["engine"] / med["bare"], 3), target_ratio=1.10,
                      engine_with_entropy_over_bare=round(med["engine_with_entropy"] / med["bare"], 3))
    dist.destroy_process_group()
    if a.json:
        print(json.dumps(result))
        return
    print(f"model {result['model']}  batch {result['batch']}  threads {a.threads}")
    for k, v in med.items():
        print(f"  {k:22s} {v * 1e3:8.1f} ms/step  {flops / v / 1e9:7.2f} GFLOP/s  {flops / v / peak:.1%} of the matmul rate"
              + (f", MFU {result['mfu'][k]:.1%}" if "mfu" in result else ""))
    print(f"  matmul rate {peak / 1e9:.1f} GFLOP/s")
    if not a.no_bare:
        print(f"  engine / bare = {result['engine_over_bare']} (target <= 1.10); "
              f"with entropy {result['engine_with_entropy_over_bare']}")


if __name__ == "__main__":
    main()
