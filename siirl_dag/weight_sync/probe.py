"""Verified sync's second half (runtime.verify_sync, every runtime.verify_probe_every syncs of a pair):
what the engines compute with after a sync (`syncs.WeightSyncs`). The trainer and every rollout rank compute the log-probs
of a fixed batch of tokens (`probe_batch`), which must agree (`check`): whatever path the weights
took, a colocated handoff included, which has nothing in transit to sample. It sees what a check of
the tensors cannot: a kernel that reads another copy of the weights, experts left in a stale layout.
"""

from __future__ import annotations

import torch

from siirl_dag.strategies.samples import Sample, pack_batch
from siirl_dag.weight_sync.fingerprints import SyncMismatch

TOKENS = (2, 16)  # rows x tokens; the log-probs of every token after the first
TOLERANCE = {"float32": 1e-3, "other": 0.1}  # mean |difference|; in fp32 the two sides agree within 1e-5 here


def probe_batch(vocab_size: int) -> dict:
    """Fixed token rows from the whole vocabulary, in the batch layout (the first token as the prompt)."""
    rows, n = TOKENS
    ids = [[(7919 * i + 104729 * j + 13) % vocab_size for j in range(n)] for i in range(rows)]
    return pack_batch([r[:1] for r in ids], [Sample(i, r[1:], [0.0] * (n - 1), "length") for i, r in enumerate(ids)],
                      1, n - 1, 0)


def check(trainer: torch.Tensor, rollout: torch.Tensor, float32: bool) -> float:
    """The mean |difference| of the two sides' probe log-probs; SyncMismatch beyond the tolerance."""
    diff = (trainer.float() - rollout.float()).abs()
    limit = TOLERANCE["float32" if float32 else "other"]
    if not diff.mean() <= limit:
        raise SyncMismatch(f"the rollout's log-probs of a fixed probe differ from the trainer's by {diff.mean():.4g} on "
                           f"average (at most {diff.max():.4g}; tolerance {limit}): its engine computes with other "
                           "weights than the trainer's")
    return float(diff.mean())
