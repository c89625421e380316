"""trainer.log_trajectories: validation rows as JSON lines, the response split by who wrote it."""

from __future__ import annotations

import json

import torch

from siirl_dag.trainer import trajectories


class Letters:
    """A tokenizer of one letter per id (a=0, b=1, ...)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_the_response_is_split_into_model_and_tool_spans_and_padding_is_left_out(tmp_path):
    batch = {"prompts": torch.tensor([[25, 0, 1], [25, 25, 2]]), "prompt_mask": torch.tensor([[0, 1, 1], [0, 0, 1]]),
             "responses": torch.tensor([[2, 3, 4, 5, 6, 25], [7, 8, 25, 25, 25, 25]]),
             "response_mask": torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0]]),
             "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0, 0, 0]]),
             "token_level_scores": torch.tensor([[0, 0, 0, 0, 1.0, 0], [0, 0.5, 0, 0, 0, 0]]),
             "data_source": ["demo", "demo"], "ground_truth": ["42", "7"]}
    rows = trajectories.lines(batch, "token_level_scores", Letters(), step=3, limit=5)
    assert rows[0] == {"step": 3, "data_source": "demo", "ground_truth": "42", "score": 1.0, "prompt": "ab",
                       "response": [{"by": "model", "text": "cd"}, {"by": "tool", "text": "ef"}, {"by": "model", "text": "g"}],
                       "model_tokens": 3, "tool_tokens": 2}
    assert rows[1]["prompt"] == "c" and rows[1]["response"] == [{"by": "model", "text": "hi"}] and rows[1]["score"] == 0.5
    assert len(trajectories.lines(batch, "token_level_scores", Letters(), step=3, limit=1)) == 1
    trajectories.append(tmp_path / "run" / "trajectories.jsonl", rows)
    trajectories.append(tmp_path / "run" / "trajectories.jsonl", rows[:1])
    assert [json.loads(x)["ground_truth"] for x in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()] == ["42", "7", "42"]
