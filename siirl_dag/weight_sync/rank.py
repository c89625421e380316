"""The rank-side half of a sync between separate meshes, one `RankSync` per rank process.

The driver calls these steps through `RankWorker.weight_sync(op, ...)`, all at once for a sync:
- the keeper (the trainer's rank 0) `send`s its export into a pipe, bucket by bucket, then the
  end; the other trainer ranks `export`, taking part in the same collective export to its end;
- every rollout rank `receive`s from the pipe into one engine load, in its own main thread, and
  the engine stamps the version once every bucket is in.
The pipe is made once per trainer -> rollout pair: a Ray shared-memory channel (`open_channel` on
the keeper, `attach` on the rollout ranks) or a process group (`join`); with
runtime.backend=local the rollout reads the keeper's export directly (`inline`).
Over a channel, the rollout ranks may `share` their parameters and record their first load
(`receive(..., record=True)`); the keeper then `target`s them, and in later syncs the keeper
`write`s straight into the rollout's parameters while the rollout ranks `take` it (see `direct`).
A pipe's capacity (two channel buffers, or a broadcast's rendezvous) paces the trainer to the
rollout, so at most a few buckets exist at a time, whatever the model size.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager, suppress
from typing import Any, Iterator

import torch

from siirl_dag.weight_sync.buckets import Aborted, Buckets, Named, exported, nbytes, timed
from siirl_dag.weight_sync.channel import ChannelPipe
from siirl_dag.weight_sync.collective import SyncGroup
from siirl_dag.weight_sync.cores import borrowed
from siirl_dag.weight_sync.direct import Recorder, Segment, Targets

log = logging.getLogger(__name__)


class InlinePipe:
    """runtime.backend=local (one process): the reader pulls buckets straight from the export."""

    def __init__(self, buckets: Buckets):
        self.buckets = buckets

    def read(self) -> list | None:
        return self.buckets.next()


class RankSync:
    def __init__(self, engines: dict):
        self.engines = engines
        self.pipes: dict[str, Any] = {}  # name -> ChannelPipe | SyncGroup, kept from sync to sync
        self.segments: dict[str, Segment] = {}  # rollout engine key -> where its parameters moved
        self.targets: dict[str, Targets] = {}  # pipe name -> the rollout parameters the keeper writes
        self.replays: dict[str, Targets | None] = {}  # colocated rollout engine -> its recorded load (None: none)

    # -- set-up, once per trainer -> rollout pair ------------------------------------------------
    def join(self, name: str, address: str, port: int, rank: int, world_size: int, device: str) -> None:
        if name not in self.pipes:
            self.pipes[name] = SyncGroup(address, port, rank, world_size, device)

    def open_channel(self, name: str, readers: list) -> ChannelPipe:
        """The keeper makes the channel; the driver hands it to the readers (`attach`)."""
        self.pipes[name] = ChannelPipe.create(readers)
        return self.pipes[name]

    def attach(self, name: str, pipe: ChannelPipe) -> None:
        self.pipes[name] = pipe

    def forget(self, name: str) -> None:
        """The pipe failed a sync: free this end (a channel's buffers, a group's sockets and thread)."""
        self.targets.pop(name, None)
        pipe = self.pipes.pop(name, None)
        if pipe is not None:
            with suppress(Exception):  # a channel the driver closed already
                pipe.close()

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    # -- trainer ranks --------------------------------------------------------------------------
    def export(self, engine_key: str, bucket_bytes: int) -> dict:
        """Take part in the export's collectives, keeping nothing (every trainer rank but the keeper)."""
        return self._buckets(engine_key, bucket_bytes).drain()

    def send(self, engine_key: str, bucket_bytes: int, pipe: str) -> dict:
        """The keeper: every bucket into the pipe, then the end. `sync/send_s` is the time spent
        writing (the copy into shared memory, or the broadcast), including any wait for a slower reader."""
        pipe, buckets = self.pipes[pipe], self._buckets(engine_key, bucket_bytes)
        stats = {"sync/send_s": 0.0}
        try:
            with _ended(pipe):
                while (bucket := buckets.next()) is not None:
                    t0 = time.perf_counter()
                    pipe.write(bucket)
                    stats["sync/send_s"] += time.perf_counter() - t0
        except Exception:
            with suppress(Exception):  # the other trainer ranks finish their collective walk
                buckets.drain()
            raise
        return {**stats, **buckets.stats}

    def target(self, pipe: str, plans: list) -> None:
        """Map every rollout rank's recorded plan: later syncs over `pipe` may `write`."""
        self.targets[pipe] = Targets(plans)

    def write(self, engine_key: str, pipe: str, cores: int | None = None) -> dict:
        """The keeper: the export straight into the rollout ranks' parameters, with `cores` threads
        if given, then the end marker into the pipe (an abort marker if it failed), for the rollout
        ranks waiting in `take`. `sync/write_s` is the time spent copying."""
        stats: dict = {}
        with _ended(self.pipes[pipe]):
            _replayed(self.targets[pipe], exported(self.engines[engine_key], stats), stats, cores)
        return stats

    def inline(self, engine_key: str, bucket_bytes: int) -> InlinePipe:
        return InlinePipe(self._buckets(engine_key, bucket_bytes))

    def _buckets(self, engine_key: str, bucket_bytes: int) -> Buckets:
        stats: dict = {}
        return Buckets(exported(self.engines[engine_key], stats), bucket_bytes, stats)

    # -- colocated: both engines in this process --------------------------------------------------
    def handoff(self, src_key: str, dst_key: str, version: int, cores: int | None = None) -> dict:
        """Colocated meshes (`handoff`). Where the rollout's parameters can be shared (CPU), its
        first load is recorded and later ones replay it (`direct`): one copy per tensor, straight
        into the packed row blocks, no loader and nothing to re-pack."""
        src, dst = self.engines[src_key], self.engines[dst_key]
        targets = self.replays.get(dst_key)
        if targets is not None:
            return self._replay(src, dst_key, targets, version, cores)
        recorder = None
        if dst_key not in self.replays:  # the first sync, or the first since a replay failed
            segment = self._segment(dst_key, shared=False, quiet=True)
            if segment is None:
                self.replays[dst_key] = None  # e.g. parameters on a GPU: the loader, always
            else:
                recorder = Recorder(segment)
        try:
            stats = handoff(src, dst, version, cores, recorder)
        except Exception:
            if recorder:
                self.segments.pop(dst_key).unlink()
            raise
        if recorder:
            plan = self._plan(dst_key, recorder)["plan"]
            self.replays[dst_key] = Targets([plan], self.segments[dst_key]) if plan else None
            if plan is None:
                log.warning("colocated weight sync into %s keeps the engine's loader: %s", dst_key, recorder.problem)
        return stats

    def _replay(self, src: Any, dst_key: str, targets: Targets, version: int, cores: int | None) -> dict:
        t0, stats = time.perf_counter(), {}
        self.engines[dst_key].expect_weights()
        try:
            _replayed(targets, exported(src, stats, first_rank_only=False), stats, cores)
        except Exception:
            self.replays.pop(dst_key)  # the next sync loads (and records) anew; the engine refuses until then
            raise
        stats.update(self.written(dst_key, version, cores))
        stats["sync/handoff_s"] = time.perf_counter() - t0
        return stats

    # -- rollout ranks --------------------------------------------------------------------------
    def share(self, engine_key: str, quiet: bool = False) -> str | None:
        """Move the engine's parameters into a new shared-memory file, for a keeper to write into;
        None if the engine cannot (no such method, or parameters on a GPU)."""
        segment = self._segment(engine_key, shared=True, quiet=quiet)
        return segment.path if segment else None

    def _segment(self, engine_key: str, shared: bool, quiet: bool) -> Segment | None:
        """The engine's parameters moved into a new `Segment` (a shared file, or this process's memory)."""
        engine = self.engines[engine_key]
        if not hasattr(engine, "weight_parameters"):
            return None
        try:
            segment = Segment(engine.weight_parameters(), getattr(engine, "blocked_weights", list)(), shared)
        except ValueError as exc:
            if not quiet:
                log.warning("weight sync into %s stays on the channel: %s", engine_key, exc)
            return None
        if engine_key in self.segments:  # an older pipe's file, if its keeper never mapped it
            self.segments[engine_key].unlink()
        self.segments[engine_key] = segment
        return segment

    def receive(self, engine_key: str, version: int, pipe: str | InlinePipe, record: bool = False,
                cores: int | None = None) -> dict:
        """Load every bucket of the pipe into the engine, which stamps `version` at the end. If the
        engine fails, the rest of the stream is still read (and dropped), so the trainer finishes.
        `record` (after `share`): the stats carry the load's `direct.Plan` under "plan", or None
        and the reason under "plan_problem". `cores`: the threads the engine may finish the load
        with (the driver's `WeightSync._cores`)."""
        pipe = self.pipes[pipe] if isinstance(pipe, str) else pipe
        stats, ended = {"sync/wait_s": 0.0}, False
        reads = timed(iter(pipe.read, None), stats, "sync/wait_s")
        recorder = Recorder(self.segments[engine_key]) if record else None

        def tensors():
            nonlocal ended
            ended = True  # until a bucket is under way: a failed read ends the stream too
            for bucket in reads:
                if isinstance(bucket, Aborted):
                    raise bucket.error()
                ended = False
                yield from recorder.track(bucket) if recorder else bucket
                ended = True

        def drop_the_rest() -> bool:
            if ended:
                return False
            with suppress(Exception):
                for _ in tensors():
                    pass
            return True

        t0 = time.perf_counter()
        try:
            with torch.no_grad():  # the engine loads in this thread's grad mode otherwise
                self.engines[engine_key].load_weights(tensors(), version, watch=recorder, cores=cores)
            if drop_the_rest():
                raise RuntimeError("the rollout engine stopped reading weights before the stream ended")
        except Exception:
            drop_the_rest()
            if recorder:
                self.segments.pop(engine_key).unlink()
            raise
        stats["sync/load_s"] = time.perf_counter() - t0 - stats["sync/wait_s"]
        return {**stats, **self._plan(engine_key, recorder)} if recorder else stats

    def _plan(self, engine_key: str, recorder: Recorder) -> dict:
        """The recorded load, if the engine still reads every parameter from the shared file (else
        the file goes: no keeper will map it)."""
        segment = self.segments[engine_key]
        if any(p.untyped_storage().data_ptr() != segment.pointer for p in self.engines[engine_key].weight_parameters()):
            recorder.problem = ("the engine replaced parameters after loading (vLLM's CPU MoE kernel re-packs "
                                "experts it pads into new ones), so writes would not reach them")
        plan = recorder.plan()
        if plan is None:
            self.segments.pop(engine_key).unlink()
        return {"plan": plan, "plan_problem": recorder.problem}

    def expect(self, engine_key: str, path: str) -> bool:
        """Before a keeper writes: False if the engine's parameters are no longer in `path` (it
        shared them again since); else the engine refuses to generate until `written`."""
        segment = self.segments.get(engine_key)
        if segment is None or segment.path != path:
            return False
        self.engines[engine_key].expect_weights()
        return True

    def take(self, engine_key: str, path: str, version: int, pipe: str, cores: int | None = None) -> dict:
        """A rollout rank while the keeper `write`s into its parameters: wait for the keeper's end
        marker in the pipe, then finish and stamp (`written`). {"moved": True} if the parameters
        are no longer in `path` (`expect`): the keeper wrote where nothing reads, the driver records anew."""
        expected = self.expect(engine_key, path)
        end = self.pipes[pipe].read()
        if isinstance(end, Aborted):
            raise end.error()
        return self.written(engine_key, version, cores) if expected else {"moved": True}

    def written(self, engine_key: str, version: int, cores: int | None = None) -> dict:
        """After a direct write into the engine's parameters: finish and stamp."""
        t0 = time.perf_counter()
        self.engines[engine_key].weights_written(version, cores)
        return {"sync/load_s": time.perf_counter() - t0}


