"""Apache Arrow Plasma (pyarrow 11, the last release with it), in the peers' environment.

The store is `plasma-store-server` started by `pyarrow.plasma.start_plasma_store`. The
zero-copy paths are used on both sides (no pyarrow serialisation):
put: `client.create(oid, nbytes)`, `numpy.copyto` into the buffer, `client.seal(oid)`.
get: `client.get_buffers([oid])` + `numpy.frombuffer` (a read-only view of the store).
handoff: the consumer blocks in `get_buffers([oid], timeout_ms=...)` for an id it is told.
"""

from __future__ import annotations

import contextlib
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pyarrow
from pyarrow import plasma

from .base import (
    KEY_BYTES,
    POOL_SIZE,
    SMALL,
    ClientPool,
    Consumer,
    Metrics,
    System,
    keys_growth,
    memory_growth,
    private_rss,
    shm_backed,
)

MEMORY = 4 << 30


def _put(client: Any, oid: Any, array: np.ndarray[Any, Any]) -> None:
    buf = client.create(oid, array.nbytes)
    np.copyto(np.frombuffer(buf, dtype=array.dtype), array.reshape(-1))
    client.seal(oid)


class Plasma(System):
    name = "plasma"
    scenarios = frozenset(
        {"put", "get", "handoff", "throughput_get", "throughput_putget", "memory"}
    )

    def __init__(self) -> None:
        super().__init__()
        self._store: contextlib.AbstractContextManager[Any] | None = None
        self._socket = ""
        self._pid = -1
        self._client: Any = None
        self._consumer: Consumer | None = None
        self._pool: ClientPool | None = None
        self._get_oid: Any = None

    def setup(self) -> dict[str, Any]:
        self._store = plasma.start_plasma_store(MEMORY)
        self._socket, proc = self._store.__enter__()
        self._pid = proc.pid
        self._client = plasma.connect(self._socket)
        self._consumer = Consumer(_consumer, (self._socket,))
        self._pool = ClientPool("systems.plasma_store:PoolClient", (self._socket,), POOL_SIZE)
        return {"pyarrow": pyarrow.__version__, "numpy": np.__version__, "store_pid": self._pid}

    def close(self) -> None:
        pool, consumer, store = self._pool, self._consumer, self._store
        self._pool = self._consumer = self._store = None
        if pool is not None:
            pool.close()
        if consumer is not None:
            consumer.close()
        if self._client is not None:
            self._client.disconnect()
            self._client = None
        if store is not None:  # kills the store and removes its socket directory
            store.__exit__(None, None, None)

    def put_once(self, array: np.ndarray[Any, Any]) -> float:
        oid = plasma.ObjectID.from_random()
        t0 = time.perf_counter()
        _put(self._client, oid, array)
        elapsed = time.perf_counter() - t0
        self._client.delete([oid])
        return elapsed

    def prepare_get(self, array: np.ndarray[Any, Any]) -> None:
        self._get_oid = plasma.ObjectID.from_random()
        _put(self._client, self._get_oid, array)

    def get_once(self) -> float:
        t0 = time.perf_counter()
        [buf] = self._client.get_buffers([self._get_oid])
        view = np.frombuffer(buf, dtype=np.float32)
        elapsed = time.perf_counter() - t0
        del view, buf
        return elapsed

    def finish_get(self) -> None:
        self._client.delete([self._get_oid])
        self._get_oid = None

    def handoff_once(self, array: np.ndarray[Any, Any]) -> float:
        assert self._consumer is not None
        oid = plasma.ObjectID.from_random()
        self._consumer.arm(oid.binary())
        t0 = time.perf_counter()
        _put(self._client, oid, array)
        elapsed = self._consumer.received_at() - t0
        self._client.delete([oid])  # deferred by the store until the consumer has let go
        return elapsed

    def throughput(self, mode: str, clients: int, duration: float) -> float:
        assert self._pool is not None
        return self._pool.run(mode, clients, duration)

    def memory(self, count: int, nbytes: int) -> Metrics:
        """Shared memory: tmpfs pages backing the store's (unlinked) file."""
        array = np.full(nbytes // 4, 1.0, dtype=np.float32)
        oids: list[Any] = []

        def put_batch(batch: int) -> None:
            for _ in range(count):
                oids.append(plasma.ObjectID.from_random())
                _put(self._client, oids[-1], array)

        try:
            return memory_growth(
                put_batch,
                lambda: float(shm_backed(self._pid, lambda path: "plasma" in path)),
                lambda: float(private_rss(self._pid)),
                count,
            )
        finally:
            self._client.delete(oids)

    def keys(self, count: int) -> Metrics:
        """`count` objects of KEY_BYTES (create, copy, seal), each under an id of its own."""
        array = np.full(KEY_BYTES // 4, 1.0, dtype=np.float32)
        oids = [plasma.ObjectID.from_random() for _ in range(count)]

        def put_keys() -> None:
            for oid in oids:
                _put(self._client, oid, array)

        try:
            return keys_growth(put_keys, self._pid, count)
        finally:
            self._client.delete(oids)


def _consumer(conn: Connection, socket: str) -> None:
    client = plasma.connect(socket)
    conn.send("ready")
    while (token := conn.recv()) is not None:
        conn.send("armed")
        [buf] = client.get_buffers([plasma.ObjectID(token)], timeout_ms=60_000)
        if buf is None:
            raise TimeoutError("plasma: the handoff object did not arrive within 60 s")
        view = np.frombuffer(buf, dtype=np.float32)
        received = time.perf_counter()
        del view, buf
        conn.send(received)
    client.disconnect()


class PoolClient:
    """One throughput client: its own store connection and its own 4 KiB object."""

    def __init__(self, index: int, socket: str) -> None:
        self.client = plasma.connect(socket)
        self.array = np.full(SMALL // 4, 1.0, dtype=np.float32)
        self.oid = plasma.ObjectID.from_random()
        _put(self.client, self.oid, self.array)
        self.ops = {"get": self.get, "putget": self.putget}

    def get(self) -> None:
        self._get(self.oid)

    def _get(self, oid: Any) -> None:
        [buf] = self.client.get_buffers([oid])
        view = np.frombuffer(buf, dtype=np.float32)
        del view, buf

    def putget(self) -> None:
        """A fresh object each time (Plasma objects cannot be replaced), then deleted."""
        oid = plasma.ObjectID.from_random()
        _put(self.client, oid, self.array)
        self._get(oid)
        self.client.delete([oid])

    def close(self) -> None:
        self.client.disconnect()
