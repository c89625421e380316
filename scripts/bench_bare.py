"""The bare loop: the demo's GRPO step (graphs/tiny_grpo_cpu.yaml) in plain torch + transformers, no engine.

One process, one model: no siirl_dag engine, vLLM, Megatron or Ray, and no weight sync (the policy that
trains is the one that samples). Per step, as the demo: 32 prompts from data/demo/train.parquet
(raw text, no chat template, left-padded, at most 16 tokens), 8 samples each with HF `generate`
(temperature 1, at most 8 new tokens, stop at EOS), the demo's rule reward (nodes/algos/scorers.py),
GRPO advantages (group mean / std), old log-probs (no-grad forward of the policy), reference
log-probs (no-grad forward of a frozen copy), and one PPO-clip update over all 256 samples (clip 0.2,
dual-clip 3, low-var KL loss 0.001 to the reference, token-mean, AdamW lr 2e-4 and weight decay 0.01,
grad clip 1.0, micro batches of 64 accumulated into one optimizer step). The step time it reports is
the bar the engine's `make demo` step is measured against (scripts/bench.py, docs/BENCHMARKS.md).

    python scripts/bench_bare.py [--steps 12] [--threads 1 2] [--json]

Reports, per thread count, the median step time over the steps after the first (warm-up), its
breakdown, tokens/s (prompt + response tokens per second) and the mean score. Also the CPU seconds
the process used per step (step_cpu_s): on one thread, about the step time of an idle machine, a
reading that other load on a shared machine disturbs less than the wall time.
Needs the demo task (make demo, or python scripts/make_demo_task.py data/demo).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS, N, P, R = 32, 8, 16, 8  # data.train_batch_size, rollout n, max prompt / response length
LR, WEIGHT_DECAY, CLIP_GRAD, MICRO = 2e-4, 0.01, 1.0, 64  # the actor's options (megatron defaults otherwise)
CLIP, CLIP_C, KL_COEF = 0.2, 3.0, 0.001  # actor_update params and defaults
PARTS = ("generate", "reward_advantage", "old_logprobs", "ref_logprobs", "update")


def load_rows(path: Path) -> list[tuple[str, str, str]]:
    """(prompt, data_source, ground truth) of each row."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["prompt", "data_source", "reward_model"]).to_pylist()
    return [(r["prompt"], r["data_source"], r["reward_model"]["ground_truth"]) for r in table]


def encode(tokenizer, prompts: list[str]) -> tuple:
    """Left-padded ids and attention mask, as the engine tokenizes text prompts (no chat template)."""
    import torch

    ids = [tokenizer.encode(p) for p in prompts]
    assert all(0 < len(i) <= P for i in ids), "a prompt longer than max_prompt_length"
    width = max(map(len, ids))  # the batch's longest, not P: no work on columns of padding only
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, i in enumerate(ids):
        input_ids[row, width - len(i):], mask[row, width - len(i):] = torch.tensor(i), 1
    return input_ids, mask


def response_logprobs(model, seqs, attention_mask, n_resp: int):
    """Log-prob of each of the last `n_resp` tokens of `seqs` (temperature 1); only the logits
    that predict them go through the softmax."""
    import torch

    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # left padding: count from the first token
    logits = model(input_ids=seqs, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=n_resp + 1).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, seqs[:, -n_resp:, None]).squeeze(-1)


def token_loss(logprobs, old, advantages, ref):
    """Per-token PPO-clip loss with dual-clip, plus the low-var (k3) KL to the reference."""
    import torch

    ratio = (logprobs - old).clamp(-20, 20).exp()
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP, 1 + CLIP))
    loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * CLIP_C), loss)
    log_ratio = (ref - logprobs).clamp(-20, 20)
    kl = (log_ratio.exp() - log_ratio - 1).clamp(-10, 10)
    return loss + KL_COEF * kl


