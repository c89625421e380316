"""The output layer at the response positions only.

megatron-core's GPTModel applies its output layer (the LM head, or a critic's value head) to every
position, but log-probs and values are read at the positions that predict response tokens: a prompt's
positions are computed, softmaxed and (in training) back-propagated for nothing. As HF's
`logits_to_keep` and vLLM do, `ResponseHead` narrows the output layer's input to those positions
(a forward pre-hook on each model chunk's output layer; the micro batch's `_logit_index`, set by the
engine around each forward): the model then returns [b, R, ...], row i's column j at position
`_logit_index[i, j]`. On the demo's batch the LM head did 21 positions per row for 8 responses; with a
GPU's 152k-word vocabulary it also spares the [s, b, V] logits of the prompt.

Only where each rank holds whole sequences at the output layer: not under context parallelism or
sequence parallelism (the positions are split across ranks there), nor with multi-token prediction
(its heads read every position).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class ResponseHead:
    def __init__(self, chunks: list[torch.nn.Module], config, cp: int):
        self.enabled = cp == 1 and not config.sequence_parallel and not getattr(config, "mtp_num_layers", None)
        self._index: torch.Tensor | None = None
        for chunk in chunks if self.enabled else ():
            if chunk.post_process:
                chunk.output_layer.register_forward_pre_hook(self._narrow, with_kwargs=True)

    @contextlib.contextmanager
    def at(self, logit_index: torch.Tensor) -> Iterator[bool]:
        """Within it, a forward's output layer sees row i's positions `logit_index[i]` [b, R] only;
        yields whether it does (else the model's output keeps every position)."""
        self._index = logit_index if self.enabled else None
        try:
            yield self.enabled
        finally:
            self._index = None

    def _narrow(self, module, args, kwargs):
        if self._index is None:
            return None
        hidden = args[0]  # [s, b, h]
        index = self._index.t().unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # [R, b, h]
        return (hidden.gather(0, index), *args[1:]), kwargs
