"""Keyed objects: put, seal, abort, get (and watch), delete, exists, keys.

What an object is and how its memory lives is the registry's (registry.py); this module turns
requests into registry calls and replies. A get of a version not sealed yet parks in the
key's line until a seal answers it. A device put that does not fit while freed device blocks
still wait for GPU work (Note [device memory] in devices.py) parks until memory comes back,
up to DEVICE_WAIT from its first try; queue puts use the same waiting (`wait_for_device`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ...common.descriptors import grant_class, object_wire
from ...common.errors import BrokerError, CapacityError, InvalidRequest, NotFound, Timeout
from ...common.protocol import Request, reply_error, reply_ok
from .arena import Growing
from .events import EventLog
from .eviction import Eviction
from .parking import ParkingLot, Waiter, secs
from .records import Session, StoredObject
from .registry import Registry

DEVICE_WAIT = 10.0  # a device put waits this long for quarantined memory to come back
DEVICE_PUTS = ("device puts",)  # the parking lot's line of device puts waiting for memory
GROWING_PUTS = ("growing puts",)  # its line of puts waiting for host memory to grow

Reply = dict[str, Any]
log = logging.getLogger(__name__)


class Send(Protocol):
    """Sends a reply: at once, or with `last` after the replies of the requests at hand."""

    def __call__(self, route: bytes, payload: bytes, last: bool = False) -> None: ...


class Elsewhere(Protocol):
    """The keys other nodes of a cluster hold (cluster.py's Cluster)."""

    def announce(self, key: str, version: int) -> None: ...
    def get(self, session: Session, route: bytes, req: Request) -> bool: ...
    def keys(self) -> list[str]: ...
    def lookup(self, session: Session, route: bytes, req: Request, keys: list[str]) -> bool: ...
    def gather(
        self, session: Session, route: bytes, req: Request, query: dict[str, Any]
    ) -> bool: ...
    def rows(self, req: Request) -> Mapping[str, tuple[str, int, int]]: ...
    def follow_prefix(self, prefix: str) -> None: ...
    def holds(self, key: str) -> bool: ...
    def delete(self, key: str) -> bool: ...
    def where(self) -> Mapping[str, tuple[str, int, int]]: ...

    @property
    def node(self) -> str: ...


class Objects:
    """The handlers of keyed objects. `send(route, payload)` sends a reply."""

    def __init__(self, registry: Registry, lot: ParkingLot, send: Send) -> None:
        self.registry, self.devices, self.lot, self._send = registry, registry.devices, lot, send
        self._memory_back = False  # device memory was freed since device puts last tried
        self.refills: list[tuple[Session, bytes, int, str]] = []  # grants to top up (refill_later)
        self._waits: dict[str, set[Waiter]] = {}  # key -> waits for many keys that name it
        self.events = EventLog(lot, send)  # every put and delete, for watch_prefix
        self.eviction = Eviction(registry, self._evicted)
        self.elsewhere: Elsewhere | None = None  # the other nodes of a cluster (cluster.py)

    def _evicted(self, obj: StoredObject) -> None:
        self._gone(obj.key, obj.version)

    def _gone(self, key: str, version: int) -> None:
        """`key` was deleted (or evicted) here at `version`: watchers of it are told, and the
        other nodes."""
        self.gone(key, version)
        if self.elsewhere is not None:
            self.elsewhere.announce(key, 0)

    def gone(self, key: str, version: int) -> None:
        """`key` is no more at `version` (here, or on the node that had it): its watchers are
        told (a per-key `watch` parks a get with `deletes`; `watch_prefix` reads the event
        log)."""
        for w in self.lot.line(("get", key)):
            if not w.done and w.request.fields.get("deletes", False):
                self.answer(w, reply_ok(w.request.id, deleted=True))
        self.events.record("delete", key, version)

    def answer(self, w: Waiter, payload: bytes, last: bool = False) -> None:
        """Answer a request that waited (`last`: as `Send`)."""
        self.lot.unpark(w)
        self._send(w.route, payload, last)

    # -- writing ---------------------------------------------------------------------------

    def put(self, session: Session, route: bytes, req: Request) -> Reply | None:
        f = req.fields

        def grant() -> Reply:
            put_id, obj = self.registry.begin_put(
                session, f["key"], f["tensors"], f.get("bundle", False),
                device=f.get("device", "cpu"), wait=True,
            )  # fmt: skip
            obj.evictable = f.get("evictable", False)
            return self.granted(put_id, obj)

        return self.grant_or_wait(session, route, req, grant)

    def grant(self, session: Session, route: bytes, req: Request) -> Reply:
        """Blocks granted ahead for puts of up to `size` bytes (Note [grants] in
        grants.py); none if that size has none, or the arena is too full to spare them."""
        device = req.fields.get("device", "cpu")
        size_class = grant_class(req.fields["size"], device != "cpu")
        grants = self.registry.grants.grant(session, size_class, device) if size_class else []
        return {"grants": grants}

    def write(self, session: Session, route: bytes, req: Request) -> Reply:
        """A block granted ahead, written: sealed as the next version of its key; the reply
        tops up the client's grants of its size."""
        f = req.fields
        if "key" not in f:
            raise InvalidRequest("write: a write names a key or a queue")
        put_id = f["put"]
        try:
            obj = self.registry.fill(
                session, put_id, f["key"], f["tensors"], f.get("bundle", False)
            )
        except BrokerError:
            self.drop_grant(session, put_id)
            raise
        obj.evictable = f.get("evictable", False)
        reply = self.seal(session, put_id, keep=False)
        self.refill_later(session, route, obj.block.size, obj.device)
        return reply

    def refill_later(
        self, session: Session, route: bytes, size_class: int, device: str = "cpu"
    ) -> None:
        """Top up `session`'s grants of `size_class` on `device` once the replies of this
        batch are out, in a message of their own (Seals.top_up): not on the writer's path."""
        self.refills.append((session, route, size_class, device))

    def drop_grant(self, session: Session, put_id: int) -> None:
        """A write that failed: its block goes back (whatever the reply, a write's block is
        the client's no more)."""
        if put_id in session.pending:
            self.registry.abort(session, put_id, keep=False)

    def granted(self, put_id: int, obj: StoredObject) -> Reply:
        """A put's reply: where to write, and for a device object the chunk's IPC handle and
        the write event to record after the copy."""
        reply = {"put": put_id, "tensors": obj.wire, "oid": obj.oid}
        if obj.events is not None:
            reply.update(self._device_fields(obj))
        return reply

    def _device_fields(self, obj: StoredObject) -> Reply:
        assert obj.events is not None
        write = obj.events[0]
        return {
            "handle": self.devices.arena(obj.device).handle(obj.block.segment),
            "event": [write, self.devices.handle(write)],
        }

    def grant_or_wait(
        self,
        session: Session,
        route: bytes,
        req: Request,
        grant: Callable[[], Reply],
        deadline: float | None = None,
    ) -> Reply | None:
        """`grant()`'s reply; or, for a device put that does not fit while freed blocks wait
        for GPU work, park it (until `deadline`, else DEVICE_WAIT from now) and try again
        when memory comes back; or, for a put that waits for host memory to grow (Note
        [growing] in arena.py), park it until the segment is made."""
        try:
            return grant()
        except Growing:
            self.lot.park(session, route, req, None, GROWING_PUTS, "", retry=grant)
            return None
        except CapacityError as exc:
            if req.fields.get("device", "cpu") == "cpu" or not self.devices.quarantine:
                raise
            if deadline is None:
                deadline = time.monotonic() + DEVICE_WAIT
            message = f"{exc} (waited {DEVICE_WAIT:g}s for readers' GPU work to finish)"
            self.lot.park(
                session, route, req, None, DEVICE_PUTS, message, deadline=deadline, retry=grant
            )
            return None

    def memory_back(self) -> None:
        """Device memory was freed (devices.py calls this): waiting puts try again."""
        self._memory_back = True

    def retry_device_puts(self) -> None:
        """Try the device puts waiting for memory again, if any came back, in their order."""
        if not self._memory_back:
            return
        self._memory_back = False
        for w in self.lot.line(DEVICE_PUTS):
            self._retry(w)

    def retry_growing_puts(self) -> None:
        """Once host memory grew, or failed to, the puts that waited for it try again, in
        their order (Note [growing] in arena.py). Called by the loop, outside any request:
        an error of one is its reply, never the loop's."""
        arena = self.registry.arena
        growth = arena.grown()
        if growth is None:
            return
        with arena.after(growth):
            for w in self.lot.line(GROWING_PUTS):
                self._retry(w)

    def _retry(self, w: Waiter) -> None:
        self.lot.unpark(w)
        assert w.retry is not None
        try:
            result = self.grant_or_wait(w.session, w.route, w.request, w.retry, w.deadline)
        except BrokerError as exc:
            self._send(w.route, reply_error(w.request.id, exc))
        except Exception as exc:  # (a bug must not take the broker down: dispatch.py's way)
            log.exception("internal error granting request %s", w.request.id)
            self._send(w.route, reply_error(w.request.id, BrokerError(f"internal error: {exc!r}")))
        else:
            if result is not None:
                self._send(w.route, reply_ok(w.request.id, **result))

    def seal(self, session: Session, put_id: int, keep: bool, version: int | None = None) -> Reply:
        """Publish a keyed put as its key's next version (or `version`: a replica), and answer
        the gets waiting for it."""
        obj = self.registry.seal(session, put_id, keep, version)
        obj.last_use = time.monotonic()
        for w in self.lot.line(("get", obj.key)):
            if w.done:  # answered in this loop already (its client cut off, say)
                continue
            if w.request.fields.get("after", 0) < obj.version:
                reply = self.describe(w.session, obj, w.request.id)
                self.answer(w, reply_ok(w.request.id, **reply))
        if version is None:  # (a replica's put was an event when its owner announced it)
            self.arrived(obj.key, obj.version)
        if self.elsewhere is not None:
            self.elsewhere.announce(obj.key, obj.version)
        return {"version": obj.version}

    def arrived(self, key: str, version: int) -> None:
        """`key` has `version` now, here or (a cluster's) on another node: the waits for
        keys that name it, and watch_prefix, are told."""
        for w in list(self._waits.get(key, ())):
            if w.done:
                continue
            present = self._present(w.request)
            if len(present) >= w.request.fields["num"]:
                self.answer(w, reply_ok(w.request.id, keys=present))
        self.events.record("put", key, version)

    def abort(self, session: Session, route: bytes, req: Request) -> Reply:
        self.registry.abort(session, req.fields["put"], req.fields.get("keep", False))
        return {}

    # -- reading ---------------------------------------------------------------------------

    def describe(
        self, session: Session, obj: StoredObject, request_id: int, shared: bool = False
    ) -> Reply:
        """The object as a reader sees it, with a new lease of the reader's on it (a queue
        item is handed over to request `request_id`: the reader's lease is then all that
        keeps it; unless `shared`, an item of a broadcast queue, which keeps it too)."""
        if obj.queue is not None and not shared:
            lease = self.registry.hand_over(session, obj, request_id)
        else:
            lease = self.registry.lease(session, obj, reader=True)
            obj.last_use = time.monotonic()
        reply = object_wire(obj.key, obj.version, obj.bundle, obj.wire, lease)
        reply["oid"] = obj.oid
        if obj.events is not None:  # and the event this reader records when it lets go
            done = session.read_events[lease]
            reply.update(self._device_fields(obj), done=[done, self.devices.handle(done)])
        return reply

    def get(self, session: Session, route: bytes, req: Request) -> Reply | None:
        """The live version of a key, if newer than `after`; else wait for one up to timeout.
        With `deletes` (a watch that saw version `after`): {"deleted": True} if the key has
        none now, or when it is deleted (or evicted) while this waits."""
        f = req.fields
        key, timeout, after = f["key"], f.get("timeout", 0.0), f.get("after", 0)
        obj = self.registry.objects.get(key)
        if obj is not None and obj.version > after:
            return self.describe(session, obj, req.id)
        elsewhere = self.elsewhere is not None and self.elsewhere.holds(key)
        if obj is None and not elsewhere and self._lookup(session, route, req, [key]):
            return None  # its home is asked where it lives, and the get runs again
        if obj is None and after and f.get("deletes", False) and not elsewhere:
            return {"deleted": True}  # gone since the watcher's version
        if elsewhere and self.elsewhere.get(session, route, req):  # type: ignore[union-attr]
            return None  # a newer version is pulled from the node that has it, then answered
        if after:
            what = f"no version of {key!r} newer than {after} was sealed"
        else:
            what = f"no object {key!r} was put"
        now: BrokerError = Timeout(what)
        if obj is None and not after:
            now = NotFound(f"no object {key!r}; put it first, or pass timeout= to wait for it")
        message = f"{what} within {secs(timeout)}"
        self.lot.wait(session, route, req, timeout, ("get", key), now, message)
        return None

    def wait(self, session: Session, route: bytes, req: Request) -> Reply | None:
        """The keys of `keys` that exist, once `num` of them do, or when the timeout passes
        (then however many do: no error)."""
        keys, num = req.fields["keys"], req.fields["num"]
        if not 1 <= num <= len(keys):
            raise InvalidRequest(f"wait: num must be 1 to the {len(keys)} keys named, not {num}")
        present = self._present(req)
        timeout = req.fields.get("timeout", 0.0)
        missing = [k for k in keys if k not in present]
        if len(present) < num and self._lookup(session, route, req, missing):
            return None  # their homes are asked where they live (and it runs again)
        if len(present) >= num or timeout == 0.0:
            return {"keys": present}
        w = self.lot.park(session, route, req, timeout, deque(), "")

        def leave() -> None:
            for key in keys:
                waits = self._waits.get(key)
                if waits is not None:
                    waits.discard(w)
                    if not waits:
                        del self._waits[key]

        w.at_deadline = lambda: reply_ok(req.id, keys=self._present(req))
        w.on_leave = leave
        for key in keys:  # every key: one there now may go, and come back
            self._waits.setdefault(key, set()).add(w)
        return None

    def waits(self, key: str) -> bool:
        """Whether a wait for keys that names `key` is parked."""
        return key in self._waits

    def _present(self, req: Request) -> list[str]:
        objects, elsewhere = self.registry.objects, self.elsewhere
        return [
            k for k in req.fields["keys"]
            if k in objects or (elsewhere is not None and elsewhere.holds(k))
        ]  # fmt: skip

    def delete(self, session: Session, route: bytes, req: Request) -> Reply | None:
        key = req.fields["key"]
        if self.elsewhere is not None and self.elsewhere.delete(key):
            return {}  # another node's: deleted there (and its replica here)
        if key not in self.registry.objects and self._lookup(session, route, req, [key]):
            return None  # its home is asked where it lives (and the delete runs again)
        self.forget(key)
        return {}

    def forget(self, key: str) -> None:
        """Delete `key` here (NotFound if it has no object), and tell its watchers."""
        version = self.registry.delete(key)
        self._gone(key, version)

    def exists(self, session: Session, route: bytes, req: Request) -> Reply | None:
        key = req.fields["key"]
        there = self.elsewhere is not None and self.elsewhere.holds(key)
        if not there and key not in self.registry.objects:
            if self._lookup(session, route, req, [key]):
                return None  # its home is asked where it lives (and it runs again)
        return {"exists": key in self.registry.objects or there}

    def _lookup(self, session: Session, route: bytes, req: Request, keys: list[str]) -> bool:
        """In a cluster, keys this node knows nothing of: their homes are asked where they
        live, and `req` waits to run again (Note [homes] in cluster/homes.py)."""
        return self.elsewhere is not None and self.elsewhere.lookup(session, route, req, keys)

    def watch_prefix(self, session: Session, route: bytes, req: Request) -> Reply | None:
        """The events under a prefix (EventLog); in a cluster, the other nodes tell this one
        of each version under it from now on."""
        if self.elsewhere is not None:
            self.elsewhere.follow_prefix(req.fields["prefix"])
        return self.events.watch(session, route, req)

    def keys(self, session: Session, route: bytes, req: Request) -> Reply | None:
        """Every key; in a cluster, every node is asked for its own (and this runs again)."""
        if self.elsewhere is None:
            return {"keys": sorted(self.registry.objects)}
        if self.elsewhere.gather(session, route, req, {}):
            return None
        return {"keys": sorted({*self.registry.objects, *self.elsewhere.rows(req)})}
