"""What every adapter shares: the request it answers, the timing loop, the source arrays, a
pool of client processes for throughput runs, and /proc readers for memory figures.

Only the standard library and NumPy (1.x or 2.x) may be imported here: this module runs in
the main virtual environment and in the peers' one.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, ClassVar, Protocol

import numpy as np

LATENCY_SCENARIOS = ("put", "put_nowait", "get", "handoff")
THROUGHPUT_SCENARIOS = ("throughput_get", "throughput_putget")
SMALL = 4096  # bytes of the objects in throughput and memory runs
KEY_BYTES = 4  # bytes of each object of the memory run's small keys (one float32)
MANY_KEYS = 100  # get_many: objects read in one call (bench/harness/plan.py says so too)
POOL_SIZE = 4  # client processes kept for throughput runs (runs use 1, 2 or 4)
HANDOFF_TIMEOUT = 120.0  # seconds a consumer may take to report (mp.Queue moves 1 GiB in ~5 s)
PINGPONG_ITEMS = 300  # pingpong: items handed over one after the other, each timed
STREAM_ITEMS = 3000  # stream: items put as fast as the queue (maxsize STREAM_MAXSIZE) takes them
STREAM_MAXSIZE = 8


@dataclass(frozen=True)
class Request:
    """One measurement, as the runner asks for it."""

    scenario: str
    size: int = SMALL  # bytes of the array
    budget: float = 0.2  # seconds of timed iterations to aim for (latency scenarios)
    max_iters: int = 2000
    clients: int = 1  # client processes (throughput scenarios)
    duration: float = 0.5  # seconds of the throughput window
    count: int = 1000  # objects stored (memory scenario)
    keys: int = 20000  # small objects under keys of their own (memory scenario)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Request:
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in fields})


Metrics = dict[str, float]


class System:
    """An adapter. Subclasses set `name` and `scenarios` and implement the hooks for them.

    Latency hooks time one iteration themselves (so setup and cleanup stay untimed) and
    return seconds; `measure` runs them in a loop.
    """

    name: ClassVar[str] = ""
    scenarios: ClassVar[frozenset[str]] = frozenset()

    def __init__(self) -> None:
        self._array: np.ndarray[Any, Any] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def setup(self) -> dict[str, Any]:
        """Start what the system needs; return facts for the report (versions, pids)."""
        return {}

    def close(self) -> None:
        """Stop every process and remove every file `setup` made. Must be idempotent."""

    # -- hooks -----------------------------------------------------------------------------

    def put_once(self, array: np.ndarray[Any, Any]) -> float:
        raise NotImplementedError

    def put_nowait_once(self, array: np.ndarray[Any, Any]) -> float:
        """A put that returns once it is sent (tensorbroker's `wait=False`)."""
        raise NotImplementedError

    def prepare_get(self, array: np.ndarray[Any, Any]) -> None:
        raise NotImplementedError

    def get_once(self) -> float:
        raise NotImplementedError

    def finish_get(self) -> None:
        pass

    def handoff_once(self, array: np.ndarray[Any, Any]) -> float:
        raise NotImplementedError

    def throughput(self, mode: str, clients: int, duration: float) -> float:
        """Operations per second over `duration` with `clients` processes."""
        raise NotImplementedError

    def prepare_get_many(self, array: np.ndarray[Any, Any], count: int) -> None:
        raise NotImplementedError

    def get_many_once(self) -> float:
        """One read of every object `prepare_get_many` stored, as NumPy arrays."""
        raise NotImplementedError

    def finish_get_many(self) -> None:
        pass

    def fanout(self, array: np.ndarray[Any, Any], readers: int) -> Metrics:
        """Seconds per item of a stream of `array` to `readers` reader processes (each gets
        every item), and the peak shared memory in use meanwhile."""
        raise NotImplementedError

    def pingpong(self, array: np.ndarray[Any, Any], items: int) -> Metrics:
        """Seconds from a put to the consumer holding the item (the median of `items`), where
        the consumer, having told the producer it has an item, asks for the next at once and
        the producer puts it as soon as it hears (`pattern_consumer`)."""
        raise NotImplementedError

    def stream(self, array: np.ndarray[Any, Any], items: int) -> Metrics:
        """Items a second through a queue of STREAM_MAXSIZE, the producer putting `items` as
        fast as it can and the consumer dropping each, from the first put to the last item."""
        raise NotImplementedError

    def memory(self, count: int, nbytes: int) -> Metrics:
        raise NotImplementedError

    def keys(self, count: int) -> Metrics:
        """The store's memory per key over `count` objects of KEY_BYTES (`keys_growth`);
        none for a system that does not measure it."""
        return {}

    # -- driving ---------------------------------------------------------------------------

    def measure(self, req: Request) -> tuple[Metrics, int]:
        """Run one measurement; return its metrics and how many samples it took."""
        if req.scenario not in self.scenarios:
            raise ValueError(f"{self.name} does not run {req.scenario}")
        if req.scenario in THROUGHPUT_SCENARIOS:
            mode = req.scenario.removeprefix("throughput_")
            return {"value": self.throughput(mode, req.clients, req.duration)}, 1
        if req.scenario == "memory":
            self.drop_array()
            return self.memory(req.count, SMALL) | self.keys(req.keys), 1
        array = self.array(req.size)
        if req.scenario == "fanout":
            return self.fanout(array, req.clients), 1
        if req.scenario == "pingpong":
            return self.pingpong(array, PINGPONG_ITEMS), PINGPONG_ITEMS
        if req.scenario == "stream":
            return self.stream(array, STREAM_ITEMS), STREAM_ITEMS
        if req.scenario == "get_many":
            self.prepare_get_many(array, MANY_KEYS)
            try:
                samples = timed_loop(self.get_many_once, req.budget, req.max_iters)
            finally:
                self.finish_get_many()
            return {"value": statistics.median(samples)}, len(samples)
        if req.scenario == "put":
            samples = timed_loop(lambda: self.put_once(array), req.budget, req.max_iters)
        elif req.scenario == "put_nowait":
            samples = timed_loop(lambda: self.put_nowait_once(array), req.budget, req.max_iters)
        elif req.scenario == "handoff":
            samples = timed_loop(lambda: self.handoff_once(array), req.budget, req.max_iters)
        else:
            self.prepare_get(array)
            try:
                samples = timed_loop(self.get_once, req.budget, req.max_iters)
            finally:
                self.finish_get()
        return {"value": statistics.median(samples)}, len(samples)

    def array(self, nbytes: int) -> np.ndarray[Any, Any]:
        """The source array of `nbytes` (float32, every page touched), kept between calls."""
        if self._array is None or self._array.nbytes != nbytes:
            self._array = None  # let the old one go before the new one is made
            self._array = np.full(nbytes // 4, 1.0, dtype=np.float32)
        return self._array

    def drop_array(self) -> None:
        self._array = None


def timed_loop(
    once: Callable[[], float], budget: float, max_iters: int, min_iters: int = 3, cap: float = 5.0
) -> list[float]:
    """One untimed warm-up call, then calls until `budget` seconds have passed and at least
    `min_iters` were made; but never past `cap` seconds (mp.Queue takes ~5 s per GiB)."""
    once()
    samples: list[float] = []
    start = time.perf_counter()
    while True:
        samples.append(once())
        elapsed = time.perf_counter() - start
        if len(samples) >= max_iters or elapsed >= cap:
            return samples
        if elapsed >= budget and len(samples) >= min_iters:
            return samples


def touched_like(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A destination as big as `array` whose pages are all faulted in."""
    out = np.empty_like(array)
    out.fill(0)
    return out


# -- client processes for throughput runs --------------------------------------------------


class Ops(Protocol):
    """What a pool child builds: named operations to count, and a way to clean up."""

    ops: dict[str, Callable[[], None]]

    def close(self) -> None: ...


def _pool_child(factory: str, args: tuple[Any, ...], index: int, conn: Connection) -> None:
    module, _, attr = factory.partition(":")
    client: Ops = getattr(importlib.import_module(module), attr)(index, *args)
    try:
        for op in client.ops.values():
            for _ in range(20):
                op()
        conn.send("ready")
        while True:
            msg = conn.recv()
            if msg is None:
                return
            mode, start_at, duration = msg
            conn.send(count_ops(client.ops[mode], start_at, duration))
    finally:
        client.close()


def count_ops(op: Callable[[], None], start_at: float, duration: float) -> int:
    """Call `op` from `start_at` (a perf_counter time) for `duration` seconds; return calls."""
    delay = start_at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    end = start_at + duration
    count = 0
    while time.perf_counter() < end:
        op()
        count += 1
    return count


class ClientPool:
    """`size` spawned processes, each running `factory(index, *args)` (a "module:callable"
    returning an `Ops`), started once and reused for every throughput run."""

    def __init__(self, factory: str, args: tuple[Any, ...], size: int) -> None:
        ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        try:
            for index in range(size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_pool_child, args=(factory, args, index, child), daemon=True
                )
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            for conn in self._conns:
                if not conn.poll(120.0) or conn.recv() != "ready":
                    raise RuntimeError(f"a {factory} client process did not start")
        except BaseException:
            self.close()
            raise

    def run(self, mode: str, clients: int, duration: float) -> float:
        if clients > len(self._conns):
            raise ValueError(f"the pool has {len(self._conns)} clients, {clients} asked")
        start_at = time.perf_counter() + 0.05
        for conn in self._conns[:clients]:
            conn.send((mode, start_at, duration))
        total = 0
        for conn in self._conns[:clients]:
            if not conn.poll(duration + 60.0):
                raise RuntimeError("a client process did not report its count")
            total += int(conn.recv())
        return total / duration

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs.clear()
        self._conns.clear()


# -- consumers for handoff runs -------------------------------------------------------------


class Consumer:
    """A spawned process running `target(conn, *args)`: the handoff's receiving side.

    The protocol (each adapter's target follows it): the producer sends a token (a key,
    an object id) or None to stop; the consumer answers "armed", then blocks until it holds
    the object, answers its `time.perf_counter()` at that moment, and drops the object.
    """

    def __init__(
        self, target: Callable[..., None], args: tuple[Any, ...], context: Any = None
    ) -> None:
        ctx = context or mp.get_context("spawn")
        pipe: tuple[Connection, Connection] = ctx.Pipe()
        self.conn, child = pipe
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(120.0) or self.conn.recv() != "ready":
            self.close()
            raise RuntimeError(f"the handoff consumer {target.__name__} did not start")

    def arm(self, token: Any) -> None:
        self.conn.send(token)
        if not self.conn.poll(HANDOFF_TIMEOUT) or self.conn.recv() != "armed":
            raise RuntimeError("the handoff consumer did not arm")
        time.sleep(0.002)  # let it block in its receive before the clock starts

    def received_at(self) -> float:
        if not self.conn.poll(HANDOFF_TIMEOUT):
            raise RuntimeError("the handoff consumer did not report within the timeout")
        return float(self.conn.recv())

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def pattern_consumer(conn: Connection, get: Callable[[str], Any]) -> None:
    """The consumer of the pingpong and stream runs, `get(name)` taking the next item of queue
    `name`. It is sent (name, count): for pingpong it reports its `time.perf_counter()` as
    it holds each item (the producer hears back) and asks for the next at once; for stream
    it takes every item and reports the moment it has the last."""
    conn.send("ready")
    while (order := conn.recv()) is not None:
        name, count = order
        for _ in range(count):
            item = get(name)
            if name == "pingpong":
                conn.send(time.perf_counter())
            del item
        if name == "stream":
            conn.send(time.perf_counter())


def pingpong_run(put: Callable[[], None], conn: Connection, items: int) -> Metrics:
    """Drive `pattern_consumer` through `items` ping-pong handoffs (`put` puts the next)."""
    conn.send(("pingpong", items + 1))
    times = []
    for _ in range(items + 1):  # the first one untimed: the consumer was not waiting yet
        began = time.perf_counter()
        put()
        if not conn.poll(HANDOFF_TIMEOUT):
            raise RuntimeError("the pingpong consumer did not report within the timeout")
        times.append(float(conn.recv()) - began)
    return {"value": statistics.median(times[1:])}


def stream_run(put: Callable[[], None], conn: Connection, items: int) -> Metrics:
    """Drive `pattern_consumer` through a stream of `items` puts."""
    conn.send(("stream", items))
    began = time.perf_counter()
    for _ in range(items):
        put()
    if not conn.poll(HANDOFF_TIMEOUT):
        raise RuntimeError("the stream consumer did not report within the timeout")
    return {"value": items / (float(conn.recv()) - began)}


# -- memory ------------------------------------------------------------------------------


def memory_growth(
    put_batch: Callable[[int], None], shm: Callable[[], float], rss: Callable[[], float], count: int
) -> Metrics:
    """Idle shared memory and store RSS, then their growth per object over the second of two
    batches of `count` objects (the first batch uses up memory the store freed earlier)."""
    shm0, rss0 = shm(), rss()
    put_batch(0)
    shm1, rss1 = shm(), rss()
    put_batch(1)
    shm2, rss2 = shm(), rss()
    return {
        "shm_idle": shm0,
        "shm_per_object": (shm2 - shm1) / count,
        "rss_idle": rss0,
        "rss_per_object": (rss2 - rss1) / count,
    }


def keys_growth(put_keys: Callable[[], None], pid: int, count: int) -> Metrics:
    """The resident memory of the store process `pid` per key, over `put_keys()` storing
    `count` objects of KEY_BYTES under keys of their own: private (anonymous + file-backed),
    and shared memory it has mapped (tensorbroker: its directory, as the broker never maps
    the objects' blocks; Plasma: the pages of its arena it touched, the objects' included)."""
    before = proc_status(pid)
    put_keys()
    after = proc_status(pid)

    def grew(*fields: str) -> float:
        return sum(after.get(f, 0) - before.get(f, 0) for f in fields) / count

    return {"rss_per_key": grew("RssAnon", "RssFile"), "shm_rss_per_key": grew("RssShmem")}


# -- /proc readers ------------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """The kB fields of /proc/PID/status, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def private_rss(pid: int) -> int:
    """Resident memory of `pid` that is not shared memory (anonymous + file-backed)."""
    status = proc_status(pid)
    return status.get("RssAnon", 0) + status.get("RssFile", 0)


def shm_backed(pid: int, match: Callable[[str], bool]) -> int:
    """Bytes of tmpfs pages backing the /dev/shm files `pid` holds open whose path `match`es
    (deleted files included)."""
    total = 0
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
            if target.startswith("/dev/shm/") and match(target):
                total += os.stat(f"{fd_dir}/{fd}").st_blocks * 512
        except OSError:
            continue
    return total
