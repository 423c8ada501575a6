"""The object registry: keys, versions, bundles, leases, and when memory goes back.

An object lives in one arena block (a bundle's tensors packed inside it, each aligned). It is
*pending* from `put` to `seal`, then *live* as the current version of its key until deleted or
replaced, then *retired*. Its memory returns to the arena when it is no longer live and no
lease holds it. A lease is one holder: each `get`, and the putter until it lets go. Leases
belong to a session, so a client that dies gives all of its leases back at once.

    put ──> pending ──seal──> live ──delete / newer version sealed──> retired
               │                                                      │
               └──abort / putter died──> retired ──last lease gone──> freed

A queue item takes the same path, except that it is live while it waits in its queue (not
under a key) and retires the moment one consumer takes it, so it is freed as soon as that
consumer lets go. Its queue learns of the free through `on_free`: that is what opens a slot.

Note [a producer that dies with its copy queued]

A device put seals as soon as its copy is *enqueued* on the producer's stream (no host
wait). If the producer is killed before that copy ran, the copy never runs and the object's
write event never completes (Note [events of dead processes] in devices.py): on an H100 a
reader of such an object waited on the GPU for as long as it was watched. So each session
keeps the device objects it sealed until their write events complete (`writing`), the
broker keeps watching a closed client's pidfd while any remain, and when the process dies
`lose_unwritten` unpublishes the ones whose copy had not run: a later get finds no object
(or the queue no item) rather than one that never held the data. A reader that took such
an object before the death still waits on the GPU forever; no broker can undo a stream
wait. A client that closes normally first waits for its copies (`DeviceLink.drain`), so a
producer that puts and exits loses nothing.

Blocks granted ahead, for puts that take one trip: grants.py (Note [grants]). Leases, and
items handed to a queue's consumer: leasing.py.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...common.config import format_size
from ...common.cudart import device_index
from ...common.descriptors import DEVICE_ALIGN, MIN_ALIGN, Shapes, laid_out, layout
from ...common.errors import CapacityError, InvalidRequest, NotFound
from ..durability.journal import ID_STEP, Journal
from .arena import Arena, Block
from .devices import DeviceArena, DeviceMemory
from .directory import Directory
from .grants import GrantBook
from .leasing import Leasing
from .records import Session, StoredObject
from .segments import ShmExhausted

if TYPE_CHECKING:
    from .members import SlotTables

log = logging.getLogger(__name__)


class Registry(Leasing):
    def __init__(
        self,
        arena: Arena,
        on_free: Callable[[StoredObject], None] | None = None,
        devices: DeviceMemory | None = None,
        directory: Directory | None = None,
        slots: SlotTables | None = None,
        journal: Journal | None = None,
        first_id: int = 1,
    ) -> None:
        self.arena = arena
        # Frees evictable objects worth that many bytes; whether it freed any (eviction.py).
        self.make_room: Callable[[int], bool] | None = None
        self.journal = journal if journal is not None else Journal()
        self.directory, self.slots = directory, slots  # None: every get asks the broker
        self._unlisted: dict[int, StoredObject] = {}  # retired, unleased: slots to be scanned
        self.devices = devices if devices is not None else DeviceMemory(load=None)
        self.on_free = on_free  # told of every freed queue item
        self.objects: dict[str, StoredObject] = {}  # key -> live version
        self.shapes = Shapes()  # the shapes and strides of objects' descriptors, shared
        self.pending: dict[int, StoredObject] = {}  # put lease id -> object
        self._versions: dict[str, int] = {}  # key -> last version sealed
        self._ids = itertools.count(first_id)
        self.first_id = first_id  # ids below it were given by a broker that died
        self._id_limit = first_id  # ids below it are reserved in the journal
        self.lease_count = 0
        self.published = 0  # objects and queue items sealed by this broker
        # Blocks granted ahead, on the host and each device (Note [grants] in grants.py).
        self.grants = GrantBook(arena, self.devices, self._open_put)

    def new_id(self) -> int:
        """A new id, of the same series as objects' and leases' (never given before)."""
        return self._id()

    def _id(self) -> int:
        """A new object or lease id, never given before (across restarts too)."""
        i = next(self._ids)
        if i >= self._id_limit:
            self._id_limit = i + ID_STEP
            self.journal.meta("next_id", self._id_limit)
        return i

    # -- writing -------------------------------------------------------------------------

    def begin_put(
        self,
        session: Session,
        key: str,
        specs: list[tuple[str, str, tuple[int, ...]]],
        bundle: bool,
        queue: Any = None,
        device: str = "cpu",
        wait: bool = False,
    ) -> tuple[int, StoredObject]:
        """Allocate an object's block; the putter holds it by the returned lease id. `wait`:
        Growing if host memory must grow first (Note [growing] in arena.py)."""
        if not bundle and (len(specs) != 1 or specs[0][0] != ""):
            raise InvalidRequest(f"put {key!r}: a plain object holds one unnamed tensor")
        arena = self.arena if device == "cpu" else self.devices.arena(device)
        offsets, size, align = layout(specs, MIN_ALIGN if device == "cpu" else DEVICE_ALIGN)
        block = self._allocate(arena, key, size, align, wait and arena is self.arena)
        device = sys.intern(device)  # not a string of its own in every object
        wire = laid_out(specs, offsets, block.segment, block.offset, device, self.shapes)
        obj = StoredObject(key, bundle, block, wire, queue=queue, device=device)
        try:
            return self._open_put(session, obj), obj
        except ShmExhausted as exc:  # no event for it (nothing of it is registered yet)
            arena.free(block)
            raise CapacityError(f"cannot store {key!r}: {exc}") from None

    def _open_put(self, session: Session, obj: StoredObject) -> int:
        """`obj` is a pending put of `session`, held by the returned lease id. ShmExhausted
        (no event for a device object) before anything of it is registered."""
        obj.oid = self._id()
        if obj.device != "cpu":
            obj.events = [self.devices.event(device_index(obj.device))[0]]
        put_id = self.lease(session, obj)
        self.pending[put_id] = obj
        session.pending.add(put_id)
        if obj.device == "cpu":
            self.journal.granted(obj, session.token, put_id)
        return put_id

    def fill(
        self,
        session: Session,
        put_id: int,
        key: str,
        specs: list[tuple[str, str, tuple[int, ...]]],
        bundle: bool,
        queue: Any = None,
    ) -> StoredObject:
        """A block granted ahead, written by its client: now a put of `key` (or an item of
        `queue`) laid out as `specs`, ready to seal."""
        obj = self.pending_put(session, put_id, "write")
        self.grants.of(obj.device).fill(session, put_id, obj, key, specs, bundle, self.shapes)
        obj.queue = queue
        return obj

    def _unpend(self, session: Session, put_id: int) -> StoredObject:
        """A pending put ends (sealed, aborted, or let go)."""
        obj = self.pending.pop(put_id)
        session.pending.discard(put_id)
        if obj.granted:
            self.grants.of(obj.device).ungrant(session, obj)
        return obj

    def _allocate(self, arena: Arena, key: str, size: int, align: int, wait: bool) -> Block:
        try:
            block = arena.allocate(size, align, wait=wait)
            if block is None and arena is self.arena and self.reclaim():  # scan now, not later
                block = arena.allocate(size, align, wait=wait)
            while block is None and arena is self.arena and self.make_room and self.make_room(size):
                block = arena.allocate(size, align, wait=wait)
        except ShmExhausted as exc:
            raise CapacityError(f"cannot store {key!r} ({format_size(size)}): {exc}") from None
        if block is None:
            where, option = "", "--memory"
            if isinstance(arena, DeviceArena):
                where, option = f" on cuda:{arena.device}", "--cuda-memory"
            raise CapacityError(
                f"cannot store {key!r}{where}: it needs {format_size(size)}, and the broker has "
                f"{format_size(arena.free_bytes)} free of {format_size(arena.capacity)} "
                f"(largest free block {format_size(arena.largest_free)}). Delete objects or drop "
                f"arrays you no longer need, or restart the broker with a larger {option}."
            )
        return block

    def seal(
        self, session: Session, put_id: int, keep: bool, version: int | None = None
    ) -> StoredObject:
        """Publish a pending put: as the next version of its key (or as `version`, a replica
        of another node's: Note [cluster] in cluster.py), or (a queue item, whose version the
        queue numbers) live and unkeyed, for the queue to hand over."""
        self.pending_put(session, put_id, "seal")
        obj = self._unpend(session, put_id)
        obj.live, obj.sealed_at = True, time.monotonic()
        self.published += 1
        if obj.events is not None:  # forget the finished ones: the list stays short
            session.writing = [o for o in session.writing if not self._written(o)]
            session.writing.append(obj)
        if obj.queue is not None:
            obj.version = version or 0
        else:
            obj.version = version or self._versions.get(obj.key, 0) + 1
            self._versions[obj.key] = max(obj.version, self._versions.get(obj.key, 0))
            old = self.objects.get(obj.key)
            self.objects[obj.key] = obj
            self._list(obj)  # (before the old version can be freed)
            if old is not None:
                self._retire(old)
        if obj.device == "cpu" and not (version and obj.queue is None):
            self.journal.sealed(obj)  # (not a replica: a broker that restarts pulls it again)
        if not keep:
            self.release(session, put_id)
        return obj

    def _list(self, obj: StoredObject) -> None:
        """List `obj` in the directory as its key's version (a device object: unlisted)."""
        if self.directory is not None and obj.device == "cpu":
            obj.listed = self.directory.publish(obj.key, obj.oid, obj.version, obj.bundle, obj.wire)
        elif self.directory is not None:
            self.directory.remove(obj.key)

    def abort(self, session: Session, put_id: int, keep: bool) -> None:
        self.pending_put(session, put_id, "abort")
        obj = self._unpend(session, put_id)
        self._retire(obj)
        if not keep:
            self.release(session, put_id)

    def pending_put(self, session: Session, put_id: int, what: str) -> StoredObject:
        obj = self.pending.get(put_id)
        if obj is None or put_id not in session.pending:
            raise InvalidRequest(f"{what}: no unsealed put {put_id} from this client")
        return obj

    def _written(self, obj: StoredObject) -> bool:
        return obj.freed or obj.events is None or self.devices.finished(obj.events[0])

    def writing(self, session: Session) -> bool:
        """Whether copies into device objects `session` sealed may still be running."""
        session.writing = [o for o in session.writing if not self._written(o)]
        return bool(session.writing)

    def lose_unwritten(self, session: Session) -> list[StoredObject]:
        """`session`'s process died: unpublish the device objects it sealed whose copies had
        not run, and count their write events as done. The objects lost."""
        lost = [o for o in session.writing if not self._written(o)]
        session.writing.clear()
        for obj in lost:
            assert obj.events is not None
            self.devices.forget(obj.events[:1])
            if obj.queue is None and self.objects.get(obj.key) is obj:
                del self.objects[obj.key]
            elif obj.queue is not None and obj in obj.queue.items:
                obj.queue.items.remove(obj)
                obj.queue.unseen.pop(obj.oid, None)  # a broadcast queue's
            self._retire(obj)
        return lost

    def delete(self, key: str) -> int:
        """Delete `key`; the version it had."""
        obj = self.objects.pop(key, None)
        if obj is None:
            raise NotFound(f"no object {key!r} to delete")
        if self.directory is not None:
            self.directory.remove(key)
        self.journal.key_deleted(key, obj.version)
        self._retire(obj)
        return obj.version

    # -- memory --------------------------------------------------------------------------

    def pin(self, obj: StoredObject) -> None:
        """A hold on `obj` that is no session's (a broadcast ring's slot): it is not freed
        until `unpin`."""
        obj.leases += 1

    def unpin(self, obj: StoredObject) -> None:
        obj.leases -= 1
        self._maybe_free(obj)

    def retire(self, obj: StoredObject) -> None:
        """No longer live (an item every subscriber of its broadcast queue has): freed once
        no lease holds it."""
        self._retire(obj)

    def _retire(self, obj: StoredObject, taker: str | None = None, took: int | None = None) -> None:
        obj.live = False
        obj.retired = True
        self._maybe_free(obj)
        if not obj.freed and obj.device == "cpu":
            self.journal.retired(obj, taker, took)

    def _maybe_free(self, obj: StoredObject) -> None:
        if obj.retired and obj.leases == 0 and not obj.freed:
            if obj.listed:  # a reader's slot may hold it: free it after a scan says not
                self._unlisted[obj.oid] = obj
                return
            obj.freed = True
            if obj.device == "cpu":
                self.arena.free(obj.block)
                self.journal.freed(obj)
                self._freed(obj)
            else:  # back once the GPU work of its writer and readers is done
                index = device_index(obj.device)
                self.devices.retire(index, obj.block, obj.events or [], lambda: self._freed(obj))

    def _freed(self, obj: StoredObject) -> None:
        if obj.queue is not None and self.on_free is not None:
            self.on_free(obj)

    @property
    def scanning(self) -> bool:
        """Whether retired objects wait for a scan of the lease slots."""
        return bool(self._unlisted)

    def reclaim(self) -> int:
        """Free the retired objects no lease slot holds (Note [directory and lease slots]);
        how many."""
        if not self._unlisted:
            return 0
        held = self.slots.held() if self.slots is not None else {}
        free = [obj for oid, obj in self._unlisted.items() if oid not in held]
        for obj in free:
            del self._unlisted[obj.oid]
            obj.listed = False
            self._maybe_free(obj)
        return len(free)

    # -- what adoption rebuilds (adoption.py) ---------------------------------------------

    def seen_version(self, key: str, version: int) -> None:
        """`key` had `version` once (at a broker that died): a put of it goes on from there."""
        self._versions[key] = max(self._versions.get(key, 0), version)

    def carry_put(self, session: Session, put_id: int, obj: StoredObject, granted: bool) -> None:
        """A pending put of a broker that died, carried over to its writer still alive
        (`granted`: a block granted ahead, not yet written)."""
        self.pending[put_id] = obj
        session.pending.add(put_id)
        if granted:
            self.grants.host.carry(session, obj)
        self.lease(session, obj, lease_id=put_id)

    def relist(self, obj: StoredObject) -> None:
        """A live object of a broker that died, live again: the current version of its key,
        or an item waiting in its queue. (Also a live object whose version changed: Note
        [homes] in cluster/homes.py.)"""
        obj.live = True
        self.seen_version(obj.key, obj.version)
        if obj.queue is not None:
            obj.queue.items.append(obj)
            return
        self.objects[obj.key] = obj
        self._list(obj)

    def stats(self) -> dict[str, int]:
        slotted = sum(self.slots.held().values()) if self.slots is not None else 0
        arena = self.arena.stats()
        granted, host = self.grants.blocks, self.grants.host
        return {
            **arena,
            "used_bytes": arena["used_bytes"] - host.bytes,  # by objects
            "objects": len(self.objects),
            "pending": len(self.pending) - granted,  # puts being written
            "granted_bytes": host.bytes,  # blocks granted ahead, not yet written
            "leases": self.lease_count - granted + slotted,
            # retired, unleased, and freed once a scan finds no lease slot holding them
            "waiting_bytes": sum(obj.block.size for obj in self._unlisted.values()),
        }