def step(policy, ref, optimizer, tokenizer, rows, score) -> dict:
    """One GRPO step on `rows`; returns its timings (s), tokens and mean score."""
    import torch

    times, t = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        times[name], t = now - t, now

    input_ids, prompt_mask = encode(tokenizer, [r[0] for r in rows])
    with torch.no_grad():  # KV cache on (generate's default); samples of a prompt are adjacent rows
        seqs = policy.generate(input_ids=input_ids, attention_mask=prompt_mask, do_sample=True, temperature=1.0,
                               top_k=0, top_p=1.0, max_new_tokens=R, num_return_sequences=N,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    n_resp = seqs.shape[1] - input_ids.shape[1]  # R, or fewer when every sample stopped early
    eos = seqs[:, -n_resp:] == tokenizer.eos_token_id
    mask = (eos.cumsum(1) - eos.long()) == 0  # up to and including the first EOS
    attention_mask = torch.cat([prompt_mask.repeat_interleave(N, 0), mask.long()], 1)
    lap("generate")

    texts = [tokenizer.decode(s[-n_resp:][m].tolist(), skip_special_tokens=True) for s, m in zip(seqs, mask)]
    scores = torch.tensor([score(src, text, truth) for text, (_, src, truth) in
                           zip(texts, (r for r in rows for _ in range(N)))])
    groups = scores.view(-1, N)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    lap("reward_advantage")

    micro = [slice(s, s + MICRO) for s in range(0, seqs.shape[0], MICRO)]  # (faster than one of 256 here)
    with torch.no_grad():
        old = torch.cat([response_logprobs(policy, seqs[mb], attention_mask[mb], n_resp) for mb in micro])
        lap("old_logprobs")
        ref_lp = torch.cat([response_logprobs(ref, seqs[mb], attention_mask[mb], n_resp) for mb in micro])
        lap("ref_logprobs")

    weights = mask.float() / mask.sum()  # token-mean over the whole mini batch, whatever the micro batches
    optimizer.zero_grad(set_to_none=True)
    for mb in micro:
        logprobs = response_logprobs(policy, seqs[mb], attention_mask[mb], n_resp)
        (token_loss(logprobs, old[mb], advantages[mb], ref_lp[mb]) * weights[mb]).sum().backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), CLIP_GRAD)
    optimizer.step()
    lap("update")
    return {"times": times, "tokens": int(attention_mask.sum()), "score": scores.mean().item(),
            "response_length": mask.sum(1).float().mean().item()}


def run(threads: int, steps: int, seed: int, data: Path, model_dir: Path) -> dict:
    """`steps` steps from a fresh model on `threads` threads; medians over all but the first."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nodes.algos.scorers import score  # the task's reward, as the demo's reward node calls it

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # no dropout in it
    ref = copy.deepcopy(policy).requires_grad_(False)
    decay = [p for p in policy.parameters() if p.ndim >= 2]  # as megatron: no decay on norms and biases
    rest = [p for p in policy.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": rest, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.999), eps=1e-8)
    rows = load_rows(data)
    order = np.random.default_rng(seed).permutation(len(rows))
    results = []
    for k in range(steps):
        first = k * PROMPTS % (len(rows) - len(rows) % PROMPTS)  # epochs in one order: enough for a benchmark
        start, cpu = time.perf_counter(), time.process_time()
        out = step(policy, ref, optimizer, tokenizer, [rows[i] for i in order[first:first + PROMPTS]], score)
        out["step"], out["cpu"] = time.perf_counter() - start, time.process_time() - cpu
        results.append(out)
    measured = results[1:] or results
    med = lambda f: statistics.median(f(r) for r in measured)  # noqa: E731
    return {"threads": threads, "steps_measured": len(measured), "step_s": round(med(lambda r: r["step"]), 4),
            "step_cpu_s": round(med(lambda r: r["cpu"]), 4),
            "breakdown_s": {p: round(med(lambda r: r["times"][p]), 4) for p in PARTS},
            "tokens_per_s": round(med(lambda r: r["tokens"] / r["step"])),
            "score_mean": round(statistics.mean(r["score"] for r in results), 4),
            "score_first_step": round(results[0]["score"], 4),
            "response_length_mean": round(statistics.mean(r["response_length"] for r in results), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="steps per thread count; the first is warm-up")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads, one measurement each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=str(ROOT / "data" / "demo" / "train.parquet"))
    ap.add_argument("--model", default=str(ROOT / "data" / "demo" / "model"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from siirl_dag.cli.json_stdout import json_stdout

    with json_stdout(args.json) as emit:
        report = {"work": {"prompts": PROMPTS, "samples_per_prompt": N, "max_prompt_length": P,
                           "max_response_length": R, "micro_batch_size": MICRO},
                  "runs": [run(t, args.steps, args.seed, Path(args.data), Path(args.model)) for t in args.threads]}
        if args.json:
            emit(report)
            return
    for r in report["runs"]:
        parts = ", ".join(f"{p} {s:.3f}" for p, s in r["breakdown_s"].items())
        print(f"{r['threads']} thread(s): {r['step_s']:.3f} s/step, median of {r['steps_measured']} "
              f"(CPU {r['step_cpu_s']:.3f} s; {parts}); {r['tokens_per_s']} tokens/s; score mean "
              f"{r['score_mean']:.3f} (first step {r['score_first_step']:.3f}); mean response "
              f"{r['response_length_mean']:.1f} tokens")


if __name__ == "__main__":
    main()
