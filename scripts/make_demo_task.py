"""Build the CPU demo task: GSM8K-format addition data, a tiny model, and its supervised warm start.

GRPO needs some reward to start from (a random model never answers right), so the model is first
trained supervised until greedy accuracy on the held-out set reaches 15%, which leaves room for RL
to show a clear rise. Every step is skipped when its output already exists.

    python scripts/make_demo_task.py OUT_DIR [--seed 0] [--data-only]

Writes OUT_DIR/{train,test}.parquet (data_source demo/arith), OUT_DIR/init_model (random init),
OUT_DIR/model (warm start, HF save_pretrained) and OUT_DIR/warm_start.json (steps, accuracy, time).
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root, for nodes.algos

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from nodes.algos.scorers import gsm8k_score  # noqa: E402

DATA_SOURCE = "demo/arith"
NUM_TEST = 200
# Warm-start recipe: supervised until greedy accuracy first reaches TARGET_ACC (a fixed step count
# lands anywhere from 10% to 50%: leaving GRPO too little or too much room).
LR, WARMUP, BATCH, CLIP, EVAL_EVERY, TARGET_ACC, MAX_STEPS, MAX_NEW_TOKENS = 1e-3, 50, 64, 1.0, 25, 0.15, 3000, 8


def prompt_of(a: int, b: int) -> str:
    return f"Q: {a}+{b}=? A:"


def write_task(out: Path, seed: int) -> None:
    """All 10,000 pairs of operands 0..99, shuffled with `seed`: 200 test, 9,800 train."""
    if (out / "train.parquet").exists() and (out / "test.parquet").exists():
        print(f"data: {out}/train.parquet and test.parquet exist, skipped")
        return
    pairs = [(a, b) for a in range(100) for b in range(100)]
    order = np.random.default_rng(seed).permutation(len(pairs))
    splits = {"test": order[:NUM_TEST], "train": order[NUM_TEST:]}
    out.mkdir(parents=True, exist_ok=True)
    for split, idx in splits.items():
        rows = [pairs[i] for i in idx]
        table = pa.table({
            "prompt": [prompt_of(a, b) for a, b in rows],
            "data_source": [DATA_SOURCE] * len(rows),
            "reward_model": [{"style": "rule", "ground_truth": str(a + b)} for a, b in rows],
            "extra_info": [{"split": split, "index": k, "a": a, "b": b} for k, (a, b) in enumerate(rows)],
        })
        tmp = out / f".{split}.parquet.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, out / f"{split}.parquet")
        print(f"data: wrote {len(rows)} rows to {out}/{split}.parquet")


def read_split(out: Path, split: str) -> list[tuple[str, str, str]]:
    """(prompt, completion, ground truth) triples of a split."""
    t = pq.read_table(out / f"{split}.parquet").to_pylist()
    return [(r["prompt"], f" #### {r['reward_model']['ground_truth']}", r["reward_model"]["ground_truth"]) for r in t]


def greedy_accuracy(model, tokenizer, test, grade=gsm8k_score) -> float:
    """Mean of grade(greedy completion, truth) over the (prompt, completion, truth) triples of `test`."""
    enc = tokenizer([p for p, _, _ in test], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(grade(t, truth) for t, (_, _, truth) in zip(texts, test)) / len(test)


def training_batch(tokenizer, examples):
    """Right-padded prompt+completion+EOS; labels only on completion and EOS (-100 elsewhere)."""
    prompts = tokenizer([p for p, _, _ in examples], add_special_tokens=False)["input_ids"]  # one call: 3x faster
    completions = tokenizer([c for _, c, _ in examples], add_special_tokens=False)["input_ids"]
    seqs, labels = [], []
    for p, c in zip(prompts, completions):
        c = c + [tokenizer.eos_token_id]
        seqs.append(p + c)
        labels.append([-100] * len(p) + c)
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    lab = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return ids, mask, lab


def supervised(model, tokenizer, train, evaluate, seed: int, target: float, name: str = "warm start",
               lr: float = LR, max_steps: int = MAX_STEPS, eval_every: int = EVAL_EVERY,
               must_reach: bool = True, decay: bool = False) -> tuple[int, float, float]:
    """AdamW (linear warmup; with `decay`, then linear decay to 0 at `max_steps`) on shuffled batches of
    `train` triples until evaluate(model), run every `eval_every` steps, first reaches `target`; returns
    (steps, accuracy, seconds). Not reached in `max_steps`: exits, or when not `must_reach` returns the last."""
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    ramp = lambda k: min(1.0, (k + 1) / WARMUP, (max_steps - k) / (max_steps - WARMUP) if decay else 1.0)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(optim, ramp)
    rng = np.random.default_rng(seed)
    order, pos = rng.permutation(len(train)), 0
    start, acc = time.perf_counter(), 0.0
    for step in range(1, max_steps + 1):
        if pos + BATCH > len(order):
            order, pos = rng.permutation(len(train)), 0
        ids, mask, labels = training_batch(tokenizer, [train[i] for i in order[pos:pos + BATCH]])
        pos += BATCH
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optim.step()
        sched.step()
        if step % eval_every == 0:
            model.eval()
            acc = evaluate(model)
            print(f"{name}: step {step:4d}  loss {loss.item():.4f}  accuracy {acc:.1%}  "
                  f"{time.perf_counter() - start:.1f}s", flush=True)
            if acc >= target:
                return step, acc, time.perf_counter() - start
    if not must_reach:
        return step, acc, time.perf_counter() - start
    raise SystemExit(f"{name}: accuracy {acc:.1%} < {target:.0%} after {max_steps} steps; try another --seed")


def save_model(model, tokenizer, dest: Path) -> None:
    """save_pretrained (safetensors) plus the tokenizer into a temporary sibling, then renamed to `dest`."""
    tmp = dest.parent / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, dest)


def warm_start(out: Path, seed: int) -> None:
    """Supervised training of init_model until greedy test accuracy >= 15%, saved to OUT_DIR/model."""
    if (out / "model" / "config.json").exists():
        print(f"warm start: {out}/model exists, skipped")
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow import, not needed for --data-only

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(out / "init_model")
    model = AutoModelForCausalLM.from_pretrained(out / "init_model", dtype=torch.float32)
    train, test = read_split(out, "train"), read_split(out, "test")
    step, acc, seconds = supervised(model, tokenizer, train, lambda m: greedy_accuracy(m, tokenizer, test),
                                    seed, TARGET_ACC)
    save_model(model, tokenizer, out / "model")
    summary = {"steps": step, "test_accuracy": acc, "seconds": round(seconds, 1), "seed": seed}
    (out / "warm_start.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"warm start: saved {out}/model after {step} steps, accuracy {acc:.1%}, {seconds:.1f}s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-only", action="store_true", help="write the parquet files only")
    a = p.parse_args()
    out = Path(a.out_dir)
    write_task(out, a.seed)
    if a.data_only:
        return
    if (out / "init_model" / "config.json").exists():
        print(f"model: {out}/init_model exists, skipped")
    else:
        from make_tiny_model import make_tiny_model  # scripts/ is on sys.path when run as a script

        make_tiny_model(out / "init_model", arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=512, tie_word_embeddings=True, seed=a.seed)
        print(f"model: wrote random-init Qwen2 to {out}/init_model")
    warm_start(out, a.seed)


if __name__ == "__main__":
    main()
