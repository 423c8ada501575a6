"""Brokers' cluster sides in one process, for unit tests (test_cluster_liveness.py,
test_queue_links.py): Cluster objects over real ZeroMQ on loopback, each stepped by hand like
a broker's loop (a journal transaction around each turn's messages, then the flush), with
NIXL replaced by reads that stay under way until a test says they are over."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tensorbroker.common.protocol import Request
from tensorbroker.server.cluster.cluster import Cluster, Joining
from tensorbroker.server.cluster.homes import Homes
from tensorbroker.server.durability.journal import Journal
from tensorbroker.server.queues.queue_state import BrokerQueue
from tensorbroker.server.queues.queues import Queues
from tensorbroker.server.store.arena import Arena
from tensorbroker.server.store.devices import DeviceMemory
from tensorbroker.server.store.objects import Objects
from tensorbroker.server.store.parking import ParkingLot
from tensorbroker.server.store.records import Session, StoredObject
from tensorbroker.server.store.registry import Registry
from tests.simcuda import SimRuntime
from tests.support import free_port

ASK_AGAIN = 0.1  # seconds (`Node.knows`)

MiB = 2**20


class Reads:
    """NIXL as far as a cluster uses it: every read stays under way (until `over`)."""

    metadata = b"agent"

    def __init__(self) -> None:
        self.fd, self._wake = os.pipe()  # (as the mover's; never written: reads end at once)
        self.mover = self  # (its `woken`)
        self.started: list[str] = []  # the keys read
        self.over = False  # reads end
        self.known: dict[str, bytes] = {}  # node -> its agent metadata, as last added
        self.vram = True  # device objects lent (False: as a NIXL without CUDA)

    def add_peer(self, node: str, metadata: bytes, version: Any = None) -> None:
        self.known[node] = metadata

    def agent_fields(self) -> dict[str, Any]:
        return {"agent": self.metadata}

    def register(self, segment: str) -> None: ...
    def woken(self) -> None: ...
    def close(self) -> None:
        os.close(self.fd)
        os.close(self._wake)

    def done(self, handle: Any) -> bool:
        return self.over and handle.limit == handle.size

    def offer(self, obj: Any, agent: bool = True, inline: bool = False) -> dict[str, Any]:
        if obj.device != "cpu" and not self.vram:
            raise OSError(f"{obj.block.segment} is not registered with NIXL (no VRAM here)")
        specs = [[t.name, t.dtype, list(t.shape)] for t in obj.tensors]
        offer = {"bundle": obj.bundle, "specs": specs, "size": obj.nbytes, "address": 1}
        if obj.device != "cpu":
            offer["device"] = obj.device
        return {**offer, "agent": self.metadata} if agent else offer

    def layout(self, node: str, offer: dict[str, Any]) -> tuple[list[Any], bool, str]:
        if "agent" in offer:  # (as Transfers.layout: the lender's metadata of then)
            self.add_peer(node, bytes(offer["agent"]))
        specs = [(str(n), str(d), tuple(s)) for n, d, s in offer["specs"]]
        return specs, bool(offer["bundle"]), str(offer.get("device", "cpu"))

    bytes_pushed = blocks_held = 0  # (no piece pushed here)

    def abandon(self, node: str, why: str) -> None: ...
    def restarted(self, node: str) -> None: ...
    def unwritten(self, node: str, tokens: Any) -> None: ...
    def wrote(self, node: str, m: dict[str, Any]) -> None: ...
    def writing(self, node: str, tokens: Any, inc: Any = None) -> None: ...
    def ask_about(self, now: float) -> None: ...
    def served(self) -> list[tuple[str, dict[str, Any]]]:
        return []

    def hold(self, reads: Any, release: Any) -> bool:  # (no piece pushed here: none held)
        return False

    def take(
        self, node: str, offer: dict[str, Any], obj: Any, lent: bool = False
    ) -> tuple[Any, int]:
        self.started.append(obj.key)
        size = int(offer["size"])
        return Taken(self, size, min(size, int(offer.get("ready", size)))), size

    def extend(self, handle: Any, ready: int) -> None:
        handle.limit = max(handle.limit, min(ready, handle.size))


class Taken:
    """A read of `size` bytes under way (as transfers.Reading), of which its source has
    `limit` (a relay lends what it still reads: the rest as it says): they end once `reads`
    do, and the read is done once all were there and read."""

    push = False  # (read, not pushed: Note [pushes])

    def __init__(self, reads: Reads, size: int, limit: int) -> None:
        self.reads, self.size, self.limit = reads, size, limit

    def ended(self) -> bool:
        return self.reads.over

    def ready(self) -> int:
        return self.limit if self.reads.over else 0


class Written(Journal):
    """A journal that keeps, in order, what reached its file (`("sealed", key)` once its
    transaction commits) beside the messages the broker sent (`("sent", op)`)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self._batch: list[tuple[str, str]] | None = None

    def begin(self) -> None:
        self._batch = []

    def commit(self) -> None:
        batch, self._batch = self._batch or [], None
        self.events.extend(batch)

    def sealed(self, obj: Any) -> None:
        event = ("sealed", str(obj.key))
        self.events.append(event) if self._batch is None else self._batch.append(event)


