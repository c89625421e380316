"""Prompt data: parquet files checked once at load, and a resumable, seeded batch loader.

A row holds a prompt (a string, or a chat list of {role, content}), its `data_source` (which picks
the reward function) and a ground truth (`reward_model.ground_truth`, verl's layout, or a plain
`ground_truth` column); `extra_info` is optional. Bad data is reported before any worker starts,
with file, row and column, all problems in one ConfigError.
"""

from __future__ import annotations

import bisect
import os
from typing import Iterator, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from siirl_dag.config.schema import is_count
from siirl_dag.errors import ConfigError, PathPart, Problem

MAX_PROBLEMS = 20  # enough to see the pattern; the rest are counted
PROMPT_EXPECTED = "a non-empty string or a chat list of {role, content} messages"


def _prompt_type_ok(t: pa.DataType) -> bool:
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return True
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return False
    names = {t.value_type.field(i).name for i in range(t.value_type.num_fields)}
    return {"role", "content"} <= names


def _unreadable(path: str, where: tuple, exc: Exception) -> Problem:
    return Problem(where, f"data file '{path}' is not readable parquet ({exc}); expected an intact parquet file")


def _prompt_problem(prompt) -> str | None:
    if prompt is None:
        return "is null"
    if isinstance(prompt, str):
        return None if prompt.strip() else "is an empty string"
    if not prompt:
        return "is an empty chat list"
    for j, msg in enumerate(prompt):
        if not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            return f"message {j} lacks a string 'role' or 'content'"
    return None


class PromptDataset:
    """All rows of `files`, validated; row i is a dict with raw_prompt, data_source, ground_truth,
    extra_info and index (its position over all files, a stable prompt id)."""

    def __init__(self, files: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]], prompt_key: str = "prompt",
                 *, config_path: tuple[PathPart, ...] = ()):
        files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        if not files:
            raise ConfigError("no data files given; expected one or more parquet files", config_path)
        self.prompt_key = prompt_key
        self.rows: list[dict] = []
        self._starts: list[int] = []  # the index of each file's first row
        self.files: list[str] = []  # the files read, in order
        problems: list[Problem] = []
        for k, f in enumerate(files):
            where = config_path + ((k,) if len(files) > 1 else ())
            problems += self._load(os.fspath(f), where)
        if problems:
            shown = problems[:MAX_PROBLEMS]
            if len(problems) > MAX_PROBLEMS:
                shown.append(Problem(config_path, f"... and {len(problems) - MAX_PROBLEMS} more problems in the data"))
            raise ConfigError(shown)

    def _load(self, path: str, where: tuple) -> list[Problem]:
        if os.path.isdir(path):
            return [Problem(where, f"data file '{path}' is a directory; expected a parquet file (list the files "
                                   "inside it one by one)")]
        if not os.path.isfile(path):
            return [Problem(where, f"data file '{path}' does not exist; expected a parquet file")]
        try:
            schema = pq.read_schema(path)
        except (pa.ArrowException, OSError) as e:
            return [_unreadable(path, where, e)]

        def column_problem(column: str, message: str) -> Problem:
            return Problem((column,), message, file=path)

        problems = []
        if self.prompt_key not in schema.names:
            problems.append(column_problem(self.prompt_key, f"column is missing (columns: {', '.join(schema.names)}); "
                                           f"expected {PROMPT_EXPECTED} (the prompt column name is data.prompt_key)"))
        elif not _prompt_type_ok(schema.field(self.prompt_key).type):
            problems.append(column_problem(self.prompt_key, f"has type {schema.field(self.prompt_key).type}; expected {PROMPT_EXPECTED}"))
        if "data_source" not in schema.names:
            problems.append(column_problem("data_source", "column is missing; expected a string naming the data set (picks the scorer)"))
        rm = schema.field("reward_model").type if "reward_model" in schema.names else None
        if rm is not None and pa.types.is_struct(rm) and rm.get_field_index("ground_truth") >= 0:
            truth_column = "reward_model.ground_truth"
        elif "ground_truth" in schema.names:
            truth_column = "ground_truth"
        else:
            truth_column = None
            problems.append(column_problem("ground_truth", "column is missing; expected reward_model.ground_truth or ground_truth"))
        if problems:
            return problems

        columns = [self.prompt_key, "data_source", truth_column.split(".")[0]]
        columns += ["extra_info"] if "extra_info" in schema.names else []
        try:  # a sound footer says nothing of the pages: damaged ones only show here
            records = pq.read_table(path, columns=columns).to_pylist()
        except (pa.ArrowException, OSError) as e:
            return [_unreadable(path, where, e)]
        start = len(self.rows)
        self._starts.append(start)
        self.files.append(path)
        for i, rec in enumerate(records):
            truth = rec["ground_truth"] if truth_column == "ground_truth" else (rec["reward_model"] or {}).get("ground_truth")
            checks = (
                (self.prompt_key, _prompt_problem(rec[self.prompt_key]), PROMPT_EXPECTED),
                ("data_source", None if isinstance(rec["data_source"], str) and rec["data_source"] else "is null or empty",
                 "the name of the data set"),
                (truth_column, None if truth not in (None, "") else "is null or empty", "the reference answer"),
                ("extra_info", None if isinstance(rec.get("extra_info"), (dict, type(None))) else "is not a mapping",
                 "a mapping or null"),
            )
            bad = [Problem(("rows", i, col), f"{what}; expected {expected}", file=path) for col, what, expected in checks if what]
            problems += bad
            if not bad:
                self.rows.append({"raw_prompt": rec[self.prompt_key], "data_source": rec["data_source"],
                                  "ground_truth": truth, "extra_info": rec.get("extra_info") or {},
                                  "index": start + i})
        return problems

    def __len__(self) -> int:
        return len(self.rows)

    def drop(self, indices: set[int]) -> None:
        """Leave out the rows of these indices (their ids stay those of the files' rows)."""
        self.rows = [row for row in self.rows if row["index"] not in indices]

    def source(self, index: int) -> tuple[str, int]:
        """The file a row came from and its row number there (for messages about it)."""
        k = bisect.bisect_right(self._starts, index) - 1
        return self.files[k], index - self._starts[k]

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


