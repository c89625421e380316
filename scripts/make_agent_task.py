"""Build the CPU agent demos' task (graphs/tiny_agent_tools_cpu.yaml, graphs/tiny_agent_openai_cpu.yaml): sums
of three 3-digit numbers, which the tiny model gets right only by calling the calculator, and a supervised
warm start from which RL has one thing left to learn, and can: to call the calculator.

A call trajectory is the model's call, `<tool_call>{"name":"calculator","arguments":{"expression":"a+b+c"}}</tool_call>`,
the calculator's answer as the chat template shows it, and the model's ` #### SUM`; a direct one is the
model's ` #### SUM` at once (a guess the model cannot make: almost always wrong). The warm start has two phases:

1. call trajectories only, until answers sampled at the RL run's temperature (0.7) are right at least
   COPY_TARGET of the time: the model has learnt the call format and to copy the calculator's answer. SFT
   learns that copying in a sharp jump, whose step depends on the seed and on the machine's float rounding;
   stopping on the plateau past it, not on its slope, leaves much the same model on every machine.
2. MIX_STEPS steps on a mixture, TOOL_SHARE of each batch calling, the rest answering at once, the learning
   rate decaying to 0: the first token's choice settles near that share, whatever the floats.

Validation (one answer per prompt sampled at 0.7) then starts near TOOL_SHARE x the copy accuracy and rises
as GRPO makes the model call. One torch thread, deterministic algorithms, seeded: a seed gives the same warm
start wherever torch computes the same floats. Every step is skipped when its output already exists.

    python scripts/make_agent_task.py OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root, for nodes

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from nodes.algos.scorers import gsm8k_score  # noqa: E402
from nodes.tool_calls import Observations, make_call, parse_calls  # noqa: E402

DATA_SOURCE, NUM_TRAIN, NUM_TEST = "demo/agent_sum", 5000, 200
LR, WARMUP, BATCH, EVAL_ROWS, MAX_STEPS, EVAL_EVERY = 1e-3, 30, 32, 100, 2000, 25
TEMPERATURE, COPY_TARGET = 0.7, 0.8  # the RL rollout's temperature; phase 1's accuracy of answers sampled at it
MIX_STEPS, MIX_LR, TOOL_CALLS = 120, 3e-4, 10  # phase 2: steps, learning rate (to 0), calling trajectories of BATCH


def prompt_of(numbers) -> str:
    return f"Q: {'+'.join(map(str, numbers))}=? A:"


def call_of(numbers) -> str:
    args = {"name": "calculator", "arguments": {"expression": "+".join(map(str, numbers))}}
    return f"<tool_call>{json.dumps(args, separators=(',', ':'))}</tool_call>"


def write_task(out: Path, seed: int) -> None:
    if (out / "train.parquet").exists() and (out / "test.parquet").exists():
        print(f"data: {out}/train.parquet and test.parquet exist, skipped")
        return
    rng = np.random.default_rng(seed)
    rows = rng.integers(100, 1000, size=(NUM_TRAIN + NUM_TEST, 3)).tolist()
    out.mkdir(parents=True, exist_ok=True)
    for split, part in (("test", rows[:NUM_TEST]), ("train", rows[NUM_TEST:])):
        table = pa.table({
            "prompt": [prompt_of(r) for r in part],
            "data_source": [DATA_SOURCE] * len(part),
            "reward_model": [{"style": "rule", "ground_truth": str(sum(r))} for r in part],
            "extra_info": [{"split": split, "index": k, "numbers": r} for k, r in enumerate(part)],
        })
        pq.write_table(table, out / f".{split}.parquet.tmp")
        os.replace(out / f".{split}.parquet.tmp", out / f"{split}.parquet")
        print(f"data: wrote {len(part)} rows to {out}/{split}.parquet")


def numbers_of(out: Path, split: str) -> list[list[int]]:
    return [r["extra_info"]["numbers"] for r in pq.read_table(out / f"{split}.parquet").to_pylist()]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer, numbers) -> list[int]:
    from siirl_dag.strategies.samples import prompt_token_ids

    return prompt_token_ids(tokenizer, prompt_of(numbers), True)


def trajectory(tokenizer, observe: Observations, numbers, call: bool = True) -> tuple[list[int], list[int]]:
    """Prompt + call + the calculator's answer + the final answer, or (`call` False) prompt + the final
    answer at once; labels on the model's tokens only."""
    p = prompt_ids(tokenizer, numbers)
    final = encode(tokenizer, f" #### {sum(numbers)}") + [tokenizer.eos_token_id]
    if not call:
        return p + final, [-100] * len(p) + final
    tool_call = encode(tokenizer, call_of(numbers))
    answer = observe.token_ids([str(sum(numbers))], ended_with_eos=False)
    return p + tool_call + answer + final, [-100] * len(p) + tool_call + [-100] * len(answer) + final


