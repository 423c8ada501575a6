"""The broker's broadcast rings, queue by queue (Note [broadcast ring] in common/ring.py):
which queues have one, the slot writes that wait for the journal's commit, and the slots
subscribers are done with. The queue rooms (queues.py, slots.py, subscriptions.py) say
when; this module keeps the rings."""

from __future__ import annotations

from collections.abc import Callable

from ...common.protocol import Request
from ...common.ring import CLOSED, REMOVED
from ..store.records import Session, StoredObject
from ..store.registry import Registry
from .queue_state import BrokerQueue
from .rings import MAX_SLOTS, Ring


class QueueRings:
    """The rings of the broadcast queues. `note_if_ended(q)` is the queue table's
    (queue_state.py): a queue whose last slot is done may have ended."""

    def __init__(self, registry: Registry, note_if_ended: Callable[[BrokerQueue], None]) -> None:
        self.registry, self._note_if_ended = registry, note_if_ended
        # Makes a ring of that many slots (or maps an existing one, by name); None: no rings.
        self.make: Callable[[int, str | None], Ring] | None = None
        self._due: set[Ring] = set()  # rings with writes waiting for the commit
        self._queues: dict[int, BrokerQueue] = {}  # queues (removed ones too) with a ring
        self._closing: list[Ring] = []  # rings of queues that ended, closed after a flush
        self.ended_bits: dict[int, int] = {}  # adopted: queue id -> bits of subscriptions gone
        self.items = 0  # items posted to rings

    def of(self, q: BrokerQueue) -> Ring | None:
        """The ring of a bounded broadcast queue, made at its first subscription that can map
        it (None: its subscribers read through messages)."""
        if (
            q.ring is None and self.make is not None and not q.closed
            and 0 < q.maxsize <= MAX_SLOTS // 2
        ):  # fmt: skip
            self._attach(q, self.make(2 * q.maxsize, None))
        return q.ring

    def adopt(self, q: BrokerQueue, name: str) -> None:
        """The ring `name` of a queue of a broker that died."""
        if self.make is not None:
            self._attach(q, self.make(0, name))

    def _attach(self, q: BrokerQueue, ring: Ring) -> None:
        q.ring, ring.queue_id = ring, q.id
        self._queues[q.id] = q

    def post(self, q: BrokerQueue, obj: StoredObject, mask: int) -> bool:
        """Post item `obj` of `q` to the subscriptions of `mask`, once the journal has it:
        described in its slot (held by the ring until the slot is done), or to be asked for.
        Whether its slot describes it."""
        ring = q.ring
        assert ring is not None
        tail = ring.tail(obj)
        if tail is not None:
            self.registry.pin(obj)
        ring.post(obj.version, mask, obj if tail is not None else None, tail or b"")
        self._due.add(ring)
        self.items += 1
        return tail is not None

    def end(self, q: BrokerQueue) -> None:
        """`q` was closed or removed: its ring says so, after the items before."""
        if q.ring is not None:
            q.ring.end(REMOVED if q.removed else CLOSED, q.sealed)
            self._due.add(q.ring)

    def leave(self, q: BrokerQueue, sub: int, session: Session, gone: bool) -> None:
        """Subscription `sub` of `q` ended (Ring.leave): the slots it leaves idle are found
        once that is written, after the journal's commit (`flush`)."""
        if q.ring is not None and sub in q.ring.bits:
            q.ring.leave(sub, session, gone)
            self._changed(q, q.ring)

    def released(self, session: Session, route: bytes, req: Request) -> None:
        """A `release`: its leases were let go as it came in (the broker's dispatch); the
        ring slots a subscriber found idle (`done`) are emptied here."""
        done = req.fields.get("done")
        if done:
            self.done(done)

    def done(self, versions: list[tuple[int, int]]) -> None:
        """Subscribers found these slots ([queue id, version]) idle: their items are done."""
        for qid, version in versions:
            q = self._queues.get(qid)
            if q is not None:
                self.slots_done(q, [version])

    def slots_done(self, q: BrokerQueue, versions: list[int]) -> None:
        """Empty the idle slots of these versions: each item goes (unless subscribers through
        messages still have it to take)."""
        ring = q.ring
        if ring is None:
            return
        for version in versions:
            posted = ring.done(version)
            if posted is not None and posted.item is not None:
                self.registry.unpin(posted.item)
        self._changed(q, ring)

    def _changed(self, q: BrokerQueue, ring: Ring) -> None:
        """`ring` has writes staged, or `q` lost a slot or a subscription: write them after
        the commit, close a removed queue with nothing left in flight, note an ending."""
        if ring.staged:
            self._due.add(ring)
        if q.removed and not q.in_flight:
            self.close(q)
        self._note_if_ended(q)

    def session_gone(self, session: Session) -> None:
        """The process of `session` is gone: what its ended subscriptions held is let go, in
        every ring (removed queues' too)."""
        for q in list(self._queues.values()):
            ring = q.ring
            if ring is not None and session in ring.parted.values():
                self.slots_done(q, ring.session_gone(session))
                if not q.removed or q.in_flight:
                    self.registry.journal.queue(q)

    def holds(self, session: Session) -> bool:
        """Whether `session`'s subscribers hold ring slots (its arrays live on after a bye)."""
        return any(self._held(q, session) for q in self._queues.values())

    def held(self, session: Session) -> list[int]:
        """The items `session`'s subscribers hold in ring slots (journaled with a closed
        session whose arrays live on, so that a broker that comes back keeps them)."""
        return [oid for q in self._queues.values() for oid in self._held(q, session)]

    @staticmethod
    def _held(q: BrokerQueue, session: Session) -> list[int]:
        ring = q.ring
        if ring is None:
            return []
        mask = 0
        for sub, s in (q.subs or {}).items():
            if s is session and sub in ring.bits:
                mask |= 1 << ring.bits[sub]
        for bit, s in ring.parted.items():
            if s is session:
                mask |= 1 << bit
        return ring.held_items(mask) if mask else []

    def flush(self) -> None:
        """The journal has this batch: write the rings' slots (after its replies)."""
        while self._due:
            due, self._due = self._due, set()
            for ring in due:
                idle = ring.flush()  # no subscription left to take these: done already
                q = self._queues.get(ring.queue_id)
                if idle and q is not None and q.ring is ring:
                    self.slots_done(q, idle)
        closing, self._closing = self._closing, []
        for ring in closing:
            ring.close()

    def scan(self) -> None:
        """Slots found idle whose "done" did not come (lost with a broker that died, or with
        a subscriber's message): the rings of queues whose producers wait are looked at."""
        for q in list(self._queues.values()):
            if q.ring is not None and (q.putters or q.closed):
                idle = q.ring.idle()
                if idle:
                    self.slots_done(q, idle)

    @property
    def due(self) -> bool:
        """Whether writes wait for a commit (made outside a batch: the loop commits next)."""
        return bool(self._due or self._closing)

    @property
    def waited_on(self) -> bool:
        """Whether a producer waits for a ring's slots (the broker then scans them)."""
        return any(q.putters for q in self._queues.values())

    def close(self, q: BrokerQueue) -> None:
        """A queue that ended (or was removed and let go of its last item): its ring goes."""
        ring = q.ring
        if ring is None or ring.posted:
            return
        q.ring = None
        self._queues.pop(q.id, None)
        self._due.add(ring)  # its end is written, then it goes (`flush`)
        self._closing.append(ring)
        if not q.removed or q.in_flight:
            self.registry.journal.queue(q)

    def close_all(self, unlink: bool) -> None:
        self.flush()
        for q in self._queues.values():
            if q.ring is not None:
                q.ring.close(unlink)
        self._queues.clear()

    @property
    def segments(self) -> list[str]:
        return [q.ring.name for q in self._queues.values() if q.ring is not None]

    def adopted(self, adopted: dict[int, StoredObject]) -> None:
        """The `adopted` items (by id) are in the registry: each ring's slots are held again,
        the subscriptions that did not come back let go, and the items never written to it
        posted."""
        for q in list(self._queues.values()):
            self._adopt_slots(q, adopted)

    def _adopt_slots(self, q: BrokerQueue, adopted: dict[int, StoredObject]) -> None:
        ring = q.ring
        assert ring is not None and q.subs is not None
        for sub in ring.unlisted():  # ended when the broker died: its bits are stray below
            del q.subs[sub], ring.bits[sub]
            ring.starts.pop(sub, None)
        for posted in ring.adopt(adopted):
            if posted.item is not None:
                self.registry.pin(posted.item)
        top = ring.top
        lost = [o for o in adopted.values() if o.queue is q and o.version > top]
        for obj in sorted(lost, key=lambda o: o.version):
            mask = ring.mask_for(obj.version)
            if mask:
                self.post(q, obj, mask)
        if q.closed:  # its end may not have been written before the broker died
            self.end(q)
        self._due.add(ring)
        # Bits of subscriptions that did not come back, or that are no one's any more.
        parted = sum(1 << bit for bit in ring.parted)
        stray = self.ended_bits.get(q.id, 0) | ring.marked() & ~(ring.members | parted)
        self.slots_done(q, ring.forget(stray) if stray else ring.idle())