@contextmanager
def _ended(pipe: Any) -> Iterator[None]:
    """The end marker into `pipe` after the body, or an abort marker if it failed (the readers
    stop waiting for buckets either way)."""
    try:
        yield
    except Exception as error:
        with suppress(Exception):
            pipe.write(Aborted(repr(error)))
        raise
    pipe.write(None)


def _replayed(targets: Targets, export: Iterator[Named], stats: dict, cores: int | None) -> dict:
    """A recorded load replayed on the trainer's export, with `cores` threads; the export is walked to
    its end whatever happens (the other trainer ranks take part in its collectives). Adds the bytes
    and `sync/write_s`, the time spent copying, to `stats` (which the export fills too)."""
    t0 = time.perf_counter()
    try:
        with borrowed(cores):
            stats["sync/bytes"] = targets.write(export)
    finally:
        with suppress(Exception):
            for _ in export:
                pass
    stats["sync/write_s"] = time.perf_counter() - t0 - stats["sync/gather_s"] - stats["sync/convert_s"]
    return stats


def handoff(src_engine: Any, dst_engine: Any, version: int, cores: int | None = None,
            recorder: Recorder | None = None) -> dict:
    """Colocated meshes: the rollout engine loads straight from the trainer's export, in process
    (finishing with `cores` threads, as in `RankSync.receive`), its loader's copies recorded by
    `recorder` if given."""
    t0, stats = time.perf_counter(), {"sync/bytes": 0}

    def counted(named):
        for name, t in named:
            stats["sync/bytes"] += nbytes(t)
            yield name, t

    export = exported(src_engine, stats, first_rank_only=False)
    try:
        with torch.no_grad():  # the engine's loader runs in this thread's grad mode otherwise
            tensors = counted(export)
            dst_engine.load_weights(recorder.track(tensors) if recorder else tensors, version, watch=recorder, cores=cores)
    finally:  # a load that failed here must not leave the other trainer ranks in the export's collectives
        with suppress(Exception):
            for _ in export:
                pass
    total = time.perf_counter() - t0
    return {**stats, "sync/handoff_s": total, "sync/load_s": total - stats["sync/gather_s"] - stats["sync/convert_s"]}