def generate(model, tokenizer, rows: list[list[int]], max_new_tokens: int, temperature: float) -> list[str]:
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, **sampling,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def accuracy(model, tokenizer, observe: Observations, test: list[list[int]], temperature: float = 0.0,
             seed: int = 0) -> tuple[float, float]:
    """(accuracy, share of answers that called the calculator) of one answer per row at `temperature` (0:
    greedy; sampled with torch's generator seeded by `seed`, restored after): the calculator really called
    where the first turn calls it, a first turn without a call taken as the answer."""
    from nodes.tools import resolve_tool

    tools = {"calculator": resolve_tool("calculator")}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        firsts = generate(model, tokenizer, [prompt_ids(tokenizer, n) for n in test],
                          len(encode(tokenizer, call_of([100] * 3))) + 4, temperature)
        finals, called = list(firsts), [i for i, t in enumerate(firsts) if "<tool_call>" in t]
        if called:
            turns = [firsts[i].split("</tool_call>")[0] + "</tool_call>" for i in called]
            answers = [[make_call(c, tools).text for c in parse_calls(t)] or ["error: no call"] for t in turns]
            seconds = [prompt_ids(tokenizer, test[i]) + encode(tokenizer, t) + observe.token_ids(a, False)
                       for i, t, a in zip(called, turns, answers)]
            for i, final in zip(called, generate(model, tokenizer, seconds, 8, temperature)):
                finals[i] = final
    right = sum(gsm8k_score(f, str(sum(n))) for f, n in zip(finals, test))
    return right / len(test), len(called) / len(test)


def call_probability(model, tokenizer, test: list[list[int]], temperature: float) -> float:
    """The mean probability, at `temperature`, that an answer starts with a call (its first token)."""
    first = encode(tokenizer, "<tool_call>")[0]
    rows = [prompt_ids(tokenizer, n) for n in test]
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -1] / temperature
    return logits.softmax(-1)[:, first].mean().item()


