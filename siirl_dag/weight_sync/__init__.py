"""Trainer -> rollout weights after every update: gathered from the trainer's layout (TP shards, PP
stages, EP experts, virtual chunks) into HF-named tensors, streamed in buckets, loaded into every
rollout engine (each shards them for its own TP), stamped with the trainer's version.

- Colocated meshes (the rollout engine lives in the trainer's rank processes): each rank's engine
  loads straight from the export iterator (`rank.handoff`), no serialization; on CPU later syncs
  replay the first one's recorded copies straight into the rollout's parameters (`direct`).
- Separate meshes: the export is gathered to the trainer's rank 0 only, which cuts it into buckets
  of at most runtime.weight_sync_bucket_mb (`buckets`) and writes them into a pipe that every
  rollout rank reads into one engine load (`rank`); the driver only starts the ranks' parts and
  waits (`sync`). The pipe is a ring of shared-memory buffers in Ray's object store, reused from
  sync to sync (`channel`), or, on GPUs and across machines, a broadcast over a process group of
  the trainer's rank 0 and the rollout ranks (`collective`: NCCL, or gloo on CPU). After a first
  sync through the channel, the trainer's rank 0 writes straight into the rollout's parameters,
  shared with it (`direct`): one copy per tensor instead of two.
- A sync runs between steps, while the other ranks wait: on CPU the trainer's writes and each
  rollout rank's finish (re-packs) borrow their machine's cores (`cores`). CPU linear layers and
  MoE experts compute from packed row blocks that a sync writes in place (`row_blocks`).

The rollout refuses to generate with weights older than the trainer's version minus
runtime.staleness (`NodeContext.check_weights_version`), and after a load that failed part-way at
all, until a sync succeeds. A pipe that failed a sync is retired on every rank (`sync`).
"""

from siirl_dag.weight_sync.rank import RankSync, handoff
from siirl_dag.weight_sync.sync import TRANSPORTS, WeightSync

__all__ = ["RankSync", "TRANSPORTS", "WeightSync", "handoff"]
