"""Rollout side: one engine load fed bucket by bucket, across separate calls into the rank.

vLLM reloads weights in one pass over an iterator (it re-processes each layer once all its tensors
have arrived), so the buckets of one sync must feed ONE `load_weights` call. That call runs in a
thread and reads a queue that each `push` fills; the queue holds one bucket, so a rank holds at
most the bucket being loaded plus one waiting, and `push` returning means "taken, send the next".

The thread is the same one from sync to sync (`loader_thread`): a fresh thread made every load
2-3x slower here (its first allocations come from a fresh malloc arena and fault in new pages).
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Iterator

import torch

_END, _ABORT = object(), object()


def loader_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-load")


class StreamingLoad:
    def __init__(self, engine: Any, version: int, thread: ThreadPoolExecutor):
        self.stats = {"sync/wait_s": 0.0}
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._done: Future = thread.submit(self._run, engine, version)

    def _tensors(self) -> Iterator:
        while True:
            t0 = time.perf_counter()
            part = self._queue.get()
            self.stats["sync/wait_s"] += time.perf_counter() - t0
            if part is _END:
                return
            if part is _ABORT:  # fail the load, so the engine keeps its old version stamp
                raise RuntimeError("the weight stream was aborted")
            yield from part

    def _run(self, engine: Any, version: int) -> None:
        t0 = time.perf_counter()
        try:
            with torch.no_grad():  # grad mode is per thread; loading needs none
                engine.load_weights(self._tensors(), version)
        finally:
            s = self.stats
            s["sync/load_s"] = time.perf_counter() - t0 - s["sync/wait_s"]

    def push(self, part: Iterable) -> None:
        """Queue one bucket: (name, tensor) pairs."""
        self._put(part)

    def close(self) -> dict:
        """End the stream, wait for the engine to finish loading; returns timings or raises its error."""
        try:
            self._put(_END)
        except RuntimeError:  # the engine stopped on an error: raise that error itself
            pass
        self._done.result()
        return self.stats

    def abort(self) -> None:
        """Give up a stream that will not be finished (the sync failed elsewhere)."""
        try:
            self._put(_ABORT)
            self._done.result()
        except RuntimeError:
            pass

    def _put(self, item) -> None:
        while True:
            if self._done.done():
                if (error := self._done.exception()) is not None:
                    raise RuntimeError(f"loading the weights into the rollout engine failed: {error!r}") from error
                if item is _END or item is _ABORT:
                    return
                raise RuntimeError("the rollout engine stopped reading weights before the stream ended")
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
