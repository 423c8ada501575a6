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

Note [grants]

A small put would take two round trips, one for its memory and one for its seal. So the
broker grants each writing client blocks ahead, per size class (a page to 1 MiB by powers
of two, `grant_class`): a pending put with no key yet (`StoredObject.granted`), held by the
client as a put lease, journaled like any put. The client lays its tensors out in a block
of the class that fits (`layout`, which both ends compute alike), copies, and sends one
`write` naming the block; the broker checks that the block is that client's grant and
that the layout fits, then seals it as any put. Once the batch's replies are out, the
broker tops the client's grants of that class back up to `grant_depth` and sends them in a
message of their own (id 0, on the socket of the write), which the client reads with its
next reply: refills cost no trip, and are not on the writer's path. Grants are real allocations
(they count in `stats()["granted_bytes"]` and never let the arena go past its capacity),
and are made only while a quarter of the arena stays free: a put that finds no grant asks
for its block as before. A client that dies, closes, or loses its broker lets them go
like any unsealed put.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ..common.config import format_size
from ..common.cudart import device_index
from ..common.descriptors import MIN_ALIGN, PAGE, Shapes, TensorDesc, laid_out, layout
from ..common.dtypes import dtype
from ..common.errors import CapacityError, InvalidRequest, NotFound
from .arena import Arena, Block, ShmExhausted
from .devices import DEVICE_ALIGN, DeviceArena, DeviceMemory
from .directory import Directory
from .state import ID_STEP, LIVE, PENDING, Journal, Row

if TYPE_CHECKING:
    from .members import SlotTables

log = logging.getLogger(__name__)

GRANT_AHEAD_BYTES = 1 << 20  # a client is granted about this much of one size class ahead,
GRANT_DEPTH = (2, 8)  # and at least 2 blocks of it, at most 8
GRANT_FREE_SHARE = 4  # grants ahead only while more than 1/4 of the arena stays free


