"""Convert a GSM8K copy already on disk into siirl_dag's prompt parquet format (no download).

Accepts the Hugging Face layout (`main/train-00000-of-00001.parquet`, ...) or the original jsonl
(`train.jsonl`, `test.jsonl`), each row with `question` and `answer`; the ground truth is the number
after `####` in the answer.

    python scripts/convert_gsm8k.py SRC_DIR OUT_DIR

Writes OUT_DIR/train.parquet and OUT_DIR/test.parquet: prompt (a chat list with one user message:
the question plus an instruction to end with `#### <answer>`), data_source openai/gsm8k,
reward_model.ground_truth, extra_info (split, index, question, answer).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def find_split(src: Path, split: str) -> list[Path]:
    """The `main` files of `split` under `src`: `train.jsonl` or HF shards `train-00000-of-00001.parquet`;
    the `socratic` variant (same questions, other answer style) is left out."""
    name = re.compile(rf"{split}(-\d+-of-\d+)?\.(parquet|jsonl)")
    files = sorted(p for p in src.rglob("*") if p.is_file() and name.fullmatch(p.name)
                   and not any("socratic" in part for part in p.relative_to(src).parts))
    if not files:
        raise SystemExit(f"no {split}*.parquet or {split}*.jsonl under {src}; expected a GSM8K copy "
                         "(Hugging Face parquet or the original jsonl with question/answer)")
    if len({p.suffix for p in files}) > 1:
        raise SystemExit(f"both parquet and jsonl {split} files under {src} ({', '.join(map(str, files))}); "
                         "expected one copy of GSM8K")
    return files


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path, columns=["question", "answer"]).to_pylist()
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def ground_truth(answer: str, where: str) -> str:
    if "####" not in answer:
        raise SystemExit(f"{where}: answer has no '#### <number>'; expected GSM8K's answer format")
    return answer.split("####")[-1].strip().replace(",", "")


def convert(src: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in ("train", "test"):
        rows = []
        for path in find_split(src, split):
            for i, r in enumerate(read_rows(path)):
                rows.append({
                    "prompt": [{"role": "user", "content": f"{r['question']} {INSTRUCTION}"}],
                    "data_source": DATA_SOURCE,
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": ground_truth(r["answer"], f"{path} row {i}")},
                    "extra_info": {"split": split, "index": len(rows), "question": r["question"], "answer": r["answer"]},
                })
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
        counts[split] = len(rows)
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src_dir")
    p.add_argument("out_dir")
    a = p.parse_args()
    counts = convert(Path(a.src_dir), Path(a.out_dir))
    print(" ".join(f"{split}: {n} rows" for split, n in counts.items()), f"-> {a.out_dir}")


if __name__ == "__main__":
    main()
