"""Queues between two processes: handoff, and for multiprocessing.Queue the pingpong and
stream patterns (base.pattern_consumer), with maxsize 8 as tensorbroker's (they have no
keyed put or get).

torch.multiprocessing.Queue: the producer puts a fresh (not yet shared) torch tensor each
time, as a pipeline producing new batches would; torch moves its storage into shared memory
and passes a file descriptor. multiprocessing.Queue: the NumPy array is pickled through a
pipe. Both queues and their consumers use the spawn start method.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .base import (
    HANDOFF_TIMEOUT,
    STREAM_MAXSIZE,
    Consumer,
    Metrics,
    System,
    pattern_consumer,
    pingpong_run,
    stream_run,
)


def _queue_consumer(conn: Connection, queue: Any, preload: str | None) -> None:
    if preload:  # import what unpickling the items needs before the clock runs
        importlib.import_module(preload)
    conn.send("ready")
    while conn.recv() is not None:
        conn.send("armed")
        item = queue.get(timeout=HANDOFF_TIMEOUT)
        received = time.perf_counter()
        del item
        conn.send(received)


def _pattern_consumer(conn: Connection, queues: dict[str, Any]) -> None:
    pattern_consumer(conn, lambda name: queues[name].get(timeout=HANDOFF_TIMEOUT))


class MpQueue(System):
    name = "mp_queue"
    scenarios = frozenset({"handoff", "pingpong", "stream"})
    preload: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self._consumer: Consumer | None = None
        self._patterns: Consumer | None = None
        self._queue: Any = None
        self._queues: dict[str, Any] = {}

    def _context(self) -> Any:
        return mp.get_context("spawn")

    def setup(self) -> dict[str, Any]:
        ctx = self._context()
        self._queue = ctx.Queue()
        self._consumer = Consumer(_queue_consumer, (self._queue, self.preload), context=ctx)
        return {"numpy": np.__version__}

    def close(self) -> None:
        for consumer in (self._consumer, self._patterns):
            if consumer is not None:
                consumer.close()
        self._consumer = self._patterns = None
        for q in self._queues.values():
            q.close()
            q.join_thread()
        self._queues.clear()
        if self._queue is not None:
            self._queue.close()
            self._queue.join_thread()
            self._queue = None

    def _item(self, array: np.ndarray[Any, Any]) -> Any:
        return array

    def handoff_once(self, array: np.ndarray[Any, Any]) -> float:
        assert self._consumer is not None
        item = self._item(array)  # untimed
        self._consumer.arm("go")
        t0 = time.perf_counter()
        self._queue.put(item)
        elapsed = self._consumer.received_at() - t0
        del item
        return elapsed

    def _pattern(self, name: str, array: np.ndarray[Any, Any]) -> tuple[Callable[[], Any], Any]:
        if self._patterns is None:
            ctx = self._context()
            self._queues = {n: ctx.Queue(maxsize=STREAM_MAXSIZE) for n in ("pingpong", "stream")}
            self._patterns = Consumer(_pattern_consumer, (self._queues,), context=ctx)
        q = self._queues[name]
        return (lambda: q.put(array)), self._patterns.conn

    def pingpong(self, array: np.ndarray[Any, Any], items: int) -> Metrics:
        return pingpong_run(*self._pattern("pingpong", array), items)

    def stream(self, array: np.ndarray[Any, Any], items: int) -> Metrics:
        return stream_run(*self._pattern("stream", array), items)


class TorchQueue(MpQueue):
    name = "torch_queue"
    scenarios = frozenset({"handoff"})
    preload = "torch.multiprocessing"

    def _context(self) -> Any:
        import torch.multiprocessing as tmp

        return tmp.get_context("spawn")

    def setup(self) -> dict[str, Any]:
        import torch

        return {**super().setup(), "torch": torch.__version__}

    def _item(self, array: np.ndarray[Any, Any]) -> Any:
        import torch

        return torch.from_numpy(array).clone()  # a fresh tensor in private memory
