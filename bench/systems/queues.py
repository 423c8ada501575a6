"""Queues between two processes: handoff only (they have no keyed put or get).

torch.multiprocessing.Queue: the producer puts a fresh (not yet shared) torch tensor each
time, as a pipeline producing new batches would; torch moves its storage into shared memory
and passes a file descriptor. multiprocessing.Queue: the NumPy array is pickled through a
pipe. Both queues and their consumers use the spawn start method.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .base import HANDOFF_TIMEOUT, Consumer, System


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


class MpQueue(System):
    name = "mp_queue"
    scenarios = frozenset({"handoff"})
    preload: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self._consumer: Consumer | None = None
        self._queue: Any = None

    def _context(self) -> Any:
        return mp.get_context("spawn")

    def setup(self) -> dict[str, Any]:
        ctx = self._context()
        self._queue = ctx.Queue()
        self._consumer = Consumer(_queue_consumer, (self._queue, self.preload), context=ctx)
        return {"numpy": np.__version__}

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
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


class TorchQueue(MpQueue):
    name = "torch_queue"
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
