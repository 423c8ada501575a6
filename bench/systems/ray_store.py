"""Ray's object store: a local `ray.init`, in the peers' environment.

put: `ray.put(array)` (the reference is dropped afterwards, untimed).
get: `ray.get(ref)` in the process that put it; NumPy arrays come back as read-only views
of the store (zero-copy).
handoff: `ray.put` in the driver, then an actor method call carrying the reference (in a
list, so Ray does not resolve it on the way); the actor's `ray.get` is the consumer.
throughput: actors (num_cpus=0) as the client processes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing here can reach the network

import numpy as np
import ray

from .base import (
    POOL_SIZE,
    SMALL,
    Metrics,
    System,
    count_ops,
    memory_growth,
    private_rss,
    shm_backed,
)

MEMORY = 4 << 30


@ray.remote(num_cpus=0)
class _Consumer:
    def take(self, refs: list[Any]) -> float:
        value = ray.get(refs[0])
        received = time.perf_counter()
        del value
        return received


@ray.remote(num_cpus=0)
class _PoolClient:
    def __init__(self) -> None:
        self.array = np.full(SMALL // 4, 1.0, dtype=np.float32)
        self.ref = ray.put(self.array)

    def get(self) -> None:
        value = ray.get(self.ref)
        del value

    def putget(self) -> None:
        ref = ray.put(self.array)
        value = ray.get(ref)
        del value, ref

    def warm(self) -> None:
        for _ in range(20):
            self.get()
            self.putget()

    def run(self, mode: str, start_at: float, duration: float) -> int:
        return count_ops(self.get if mode == "get" else self.putget, start_at, duration)


class Ray(System):
    name = "ray"
    scenarios = frozenset(
        {"put", "get", "handoff", "throughput_get", "throughput_putget", "memory"}
    )

    def __init__(self) -> None:
        super().__init__()
        self._tmp: str | None = None
        self._consumer: Any = None
        self._pool: list[Any] = []
        self._get_ref: Any = None
        self._warm = False

    def setup(self) -> dict[str, Any]:
        # A short private directory: Ray's socket paths must fit in 107 bytes.
        self._tmp = tempfile.mkdtemp(prefix="tbb-ray-")
        # Ray's worker processes must import this module to run the actors.
        bench_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (bench_dir, os.environ.get("PYTHONPATH")) if p
        )
        ray.init(
            num_cpus=2,
            object_store_memory=MEMORY,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=self._tmp,
        )
        self._consumer = _Consumer.remote()  # type: ignore[attr-defined]
        self._pool = [_PoolClient.remote() for _ in range(POOL_SIZE)]  # type: ignore[attr-defined]
        ray.get([self._consumer.take.remote([ray.put(0)])])
        return {"ray": ray.__version__, "numpy": np.__version__, "store_pids": self._store_pids()}

    def close(self) -> None:
        self._consumer = None
        self._pool = []
        self._get_ref = None
        if ray.is_initialized():
            ray.shutdown()
        if self._tmp is not None:
            for _ in range(20):  # Ray's processes may still be writing their last logs
                shutil.rmtree(self._tmp, ignore_errors=True)
                if not os.path.exists(self._tmp):
                    break
                time.sleep(0.25)
            self._tmp = None

    @staticmethod
    def _store_pids() -> dict[str, int]:
        """The processes that make up the object store: raylet (which holds the shared
        memory) and the GCS server."""
        node = ray._private.worker._global_node
        return {
            name: node.all_processes[name][0].process.pid
            for name in ("raylet", "gcs_server")
            if node.all_processes.get(name)
        }

    def put_once(self, array: np.ndarray[Any, Any]) -> float:
        t0 = time.perf_counter()
        ref = ray.put(array)
        elapsed = time.perf_counter() - t0
        del ref
        return elapsed

    def prepare_get(self, array: np.ndarray[Any, Any]) -> None:
        self._get_ref = ray.put(array)

    def get_once(self) -> float:
        t0 = time.perf_counter()
        value = ray.get(self._get_ref)
        elapsed = time.perf_counter() - t0
        del value
        return elapsed

    def finish_get(self) -> None:
        self._get_ref = None

    def handoff_once(self, array: np.ndarray[Any, Any]) -> float:
        t0 = time.perf_counter()
        ref = ray.put(array)
        received: float = ray.get(self._consumer.take.remote([ref]))
        del ref
        return received - t0

    def throughput(self, mode: str, clients: int, duration: float) -> float:
        if not self._warm:  # not at setup: the memory figures want a fresh store
            ray.get([client.warm.remote() for client in self._pool])
            self._warm = True
        start_at = time.perf_counter() + 0.05
        counts: list[int] = ray.get(
            [client.run.remote(mode, start_at, duration) for client in self._pool[:clients]]
        )
        return sum(counts) / duration

    def memory(self, count: int, nbytes: int) -> Metrics:
        """Shared memory: tmpfs pages backing the raylet's store file; RSS: raylet + GCS."""
        pids = self._store_pids()
        array = np.full(nbytes // 4, 1.0, dtype=np.float32)
        refs: list[Any] = []

        def put_batch(batch: int) -> None:
            refs.extend(ray.put(array) for _ in range(count))

        try:
            return memory_growth(
                put_batch,
                lambda: float(shm_backed(pids["raylet"], lambda path: "plasma" in path)),
                lambda: float(sum(private_rss(pid) for pid in pids.values())),
                count,
            )
        finally:
            refs.clear()
