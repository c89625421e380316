"""A few validation trajectories as JSON lines (`trainer.log_trajectories: N`), to read what the model
did: the prompt, the response split into spans by who wrote them (the model's tokens are the ones
`response_mask` trains on; the rest, inside the response, are tool observations), and the score."""

from __future__ import annotations

import json
from pathlib import Path

# the batch keys a line is made of (besides the score's)
KEYS = ("prompts", "prompt_mask", "responses", "response_mask", "attention_mask", "data_source", "ground_truth")


def spans(ids: list[int], trained: list[int]) -> list[tuple[str, list[int]]]:
    """Consecutive runs of the response by author: ("model", ids) where trained, else ("tool", ids)."""
    out: list[tuple[str, list[int]]] = []
    for token, mine in zip(ids, trained):
        who = "model" if mine else "tool"
        if out and out[-1][0] == who:
            out[-1][1].append(token)
        else:
            out.append((who, [token]))
    return out


def lines(batch, score_key: str, tokenizer, step: int, limit: int) -> list[dict]:
    """The first `limit` rows of a validation batch, one dict each."""
    prompt_len = batch["prompts"].shape[1]
    out = []
    for i in range(min(limit, batch["prompts"].shape[0])):
        prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()].tolist()
        present = batch["attention_mask"][i, prompt_len:].bool()  # the whole response, tool tokens included
        ids, trained = batch["responses"][i][present].tolist(), batch["response_mask"][i][present].tolist()
        parts = [{"by": who, "text": tokenizer.decode(part)} for who, part in spans(ids, trained)]
        out.append({"step": step, "data_source": batch["data_source"][i], "ground_truth": batch["ground_truth"][i],
                    "score": float(batch[score_key][i].sum()), "prompt": tokenizer.decode(prompt), "response": parts,
                    "model_tokens": int(sum(trained)), "tool_tokens": len(ids) - int(sum(trained))})
    return out


def generation(line: dict) -> dict:
    """A trajectory line as the trackers' table of validation samples has it (trainer.log_val_generations):
    step, data source, prompt, the whole response (tool observations included) and score."""
    return {"step": line["step"], "data_source": line["data_source"], "prompt": line["prompt"],
            "response": "".join(part["text"] for part in line["response"]), "score": line["score"]}


def append(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows)
