"""Pipeline queues: the requests of ordinary queues (open, get, close, info, remove) and the
seal of an item into its queue, and the rooms the rest of a queue's life is in, which
`Queues` makes and holds: the queue state (queue_state.py), the slots and credits
(slots.py, Note [queue slots]), the subscriptions of broadcast queues (subscriptions.py,
Note [broadcast]) and their rings (broadcast.py), and writes into granted blocks with the
direct handoff (direct.py, handoff.py). A queue of a broker that died is adopted here too.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from ...common.errors import InvalidRequest, NotFound, QueueClosed
from ...common.protocol import Request, reply_error, reply_ok
from ..durability.journal import PENDING, Row
from ..store.objects import Objects
from ..store.records import Session, StoredObject
from .broadcast import QueueRings
from .direct import DirectItems
from .qrings import QueueRingRoom
from .queue_state import BrokerQueue, QueueTable, park_get
from .slots import QueueSlots
from .subscriptions import Broadcasts

log = logging.getLogger(__name__)

Reply = dict[str, Any]


class OtherNodes(Protocol):
    """The parts of this broker's queues on the other nodes of a cluster (queue_links.py)."""

    def opened(self, q: BrokerQueue) -> None: ...
    def asked(self, q: BrokerQueue) -> None: ...
    def item(self, q: BrokerQueue) -> None: ...
    def published(self, q: BrokerQueue, obj: StoredObject, session: Session) -> None: ...
    def subscribed(self, q: BrokerQueue) -> None: ...
    def closed(self, q: BrokerQueue) -> None: ...
    def supplies(self, q: BrokerQueue) -> bool: ...
    def removed(self, name: str) -> None: ...


