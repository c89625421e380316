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
    tokenizer_path: str | None = None
    step: int = 0
    validating: bool = False
    rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    metrics: dict = field(default_factory=dict)

    @property
    def params(self) -> dict:
        return self.node.params

    @property
    def options(self) -> dict:
        return self.node.options

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_path)

    @cached_property
    def generator(self) -> torch.Generator:
        """An RNG owned by this node, rank and step (vLLM resets the global one)."""
        return torch.Generator().manual_seed(self.seed)

    def expand(self, index, outputs: dict) -> dict:
        """Repeat input rows by `index` (e.g. n samples per prompt) and add `outputs`: a new row space."""
        return dict(self.batch.select(index).merge(outputs))
