"""Methods mixed into vLLM's worker (`worker_extension_cls`), reached through `collective_rpc`.

The engine runs in this process, so arguments and results pass by reference: the weights iterator's
tensors are consumed one by one as the worker loads them, never copied or pickled.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch

from siirl_dag.strategies.vllm import cpu_compat


class WeightSyncExtension:
    """Loaded by vLLM as a mixin of its worker class; `self` is the worker."""

    def siirl_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], watch: Any = None,
                           cores: int | None = None) -> None:
        """Load HF-named tensors in place (the model's own loader fuses qkv / gate_up and shards),
        under `watch` (a context, e.g. the weight sync's recorder of the loader's copies) if given."""
        with watch or contextlib.nullcontext():
            self.model_runner.get_model().load_weights(weights)
        self.siirl_finish_load(cores)

    def siirl_finish_load(self, cores: int | None = None, blocks_written: bool = False) -> None:
        """What follows new weights in place, however they got there (with `cores` threads;
        `blocks_written`: a weight sync wrote the packed row blocks, see `cpu_compat.finish_load`)."""
        if cpu_compat.active():
            cpu_compat.finish_load(self, cores, blocks_written)

    def siirl_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model_runner.get_model().parameters())

    def siirl_blocked_weights(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter, int, bool]]:
        return cpu_compat.blocked_weights(self.model_runner.get_model()) if cpu_compat.active() else []
