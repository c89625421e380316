"""Trainer -> rollout weights after every update: gathered from the trainer's layout (TP shards, PP
stages, EP experts, virtual chunks) into HF-named tensors, streamed in buckets, loaded into every
rollout engine (each shards them for its own TP), stamped with the trainer's version.

- Colocated meshes (the rollout engine lives in the trainer's rank processes): each rank's engine
  loads straight from the export iterator (`rank.handoff`), no serialization.
- Separate meshes: the export is gathered to the trainer's rank 0 only, which cuts it into buckets
  of runtime.weight_sync_bucket_mb (`buckets`) and streams them (a Ray streaming generator); the
  driver forwards them one at a time (`sync`), and every rollout rank feeds them into one streaming
  engine load (`loader`). Buckets go through Ray's object store, or, on GPUs,
  by NCCL broadcast over a group of the trainer's rank 0 and the rollout ranks (`collective`).

The rollout refuses to generate with weights older than the trainer's version minus
runtime.staleness (`NodeContext.check_weights_version`).
"""

from siirl_dag.weight_sync.rank import RankSync, handoff
from siirl_dag.weight_sync.sync import TRANSPORTS, WeightSync

__all__ = ["RankSync", "TRANSPORTS", "WeightSync", "handoff"]
