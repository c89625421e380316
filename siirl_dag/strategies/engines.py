"""What the runtime calls on an engine outside nodes: the weight flow (`weight_sync`), checkpoints and
the Hugging Face export (`trainer/`). Nodes call the rest (generate, train, ...) on `ctx.engine`.

`MegatronEngine` is a `TrainerEngine`, `VllmRollout` a `RolloutEngine`; the rank calls them by these
names (`weight_sync.rank.SyncRank`, `runtime.worker.RankWorker`), never by a string.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Protocol

import torch

Named = tuple[str, torch.Tensor]  # (Hugging Face name, tensor)


class Engine(Protocol):
    """Every strategy (`strategies.base.Strategy`): colocated engines take turns on the device."""

    def offload(self) -> None: ...

    def onload(self) -> None: ...

    def close(self) -> None: ...

    def probe_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        """Log-probs of the response tokens of a small fixed batch (verified sync's probe)."""


class TrainerEngine(Engine, Protocol):
    """An engine whose weights a sync exports, and that saves and restores its training state."""

    def export_hf_weights(self, copy: bool = True, first_rank_only: bool = False, timings: dict | None = None,
                          what: str = "merged") -> Iterator[Named]:
        """(HF name, full tensor) pairs; collective over the model-parallel group. `what`: "merged",
        "base" or "adapters"."""

    def save_checkpoint(self, directory: str) -> None: ...

    def load_checkpoint(self, directory: str) -> None: ...

    def save_adapters(self, directory: str) -> None:
        """The LoRA adapters as a PEFT folder."""

    def save_hf(self, directory: str) -> None:
        """The model as it computes, as a Hugging Face folder."""


class RolloutEngine(Engine, Protocol):
    """An engine a sync loads weights into, stamped with the trainer's version."""

    weights_version: int

    def load_weights(self, named_tensors: Iterable[Named], version: int) -> None: ...

    def load_adapters(self, named_tensors: Iterable[Named], version: int) -> None: ...
