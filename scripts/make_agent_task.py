"""Build the CPU agent demo: sums of three 3-digit numbers, which the tiny model can only get right by
calling the calculator, and a supervised warm start that teaches it the call format.

A trajectory is the model's call, `<tool_call>{"name":"calculator","arguments":{"expression":"a+b+c"}}</tool_call>`,
the calculator's answer as the chat template shows it, and the model's ` #### SUM`. The warm start trains on
such trajectories (the tool's tokens masked, as in RL) until greedy accuracy, with the calculator really
called, first reaches 25% (checked every second step: the copying is learnt within a few), leaving the RL run (graphs/tiny_agent_tools_cpu.yaml) room to show a rise.
Every step is skipped when its output already exists.

    python scripts/make_agent_task.py OUT_DIR [--seed 0] [--target-accuracy 0.25] [--min-calls 0]
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
LR, WARMUP, BATCH, EVAL_EVERY, EVAL_ROWS, TARGET_ACC, MAX_STEPS = 1e-3, 30, 32, 2, 100, 0.25, 2000


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


def generate(model, tokenizer, rows: list[list[int]], max_new_tokens: int) -> list[str]:
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def greedy_accuracy(model, tokenizer, observe: Observations, test: list[list[int]]) -> tuple[float, float]:
    """(accuracy, share of well-formed calls), the calculator really called between the two turns."""
    from nodes.tools import resolve_tool

    tools = {"calculator": resolve_tool("calculator")}
    firsts = [t.split("</tool_call>")[0] + "</tool_call>" for t in generate(
        model, tokenizer, [prompt_ids(tokenizer, n) for n in test], len(encode(tokenizer, call_of([100] * 3))) + 4)]
    answers = [[make_call(c, tools).text for c in parse_calls(t)] or ["error: no call"] for t in firsts]
    seconds = [prompt_ids(tokenizer, n) + encode(tokenizer, t) + observe.token_ids(a, False)
               for n, t, a in zip(test, firsts, answers)]
    finals = generate(model, tokenizer, seconds, 8)
    right = sum(gsm8k_score(f, str(sum(n))) for f, n in zip(finals, test))
    return right / len(test), sum(not a[0].startswith("error") for a in answers) / len(test)


def warm_start(out: Path, seed: int, target: float = TARGET_ACC, min_calls: float = 0.0) -> None:
    """Supervised until greedy accuracy >= `target` and well-formed calls >= `min_calls`."""
    if (out / "model" / "config.json").exists():
        print(f"warm start: {out}/model exists, skipped")
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(os.cpu_count() or 1, 1))
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(out / "init_model")
    model = AutoModelForCausalLM.from_pretrained(out / "init_model", dtype=torch.float32)
    observe = Observations(tokenizer)
    train, test = numbers_of(out, "train"), numbers_of(out, "test")[:EVAL_ROWS]
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda k: min(1.0, (k + 1) / WARMUP))
    rng, start, acc = np.random.default_rng(seed), time.perf_counter(), 0.0
    for step in range(1, MAX_STEPS + 1):
        pairs = [trajectory(tokenizer, observe, train[i]) for i in rng.integers(0, len(train), BATCH)]
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
        if step % EVAL_EVERY == 0:
            model.eval()
            acc, calls = greedy_accuracy(model, tokenizer, observe, test)
            print(f"warm start: step {step:4d}  loss {loss.item():.4f}  well-formed calls {calls:.0%}  "
                  f"accuracy {acc:.1%}  {time.perf_counter() - start:.0f}s", flush=True)
            if acc >= target and calls >= min_calls:
                break
    else:
        raise SystemExit(f"warm start: accuracy {acc:.1%} < {target:.0%} after {MAX_STEPS} steps; try another --seed")
    tmp = out / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out / "model")
    summary = {"steps": step, "test_accuracy": acc, "seconds": round(time.perf_counter() - start, 1), "seed": seed}
    (out / "warm_start.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"warm start: saved {out}/model after {step} steps, accuracy {acc:.1%}")


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
