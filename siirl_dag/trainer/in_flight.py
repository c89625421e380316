"""The batches generated ahead and not trained yet (runtime.schedule one_step_off, async), kept in a
checkpoint so that a resumed run trains on exactly them: per batch, every output's tensors in
in_flight/<batch>.safetensors and the rest (row ranges, token counts, metadata, the rollout's
metrics) in in_flight/<batch>.json. The trainer state lists the batches; a resume reads them whole
before any process starts (`read`), and the run turns them back into step results (`generated`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import safetensors.numpy
from safetensors import SafetensorError

FOLDER = "in_flight"


def save(folder: Path, queue: list, fetch: Callable[[Any], dict]) -> list[int]:
    """Write `queue` (schedules.generation.Generated, in order) under `folder`; `fetch` brings a shard's wire dict
    to the driver. Returns the batches written, for the trainer state."""
    (folder / FOLDER).mkdir()
    for g in queue:
        arrays, outputs = {}, {}
        for node, out in g.result.outputs.items():
            shards = []
            for i, shard in enumerate(out.shards):
                wire = fetch(shard.ref)
                arrays.update({f"{node}/{i}/{k}": np.ascontiguousarray(a) for k, (a, _) in wire["tensors"].items()})
                shards.append({"start": shard.start, "stop": shard.stop, "meta": wire["meta"],
                               "dtypes": {k: dtype for k, (_, dtype) in wire["tensors"].items()}})
            outputs[node] = {"keys": sorted(out.keys), "rows": out.rows, "tokens": out.tokens.tolist(), "shards": shards}
        safetensors.numpy.save_file(arrays, str(folder / FOLDER / f"{g.batch}.safetensors"))
        record = {"batch": g.batch, "segments": g.segments, "metrics": g.result.metrics, "outputs": outputs}
        (folder / FOLDER / f"{g.batch}.json").write_text(json.dumps(record))
    return [g.batch for g in queue]


_COUNT = {"type": "integer", "minimum": 0}
_RECORD = {  # what `save` writes in <batch>.json, checked before the tensors are read
    "type": "object", "required": ["batch", "metrics", "outputs"],
    "properties": {
        "batch": _COUNT, "segments": _COUNT, "metrics": {"type": "object"},
        "outputs": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["keys", "rows", "tokens", "shards"],
            "properties": {
                "keys": {"type": "array", "items": {"type": "string"}}, "rows": _COUNT,
                "tokens": {"type": "array", "items": _COUNT},
                "shards": {"type": "array", "items": {
                    "type": "object", "required": ["start", "stop", "meta", "dtypes"],
                    "properties": {"start": _COUNT, "stop": _COUNT, "meta": {"type": "object"},
                                   "dtypes": {"type": "object", "additionalProperties": {"type": "string"}}}}}}}}},
}


def read(folder: Path, batches: list) -> list[tuple[dict, dict]]:
    """Each listed batch's (record, arrays), whole and consistent; raises ValueError naming the file
    and what is wrong."""
    import jsonschema

    out = []
    for b in batches:
        path = folder / FOLDER / f"{b}.json"
        try:
            record = json.loads(path.read_text())
            jsonschema.validate(record, _RECORD)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from None
        except jsonschema.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "the top"
            raise ValueError(f"{path} is not a batch record: at {where}, {exc.message}") from None
        if record["batch"] != b:
            raise ValueError(f"{path} holds batch {record['batch']}, not {b}")
        path = path.with_suffix(".safetensors")
        try:
            arrays = safetensors.numpy.load_file(str(path))
        except (OSError, SafetensorError) as exc:
            raise ValueError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from None
        missing = [name for node, o in record["outputs"].items() for i, shard in enumerate(o["shards"])
                   for k in shard["dtypes"] if (name := f"{node}/{i}/{k}") not in arrays]
        if missing:
            raise ValueError(f"{path} lacks {len(missing)} tensor(s) of batch {b}, {missing[0]} first")
        out.append((record, arrays))
    return out


def generated(records: list[tuple[dict, dict]]) -> list:
    """`read`'s batches as the queue of schedules.generation.Generated they were saved from."""
    from siirl_dag.runtime.batch import Batch, version_counts
    from siirl_dag.runtime.reshard import Shard
    from siirl_dag.runtime.step import NodeOutput, StepResult
    from siirl_dag.trainer.schedules.generation import Generated

    queue = []
    for record, arrays in records:
        outputs = {}
        for node, o in record["outputs"].items():
            shards = [Shard({"tensors": {k: (arrays[f"{node}/{i}/{k}"], dtype) for k, dtype in s["dtypes"].items()},
                             "meta": s["meta"]}, s["start"], s["stop"]) for i, s in enumerate(o["shards"])]
            versions = version_counts(Batch.concat([Batch.from_wire(s.ref, ["weights_version", "token_weights_version"])
                                                    for s in shards]))
            outputs[node] = NodeOutput(shards, set(o["keys"]), o["rows"], np.asarray(o["tokens"], dtype=np.int64), versions)
        queue.append(Generated(record["batch"], StepResult(metrics=record["metrics"], outputs=outputs),
                               record.get("segments", 1)))
    return queue