def seeded(seed: int) -> None:
    """One thread and deterministic algorithms, so that a seed's floats do not depend on the machine's cores."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)


def optimizer(model, lr: float = LR, warmup: int = WARMUP, decay: int | None = None):
    """AdamW at `lr` with a linear warm-up of `warmup` steps and, over `decay` steps, a linear decay to 0:
    (optimizer, scheduler)."""
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    return optim, torch.optim.lr_scheduler.LambdaLR(optim, lambda k: min(1.0, (k + 1) / warmup, 1 - k / decay if decay else 1))


def train_step(model, optim, sched, tokenizer, observe: Observations, numbers: list[list[int]],
               calls: list[bool] | None = None) -> float:
    """One supervised step on the trajectories of `numbers` (calling the calculator where `calls` says,
    everywhere by default); the loss."""
    pairs = [trajectory(tokenizer, observe, n, c) for n, c in zip(numbers, calls or [True] * len(numbers))]
    width = max(len(s) for s, _ in pairs)
    ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s, _ in pairs])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in pairs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s, _ in pairs])
    model.train()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    sched.step()
    return loss.item()


def warm_start(out: Path, seed: int, copy_target: float = COPY_TARGET, min_calls: float = 0.0,
               mix_steps: int = MIX_STEPS) -> None:
    """Phase 1 until the accuracy sampled at TEMPERATURE >= `copy_target` and its answers call the calculator
    at least `min_calls` of the time; then `mix_steps` of phase 2's mixture (tests take a quick start: a model
    that calls, right or not)."""
    if (out / "model" / "config.json").exists():
        print(f"warm start: {out}/model exists, skipped")
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seeded(seed)
    tokenizer = AutoTokenizer.from_pretrained(out / "init_model")
    model = AutoModelForCausalLM.from_pretrained(out / "init_model", dtype=torch.float32)
    observe = Observations(tokenizer)
    train, test = numbers_of(out, "train"), numbers_of(out, "test")[:EVAL_ROWS]
    rng, start, acc = np.random.default_rng(seed), time.perf_counter(), 0.0

    def batch() -> list[list[int]]:
        return [train[i] for i in rng.integers(0, len(train), BATCH)]

    optim, sched = optimizer(model)
    for step in range(1, MAX_STEPS + 1):
        loss = train_step(model, optim, sched, tokenizer, observe, batch())
        if step % EVAL_EVERY == 0:
            model.eval()
            acc, called = accuracy(model, tokenizer, observe, test, TEMPERATURE, seed)
            print(f"warm start, phase 1 (calls only): step {step:4d}  loss {loss:.4f}  accuracy sampled at "
                  f"{TEMPERATURE} {acc:.1%} ({called:.0%} calling)  {time.perf_counter() - start:.0f}s", flush=True)
            if acc >= copy_target and called >= min_calls:
                break
    else:
        raise SystemExit(f"warm start: accuracy {acc:.1%} < {copy_target:.0%} after {MAX_STEPS} steps; try another --seed")
    copied, copy_steps = acc, step
    optim, sched = optimizer(model, MIX_LR, warmup=1, decay=mix_steps)
    for step in range(1, mix_steps + 1):
        calls = [True] * TOOL_CALLS + [False] * (BATCH - TOOL_CALLS)
        rng.shuffle(calls)
        loss = train_step(model, optim, sched, tokenizer, observe, batch(), calls)
    model.eval()
    acc, called = accuracy(model, tokenizer, observe, test, TEMPERATURE, seed)
    p_call = call_probability(model, tokenizer, test, TEMPERATURE)
    print(f"warm start, phase 2 ({TOOL_CALLS} of {BATCH} calling): {mix_steps} steps  loss {loss:.4f}  "
          f"calls {called:.1%} (p {p_call:.2f})  accuracy sampled at {TEMPERATURE} {acc:.1%}", flush=True)
    tmp = out / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out / "model")
    summary = {"copy_steps": copy_steps, "copy_accuracy": copied, "mix_steps": mix_steps,
               "tool_share": TOOL_CALLS / BATCH, "call_probability": round(p_call, 4), "sampled_accuracy": acc,
               "temperature": TEMPERATURE, "seconds": round(time.perf_counter() - start, 1), "seed": seed}
    (out / "warm_start.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"warm start: saved {out}/model, accuracy {acc:.1%} sampled at {TEMPERATURE} ({called:.0%} calling)")


def make_task(out: Path, seed: int = 0, **warm: Any) -> Path:
    """Data, a random tiny model and its warm start in `out` (`warm`: warm_start's settings); the
    warm-started model's folder."""
    write_task(out, seed)
    if not (out / "init_model" / "config.json").exists():
        from make_tiny_model import make_tiny_model

        make_tiny_model(out / "init_model", arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=512, tie_word_embeddings=True, seed=seed)
    warm_start(out, seed, **warm)
    return out / "model"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    make_task(Path(a.out_dir), a.seed)


if __name__ == "__main__":
    main()
