"""What a node kind's function receives besides its input batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from siirl_dag.runtime.batch import Batch


@dataclass
class NodeContext:
    node: Any  # NodeSpec
    batch: Batch  # this rank's input rows
    engine: Any = None  # the Strategy instance of a model node, None for compute nodes
    data: Any = None  # DataSpec: max lengths, batch sizes
    tokenizer_model: Any = None  # the ModelSpec whose tokenizer decodes this node's tokens
    step: int = 0
    validating: bool = False
    rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    samples_per_prompt: int = 1  # rows per prompt this node sees (product of upstream n)
    min_weights_version: int = 0  # the oldest weights this node may use (runtime.staleness)
    # a partial rollout (runtime.partial_rollout): the tokens this call may add to each sample (None:
    # to the end), and whether its input is its own earlier output, to continue
    segment_tokens: int | None = None
    resuming: bool = False
    metrics: dict = field(default_factory=dict)

    @property
    def params(self) -> dict:
        return self.node.params

    @property
    def options(self) -> dict:
        return self.node.options

    @cached_property
    def tokenizer(self):
        """Read once per process (ModelSpec.load_tokenizer), and checked once per node run here, not
        per row of a node that decodes row by row."""
        return self.tokenizer_model.load_tokenizer()

    @cached_property
    def generator(self) -> torch.Generator:
        """An RNG owned by this node, rank and step (vLLM resets the global one)."""
        return torch.Generator().manual_seed(self.seed)

    def check_weights_version(self) -> None:
        """Refuse to run on weights older than allowed (no silent stale rollouts)."""
        have = getattr(self.engine, "weights_version", None)
        if have is not None and have < self.min_weights_version:
            raise RuntimeError(f"node '{self.node.id}' would generate with weights version {have}, older than "
                               f"version {self.min_weights_version} (the trainer's minus runtime.staleness); "
                               "the weight sync did not reach this engine")

    def expand(self, index, outputs: dict) -> dict:
        """Repeat input rows by `index` (e.g. n samples per prompt) and add `outputs`: a new row space."""
        return dict(self.batch.select(index).merge(outputs))
