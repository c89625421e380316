"""What every strategy (a per-rank engine bound to one node's model and mesh) provides.

A strategy instance lives inside one rank process of a worker group. The runtime has already
initialised torch.distributed for the mesh (gloo on CPU, NCCL on CUDA) before constructing it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from siirl_dag.errors import ConfigError

from siirl_dag.placement.parallel_dims import ParallelDims


@dataclass(frozen=True)
class RankContext:
    """Where a strategy instance runs: its rank in the mesh, the mesh's sizes, the device it owns."""

    rank: int
    dims: ParallelDims = ParallelDims()
    device: str = "cpu"  # "cpu" or "cuda"
    local_device_index: int = 0
    seed: int = 0

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def cuda_index(self) -> int:
        """This rank's GPU among those its process sees: under Ray a rank sees its own GPU only (index 0);
        in one process (runtime.backend=local) it sees them all."""
        import torch

        return self.local_device_index % torch.cuda.device_count()


@dataclass(frozen=True)
class MiniBatchTotals:
    """What one optimizer step's mini batch holds over all its micro batches and data-parallel ranks.
    A training loss divides by these, not by its micro batch's own counts, so its value and gradient
    do not depend on how the batch is split (the engine undoes megatron's per-micro-batch mean)."""

    tokens: float  # response tokens
    sequences: float  # rows with at least one response token


class Strategy:
    """Base class. Subclasses: the vLLM rollout engine, the Megatron engine."""

    name: str = ""

    def __init__(self, ctx: RankContext, model: Any, options: dict[str, Any]):
        self.ctx = ctx
        self.model_spec = model
        self.options = options

    @property
    def model_path(self) -> str:
        """The model's HF folder: given as a path, or as a spec (ModelSpec, dict) with a `path`."""
        model = self.model_spec
        path = model if isinstance(model, (str, os.PathLike)) else self.model_field("path")
        if not path:
            raise ConfigError(f"the {self.name} strategy needs a model with `path` (an HF model folder)", ("model",))
        return str(path)

    def model_field(self, key: str) -> Any:
        """A field of the model spec (ModelSpec, or a dict in tests and scripts), None if it has none."""
        model = self.model_spec
        return model.get(key) if isinstance(model, dict) else getattr(model, key, None)

    def offload(self) -> None:
        """Free the device for a colocated role (hybrid engine). Default: nothing to free."""

    def onload(self) -> None:
        """Take the device back after `offload`."""

    def close(self) -> None:
        """Release processes and memory held by the engine."""
