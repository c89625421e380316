"""Build the CPU agent demo: sums of three 3-digit numbers, which the tiny model can only get right by
calling the calculator, and a supervised warm start that teaches it the call format.

A trajectory is the model's call, `<tool_call>{"name":"calculator","arguments":{"expression":"a+b+c"}}</tool_call>`,
the calculator's answer as the chat template shows it, and the model's ` #### SUM`. The warm start trains on
such trajectories (the tool's tokens masked, as in RL) until the accuracy of answers sampled at the RL run's
temperature (0.7; graphs/tiny_agent_tools_cpu.yaml), the calculator really called, first reaches 12%: sampled,
not greedy accuracy, since half-way through learning to copy the digits greedy decoding is right far more
often than sampling and a greedy target leaves RL without groups of mixed scores (docs/AGENTS.md). Checked
every 10th step until a sampled answer is right, then every 2nd. One torch thread, deterministic algorithms, seeded: a seed gives the same warm start wherever torch
computes the same floats.
Every step is skipped when its output already exists.

    python scripts/make_agent_task.py OUT_DIR [--seed 0] [--target-accuracy 0.12] [--min-calls 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root, for nodes

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from nodes.algos.scorers import gsm8k_score  # noqa: E402
from nodes.tool_calls import Observations, make_call, parse_calls  # noqa: E402

DATA_SOURCE, NUM_TRAIN, NUM_TEST = "demo/agent_sum", 5000, 200
LR, WARMUP, BATCH, EVAL_ROWS, SAMPLES, MAX_STEPS = 1e-3, 30, 32, 100, 2, 2000
TEMPERATURE, TARGET_ACC = 0.7, 0.12  # the RL rollout's temperature; accuracy of answers sampled at it
EVAL_EVERY = {False: 10, True: 2}  # steps between checks: before a sampled answer is right, and after


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


def trajectory(tokenizer, observe: Observations, numbers) -> tuple[list[int], list[int]]:
    """Prompt + call + the calculator's answer + the final answer; labels on the model's tokens only."""
    p, call = prompt_ids(tokenizer, numbers), encode(tokenizer, call_of(numbers))
    answer = observe.token_ids([str(sum(numbers))], ended_with_eos=False)
    final = encode(tokenizer, f" #### {sum(numbers)}") + [tokenizer.eos_token_id]
    return p + call + answer + final, [-100] * len(p) + call + [-100] * len(answer) + final


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
    """(accuracy, share of well-formed calls) of one answer per row at `temperature` (0: greedy; sampled
    with torch's generator seeded by `seed`, restored after), the calculator really called between the turns."""
    from nodes.tools import resolve_tool

    tools = {"calculator": resolve_tool("calculator")}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        firsts = [t.split("</tool_call>")[0] + "</tool_call>" for t in generate(
            model, tokenizer, [prompt_ids(tokenizer, n) for n in test], len(encode(tokenizer, call_of([100] * 3))) + 4,
            temperature)]
        answers = [[make_call(c, tools).text for c in parse_calls(t)] or ["error: no call"] for t in firsts]
        seconds = [prompt_ids(tokenizer, n) + encode(tokenizer, t) + observe.token_ids(a, False)
                   for n, t, a in zip(test, firsts, answers)]
        finals = generate(model, tokenizer, seconds, 8, temperature)
    right = sum(gsm8k_score(f, str(sum(n))) for f, n in zip(finals, test))
    return right / len(test), sum(not a[0].startswith("error") for a in answers) / len(test)


def seeded(seed: int) -> None:
    """One thread and deterministic algorithms, so that a seed's floats do not depend on the machine's cores."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)


def optimizer(model):
    """AdamW at LR with a linear warm-up of WARMUP steps: (optimizer, scheduler)."""
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    return optim, torch.optim.lr_scheduler.LambdaLR(optim, lambda k: min(1.0, (k + 1) / WARMUP))


def train_step(model, optim, sched, tokenizer, observe: Observations, numbers: list[list[int]]) -> float:
    """One supervised step on the trajectories of `numbers`; the loss."""
    pairs = [trajectory(tokenizer, observe, n) for n in numbers]
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


def warm_start(out: Path, seed: int, target: float = TARGET_ACC, min_calls: float = 0.0) -> None:
    """Supervised until the accuracy sampled at TEMPERATURE >= `target` and well-formed calls >= `min_calls`."""
    if (out / "model" / "config.json").exists():
        print(f"warm start: {out}/model exists, skipped")
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seeded(seed)
    tokenizer = AutoTokenizer.from_pretrained(out / "init_model")
    model = AutoModelForCausalLM.from_pretrained(out / "init_model", dtype=torch.float32)
    observe = Observations(tokenizer)
    train, test = numbers_of(out, "train"), [n for n in numbers_of(out, "test")[:EVAL_ROWS] for _ in range(SAMPLES)]
    optim, sched = optimizer(model)
    rng, start, acc, checked = np.random.default_rng(seed), time.perf_counter(), 0.0, 0
    for step in range(1, MAX_STEPS + 1):
        loss = train_step(model, optim, sched, tokenizer, observe, [train[i] for i in rng.integers(0, len(train), BATCH)])
        if step - checked == EVAL_EVERY[acc > 0]:
            model.eval()
            acc, calls, checked = *accuracy(model, tokenizer, observe, test, TEMPERATURE, seed), step
            print(f"warm start: step {step:4d}  loss {loss:.4f}  well-formed calls {calls:.0%}  "
                  f"accuracy sampled at {TEMPERATURE} {acc:.1%}  {time.perf_counter() - start:.0f}s", flush=True)
            if acc >= target and calls >= min_calls:
                break
    else:
        raise SystemExit(f"warm start: accuracy {acc:.1%} < {target:.0%} after {MAX_STEPS} steps; try another --seed")
    greedy, _ = accuracy(model, tokenizer, observe, test[::SAMPLES])
    tmp = out / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out / "model")
    summary = {"steps": step, "sampled_accuracy": acc, "temperature": TEMPERATURE, "greedy_accuracy": greedy,
               "seconds": round(time.perf_counter() - start, 1), "seed": seed}
    (out / "warm_start.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"warm start: saved {out}/model after {step} steps, accuracy {acc:.1%} sampled at {TEMPERATURE}, "
          f"{greedy:.1%} greedy")


def make_task(out: Path, seed: int = 0, target: float = TARGET_ACC, min_calls: float = 0.0) -> Path:
    """Data, a random tiny model and its warm start in `out`; the warm-started model's folder."""
    write_task(out, seed)
    if not (out / "init_model" / "config.json").exists():
        from make_tiny_model import make_tiny_model

        make_tiny_model(out / "init_model", arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=512, tie_word_embeddings=True, seed=seed)
    warm_start(out, seed, target, min_calls)
    return out / "model"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-accuracy", type=float, default=TARGET_ACC)
    p.add_argument("--min-calls", type=float, default=0.0, help="share of well-formed calls to reach as well")
    a = p.parse_args()
    make_task(Path(a.out_dir), a.seed, a.target_accuracy, a.min_calls)


if __name__ == "__main__":
    main()
