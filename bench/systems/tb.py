"""tensorbroker: a broker from `tb.start_broker`, driven through the public client API.

put: `c.put(key, array)` to a fresh key (deleted afterwards, untimed).
put_nowait: `c.put(key, array, wait=False)`: returns once the seal is sent.
get: `c.get(key)` + `numpy.from_dlpack` of an existing object.
handoff: through a queue: the consumer is parked in `q.get(timeout=...)` when the producer
calls `q.put(array)`, and the clock stops when it holds the item as a NumPy array.
get_many: `c.get_many(keys)` of 100 existing objects, each as a NumPy array.
pingpong, stream: through queues of maxsize 8 (base.pattern_consumer), each item taken as a
NumPy array.
fanout: FANOUT_ITEMS items through a queue of maxsize 8 to 1 reader process, or a
broadcast queue to 4 subscriber processes; from the first put until every reader has every
item, per item; and the peak of `used_bytes` meanwhile.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import tensorbroker as tb
from tensorbroker.server.durability.journal import read_journal

from .base import (
    KEY_BYTES,
    POOL_SIZE,
    SMALL,
    STREAM_MAXSIZE,
    ClientPool,
    Consumer,
    Metrics,
    System,
    keys_growth,
    memory_growth,
    pattern_consumer,
    pingpong_run,
    private_rss,
    stream_run,
)

MEMORY = "4GiB"
HANDOFF_QUEUE = "handoff"
FANOUT_ITEMS = 100
FANOUT_MAXSIZE = 8


class TensorBroker(System):
    name = "tensorbroker"
    scenarios = frozenset(
        {"put", "put_nowait", "get", "handoff", "throughput_get", "throughput_putget", "memory",
         "get_many", "fanout", "pingpong", "stream"}
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self._broker: tb.BrokerProcess | None = None
        self._client: tb.Client | None = None
        self._consumer: Consumer | None = None
        self._patterns: Consumer | None = None  # the pingpong and stream runs' consumer
        self._pool: ClientPool | None = None
        self._queue: tb.Queue | None = None
        self._keys = itertools.count()
        self._many: list[str] = []

    def setup(self) -> dict[str, Any]:
        self._broker = tb.start_broker(memory=MEMORY)
        self._client = tb.connect(self._broker.address)
        address = self._broker.address
        self._queue = self._client.queue(HANDOFF_QUEUE)
        self._consumer = Consumer(_consumer, (address,))
        self._pool = ClientPool("systems.tb:PoolClient", (address,), POOL_SIZE)
        return {"tensorbroker": tb.__version__, "broker_pid": self._broker.pid, "memory": MEMORY}

    @property
    def client(self) -> tb.Client:
        assert self._client is not None, "setup() first"
        return self._client

    def close(self) -> None:
        pool, consumer, client, broker = self._pool, self._consumer, self._client, self._broker
        patterns, self._patterns = self._patterns, None
        self._pool = self._consumer = self._client = self._broker = None
        if pool is not None:
            pool.close()
        for c in (consumer, patterns):
            if c is not None:
                c.close()
        if client is not None:
            client.close()
        if broker is not None:
            broker.stop()  # a broker that died leaves its segments: stop() discards them

    def put_once(self, array: np.ndarray[Any, Any]) -> float:
        key = f"put-{next(self._keys)}"
        t0 = time.perf_counter()
        self.client.put(key, array)
        elapsed = time.perf_counter() - t0
        self.client.delete(key)
        return elapsed

    def put_nowait_once(self, array: np.ndarray[Any, Any]) -> float:
        key = f"put-{next(self._keys)}"
        t0 = time.perf_counter()
        self.client.put(key, array, wait=False)
        elapsed = time.perf_counter() - t0
        self.client.delete(key)  # after its seal is answered
        return elapsed

    def prepare_get(self, array: np.ndarray[Any, Any]) -> None:
        self.client.put("get", array)

    def get_once(self) -> float:
        t0 = time.perf_counter()
        tensor = self.client.get("get")
        view = np.from_dlpack(tensor)
        elapsed = time.perf_counter() - t0
        del view, tensor
        return elapsed

    def finish_get(self) -> None:
        self.client.delete("get")

    def prepare_get_many(self, array: np.ndarray[Any, Any], count: int) -> None:
        self._many = [f"many-{i}" for i in range(count)]
        for key in self._many:
            self.client.put(key, array)

    def finish_get_many(self) -> None:
        for key in self._many:
            self.client.delete(key)
        self._many = []

    def get_many_once(self) -> float:
        t0 = time.perf_counter()
        items = self.client.get_many(self._many)
        views = [np.from_dlpack(item) for item in items.values()]
        elapsed = time.perf_counter() - t0
        del views, items
        return elapsed

    def fanout(self, array: np.ndarray[Any, Any], readers: int) -> Metrics:
        assert self._broker is not None
        name = f"fanout-{next(self._keys)}"
        broadcast = readers > 1
        q = (
            self.client.broadcast(name, FANOUT_MAXSIZE)
            if broadcast
            else self.client.queue(name, FANOUT_MAXSIZE)
        )
        procs = [Consumer(_fanout_reader, (self._broker.address, name, broadcast))
                 for _ in range(readers)]  # fmt: skip
        try:
            for p in procs:
                p.conn.send(FANOUT_ITEMS)
            # The stream's own memory: other scenarios' objects (the throughput clients'
            # 4 KiB each) are in use already.
            before = int(self.client.stats()["used_bytes"])
            peak, t0 = 0, time.perf_counter()
            for i in range(FANOUT_ITEMS):
                q.put(array)
                if i % 4 == 0:
                    peak = max(peak, int(self.client.stats()["used_bytes"]) - before)
            done = max(p.received_at() for p in procs)
        finally:
            for p in procs:
                p.close()
            q.close()
        return {"value": (done - t0) / FANOUT_ITEMS, "peak_bytes": float(peak)}

    def handoff_once(self, array: np.ndarray[Any, Any]) -> float:
        assert self._consumer is not None and self._queue is not None
        self._consumer.arm(array.nbytes)
        t0 = time.perf_counter()
        self._queue.put(array)
        return self._consumer.received_at() - t0

    def _pattern(self, name: str, array: np.ndarray[Any, Any]) -> tuple[Callable[[], Any], Any]:
        if self._patterns is None:
            assert self._broker is not None
            self._patterns = Consumer(_pattern_consumer, (self._broker.address,))
        q = self.client.queue(name, maxsize=STREAM_MAXSIZE)
        return (lambda: q.put(array)), self._patterns.conn

    def pingpong(self, array: np.ndarray[Any, Any], items: int) -> Metrics:
        return pingpong_run(*self._pattern("pingpong", array), items)

    def stream(self, array: np.ndarray[Any, Any], items: int) -> Metrics:
        return stream_run(*self._pattern("stream", array), items)

    def throughput(self, mode: str, clients: int, duration: float) -> float:
        assert self._pool is not None
        return self._pool.run(mode, clients, duration)

    def memory(self, count: int, nbytes: int) -> Metrics:
        """Shared memory per object is the arena's accounting (the arena itself is backed
        when it grows, in large chunks)."""
        assert self._broker is not None
        pid, state_dir = self._broker.pid, str(self.client.stats()["state_dir"])
        array = np.full(nbytes // 4, 1.0, dtype=np.float32)
        keys: list[str] = []

        def put_batch(batch: int) -> None:
            for i in range(count):
                keys.append(f"mem-{batch}-{i}")
                self.client.put(keys[-1], array)

        try:
            return memory_growth(
                put_batch,
                lambda: float(self.client.stats()["used_bytes"]),
                lambda: float(private_rss(pid)),
                count,
            ) | {"shm_idle": float(_backed(state_dir))}
        finally:
            for key in keys:
                self.client.delete(key)

    def keys(self, count: int) -> Metrics:
        """`count` puts of KEY_BYTES under keys of their own (not waiting for each: how a
        store is loaded with many keys), then a flush."""
        assert self._broker is not None
        array = np.full(KEY_BYTES // 4, 1.0, dtype=np.float32)
        keys = [f"key-{i}" for i in range(count)]

        def put_keys() -> None:
            for key in keys:
                self.client.put(key, array, wait=False)
            self.client.flush()

        try:
            return keys_growth(put_keys, self._broker.pid, count)
        finally:
            for key in keys:
                self.client.delete(key)


def _backed(state_dir: str) -> int:
    """tmpfs bytes backing the broker's segments (named in its journal): the arena, backed
    as it grows, the directory and the lease slots."""
    found = read_journal(state_dir)
    total = 0
    for name in found.segments if found is not None else ():
        try:
            total += os.stat(os.path.join("/dev/shm", name)).st_blocks * 512
        except OSError:
            continue
    return total


def _fanout_reader(conn: Connection, address: str, name: str, broadcast: bool) -> None:
    """Read the number of items the producer sends, then answer when it has them all."""
    with tb.connect(address) as client:
        source = client.subscribe(name) if broadcast else client.queue(name)
        conn.send("ready")
        count = conn.recv()
        if count is None:
            return
        for _ in range(count):
            item = source.get(timeout=60.0)
            view = np.from_dlpack(item)
            del view, item
        conn.send(time.perf_counter())
        conn.recv()  # None: done


def _consumer(conn: Connection, address: str) -> None:
    with tb.connect(address) as client:
        queue = client.queue(HANDOFF_QUEUE)
        conn.send("ready")
        while conn.recv() is not None:
            conn.send("armed")
            item = queue.get(timeout=60.0)
            view = np.from_dlpack(item)
            received = time.perf_counter()
            del view, item
            conn.send(received)


def _pattern_consumer(conn: Connection, address: str) -> None:
    with tb.connect(address) as client:
        queues: dict[str, tb.Queue] = {}

        def get(name: str) -> Any:
            q = queues.get(name)  # (not `or`: a Queue's truth is its len(), a request)
            if q is None:
                q = queues[name] = client.queue(name)
            return np.from_dlpack(q.get(timeout=60.0))

        pattern_consumer(conn, get)


class PoolClient:
    """One throughput client: its own connection and its own 4 KiB object."""

    def __init__(self, index: int, address: str) -> None:
        self.client = tb.connect(address)
        self.key = f"tp-{index}"
        self.array = np.full(SMALL // 4, 1.0, dtype=np.float32)
        self.client.put(self.key, self.array)
        self.ops = {"get": self.get, "putget": self.putget}

    def get(self) -> None:
        tensor = self.client.get(self.key)
        view = np.from_dlpack(tensor)
        del view, tensor

    def putget(self) -> None:
        self.client.put(self.key, self.array)
        self.get()

    def close(self) -> None:
        self.client.close()