def grant_depth(size_class: int) -> int:
    """Blocks of `size_class` a client is granted ahead."""
    return max(GRANT_DEPTH[0], min(GRANT_DEPTH[1], GRANT_AHEAD_BYTES // size_class))


@dataclass(eq=False, slots=True)
class StoredObject:
    key: str
    bundle: bool
    block: Block
    wire: Sequence[Any]  # its tensors, as sent on the wire (built once, at put: laid_out)
    version: int = 0  # set at seal
    leases: int = 0
    live: bool = False
    retired: bool = False
    freed: bool = False
    queue: Any = None  # the queue this item goes to (None: a keyed object)
    device: str = "cpu"  # or "cuda:N": then block is in that device's arena
    events: list[int] | None = None  # a device object's write and read-done events
    oid: int = 0  # its id, never reused: what lease slots hold
    listed: bool = False  # in the directory since sealed: readers' slots may hold it
    granted: bool = False  # a block granted ahead, not yet written (Note [grants])
    evictable: bool = False  # may be freed to make room (eviction.py)
    last_use: float = 0.0  # when it was put, or last read through the broker (monotonic)

    @property
    def nbytes(self) -> int:
        return self.block.size

    @property
    def tensors(self) -> tuple[TensorDesc, ...]:
        return tuple(TensorDesc.from_wire(w) for w in self.wire)

    @property
    def data_bytes(self) -> int:
        """The bytes of its tensors (its block may be larger: blocks come in size classes)."""
        return sum(dtype(t.dtype).nbytes(t.shape) for t in self.tensors)


class Peer(NamedTuple):
    """The process at the other end of a socket, as the kernel says (SO_PEERCRED)."""

    pid: int | None  # None where the kernel cannot say (another pid namespace)
    uid: int | None


@dataclass(eq=False, slots=True)
class Session:
    """One client (all the sockets of one `Client`), known from its hello."""

    token: str
    pid: int | None
    boot_id: str | None = None
    start_time: int | None = None
    leases: dict[int, StoredObject] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)  # lease ids of its unsealed puts
    read_events: dict[int, int] = field(default_factory=dict)  # device lease -> read-done event
    writing: list[StoredObject] = field(default_factory=list)  # device objects it sealed whose
    # copies may still be running (Note [a producer that dies with its copy queued])
    routes: set[bytes] = field(default_factory=set)  # its sockets' ZeroMQ routing ids
    pidfd: int | None = None  # readable when the client process exits
    last_seen: float = 0.0  # for sessions without a pidfd: heartbeats keep them alive
    closed: bool = False  # said bye, kept only for the leases its process still holds
    region: int | None = None  # its lease-slot region (Note [directory and lease slots])
    mailbox: int | None = None  # its mailbox (Note [direct handoff] in common/mailbox.py)
    applied: int = 0  # the request id of its last seal applied (or refused) and journaled
    awaiting: bool = False  # adopted from a broker that died: not back yet (Note [recovery])
    came_back: bool = False  # adopted, and its hello with its leases was answered
    grants: dict[int, int] = field(default_factory=dict)  # size class -> blocks granted ahead
    credits: dict[int, int] = field(default_factory=dict)  # queue id -> slots granted ahead
    uid: int | None = None  # the kernel's word for the user it runs as (None: tcp://)

    def __repr__(self) -> str:
        return f"<session {self.token[:8]} pid={self.pid} uid={self.uid}>"


class Registry:
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
        self.granted_bytes = self.granted_blocks = 0  # granted ahead (Note [grants])
        # Adopted from a broker that died (Note [recovery] in state.py):
        self.adopted: dict[int, StoredObject] = {}  # oid -> object, until all are back
        self._holding: list[StoredObject] = []  # retired: held until every client is back
        self.taken: dict[tuple[str, int], StoredObject] = {}  # (session, qget id) -> item
        self._sealed_puts: dict[tuple[str, int], StoredObject] = {}  # (session, put id)

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
    ) -> tuple[int, StoredObject]:
        """Allocate an object's block; the putter holds it by the returned lease id."""
        if not bundle and (len(specs) != 1 or specs[0][0] != ""):
            raise InvalidRequest(f"put {key!r}: a plain object holds one unnamed tensor")
        arena = self.arena if device == "cpu" else self.devices.arena(device)
        offsets, size, align = layout(specs, MIN_ALIGN if device == "cpu" else DEVICE_ALIGN)
        block = self._allocate(arena, key, size, align)
        device = sys.intern(device)  # not a string of its own in every object
        wire = laid_out(specs, offsets, block.segment, block.offset, device, self.shapes)
        obj = StoredObject(key, bundle, block, wire, queue=queue, device=device)
        obj.oid = self._id()
        if device != "cpu":
            obj.events = [self.devices.event(device_index(device))[0]]
        put_id = self.lease(session, obj)
        self.pending[put_id] = obj
        session.pending.add(put_id)
        if device == "cpu":
            self.journal.granted(obj, session.token, put_id)
        return put_id, obj

    def grant(self, session: Session, size_class: int) -> list[list[Any]]:
        """Blocks of `size_class` bytes granted ahead to `session`, up to its depth (fewer,
        or none, once the arena is three quarters full): [[put id, object id, segment,
        offset, size], ...] (Note [grants])."""
        have = session.grants.get(size_class, 0)
        out: list[list[Any]] = []
        arena = self.arena
        for _ in range(grant_depth(size_class) - have):
            if arena.free_bytes - size_class < arena.capacity // GRANT_FREE_SHARE:
                break
            block = arena.allocate(size_class, PAGE)
            if block is None:
                break
            obj = StoredObject("", False, block, (), granted=True)
            obj.oid = self._id()
            put_id = self.lease(session, obj)
            self.pending[put_id] = obj
            session.pending.add(put_id)
            self.journal.granted(obj, session.token, put_id)
            out.append([put_id, obj.oid, block.segment, block.offset, block.size])
        if out:
            session.grants[size_class] = have + len(out)
            self.granted_bytes += size_class * len(out)
            self.granted_blocks += len(out)
        return out

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
        if not obj.granted:
            raise InvalidRequest(f"write {key!r}: put {put_id} is not a block granted ahead")
        if not bundle and (len(specs) != 1 or specs[0][0] != ""):
            raise InvalidRequest(f"write {key!r}: a plain object holds one unnamed tensor")
        offsets, size, _ = layout(specs)
        if size > obj.block.size:
            raise InvalidRequest(
                f"write {key!r}: its tensors take {size} bytes, and block {put_id} has "
                f"{obj.block.size}"
            )
        self._ungrant(session, obj)
        obj.key, obj.bundle, obj.queue = key, bundle, queue
        block = obj.block
        obj.wire = laid_out(specs, offsets, block.segment, block.offset, "cpu", self.shapes)
        return obj

    def _ungrant(self, session: Session, obj: StoredObject) -> None:
        if obj.granted:
            obj.granted = False
            session.grants[obj.block.size] -= 1
            self.granted_bytes -= obj.block.size
            self.granted_blocks -= 1

    def _unpend(self, session: Session, put_id: int) -> StoredObject:
        """A pending put ends (sealed, aborted, or let go)."""
        obj = self.pending.pop(put_id)
        session.pending.discard(put_id)
        self._ungrant(session, obj)
        return obj

    def _allocate(self, arena: Arena, key: str, size: int, align: int) -> Block:
        try:
            block = arena.allocate(size, align)
            if block is None and arena is self.arena and self.reclaim():  # scan now, not later
                block = arena.allocate(size, align)
            while block is None and arena is self.arena and self.make_room and self.make_room(size):
                block = arena.allocate(size, align)
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
        """Publish a pending put: as the next version of its key, or (a queue item, whose
        version the queue numbers) live and unkeyed, for the queue to hand over."""
        self.pending_put(session, put_id, "seal")
        obj = self._unpend(session, put_id)
        obj.live = True
        self.published += 1
        if obj.events is not None:  # forget the finished ones: the list stays short
            session.writing = [o for o in session.writing if not self._written(o)]
            session.writing.append(obj)
        if obj.queue is not None:
            obj.version = version or 0
        else:
            obj.version = self._versions.get(obj.key, 0) + 1
            self._versions[obj.key] = obj.version
            old = self.objects.get(obj.key)
            self.objects[obj.key] = obj
            if self.directory is not None:  # listed before the old version can be freed
                if obj.device == "cpu":
                    obj.listed = self.directory.publish(
                        obj.key, obj.oid, obj.version, obj.bundle, obj.wire
                    )
                else:
                    self.directory.remove(obj.key)
            if old is not None:
                self._retire(old)
        if obj.device == "cpu":
            self.journal.sealed(obj)
        if not keep:
            self.release(session, put_id)
        return obj

    def sealed_before(self, session: Session, put_id: int) -> tuple[int] | None:
        """(version,) of a put the broker that died sealed, if this seal is sent again. A put
        it granted that is neither pending nor journaled was sealed and freed since (a put
        the client aborted is never sealed): its version is not known, (0,)."""
        obj = self._sealed_puts.get((session.token, put_id))
        if obj is not None:
            return (obj.version,)
        if put_id < self.first_id and put_id not in self.pending:
            return (0,)
        return None

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

    # -- reading -------------------------------------------------------------------------

    def lease(
        self, session: Session, obj: StoredObject, reader: bool = False, lease_id: int = 0
    ) -> int:
        """A new lease of `session` on `obj` (id `lease_id` if set aside, else a new one). A
        reader of a device object gets a read-done event with it (`session.read_events`),
        which the object keeps once the lease ends."""
        if not lease_id:
            lease_id = self._id()
        elif lease_id in session.leases:
            if session.leases[lease_id] is obj:
                return lease_id  # claimed already, by a client back after a restart
            raise InvalidRequest(f"lease {lease_id} is taken already")
        session.leases[lease_id] = obj
        obj.leases += 1
        self.lease_count += 1
        if reader and obj.events is not None:
            index = device_index(obj.device)
            session.read_events[lease_id] = self.devices.event(index)[0]
        return lease_id

    def hand_over(
        self, session: Session, obj: StoredObject, request_id: int | None, lease_id: int = 0
    ) -> int:
        """Give a queue item to its one consumer (asking by `request_id`; None: it has it
        already, on the lease `lease_id` set aside): the consumer's lease is now all that
        keeps it."""
        lease_id = self.lease(session, obj, reader=True, lease_id=lease_id)
        self._retire(obj, session.token, request_id)
        return lease_id

    def release(self, session: Session, lease_id: int) -> bool:
        """End one lease; False (and nothing changes) if the session does not hold it."""
        obj = session.leases.pop(lease_id, None)
        if obj is None:
            return False
        read_done = session.read_events.pop(lease_id, None)
        if read_done is not None and obj.events is not None:
            self.devices.settle(obj.events, read_done)
        if lease_id in session.pending:  # the putter let go before sealing: abort
            self._unpend(session, lease_id)
            self._retire(obj)
        obj.leases -= 1
        self.lease_count -= 1
        self._maybe_free(obj)
        return True

    def drop_session(self, session: Session, keep_leases: bool = False) -> None:
        """Abort the session's unsealed puts and, unless kept, end all of its leases."""
        for key in [k for k in self.taken if k[0] == session.token]:
            obj = self.taken.pop(key)  # handed over when the broker died, never asked again
            obj.leases -= 1
            self._maybe_free(obj)
        for put_id in list(session.pending):
            self.abort(session, put_id, keep=True)
        if not keep_leases:
            for lease_id in list(session.leases):
                self.release(session, lease_id)
            if session.region is not None and self.slots is not None:
                self.slots.release(session.region)  # what its slots held is free to go
                session.region = None

    def slotted(self, session: Session) -> bool:
        """Whether the session's lease slots hold anything."""
        if session.region is None or self.slots is None:
            return False
        return bool(self.slots.held(session.region))

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

    def retire_adopted(self, obj: StoredObject) -> None:
        """An adopted item no one is to be given any more: retired, and held until `settle`
        (its readers may not be back yet with their leases)."""
        obj.leases += 1
        self._holding.append(obj)
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

    # -- adopting the state of a broker that died (Note [recovery] in state.py) -----------

    def adopt(self, rows: list[Row], sessions: dict[str, Session], queues: dict[int, Any]) -> None:
        """Rebuild the objects of the journal `rows` (their blocks are allocated in the arena
        already). Live ones are published again; puts of sessions still alive carry over;
        retired ones are held until `settle`, as leases on them come back with their clients."""
        for row in rows:
            q = queues.get(row.queue) if row.queue is not None else None
            block = Block(row.segment, row.offset, row.size)
            if row.queue is not None and q is None:  # an item of a queue forgotten since
                self.arena.free(block)
                self.journal.freed(row)
                continue
            obj = StoredObject(row.key, row.bundle, block, row.wire, row.version, queue=q)
            obj.oid, obj.evictable = row.oid, row.evictable
            self.adopted[obj.oid] = obj
            owner = sessions.get(row.session)
            if row.state == PENDING:
                if owner is None or owner.closed:  # its writer died with the broker
                    self._retire(obj)
                    continue
                self.pending[row.put] = obj
                owner.pending.add(row.put)
                if not row.wire:  # a block granted ahead, not yet written
                    obj.granted = True
                    owner.grants[row.size] = owner.grants.get(row.size, 0) + 1
                    self.granted_bytes += row.size
                    self.granted_blocks += 1
                owner.leases[row.put] = obj
                obj.leases += 1
                self.lease_count += 1
                continue
            self._sealed_puts[row.session, row.put] = obj
            for taker, took in row.gives:  # a broadcast item given to these gets
                if _asks_again(sessions, taker):  # held until it asks again, or has it
                    self.taken[taker, took] = obj
                    obj.leases += 1
            if row.state == LIVE:
                obj.live = True
                self._versions[obj.key] = max(self._versions.get(obj.key, 0), obj.version)
                if q is not None:
                    q.items.append(obj)
                    continue
                self.objects[obj.key] = obj
                if self.directory is not None:
                    obj.listed = self.directory.publish(
                        obj.key, obj.oid, obj.version, obj.bundle, obj.wire
                    )
            else:  # retired: leases or slots may hold it
                obj.retired = obj.listed = True
                obj.leases += 1
                if (
                    row.taker is not None
                    and row.took is not None
                    and _asks_again(sessions, row.taker)
                ):
                    self.taken[row.taker, row.took] = obj  # held until the taker asks again
                else:
                    self._holding.append(obj)

    def retake(self, session: Session, request_id: int) -> StoredObject | None:
        """A queue item the broker that died handed to this very request, whose answer was
        lost: it goes to the request sent again (the hold becomes the consumer's lease)."""
        obj = self.taken.pop((session.token, request_id), None) if self.taken else None
        if obj is not None:
            obj.leases -= 1
        return obj

    def versions(self, deleted: dict[str, int]) -> None:
        """The last versions of deleted keys: a key put again goes on from there."""
        for key, version in deleted.items():
            self._versions[key] = max(self._versions.get(key, 0), version)

    def claim(self, session: Session, leases: list[tuple[int, int]], calls: list[int]) -> list[int]:
        """A client of the broker that died is back with the leases it holds ([lease id,
        object id]) and the ids of its calls still waiting for an answer; the leases hold
        their objects again. Its puts it no longer knows of are aborted, and queue items
        handed to calls no longer waiting are let go. The lease ids whose objects are gone."""
        lost, claimed = [], set()
        for lease_id, oid in leases:
            claimed.add(lease_id)
            if lease_id in session.leases:
                continue  # a put carried over
            obj = self.adopted.get(oid)
            if obj is None or obj.freed:
                lost.append(lease_id)
                continue
            session.leases[lease_id] = obj
            obj.leases += 1
            self.lease_count += 1
        for put_id in [p for p in session.pending if p not in claimed]:
            self.abort(session, put_id, keep=False)
        waiting = set(calls)
        for key in [k for k in self.taken if k[0] == session.token and k[1] not in waiting]:
            obj = self.taken.pop(key)  # its answer came (a lease above holds it) or not needed
            obj.leases -= 1
            self._maybe_free(obj)
        return lost

    def hold(self, session: Session, oids: list[int]) -> None:
        """Leases of a closed client whose arrays live on, on adopted objects."""
        for oid in oids:
            obj = self.adopted.get(oid)
            if obj is not None and not obj.freed:
                self.lease(session, obj)

    def settle(self) -> None:
        """Every client of the broker that died is back or gone: retired objects that no
        lease came back for are freed (after a scan of the slots)."""
        holding, self._holding = self._holding, []
        for obj in holding:
            obj.leases -= 1
            self._maybe_free(obj)
        self.adopted.clear()

    def stats(self) -> dict[str, int]:
        slotted = sum(self.slots.held().values()) if self.slots is not None else 0
        arena = self.arena.stats()
        return {
            **arena,
            "used_bytes": arena["used_bytes"] - self.granted_bytes,  # by objects
            "objects": len(self.objects),
            "pending": len(self.pending) - self.granted_blocks,  # puts being written
            "granted_bytes": self.granted_bytes,  # blocks granted ahead, not yet written
            "leases": self.lease_count - self.granted_blocks + slotted,
            # retired, unleased, and freed once a scan finds no lease slot holding them
            "waiting_bytes": sum(obj.block.size for obj in self._unlisted.values()),
        }


def _asks_again(sessions: dict[str, Session], token: str) -> bool:
    """Whether the client of `token` may send a get again after a restart (alive and open:
    a client closed with arrays alive says which it holds otherwise, and asks nothing)."""
    session = sessions.get(token)
    return session is not None and not session.closed
