"""Methods mixed into vLLM's worker (`worker_extension_cls`), reached through `collective_rpc`.

The engine runs in this process, so the weights iterator arrives by reference: tensors are consumed
one by one as the worker loads them, never copied or pickled.
"""

from __future__ import annotations

from typing import Iterable

import torch

from siirl_dag.strategies.vllm import cpu_compat


class WeightSyncExtension:
    """Loaded by vLLM as a mixin of its worker class; `self` is the worker."""

    def siirl_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors in place (the model's own loader fuses qkv / gate_up and shards)."""
        if cpu_compat.active():
            cpu_compat.load_weights(self, weights)
        else:
            self.model_runner.get_model().load_weights(weights)
