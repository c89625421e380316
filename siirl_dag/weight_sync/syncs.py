"""The driver's side of weight sync (`Runtime.weight_syncs`): each `weights_from` consumer brought to its
trainer's latest version along its route (`routes`), through the SyncPath made at its first sync, with
the probe (`probe`, every runtime.verify_probe_every syncs) when it is due."""

from __future__ import annotations

import functools
import time
from typing import Callable

from siirl_dag.errors import PipelineError
from siirl_dag.refs import import_ref
from siirl_dag.weight_sync import probe
from siirl_dag.weight_sync.rank import SyncRank
from siirl_dag.weight_sync.path import Placed
from siirl_dag.weight_sync.routes import TABLE, routes


class WeightSyncs:
    def __init__(self, runtime):
        pipe, self.rt = runtime.pipe, runtime
        self.routes = routes(pipe)  # rollout node -> how its weights travel
        self.paths: dict = {}  # rollout node -> its weight_sync.path.SyncPath, made at its first sync
        self.count = dict.fromkeys(runtime.versions.held, 0)  # syncs done per rollout node (the probe's schedule)
        # the probe's vocabulary, per rollout node (None: no model config on disk, no probe)
        self.probe_vocab = {n: (pipe.models[pipe.nodes[n].model].hf_config() or {}).get("vocab_size")
                            for n in runtime.versions.held}

    def close(self, dst: str) -> None:
        """Let go of `dst`'s path (it failed, or its ranks are replaced): the next sync makes a new one."""
        if dst in self.paths:
            self.paths.pop(dst).close()

    def run(self, step: int = 0, landed: frozenset = frozenset()) -> dict:
        """`start`, waited for."""
        return self.start(step, landed)()

    def start(self, step: int = 0, landed: frozenset = frozenset()) -> Callable[[], dict]:
        """Start bringing every `weights_from` consumer up to its trainer's latest version (after `step`),
        each pair along its route (`weight_sync.routes`), through the SyncPath made at its first sync.
        The consumers count as holding that version from now: calls made to their ranks after this one
        run after the load (`SyncPath.start`). Returns the wait, which raises if a sync failed (the
        consumer is then behind again) and gives the metrics.

        `landed`: trainers whose update has finished on their ranks but is not counted in the
        runtime's `versions` yet (another batch's job, still to be collected): their weights go out
        stamped with the version that update makes.

        Metrics are `sync/<stat>`, or `sync/<consumer>/<stat>` in a pipeline with several consumers;
        `timing_s/sync_weights` is the time of all syncs together, from their start to the wait's end."""
        versions, started, t0 = self.rt.versions, [], time.perf_counter()
        for dst, have in versions.held.items():
            src = versions.source[dst]
            version = versions.trainer[src] + (src in landed)
            if have >= version:
                continue
            began = time.time()
            try:
                wait = self._one(src, dst, version)
            except Exception as exc:  # noqa: BLE001 - a rank's error, or a pipe not made
                raise self._failed(step, src, dst, version, exc) from None
            versions.held[dst] = version
            self.count[dst] += 1
            started.append((src, dst, have, version, began, wait))
        return functools.partial(self._wait, step, t0, started)

    def _wait(self, step: int, t0: float, started: list) -> dict:
        metrics, versions = {}, self.rt.versions
        for src, dst, had, version, began, wait in started:
            try:
                stats = wait()
            except Exception as exc:  # noqa: BLE001 - a rank's error (with its traceback)
                versions.held[dst] = had
                raise self._failed(step, src, dst, version, exc) from None
            metrics["timing_s/sync_weights"] = time.perf_counter() - t0
            prefix = f"sync/{dst}/" if len(versions.held) > 1 else "sync/"
            metrics.update({prefix + k.removeprefix("sync/"): v for k, v in stats.items()})
            if self.rt.trace is not None:
                self.rt.trace.driver(f"sync {src} -> {dst}", began, step=step, version=version,
                                     path=self.routes[dst].path, **{k.removeprefix("sync/"): v for k, v in stats.items()})
        return metrics

    def _failed(self, step: int, src: str, dst: str, version: int, exc: Exception) -> PipelineError:
        self.close(dst)  # a part may have stopped half-way: never used again
        self.rt.recovery.stop_if_machines_lost(step)
        cause = getattr(exc, "cause", None) or exc
        return PipelineError(f"weight sync '{src}' -> '{dst}' (version {version}, path "
                             f"{self.routes[dst].path}) failed: {cause}")

    def _one(self, src: str, dst: str, version: int) -> Callable[[], dict]:
        """One pair's sync through its path, started (`SyncPath.start`); when the probe (`probe`) is due,
        done at once with it: the trainer's side first, while a colocated trainer still holds the device."""
        path = self.paths.get(dst) or self._path(dst)
        every, vocab = self.rt.pipe.runtime.verify_probe_every, self.probe_vocab[dst]
        if not (vocab and self.rt.pipe.runtime.verify_sync and every and self.count[dst] % every == 0):
            return path.start(version)
        t0 = time.perf_counter()
        trainer = self._probe(src, vocab)
        took = time.perf_counter() - t0
        stats = path.sync(version)
        t0 = time.perf_counter()
        stats["sync/probe_diff"] = self._check_probe(src, dst, trainer, vocab)
        stats["sync/probe_s"] = took + time.perf_counter() - t0
        return lambda: stats

    def _probe(self, node: str, vocab: int) -> list:
        """Every rank's log-probs of the fixed probe batch (`probe`), on `node`'s engine."""
        batch = probe.probe_batch(vocab)
        return self.rt.backend.get([self.rt.backend.call(w, SyncRank.probe_logprobs, role.engine_key, batch)
                                 for w, role in self.rt.roles[node]])

    def _check_probe(self, src: str, dst: str, trainer: list, vocab: int) -> float:
        """Every rollout rank's probe against the trainer's (its first rank's: all hold the whole batch)."""
        nodes = self.rt.pipe.nodes
        float32 = not nodes[src].options.get("bf16") and nodes[dst].options.get("dtype") == "float32"
        return max(probe.check(trainer[0], rollout, float32) for rollout in self._probe(dst, vocab))

    def _path(self, dst: str):
        """The SyncPath of `dst`'s route, over the ranks as they run now."""
        src, runtime = self.rt.pipe.nodes[dst].weights_from, self.rt.pipe.runtime
        placed = Placed(src, dst, self.rt.backend, [(w, r.engine_key) for w, r in self.rt.roles[src]],
                        [(w, r.engine_key) for w, r in self.rt.roles[dst]], int(runtime.weight_sync_bucket_mb * 2**20),
                        runtime.verify_sync, self.rt.pipe.cluster.device, self.routes[dst].payload,
                        self.routes[dst].mode == "delta")
        row = next(row for row in TABLE if row.name == self.routes[dst].path)
        self.paths[dst] = import_ref(row.ref)(placed)
        return self.paths[dst]
