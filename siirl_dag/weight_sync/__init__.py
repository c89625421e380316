"""Trainer -> rollout weights after every update: the trainer's layout (TP shards, PP stages, EP experts,
virtual chunks) gathered into HF-named tensors, loaded into every rollout engine (each shards them
for its own TP), verified, and stamped with the trainer's version.

Reading path:
- `routes`: the decision table: which path each trainer -> rollout pair takes, and why (also shown
  by `plan` and `validate --json`).
- `syncs`: the driver's side (`WeightSyncs`, which the runtime holds): every consumer brought to its
  trainer's version after each update, through its pair's path.
- `versions`: `WeightVersions`, the one record of the weights' versions: each trainer's, and the one
  each consumer holds.
- `path`: the `SyncPath` interface (`sync(version)`, `close()`), and `Streamed`, the part every path
  between separate meshes shares.
- One module per path: `colocated` (in-process handoff), `in_process` (runtime.backend=local),
  `shared_memory` (Ray's object store on one CPU machine), `process_group` (NCCL, or gloo).
- `rank`: the calls a path makes on a rank (`SyncRank.send_weights` / `walk_export` /
  `receive_weights` / `handoff_weights`, mixed into `runtime.worker.RankWorker`); `stream` their
  logic (export, buckets, pipe, engine load), on the engines' protocols (`strategies.engines`).
- `fingerprints` and `probe`: verified sync (runtime.verify_sync): the tensors sent, then what the
  engines compute with.
- `delta`: weight_sync.mode=delta on the paths that move bytes: a path's pipe wrapped on each
  member, sending each bucket as the compressed XOR against the version the rollout holds.

The rollout refuses to generate with weights older than the trainer's version minus
runtime.staleness (`NodeContext.check_weights_version`), and after a load that failed part-way or
did not verify, until a sync succeeds.
"""
