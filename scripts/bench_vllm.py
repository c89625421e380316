"""Rollout throughput: the `vllm` strategy vs HF transformers `generate`, same tiny model and batch.

Both sample at temperature 1 (the RL setting) from the same prompts and stop at EOS; tokens/s counts
generated tokens (up to and including EOS). Also vLLM's own `LLM.generate` on the same token ids
without the strategy around it (`vllm_raw_tokens_per_s`: what is the library's; the rest, prompt
tokenization, per-prompt seeds and packing the batch, is the engine's), the engine start time and
the time of one in-place weight update.

    python scripts/bench_vllm.py [--prompts 32] [--n 1] [--new-tokens 64] [--hidden-size 512] [--num-layers 4]
        [--threads 1] [--json]
    python scripts/bench_vllm.py --shape qwen3_8b --prompts 32 --n 8 --prompt-tokens 1024 --new-tokens 2048 --json

`--shape qwen3_8b` (for a GPU; qwen3_0.6b also runs on a CPU): a real model's shape (Qwen3-8B with its
151,936-token vocabulary) with vLLM's random weights (`load_format: dummy`), bf16, prompts of
`--prompt-tokens` random token ids, and no HF side: the engine's overhead over the library
(`engine_overhead` = strategy time / raw time) at the size it runs in production. The 8B graph's
engine (vllm:d4t2) takes 32 prompts x 8 samples a step.

The default model (13M parameters) is the smallest where the forward pass, not per-step Python,
decides the speed. On the 0.5M-parameter demo model (--hidden-size 128 --num-layers 2) both
generators are bound by Python and vLLM's scheduler (about 20 us per sequence per step) makes it
slightly slower than HF; the README's table gives both readings.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# real models' shapes (head_dim = hidden / heads, as make_tiny_model builds them), vLLM's dummy weights
SHAPES = {"qwen3_8b": dict(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=12288),
          "qwen3_0.6b": dict(hidden_size=1024, num_layers=28, num_heads=8, num_kv_heads=4, intermediate_size=3072)}


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (starts faster)")
    p.add_argument("--hidden-size", type=int, default=512, help="tiny model width (head_dim 32)")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads for both engines")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shape", choices=["tiny", *SHAPES], default="tiny")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="with --shape other than tiny")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    a = p.parse_args()
    if a.shape != "tiny":
        real_shape(a)
        return
    os.environ["OMP_NUM_THREADS"] = str(a.threads)

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from make_tiny_model import make_tiny_model
    from siirl_dag.cli.json_stdout import json_stdout
    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.vllm.rollout import VllmRollout

    torch.set_num_threads(a.threads)
    rng = random.Random(0)
    prompts = [f"Q: {rng.randrange(100)}+{rng.randrange(100)}=? A:" for _ in range(a.prompts)]
    P, R = 32, a.new_tokens

    with json_stdout(a.json) as emit, tempfile.TemporaryDirectory() as tmp:
        heads = a.hidden_size // 32
        model_dir = make_tiny_model(tmp, hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=heads,
                                    num_kv_heads=max(1, heads // 2), intermediate_size=4 * a.hidden_size)
        engine_start_s, engine = timed(lambda: VllmRollout(
            RankContext(0), model_dir,
            {"dtype": "float32", "kv_cache_gb": 0.5, "max_model_len": P + R, "enforce_eager": a.enforce_eager}))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        batch = tokenizer(prompts, return_tensors="pt", padding=True)

        def vllm_generate():
            return int(engine.generate(prompts, {"temperature": 1.0, "n": a.n}, P, R)["response_length"].sum())

        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = [TokensPrompt(prompt_token_ids=tokenizer(p)["input_ids"]) for p in prompts]
        raw_params = SamplingParams(n=a.n, temperature=1.0, max_tokens=R, logprobs=0, detokenize=False)

        def raw_generate():
            outs = engine.llm.generate(ids, raw_params, use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)

        def hf_generate():
            with torch.no_grad():
                out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                     max_new_tokens=R, num_return_sequences=a.n,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            # generated tokens up to and including EOS (HF pads finished rows but keeps computing them)
            return int((out[:, batch["input_ids"].shape[1]:] != tokenizer.pad_token_id).sum())

        # Interleaved, best of `repeats` after a warm-up: the fairest reading on a shared machine.
        vllm_generate(), hf_generate(), raw_generate()
        runs = [(timed(vllm_generate), timed(hf_generate), timed(raw_generate)) for _ in range(a.repeats)]
        vllm_rate, hf_rate, raw_rate = (max(tokens / secs for secs, tokens in (run[i] for run in runs)) for i in (0, 1, 2))
        weights = load_file(f"{model_dir}/model.safetensors")
        load_s = min(timed(lambda: engine.load_weights(weights.items(), engine.weights_version + 1))[0]
                     for _ in range(a.repeats))
        engine.close()

        result = {
            "hidden_size": a.hidden_size, "num_layers": a.num_layers, "prompts": a.prompts, "n": a.n,
            "new_tokens": R, "threads": a.threads, "enforce_eager": a.enforce_eager,
            "vllm_tokens_per_s": round(vllm_rate), "vllm_raw_tokens_per_s": round(raw_rate), "hf_tokens_per_s": round(hf_rate),
            "speedup": round(vllm_rate / hf_rate, 2),
            "engine_start_s": round(engine_start_s, 2), "load_weights_s": round(load_s, 4),
        }
        if a.json:
            emit(result)
            return
    for key, value in result.items():
        print(f"{key:>18}: {value}")


def real_shape(a) -> None:
    """The strategy against `LLM.generate` on a real model's shape with dummy weights (no HF side)."""
    import torch

    from make_tiny_model import make_tiny_model
    from siirl_dag.cli.json_stdout import json_stdout
    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.vllm.rollout import VllmRollout

    P, R = a.prompt_tokens, a.new_tokens
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(300, 150_000, (P,), generator=g).tolist() for _ in range(a.prompts)]
    with json_stdout(a.json) as emit, tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(tmp, arch="qwen3", **SHAPES[a.shape], tie_word_embeddings=False,
                                    vocab_size=151_936, max_positions=P + R, weights=False)
        cuda = torch.cuda.is_available()
        engine_start_s, engine = timed(lambda: VllmRollout(
            RankContext(0, device="cuda" if cuda else "cpu"), model_dir,
            {"dtype": "bfloat16", "load_format": "dummy", "max_model_len": P + R, "enforce_eager": a.enforce_eager,
             "gpu_memory_utilization": 0.85, "kv_cache_gb": 4, "max_num_seqs": a.prompts * a.n}))
        engine.load_weights(iter(()), 1)  # an empty update: the dummy weights stand as the engine's own

        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # the same request on both sides; random weights stop at EOS about once in 150k tokens
        sampling = {"temperature": 1.0, "n": a.n}
        raw_params = SamplingParams(n=a.n, temperature=1.0, max_tokens=R, logprobs=0, flat_logprobs=True,
                                    detokenize=False)
        ids = [TokensPrompt(prompt_token_ids=p) for p in prompts]

        def strategy():
            return int(engine.generate(prompts, sampling, P, R)["response_length"].sum())

        def raw():
            return sum(len(c.token_ids) for o in engine.llm.generate(ids, raw_params, use_tqdm=False) for c in o.outputs)

        engine.llm.generate(ids[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        runs = [(timed(strategy), timed(raw)) for _ in range(a.repeats)]
        best = [min(secs for secs, _ in (run[i] for run in runs)) for i in (0, 1)]
        tokens = runs[0][0][1]
        engine.close()
        result = {"shape": a.shape, "device": torch.cuda.get_device_name() if cuda else "cpu", "prompts": a.prompts,
                  "n": a.n, "prompt_tokens": P, "new_tokens": R, "enforce_eager": a.enforce_eager,
                  "generated_tokens": tokens, "strategy_s": round(best[0], 3), "raw_s": round(best[1], 3),
                  "strategy_tokens_per_s": round(tokens / best[0]), "raw_tokens_per_s": round(tokens / best[1]),
                  "engine_overhead": round(best[0] / best[1], 3), "engine_start_s": round(engine_start_s, 1)}
        if a.json:
            emit(result)
            return
    for key, value in result.items():
        print(f"{key:>22}: {value}")


if __name__ == "__main__":
    main()
