"""Trainer -> rollout weights after every update: gathered from the trainer's layout into HF-named
tensors, streamed in buckets, loaded into every rollout engine, stamped with a version.

- Colocated (trainer and rollout in the same processes): in-process handoff, no serialization;
  each rank's rollout engine loads straight from the export iterator.
- Separate meshes: trainer rank 0 packs numpy buckets into the object store (Ray) and every
  rollout rank streams them into its engine. The same `sync` call covers both.
The engine-side halves run inside rank workers (`export_buckets`, `import_buckets`, `handoff`).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Iterator

import torch

from siirl_dag.runtime.batch import tensor_from_wire, tensor_to_wire


def export_buckets(engine, rank: int, bucket_bytes: int, put=lambda x: x) -> tuple[list, dict]:
    """Every trainer rank walks the export (it is collective); rank 0 keeps (name, tensor) buckets."""
    t0 = time.perf_counter()
    buckets, current, size, nbytes = [], {}, 0, 0
    for name, tensor in engine.export_hf_weights():
        if rank != 0:
            continue
        current[name] = tensor_to_wire(tensor)
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            buckets.append(put(current))
            nbytes, current, size = nbytes + size, {}, 0
    if current:
        buckets.append(put(current))
        nbytes += size
    return buckets, {"sync/gather_s": time.perf_counter() - t0, "sync/bytes": nbytes, "sync/buckets": len(buckets)}


def _tensors(buckets: Iterable, fetch) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets:
        for name, wire in fetch(bucket).items():
            yield name, tensor_from_wire(*wire)


def import_buckets(engine, buckets: list, version: int, fetch=lambda x: x) -> dict:
    t0 = time.perf_counter()
    engine.load_weights(_tensors(buckets, fetch), version)
    return {"sync/load_s": time.perf_counter() - t0}


def handoff(src_engine, dst_engine, version: int) -> dict:
    """Colocated: the rollout engine reads the trainer's export directly (same process, no copies)."""
    t0 = time.perf_counter()
    dst_engine.load_weights(src_engine.export_hf_weights(), version)
    return {"sync/handoff_s": time.perf_counter() - t0}


def sync(runtime: Any, src_node: str, dst_node: str, version: int) -> dict:
    """Push `src_node`'s trainer weights into `dst_node`'s engines; returns timing metrics."""
    t0 = time.perf_counter()
    backend = runtime.backend
    src, dst = runtime.roles[src_node], runtime.roles[dst_node]
    src_key, dst_key = src[0][1].engine_key, dst[0][1].engine_key
    src_workers = {id(w) for w, _ in src}
    if all(id(w) in src_workers for w, _ in dst) and len(dst) == len(src):
        stats = backend.get([backend.call(w, "sync_handoff", src_key, dst_key, version) for w, _ in dst])
        metrics = dict(stats[0])
    else:
        bucket_bytes = int(runtime.pipe.runtime.weight_sync_bucket_mb * 2**20)
        exported = backend.get([backend.call(w, "export_weights", src_key, bucket_bytes) for w, _ in src])
        buckets, metrics = next((b, m) for b, m in exported if b or m.get("sync/bytes"))
        loads = backend.get([backend.call(w, "import_weights", dst_key, buckets, version) for w, _ in dst])
        metrics.update(loads[0])
    metrics["timing_s/sync_weights"] = time.perf_counter() - t0
    return metrics