class PromptLoader:
    """Batches of row dicts, reshuffled each epoch with a numpy Generator seeded by (seed, epoch).

    The order of an epoch is a pure function of (seed, epoch), so `state_dict()` only needs
    (epoch, position); `load_state_dict()` continues with exactly the next unseen rows. The global
    RNG is never used (vLLM reseeds it). `__iter__` yields the rest of the current epoch;
    `next_batch()` rolls over epochs, for drivers that count steps.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise ConfigError(f"the data has {len(dataset)} rows, fewer than one batch of {batch_size}; "
                              "expected at least batch_size rows (or drop_last=False)")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch = 0
        self.position = 0  # rows of this epoch's order already handed out
        self._order: tuple[int, np.ndarray] | None = None

    def _epoch_rows(self) -> int:
        n = len(self.dataset)
        return n - n % self.batch_size if self.drop_last else n

    def __len__(self) -> int:
        """Batches per epoch."""
        return -(-self._epoch_rows() // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            n = len(self.dataset)
            perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order = (epoch, perm)
        return self._order[1]

    def next_batch(self) -> list[dict]:
        if len(self.dataset) == 0:
            raise ValueError("the dataset is empty")
        stop = min(self.position + self.batch_size, self._epoch_rows())
        batch = [self.dataset[int(i)] for i in self.order(self.epoch)[self.position:stop]]
        self.position = stop
        if self.position >= self._epoch_rows():
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def __iter__(self) -> Iterator[list[dict]]:
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": len(self.dataset),
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Resume; refuses a malformed state, or one from other data, another seed or shuffle, which
        would skip or replay rows. Each problem's path names the state field at fault."""
        problems = self._state_problems(state)
        if problems:
            raise ConfigError(problems)
        self.epoch, self.position = state["epoch"], state["position"]

    def _state_problems(self, state) -> list[Problem]:
        """What keeps `state` from resuming this loader (empty when it can)."""
        mine = self.state_dict()
        missing = list(mine) if not isinstance(state, dict) else [k for k in mine if k not in state]
        if missing:
            return [Problem((), f"the loader state lacks {', '.join(missing)}; expected a mapping with {', '.join(mine)}")]
        bad = [k for k in ("epoch", "position") if not is_count(state[k])]
        changed = [k for k in ("seed", "num_rows", "shuffle") if state[k] != mine[k]]
        if bad or changed:
            return ([Problem((k,), f"{k} {state[k]!r:.40} is not a count; expected a non-negative 64-bit integer") for k in bad] +
                    [Problem((k,), f"{k} {state[k]!r:.40} then, {mine[k]!r} now; expected the same {k} as the checkpoint "
                                   "(resuming would skip or replay rows)") for k in changed])
        if state["position"] >= max(self._epoch_rows(), 1):
            return [Problem(("position",), f"position {state['position']} is outside an epoch of {self._epoch_rows()} "
                                           "rows; expected the same batch layout as the checkpoint")]
        return []
