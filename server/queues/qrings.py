"""The broker's side of Note [queue ring] (common/qring.py), queue by queue: which queues have
a ring, the items put through the broker for a position (published there as ASK once the
journal has them, handed over when asked for), and what a client that goes leaves behind.
qring_state.py has each ring's segment and owner numbers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ...common.errors import InvalidRequest, QueueClosed
from ...common.qring import (
    ASK,
    CLOSED,
    FREE,
    HELD,
    QUEUED,
    REMOVED,
    TAKEN,
    WRITING,
)  # fmt: skip
from ..store.records import Session, StoredObject
from ..store.registry import Registry
from .qring_state import QRing
from .queue_state import BrokerQueue

MAX_SLOTS = 1024  # a queue of a larger maxsize goes through the broker

Reply = dict[str, Any]


class QueueRingRoom:
    """The rings of the bounded ordinary queues. `make(slots, existing)` makes one (or maps
    one a broker that died made); None: queues go through the broker (a cluster)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.make: Callable[[int, str | None], QRing] | None = None
        self._queues: dict[int, BrokerQueue] = {}  # queues with a ring, removed ones too
        self._due: set[BrokerQueue] = set()  # with positions to publish after the commit
        self._closing: list[QRing] = []  # rings of queues that ended, unmapped after the batch

    @property
    def segments(self) -> list[str]:
        return [q.qring.name for q in self._queues.values() if q.qring is not None]

    def _rings(self) -> list[tuple[BrokerQueue, QRing]]:
        return [(q, q.qring) for q in self._queues.values() if q.qring is not None]

    def made(self, q: BrokerQueue, ring: bool) -> None:
        """A new queue: bounded and ordinary, asked for by a client that can use a ring
        (`ring`), it gets one."""
        if ring and self.make is not None and q.subs is None and 0 < q.maxsize <= MAX_SLOTS:
            q.qring = self.make(q.maxsize, None)
            self._queues[q.id] = q

    def opened(self, q: BrokerQueue, session: Session, ring: bool) -> Reply:
        """The reply's ring, for a client of `q` that can use one."""
        qring = q.qring
        if qring is None:
            return {}
        if not ring:
            raise InvalidRequest(
                f"queue {q.name!r} is served through shared memory, and this client cannot "
                "map it: use the same tensorbroker version on the same host"
            )
        known = qring.owners.get(session.token)
        owner = qring.join(session)
        if known is None:
            self.registry.journal.queue(q)
        return {"ring": qring.description(owner)}

    # -- items put through the broker -------------------------------------------------------

    def put(self, session: Session, q: BrokerQueue, pos: int) -> int:
        """A put for position `pos`, which `session` must have claimed: its slot."""
        qring = q.qring
        if qring is None:
            raise InvalidRequest(f"queue {q.name!r} has no ring")
        if q.removed:
            raise QueueClosed(f"queue {q.name!r} was removed")
        slot = qring.claimed(pos, qring.owner(session))
        if slot is None:
            raise InvalidRequest(f"queue {q.name!r}: position {pos} is not this client's to write")
        return slot

    def begun(
        self, session: Session, q: BrokerQueue, put_id: int, pos: int, slot: int, oid: int
    ) -> None:
        assert q.qring is not None
        q.qring.pending[put_id] = (pos, slot, oid, q.qring.owner(session))

    def position(self, session: Session, q: BrokerQueue, put_id: int) -> int | None:
        """The position put `put_id` was made for (None: not a ring put). A put a broker
        that died gave is for the first position its producer claimed and has not
        published (it claims them in turn)."""
        qring = q.qring
        if qring is None:
            return None
        got = qring.pending.get(put_id)
        if got is not None:
            return got[0]
        owner = qring.owner(session)
        known = {p for p, _s, _o, _w in qring.pending.values()} | set(qring.asks)
        words = qring.view.entry_words()
        for pos in sorted(p for p, o, st, _s in words if o == owner and st == WRITING):
            slot = qring.claimed(pos, owner)
            if pos not in known and slot is not None:
                qring.pending[put_id] = (pos, slot, 0, owner)
                return pos
        return None

    def unclaim(self, session: Session, q: BrokerQueue, pos: int) -> bool:
        """`session` gave up its put for position `pos` with no answer (its cancel was not
        confirmed): aborted if it was granted (True: its position is passed over and its slot
        freed, as for any put aborted); else none is granted for `pos` from now on (False:
        its producer passes the position over and frees the slot itself). Either way one
        side only frees that slot, so never one the producer has taken again since."""
        qring = q.qring
        if qring is None:
            return False
        owner = qring.owner(session)
        for put_id, (p, _slot, _oid, o) in list(qring.pending.items()):
            if p == pos and o == owner:
                self.registry.abort(session, put_id, False)  # -> freed
                return True
        head = qring.view.head()
        qring.given_up = {p for p in qring.given_up if p >= head}
        qring.given_up.add(pos)
        return False

    def sealed(self, q: BrokerQueue, put_id: int, obj: StoredObject) -> None:
        """Item `obj` (version: its position + 1) is sealed: published at its position once
        the journal has it."""
        qring = q.qring
        assert qring is not None
        pos, slot, _oid, owner = qring.pending.pop(put_id)
        qring.asks[pos] = (obj, slot, owner)
        qring.staged.append(pos)
        self._due.add(q)

    def flush(self) -> None:
        """After the journal's commit: the items sealed since go to their positions, and the
        rings of queues that ended go."""
        self.close_ended()
        for q in self._due:
            qring = q.qring
            if qring is None:
                continue
            for pos in qring.staged:
                got = qring.asks.get(pos)
                if got is not None:
                    qring.view.publish(pos, got[1], got[2])
            qring.staged.clear()
        self._due.clear()

    def close_ended(self) -> None:
        """Unmap (and unlink) the rings of the queues that ended."""
        for qring in self._closing:
            qring.close()
        self._closing.clear()

    def ask(self, session: Session, q: BrokerQueue, pos: int) -> StoredObject:
        """The item at `pos`, which `session` took from the ring."""
        qring = q.qring
        if q.removed:  # (it took the position as the queue was removed)
            raise QueueClosed(f"queue {q.name!r} was removed")
        got = None if qring is None else qring.asks.get(pos)
        if qring is None or got is None:
            raise InvalidRequest(f"queue {q.name!r}: there is no item at {pos} to ask for")
        obj, slot, _owner = got
        if qring.view.slot_word(slot)[:2] != (qring.owner(session), HELD):
            raise InvalidRequest(f"queue {q.name!r}: this client holds no item at {pos}")
        del qring.asks[pos]
        qring.lent[obj.oid] = slot
        return obj

    def unask(self, session: Session, q: BrokerQueue, pos: int) -> bool:
        """`session` took the item at `pos` from the ring (its entry still TAKEN) and its get
        failed, maybe after asking for it: whether the broker has it for the next consumer
        (taken back from the session's lease if it was handed over). False: the item stays
        the session's (an item on a device, which a lease cannot give back), or is gone."""
        qring = q.qring
        if qring is None or q.removed:
            return False
        return pos in qring.asks or self._unlend(q, qring, session, pos)

    def _unlend(self, q: BrokerQueue, qring: QRing, session: Session, pos: int) -> bool:
        """The item at `pos`, handed over to `session`, back to the broker (as if never asked
        for), if the registry can take its lease back."""
        for lease, obj in session.leases.items():
            if obj.queue is q and obj.version == pos + 1 and obj.oid in qring.lent:
                if self.registry.take_back(session, lease, q) is None:
                    return False
                qring.asks[pos] = (obj, qring.lent.pop(obj.oid), 0)
                return True
        return False

    def freed(self, obj: StoredObject) -> None:
        """The registry freed item `obj`: its slot is free (a put aborted before its seal:
        its position is passed over)."""
        q = obj.queue
        qring = None if q is None else q.qring
        if qring is None:
            return
        slot = qring.lent.pop(obj.oid, None)
        if slot is None and obj.version:
            slot = qring.asks.pop(obj.version - 1, (None, None, None))[1]
        if slot is not None:
            qring.view.free(slot)
            return
        for put_id, (pos, s, oid, owner) in list(qring.pending.items()):
            if oid == obj.oid:  # aborted before its seal: passed over, its slot freed if
                del qring.pending[put_id]  # still its producer's (it may have freed it)
                qring.view.skip(pos, None)
                qring.view.free(s, owner << 2 | WRITING)

    # -- clients that go, and queues that end ------------------------------------------------

    def session_gone(self, session: Session, gone: bool) -> None:
        """A client is gone (its process, or it closed holding nothing): what it was writing
        is passed over and freed, and what it took or held is let go. One that closed and
        holds items (`gone` False) keeps them until its process exits."""
        if not gone:
            return
        for q, qring in self._rings():
            owner = qring.owners.pop(session.token, 0)
            if owner:
                self._left(qring, owner, functools.partial(self._unlend, q, qring, session))
                self.registry.journal.queue(q)

    def _left(
        self, qring: QRing, owner: int, unlend: Callable[[int], bool] = lambda pos: False
    ) -> None:
        """What `owner`, gone, had in the ring: its sleepers counted out, what it was writing
        passed over and freed, what it was taking given back (an item it asked for, if
        `unlend` takes it back from its lease; else it goes with the lease), what it held
        let go."""
        view = qring.view
        for producer in (False, True):  # its sleepers are counted out
            asleep = view.sleeping_of(producer, owner)
            if asleep:
                view.sleeping(producer, -asleep, owner)
        ours = {s for _p, s, _o, _w in qring.pending.values()}
        ours |= {s for _o, s, _w in qring.asks.values()}
        mine = {p for p, _s, _o, _w in qring.pending.values()} | set(qring.asks)
        slots = view.slot_words()
        for pos, o, st, slot in view.entry_words():
            if o == owner and st == WRITING and pos not in mine:
                if slot < view.slots and slots[slot][:2] == (owner, QUEUED):
                    view.release_entry(pos)  # it died publishing a whole item
                else:
                    view.skip(pos, owner)
        for slot, (o, st, _flags, _pos) in enumerate(view.slot_words()):
            if o == owner and st == WRITING and slot not in ours:
                view.free(slot)
        for pos, o, st, slot in view.entry_words():
            if o == owner and st == TAKEN:  # it died taking it: the item keeps its place
                if slot >= view.slots:
                    view.untake(pos)  # (passing over)
                elif slot not in qring.lent.values() or unlend(pos):
                    view.back(pos, slot, owner)
                else:
                    view.commit(pos)  # (its slot is freed with the lease)
        for slot, (o, st, _flags, _pos) in enumerate(view.slot_words()):
            if o == owner and st == HELD:
                self._let_go(qring, slot)

    def _let_go(self, qring: QRing, slot: int) -> None:
        """The item in `slot` goes: an item of the broker's is retired (its slot is freed
        with it: `freed`; one lent is freed as its lease goes)."""
        if slot in qring.lent.values():
            return
        for obj, s, _owner in list(qring.asks.values()):
            if s == slot:
                self.registry.retire(obj)  # -> freed
                return
        qring.view.free(slot)

    def holds(self, session: Session) -> bool:
        """Whether `session` holds ring items (its arrays live on after a bye)."""
        for _q, qring in self._rings():
            owner = qring.owners.get(session.token, 0)
            words = qring.view.slot_words()
            if owner and any(o == owner and st == HELD for o, st, _f, _p in words):
                return True
        return False

    def end(self, q: BrokerQueue) -> None:
        """`q` was closed or removed: its ring says so (a removed queue's items go, but for
        those consumers hold)."""
        qring = q.qring
        if qring is None:
            return
        qring.view.end(REMOVED if q.removed else CLOSED)
        if q.removed:
            for slot, (_o, st, _f, _p) in enumerate(qring.view.slot_words()):
                if st == QUEUED:
                    qring.view.free(slot)
            for obj, _slot, _owner in list(qring.asks.values()):
                self.registry.retire(obj)  # (freeing the last item closes the ring: unmapped)

    def closed(self) -> list[BrokerQueue]:
        """The closed queues with a ring: each may have ended (drained) since it was looked at."""
        return [q for q, _r in self._rings() if q.closed]

    def close(self, q: BrokerQueue) -> None:
        """`q` ended (or was removed and let go of its last item): its ring goes (clients
        that mapped it keep their mapping), and so does the ring in its journal row, or a
        broker restarted on the journal would look for a segment that is no more."""
        qring, q.qring = q.qring, None
        self._queues.pop(q.id, None)
        if qring is None:
            return
        self._closing.append(qring)  # (a caller may still hold its view: unmapped in `flush`)
        if not q.removed or q.in_flight:
            self.registry.journal.queue(q)

    # -- a broker that died ----------------------------------------------------------------

    def adopt(self, q: BrokerQueue, row: list[Any], alive: dict[str, Session]) -> None:
        """The ring of a queue of a broker that died, with the owners still alive; what
        those gone had is passed over or let go (the items of the journal are `adopted`)."""
        if self.make is None:
            return
        name, owners = row
        q.qring = qring = self.make(0, name)
        self._queues[q.id] = q
        qring.owners = {token: n for token, n in owners if token in alive}
        qring.gone = {n for token, n in owners if token not in alive}

    def adopted(
        self, q: BrokerQueue, objects: list[StoredObject],
        carried: list[tuple[str, int, StoredObject]],
    ) -> None:  # fmt: skip
        """The items of `q` the journal has (`objects`, sealed; the live ones are in
        `q.items`) go back to the slots that name their positions: one not taken yet is
        asked for (and published again if the broker died before it was), one handed over is
        freed with its lease. Puts carried over to their writers ([session token, put id,
        item]) are for the positions each claimed and has not published, in turn, so that an
        abort passes its position over. Then what the owners gone had is let go."""
        qring = q.qring
        if qring is None:
            return
        q.items = type(q.items)()
        view = qring.view
        entries = view.entry_words()
        where = {
            pos: (slot, owner)
            for slot, (owner, st, flags, pos) in enumerate(view.slot_words())
            if st != FREE
            and flags & ASK
            and (st != WRITING or entries[pos % view.entries] == (pos, owner, WRITING, slot))
        }  # fmt: skip  (a slot WRITING names its position only once its entry names it)
        for obj in objects:
            pos = obj.version - 1
            found = where.get(pos) if obj.version else None
            if found is None:
                self.registry.retire(obj)  # its position was passed over
                continue
            slot, owner = found
            if not obj.live:
                qring.lent[obj.oid] = slot  # handed over: its consumer's lease holds it
                continue
            qring.asks[pos] = (obj, slot, owner)
            e_pos, _o, st, _slot = entries[pos % view.entries]
            if e_pos == pos and st == WRITING:
                qring.staged.append(pos)
                self._due.add(q)
        for token, put_id, obj in sorted(carried, key=lambda c: c[1]):
            owner = qring.owners.get(token, 0)
            taken = {p for p, _s, _o, _w in qring.pending.values()}
            free = sorted(
                (pos, slot) for pos, (slot, o) in where.items()
                if o == owner and pos not in taken
                and entries[pos % view.entries][:3] == (pos, owner, WRITING)
            )  # fmt: skip
            if owner and free:
                qring.pending[put_id] = (*free[0], obj.oid, owner)
        for owner in qring.gone:
            self._left(qring, owner)
        qring.gone.clear()