class Queues:
    """The handlers of ordinary queue requests, and the rooms of the others (`slots`,
    `broadcasts`, `direct`) over one table of queues (`table`). Items are objects
    (registry.py) with a queue; they are written and read through `objects`."""

    def __init__(self, objects: Objects) -> None:
        self.objects, self.registry, self.lot = objects, objects.registry, objects.lot
        self.table = QueueTable(self.registry)
        self.rings = QueueRings(self.registry, self.table.note_if_ended)  # Note [broadcast ring]
        self.qrings = QueueRingRoom(self.registry)  # Note [queue ring] in common/qring.py
        self.table.on_end = self._ended
        self.slots = QueueSlots(objects, self.table, self.rings, self.qrings)
        self.broadcasts = Broadcasts(objects, self.table, self.rings)
        self.direct = DirectItems(objects, self.table, self.slots, self.seal, self.get)
        self.handoffs = self.direct.handoffs  # Note [direct handoff]
        self.direct.requeue = self._back_in_queue
        # The item a broker that died handed to this very get, sent again (adoption.py).
        self.retake: Callable[[Session, int], StoredObject | None] = lambda s, request: None
        self.elsewhere: OtherNodes | None = None  # a cluster's other nodes (queue_links.py)

    def _ended(self, q: BrokerQueue) -> None:
        self.rings.close(q)
        self.qrings.close(q)

    @property
    def by_name(self) -> dict[str, BrokerQueue]:
        return self.table.by_name

    @property
    def by_id(self) -> dict[int, BrokerQueue]:
        return self.table.by_id

    def open(self, session: Session, route: bytes, req: Request) -> Reply:
        name, maxsize = req.fields["name"], req.fields.get("maxsize", 0)
        broadcast, ring = req.fields.get("broadcast", False), req.fields.get("ring", False)
        q = self.table.by_name.get(name)
        if q is None:
            q = BrokerQueue(name, self.table.new_id(), maxsize, subs={} if broadcast else None)
            self.table.add(q)
            self.qrings.made(q, ring)
            self.registry.journal.queue(q)
            if self.elsewhere is not None:
                self.elsewhere.opened(q)
        elif broadcast != (q.subs is not None):
            kind = "a broadcast queue" if q.subs is not None else "an ordinary queue"
            raise InvalidRequest(
                f"queue {name!r} is {kind}: open it with "
                + ("c.broadcast() or c.subscribe()" if q.subs is not None else "c.queue()")
            )
        elif maxsize and q.maxsize and maxsize != q.maxsize:
            raise InvalidRequest(
                f"queue {name!r} is open with maxsize={q.maxsize}, not {maxsize}: open it with "
                f"maxsize={q.maxsize}, or with maxsize=0 to take it as it is"
            )
        elif maxsize and not q.maxsize:
            q.maxsize = maxsize  # the first bound asked for holds
            self.registry.journal.queue(q)
        reply = {"queue": q.id, "maxsize": q.maxsize, "closed": q.closed or q.closing}
        return {**reply, **self.qrings.opened(q, session, ring)}

    def seal(self, session: Session, put_id: int, keep: bool, q: BrokerQueue) -> Reply:
        """An item sealed: to the first waiting consumer, else to the back of the queue (or,
        put for a position of its ring, there: Note [queue ring])."""
        pos = self.qrings.position(session, q, put_id)
        if pos is not None:
            if q.removed:
                self.registry.abort(session, put_id, keep)
                raise QueueClosed(f"queue {q.name!r} was removed before this item was sealed")
            obj = self.registry.seal(session, put_id, keep, version=pos + 1)
            q.pending -= 1
            self.qrings.sealed(q, put_id, obj)
            return {"version": obj.version}
        if q.closed or q.closing:
            self.registry.abort(session, put_id, keep)
            raise QueueClosed(f"queue {q.name!r} was closed before this item was sealed")
        return self.deliver(session, put_id, q, keep)

    def deliver(self, session: Session, put_id: int, q: BrokerQueue, keep: bool = False) -> Reply:
        """Seal an item into `q` (also closed: one put on another node before the close)."""
        if q.id in self.handoffs.offered:  # the consumer's grant goes back, or came first
            self.handoffs.take_back(q)
        q.sealed += 1
        obj = self.registry.seal(session, put_id, keep, version=q.sealed)
        q.pending -= 1
        if q.subs is not None:
            if self.elsewhere is not None:  # (pinned for the other nodes before it is given)
                self.elsewhere.published(q, obj, session)
            self.broadcasts.publish(q, obj)
        elif q.getters:  # a consumer is waiting: it takes the item now
            self._to_first_getter(q, obj)
        else:
            q.items.append(obj)
            if self.elsewhere is not None:
                self.elsewhere.item(q)
        return {"version": obj.version}

    def requeue(self, q: BrokerQueue, obj: StoredObject) -> bool:
        """An item lent to another node came back, or one given back: to a consumer waiting,
        else to the front (True). A waiting get whose grant a producer claimed has its
        answer: the grant is taken back first, as `deliver` does."""
        if q.id in self.handoffs.offered:
            self.handoffs.take_back(q)
        if q.removed:
            self.registry.retire(obj)
        elif q.getters:
            self._to_first_getter(q, obj)
        else:  # to the front, behind those given back before it that were put before it
            items, i = q.items, 0
            while i < len(items) and items[i].version < obj.version:
                i += 1
            items.insert(i, obj)
            return True
        return False

    def give_back(self, session: Session, route: bytes, req: Request) -> Reply:
        """Items of queue `queue` handed to this client that it never took (answers to gets
        it gave up), given back as it closes: to a consumer waiting, else to the front, as
        if never handed out. Leases it does not hold so stay its own (it lets them go).
        With `ring`, the item a get that failed took from the ring there (`QueueRingRoom.unask`)."""
        q = self.table.by_id.get(req.fields["queue"])
        if "ring" in req.fields:  # an item taken from the ring, maybe asked for
            return {"back": q is not None and self.qrings.unask(session, q, req.fields["ring"])}
        back = []
        if q is not None and q.subs is None and not q.ended:  # (an ended one tells no one)
            for lease in req.fields.get("leases", []):
                obj = self.registry.take_back(session, lease, q)
                if obj is not None:
                    self._back_in_queue(q, obj)
                    back.append(lease)
                elif self.handoffs.given_back_early(session, lease):
                    back.append(lease)  # handed over directly: back once its seal comes
        return {"back": back}

    def unclaim(self, session: Session, route: bytes, req: Request) -> Reply:
        """A put for a position of the queue's ring given up with no answer (QueueRingRoom)."""
        q = self.table.by_id.get(req.fields["queue"])
        return {"aborted": q is not None and self.qrings.unclaim(session, q, req.fields["ring"])}

    def _back_in_queue(self, q: BrokerQueue, obj: StoredObject) -> None:
        if self.requeue(q, obj) and self.elsewhere is not None:
            self.elsewhere.item(q)  # (the other nodes' consumers may want it)

    def _to_first_getter(self, q: BrokerQueue, obj: StoredObject) -> None:
        w = q.getters[0]
        reply = self.objects.describe(w.session, obj, w.request.id)
        self.objects.answer(w, reply_ok(w.request.id, **reply))

    def get(self, session: Session, route: bytes, req: Request) -> Reply | None:
        q = self.table.find(req)
        if req.fields.get("mailbox"):  # it waits on its bell (Note [direct handoff])
            self.handoffs.ring_after_reply(route, session)
        again = self.retake(session, req.id)
        if again is not None:  # sent again after a restart: the item it was handed
            return self.objects.describe(session, again, req.id, shared=q.subs is not None)
        if q.subs is not None:
            return self.broadcasts.get(session, route, req, q)
        if "sub" in req.fields:
            raise InvalidRequest(f"queue {q.name!r} is an ordinary queue: read it with get")
        if "ring" in req.fields:  # an item this consumer took from the ring
            taken = self.qrings.ask(session, q, req.fields["ring"])
            return self.objects.describe(session, taken, req.id)
        if q.items:
            reply = self.objects.describe(session, q.items.popleft(), req.id)
            self.table.note_if_ended(q)
            if self.elsewhere is not None:
                self.elsewhere.asked(q)
            return reply
        more = q.closed and self.elsewhere is not None and self.elsewhere.supplies(q)
        self.handoffs.offer(q, park_get(self.lot, session, route, req, q, more))
        if self.elsewhere is not None:
            self.elsewhere.asked(q)
        return None

    def subscribe(self, session: Session, route: bytes, req: Request) -> Reply:
        reply = self.broadcasts.subscribe(session, route, req)
        if self.elsewhere is not None:  # (its subscription starts there once they hear)
            self.elsewhere.subscribed(self.table.find(req))
        return reply

    def close(self, session: Session, route: bytes, req: Request) -> Reply:
        q = self.table.by_id.get(req.fields["queue"])
        if q is None or q.closed or q.closing:
            return {}  # closing a closed queue succeeds
        if self.elsewhere is not None:
            self.elsewhere.closed(q)  # closed here too once the other nodes closed theirs
        else:
            self.close_part(q)
        return {}

    def close_part(self, q: BrokerQueue) -> None:
        """Close `q` on this node (in a cluster, once every node closed its part). Its
        consumers waiting end, unless other nodes may still have items for them."""
        q.closed, q.closing = True, False
        self.registry.journal.queue(q)
        self.rings.end(q)
        self.qrings.end(q)
        self.handoffs.take_back(q)  # an item handed over already came before the close
        more = q.subs is None and self.elsewhere is not None and self.elsewhere.supplies(q)
        for w in [*q.putters, *([] if more else q.getters)]:
            closed = QueueClosed(f"queue {q.name!r} was closed")
            self.objects.answer(w, reply_error(w.request.id, closed))
        self.table.note_if_ended(q)

    def remove(self, session: Session, route: bytes, req: Request) -> Reply:
        """Remove the queue `name` at once: its waiting consumers and producers get
        QueueClosed, the items waiting in it are freed (an item a consumer holds stays until
        it lets go), its handles fail with QueueClosed, and the name may start a new queue.
        Its journal row stays, closed, until its last item is freed: a broker that restarts
        before then must not free items consumers still hold. In a cluster, so is its part
        on every node (and a name this node has no part of is no error: another may)."""
        name = req.fields["name"]
        q = self.table.by_name.get(name)
        if self.elsewhere is not None:
            self.elsewhere.removed(name)
        elif q is None:
            raise NotFound(f"there is no queue {name!r} (`tensorbroker ls` lists them)")
        if q is not None:
            self.remove_part(q)
        return {}

    def remove_part(self, q: BrokerQueue) -> None:
        """Remove `q` on this node (`remove`)."""
        name = q.name
        self.table.remove(q)
        q.closed = q.removed = True
        self.handoffs.take_back(q)
        for w in [*q.getters, *q.putters]:
            removed = QueueClosed(f"queue {name!r} was removed")
            self.objects.answer(w, reply_error(w.request.id, removed))
        self.rings.end(q)
        self.qrings.end(q)
        self.broadcasts.removed(q)
        if q.in_flight:
            self.registry.journal.queue(q)  # closed; gone once its last item is freed
        else:
            self.registry.journal.queue_gone(q)
            self.qrings.close(q)
        items, q.items = list(q.items), deque()
        q.unseen.clear()
        for obj in items:
            self.registry.retire(obj)

    def info(self, session: Session, route: bytes, req: Request) -> Reply:
        q = self.table.find(req)
        waiting, in_flight = q.counts()
        return {
            "name": q.name,
            "len": waiting,
            "maxsize": q.maxsize,
            "in_flight": in_flight,
            "closed": q.closed or q.closing,
        }

    def session_gone(self, session: Session, gone: bool = True) -> None:
        """A client closed or died (`gone`: its process too, or it holds nothing): its
        direct grants are taken back (or sealed, if it handed an item over), its
        subscriptions end, and its credits go back to their queues."""
        self.direct.session_gone(session)
        self.broadcasts.session_gone(session, gone)
        self.qrings.session_gone(session, gone)
        self.slots.give_back(session)

    def item_freed(self, obj: StoredObject) -> None:
        """The registry freed an item: its slot opens (in its ring too, if it has one)."""
        self.slots.item_freed(obj)
        self.qrings.freed(obj)
        q = obj.queue
        if q is not None and q.removed and not q.in_flight:
            self.qrings.close(q)

    def adopt(
        self, rows: list[tuple[int, str, int, bool, int, bool, Any, Any]],
        objects: list[Row], sessions: dict[str, Session],
    ) -> None:  # fmt: skip
        """The queues of a broker that died (Note [recovery] in state.py), each item of the
        journal holding its slot as before; `adopted` orders them once their items are in.
        A broadcast queue keeps the subscriptions of the `sessions` still alive, and its
        ring, with their bits (Note [broadcast ring]); an ordinary one its ring (a list: its
        segment and owners), with its owners still alive (Note [queue ring])."""
        subs_seen = 0
        for qid, name, maxsize, closed, sealed, removed, subs, ring in rows:
            q = BrokerQueue(name, qid, maxsize, closed, sealed=sealed, removed=removed)
            try:
                if isinstance(ring, list):
                    self.qrings.adopt(q, ring, sessions)
                elif ring is not None:
                    self.rings.adopt(q, ring)
            except (OSError, ValueError) as exc:  # one queue lost, not the whole state
                log.error(
                    "queue %r of the state is dropped with its items: its ring %s cannot be "
                    "mapped (%s)", name, ring[0] if isinstance(ring, list) else ring, exc,
                )  # fmt: skip
                self.registry.journal.queue_gone(q)
                continue
            if subs is not None:
                subs_seen = max(subs_seen, self.broadcasts.adopt(q, subs, sessions))
            self.table.add(q)  # a removed queue only until its items are adopted
        for row in objects:
            item_of = self.table.by_id.get(row.queue) if row.queue is not None else None
            if item_of is not None:
                item_of.in_flight += 1
                item_of.pending += row.state == PENDING
        self.table.number_after_adopted()
        self.broadcasts.number_after(subs_seen)

    def adopted(
        self,
        objects: list[Row],
        adopted: dict[int, StoredObject],
        retire: Callable[[StoredObject], None],
    ) -> None:
        """The adopted items are in their queues: put them in order (a broadcast queue's
        still to be given to the subscriptions that carried over, as its row in `objects`
        says). Removed queues are known to their items only (gone from the journal once the
        last is freed)."""
        self.rings.adopted(adopted)
        for q in self.table.forget_removed():
            if not q.in_flight:
                self.registry.journal.queue_gone(q)
                self.rings.close(q)
        unseen = {row.oid: set(row.unseen) for row in objects if row.unseen is not None}
        carried = [
            (row.session, row.put, adopted[row.oid])
            for row in objects
            if row.state == PENDING and row.oid in adopted and not adopted[row.oid].freed
        ]  # puts whose writers are back
        for q in list(self.table.by_name.values()):
            q.items = deque(sorted(q.items, key=lambda o: o.version))
            self.qrings.adopted(
                q, [o for o in adopted.values() if o.queue is q and o.version],
                [(token, put, o) for token, put, o in carried if o.queue is q],
            )  # fmt: skip
            if q.subs is not None:
                self.broadcasts.adopted(q, unseen, retire)
            self.table.note_if_ended(q)

    def stats(self) -> Reply:
        for q in self.qrings.closed():  # drained through their rings since
            self.table.note_if_ended(q)
        queues = self.table.by_name.values()
        waiters = [q.waiters() for q in queues]  # parked here, or asleep on a ring
        return {
            "queues": self.table.live,  # not ended yet
            "queued_items": sum(q.counts()[0] for q in queues),
            "queue_in_flight": sum(q.counts()[1] for q in queues),
            "queue_consumers": sum(c for c, _p in waiters),
            "queue_producers": sum(p for _c, p in waiters),
            "ring_items": self.rings.items,  # broadcast items posted to rings
            **self.handoffs.stats(),
        }