class Node:
    """A broker's cluster side, stepped by hand."""

    def __init__(
        self, name: str, port: int, peers: list[int], shm: Path, prefetch: int = 0,
        gpus: bool = False, quiet: bool = False, etcd: tuple[str, ...] = (), last: Any = None,
    ) -> None:  # fmt: skip
        """`prefetch`: serve --prefetch (0 here: a test pulls by hand, with `get`); `gpus`:
        it serves cuda:0, 8 MiB of a simulated GPU (tests/simcuda.py); `quiet`: its idle
        links are not beaten, as with etcd (Note [beats]); `etcd`: its endpoints (never
        reached: its membership is not started); `last`: the incarnation its journal named."""
        shm.mkdir(exist_ok=True)
        self.arena = Arena(32 * MiB, shm_dir=str(shm), chunk_size=4 * MiB)
        self.journal = Written()
        devices = DeviceMemory(load=SimRuntime if gpus else None, spec={0: 8 * MiB})
        devices.start()
        self.registry = Registry(self.arena, devices=devices, journal=self.journal)
        lot = ParkingLot()
        objects = Objects(self.registry, lot, lambda route, payload, last=False: None)
        self.poller, self.reads = zmq.Poller(), Reads()
        addresses = [f"tcp://127.0.0.1:{p}" for p in peers]
        joining = Joining(name, f"tcp://127.0.0.1:{port}", addresses, None, prefetch, etcd)
        self.queues = Queues(objects)
        self.cluster = Cluster(joining, objects, self.queues, lot, self.reads, self.poller, last)  # type: ignore[arg-type]
        self.cluster.links.quiet = quiet
        objects.elsewhere, self.objects = self.cluster.replicas, objects
        self.queues.elsewhere = self.cluster.queues
        self.session = Session(name * 8, None)
        self.name, self.closed = name, False
        self.asked: dict[str, float] = {}  # when this node last asked a key's home (`knows`)
        links, events = self.cluster.links, self.journal.events
        send_to = links.send_to

        def sent(peer: Any, message: dict[str, Any]) -> bool:
            events.append(("sent", str(message.get("op"))))
            return send_to(peer, message)

        links.send_to = sent  # type: ignore[method-assign]

    def put(self, key: str, nbytes: int, device: str = "cpu") -> StoredObject:
        specs = [("", "uint8", (nbytes,))]
        put, _ = self.registry.begin_put(self.session, key, specs, False, device=device)
        self.objects.seal(self.session, put, False)
        return self.registry.objects[key]

    def knows(self, key: str) -> bool:
        """Whether this node knows where `key` lives (its index): asked of the key's home as
        a client's `exists` does (Note [homes] in homes.py), again every ASK_AGAIN while the
        home answers it knows none: an ask can reach the home before the owner's claim."""
        replicas, now = self.cluster.replicas, time.monotonic()
        homes = replicas.homes
        unasked = key not in homes.asked and now - self.asked.get(key, -ASK_AGAIN) >= ASK_AGAIN
        if not replicas.holds(key) and unasked:
            # (its answer, none: a test's `_send` sees no more)
            homes.handlers["knows"] = lambda session, route, req: None
            asking = Request("knows", 9, {"key": key}, [])
            if homes.lookup(self.session, b"client", asking, [key]):
                self.asked[key] = now
        return replicas.holds(key) and not replicas.homes.asks  # (and its ask answered)

    def get(self, key: str) -> bool:
        req = Request("get", 7, {"key": key, "timeout": 10.0}, [])
        return self.cluster.replicas.get(self.session, b"client", req)

    def queue(self, name: str) -> BrokerQueue:
        self.queues.open(self.session, b"client", Request("queue", 1, {"name": name}, []))
        return self.queues.by_name[name]

    def queue_put(self, name: str, nbytes: int) -> None:
        q, specs = self.queue(name), [("", "uint8", (nbytes,))]
        put, _ = self.registry.begin_put(self.session, name, specs, False, queue=q)
        q.in_flight += 1  # (as a client's put does)
        q.pending += 1
        self.queues.seal(self.session, put, False, q)

    def step(self, skip: Any = None) -> None:
        """One turn of the loop (its ROUTER's messages left where they are, if `skip`)."""
        events = dict(self.poller.poll(1))
        self.journal.begin()
        for s in list(self.cluster.sockets):
            if s in events and s is not skip:
                self.cluster.ready(s)
        self.cluster.tick(time.monotonic())
        self.journal.commit()
        self.cluster.flush()
        self.objects.retry_growing_puts()  # (as the broker's loop: Note [growing])

    def up(self, node: str) -> bool:
        return self.cluster.links.up(node)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.cluster.close()
            self.arena.close()
            self.registry.devices.close()


def homed(homes: str, names: str, stem: str = "k") -> str:
    """A key whose home is node `homes[0]` of nodes `names`, all up, and its second home
    `homes[1]`, if named (Note [homes])."""
    members = tuple(sorted(names))
    keys = (f"{stem}{i}" for i in range(10_000))
    return next(k for k in keys if "".join(Homes.homes_of(k, members)).startswith(homes))


def run(nodes: list[Node], seconds: float, until: Callable[[], bool] | None = None) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for n in nodes:
            n.step()
        if until is not None and until():
            return True
    return until is None


def _made(tmp_path: Path, names: str) -> Iterator[Callable[[str], Node]]:
    ports, made = {n: free_port() for n in names}, []

    def make(name: str, prefetch: int = 0, gpus: bool = False, quiet: bool = False) -> Node:
        others = [p for n, p in ports.items() if n != name]
        shm = tmp_path / f"{name}{len(made)}"
        node = Node(name, ports[name], others, shm, prefetch, gpus, quiet)
        made.append(node)
        return node

    yield make
    for node in made:
        node.close()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Callable[[str], Node]]:
    """Nodes a and b, made on demand (`make(name)`; a name made again: that node restarted
    on a new process)."""
    yield from _made(tmp_path, "ab")


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[Callable[[str], Node]]:
    """Nodes a, b and c, as `pair`."""
    yield from _made(tmp_path, "abc")


@pytest.fixture
def quad(tmp_path: Path) -> Iterator[Callable[[str], Node]]:
    """Nodes a, b, c and d, as `pair`."""
    yield from _made(tmp_path, "abcd")
