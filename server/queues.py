"""Pipeline queues: their state and every queue request (open, put, get, close, info).

Note [queue slots]

    producer ── qput ──> slot free? ─no──> parked in `putters` (no polling)
                            │yes                  ▲ woken when an item is freed
                            ▼                     │
                     memory granted ── seal ──> `items` ── qget ──> one consumer's lease
                     (in flight)                                        │ lets go
                                                                        ▼
                                                                 freed: slot open

`maxsize` bounds the items *in flight*: an item takes its slot when its producer is given
memory and gives it back when its memory is freed, after its consumer let go of it. So a
queue never holds more than `maxsize` items' worth of shared memory, whatever its
consumers are slow at. A consumer that keeps items alive keeps their slots: with
`maxsize=1`, drop an item before asking for the next one.

Credits are slots granted ahead to a producer (`credit`, and the reply of each `write`), so
that its next puts need not ask: a credited slot counts as in flight (`full`), and at most
half of a queue's slots are credited ahead at a time (`credit_room`), so a producer that
holds credits and goes quiet can never starve the others. An unbounded queue needs none.
A producer that closes or dies gives its credits back.

Note [broadcast]
~~~~~~~~~~~~~~~~
A broadcast queue gives every item to each of its subscribers (those subscribed when it was
sealed), all from the one copy: each gets a lease of its own on the item, and the item
leaves `items` (retired, freed once the last lease ends) when the last of them took it. Its
slot is taken until then, so `maxsize` bounds the items in flight until the slowest
subscriber let go, and the producer waits for it. A subscriber that unsubscribes, closes or
dies is taken off every item waiting for it. A broker that restarts takes a broadcast queue
back with the subscriptions of the clients that come back (the journal's queue row lists
them) and, for each item, the subscriptions not yet given it and the gets it was given to
(the item's row: `given`), so each subscriber goes on where it was, and a get whose answer
the broker that died never sent gets the same item when it is sent again.

The subscribers waiting for an item are answered after the reply to its seal: the producer
of a stream waits for its slowest subscriber anyway, and so asks for its next item's memory
while they read this one, instead of after them.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..common.errors import BrokerError, InvalidRequest, NotFound, QueueClosed, Timeout
from ..common.protocol import Op, Request, reply_error, reply_ok
from .broadcast import QueueRings
from .handoff import Bound, Direct, Handoffs
from .objects import Objects
from .parking import Waiter, secs
from .registry import Session, StoredObject
from .rings import Ring
from .state import PENDING, Row

log = logging.getLogger(__name__)

CREDITS_AHEAD = 8  # slots of a bounded queue a producer may hold ahead, at most
ENDED_QUEUES = 4096  # ended queues remembered, so that a late consumer sees them closed

Reply = dict[str, Any]


@dataclass(eq=False)
class BrokerQueue:
    name: str
    id: int  # a new id for each queue ever opened under a name: handles of an ended one fail
    maxsize: int = 0  # items in flight at most; 0: no bound
    closed: bool = False
    items: deque[StoredObject] = field(default_factory=deque)  # sealed, not yet taken
    getters: deque[Waiter] = field(default_factory=deque)  # consumers waiting for an item
    putters: deque[Waiter] = field(default_factory=deque)  # producers waiting for a slot
    in_flight: int = 0  # items given memory and not yet freed
    pending: int = 0  # of those, items not sealed yet
    sealed: int = 0  # items numbered so far: an item's version is its place in the stream
    credited: int = 0  # slots granted ahead to producers, not yet used
    # A broadcast queue (Note [broadcast]): its subscribers by id, and for each item waiting
    # in `items` the subscribers not yet given it. None: an ordinary queue.
    subs: dict[int, Session] | None = None
    unseen: dict[int, set[int]] = field(default_factory=dict)  # item's oid -> subscribers
    removed: bool = False  # by `qdelete`: its name may start a new queue already
    producer: Any = None  # the session of the last item written: offered direct grants
    ring: Ring | None = None  # a bounded broadcast queue's (Note [broadcast ring])

    @property
    def full(self) -> bool:
        return self.maxsize > 0 and self.in_flight + self.credited >= self.maxsize

    @property
    def credit_room(self) -> bool:
        """Whether one more slot may be granted ahead, beyond what producers wait for: only
        while the queue stays at most half full with it, so that slots held ahead by a quiet
        producer never keep another from a queue that is not backed up."""
        return not self.putters and self.in_flight + self.credited < self.maxsize // 2

    @property
    def ended(self) -> bool:
        """Closed, and nothing left to take or still being written."""
        return (
            self.closed and not self.items and self.pending == 0
            and (self.ring is None or not self.ring.posted)
        )  # fmt: skip

    def describe(self) -> str:
        bound = f"of {self.maxsize} " if self.maxsize else ""
        return f"queue {self.name!r} ({len(self.items)} waiting, {self.in_flight} {bound}in flight)"


class Queues:
    """Every queue by name and by id (open, draining, or ended and remembered), and the
    handlers of queue requests. Items are objects (registry.py) with a queue; they are
    written and read through `objects`."""

    def __init__(self, objects: Objects) -> None:
        self.objects, self.registry, self.lot = objects, objects.registry, objects.lot
        self.by_name: dict[str, BrokerQueue] = {}
        self.by_id: dict[int, BrokerQueue] = {}
        self._ids = itertools.count(1)
        self._ended: dict[int, BrokerQueue] = {}  # ended queues, oldest first
        self._roomy: set[BrokerQueue] = set()  # queues that freed a slot since the last look
        self._sub_ids = itertools.count(1)
        self.handoffs = Handoffs(self.registry, self.lot, self._get_again, self._undo_claim)
        self.rings = QueueRings(self.registry, self._note_if_ended)  # Note [broadcast ring]

    def open(self, session: Session, route: bytes, req: Request) -> Reply:
        name, maxsize = req.fields["name"], req.fields.get("maxsize", 0)
        broadcast = req.fields.get("broadcast", False)
        q = self.by_name.get(name)
        if q is None:
            q = BrokerQueue(name, next(self._ids), maxsize, subs={} if broadcast else None)
            self.by_name[name] = q
            self.by_id[q.id] = q
            self.registry.journal.queue(q)
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
        return {"queue": q.id, "maxsize": q.maxsize, "closed": q.closed}

    def _queue(self, req: Request) -> BrokerQueue:
        q = self.by_id.get(req.fields["queue"])
        if q is None:
            name = req.fields.get("name", f"#{req.fields['queue']}")
            raise QueueClosed(f"queue {name!r} is closed and drained")
        return q

    def put(self, session: Session, route: bytes, req: Request) -> Reply | None:
        q = self._queue(req)
        self._check_open(q)
        if not q.full and not q.putters:
            return self.objects.grant_or_wait(
                session, route, req, lambda: self._grant_open(session, q, req)
            )
        self._wait_for_slot(session, route, req, q)
        return None

    def write(self, session: Session, route: bytes, req: Request) -> Reply:
        """An item written into a block granted ahead, on a slot credited ahead (an unbounded
        queue needs none): sealed at once; the reply tops up the producer's credits."""
        f, put_id = req.fields, req.fields["put"]
        direct: Bound | None = None
        if "undone" in f:  # a grant it claimed and could not fill: the item comes this way
            self.handoffs.undone(session, f["undone"])
        try:
            if "direct" in f:  # handed to a consumer already (Note [direct handoff])
                direct = self.handoffs.bind(session, f, self.by_id)
                q = direct.queue
            else:
                q = self._queue(req)
                self._check_open(q)
            credited = self._use_credit(session, q)
            obj = self.registry.fill(
                session, put_id, q.name, f["tensors"], f.get("bundle", False), queue=q
            )
        except BrokerError:
            self.objects.drop_grant(session, put_id)
            raise
        if direct is None or not direct.counted:  # a claim counts its item already
            q.in_flight += 1
            q.pending += 1
        q.producer = session
        if direct is not None:
            reply = self._seal_direct(session, put_id, direct)
        else:
            reply = self.seal(session, put_id, False, q)
        self.objects.refill_later(session, route, obj.block.size)
        credits = self._credit_ahead(session, q, 0)
        if credits:
            reply["credits"] = credits
        if not credited and q.maxsize:  # the producer takes credits from now on
            reply["maxsize"] = q.maxsize
        return reply

    def _seal_direct(self, session: Session, put_id: int, direct: Bound) -> Reply:
        """Seal an item its producer handed to a consumer itself: the consumer's lease (set
        aside with the grant) is all that keeps it."""
        q, consumer = direct.queue, direct.consumer
        held = consumer.leases.get(direct.lease) if consumer is not None else None
        if held is not None and held is not self.registry.pending.get(put_id):
            log.warning("%s: the lease of a direct item is another's; the item is let go", consumer)
            consumer = None  # (its own lease, claimed after a restart, is fine)
        obj = self.registry.seal(session, put_id, False, version=direct.version)
        q.pending -= 1
        if consumer is not None:
            self.registry.hand_over(consumer, obj, None, lease_id=direct.lease)
        else:  # its consumer is gone (or let go of it before this seal came)
            self.registry.retire(obj)
        if q.getters:
            self.handoffs.offer(q, q.getters[0])
        self._note_if_ended(q)
        return {"version": obj.version}

    def _undo_claim(self, d: Direct) -> None:
        """A claimed item that never came: it no longer holds a slot."""
        self._slot_back(d.queue, unsealed=True)
        if not d.queue.removed:
            self._note_if_ended(d.queue)

    def _seal_left(self, producer: Session, d: Direct, body: dict[str, Any]) -> None:
        """The producer died after handing its item over, before its seal: seal it from the
        body it left in the consumer's mailbox."""
        consumer = d.waiter.session
        fields = {
            "put": body.get("put"),
            "queue": d.queue.id,
            "tensors": [w[:3] for w in body.get("tensors", ())],
            "bundle": bool(body.get("bundle")),
            "direct": [d.token, consumer.token, d.lease, d.version],
        }
        try:
            self.write(producer, b"", Request(Op.WRITE, 0, fields, []))
        except (BrokerError, TypeError, ValueError) as exc:
            log.warning("could not seal the item %s handed to %s before it died: %s",
                        producer, consumer, exc)  # fmt: skip

    def _get_again(self, w: Waiter) -> None:
        """Handle a consumer's get again (its direct grant came to nothing)."""
        try:
            reply = self.get(w.session, w.route, w.request)
        except BrokerError as exc:
            self.objects.answer(w, reply_error(w.request.id, exc))
        else:
            if reply is not None:
                self.objects.answer(w, reply_ok(w.request.id, **reply))

    def _use_credit(self, session: Session, q: BrokerQueue) -> bool:
        """Spend one of the producer's credits; False if it had none."""
        have = session.credits.get(q.id, 0)
        if have:
            session.credits[q.id] = have - 1
            q.credited -= 1
            return True
        if q.maxsize:
            # Its credits were lost with a broker that died, or the queue was bounded after
            # the producer found it unbounded: the writes already sent take their slots (a
            # few over maxsize at most), and the reply tells the producer to take credits.
            log.info("%s wrote an item of %s without a credit", session, q.describe())
        return False

    def credit(self, session: Session, route: bytes, req: Request) -> Reply | None:
        """Slots granted ahead to a producer of a bounded queue: one as soon as a slot is
        free (waiting for it as a put does), and more if there is room."""
        q = self._queue(req)
        self._check_open(q)
        if not q.maxsize:
            return {"credits": 0}  # nothing to wait for
        if not q.full and not q.putters:
            return {"credits": self._credit_ahead(session, q, 1)}
        self._wait_for_slot(session, route, req, q)
        return None

    def _wait_for_slot(self, session: Session, route: bytes, req: Request, q: BrokerQueue) -> None:
        """Park a put or a credit request until a slot is free (admit_putters) or its
        timeout passes."""
        timeout = req.fields.get("timeout")
        message = f"{q.describe()} stayed full for {secs(timeout)}: is a consumer keeping up?"
        self.lot.wait(session, route, req, timeout, q.putters, Timeout(f"{q.describe()} is full"),
                      message)  # fmt: skip

    def _credit_ahead(self, session: Session, q: BrokerQueue, due: int) -> int:
        """Grant `session` the `due` slots it waited for, and more while there is room."""
        if not q.maxsize:
            return 0
        q.credited += due
        given = due
        while given < CREDITS_AHEAD and q.credit_room:
            given += 1
            q.credited += 1
        if given:
            session.credits[q.id] = session.credits.get(q.id, 0) + given
        return given

    def session_gone(self, session: Session, gone: bool = True) -> None:
        """A client closed or died (`gone`: its process too, or it holds nothing): its
        credits go back to their queues, its subscriptions end, and its direct grants are
        taken back (or sealed, if it handed an item over)."""
        for d, body in self.handoffs.session_gone(session):
            if body is not None:
                self._seal_left(session, d, body)
        for bq in list(self.by_id.values()):
            if bq.subs is not None:
                for sub in [sub for sub, s in bq.subs.items() if s is session]:
                    self._drop_sub(bq, sub, gone)
        if gone:
            self.rings.session_gone(session)
        for qid, n in session.credits.items():
            q = self.by_id.get(qid)
            if q is not None and n:
                q.credited -= n
                self._roomy.add(q)
        session.credits.clear()

    @staticmethod
    def _check_open(q: BrokerQueue) -> None:
        if q.closed:
            raise QueueClosed(
                f"queue {q.name!r} is closed: it takes no more puts (a closed queue stays "
                "closed; give a new stream a new name)"
            )

    def _grant_open(self, session: Session, q: BrokerQueue, req: Request) -> Reply:
        self._check_open(q)  # a put that waited for device memory may find it closed
        return self._grant(session, q, req)

    def _grant(self, session: Session, q: BrokerQueue, req: Request) -> Reply:
        """Memory for one item of `q`: it takes a slot until the item is freed."""
        f = req.fields
        put_id, obj = self.registry.begin_put(
            session, q.name, f["tensors"], f.get("bundle", False), queue=q,
            device=f.get("device", "cpu"),
        )  # fmt: skip
        q.in_flight += 1
        q.pending += 1
        return self.objects.granted(put_id, obj)

    def seal(self, session: Session, put_id: int, keep: bool, q: BrokerQueue) -> Reply:
        """An item sealed: to the first waiting consumer, else to the back of the queue."""
        if q.closed:
            self.registry.abort(session, put_id, keep)
            raise QueueClosed(f"queue {q.name!r} was closed before this item was sealed")
        if q.id in self.handoffs.offered:  # the consumer's grant goes back, or came first
            self.handoffs.take_back(q)
        q.sealed += 1
        obj = self.registry.seal(session, put_id, keep, version=q.sealed)
        q.pending -= 1
        if q.subs is not None:
            self._publish(q, obj)
        elif q.getters:  # a consumer is waiting: it takes the item now
            w = q.getters[0]
            reply = self.objects.describe(w.session, obj, w.request.id)
            self.objects.answer(w, reply_ok(w.request.id, **reply))
        else:
            q.items.append(obj)
        return {"version": obj.version}

    # -- broadcast queues (Note [broadcast]) --------------------------------------------------

    def subscribe(self, session: Session, route: bytes, req: Request) -> Reply:
        """A new subscription: the items sealed from now on, each given to it too."""
        q = self._queue(req)
        if q.subs is None:
            raise InvalidRequest(f"queue {q.name!r} is an ordinary queue: read it with get")
        sub = next(self._sub_ids)
        q.subs[sub] = session
        reply: Reply = {"sub": sub}
        ring = self.rings.of(q) if req.fields.get("ring") else None
        bit = ring.join(sub, q.sealed + 1) if ring is not None else None
        if ring is not None and bit is not None:  # from the next item sealed on
            reply["ring"] = [*ring.describe(), bit, q.sealed + 1]
        self.registry.journal.queue(q)
        return reply

    def unsubscribe(self, session: Session, route: bytes, req: Request) -> Reply:
        q = self.by_id.get(req.fields["queue"])
        sub = req.fields["sub"]
        if q is not None and q.subs is not None and q.subs.get(sub) is session:
            self._drop_sub(q, sub, gone=False)
        return {}

    def _publish(self, q: BrokerQueue, obj: StoredObject) -> None:
        """Give a sealed item to every subscription: in its ring slot to those with a bit
        (Note [broadcast ring]), through `items` to the others (and to all of them, if the
        slot cannot describe the item: they ask for it)."""
        assert q.subs is not None
        unseen = set(q.subs)
        ring = q.ring
        if ring is not None and ring.bits and self.rings.post(q, obj, ring.mask_for(obj.version)):
            unseen -= ring.bits.keys()
        q.items.append(obj)
        q.unseen[obj.oid] = unseen
        self.registry.journal.given(obj, unseen, None, None)
        for w in list(q.getters):
            if not w.done and w.request.fields["sub"] in q.unseen.get(obj.oid, ()):
                reply = self._give(w.session, w.request, obj)
                self.objects.answer(w, reply_ok(w.request.id, **reply), last=True)
        if not q.unseen.get(obj.oid, True):  # no subscriber: no one to give it to
            self._done_with(q, obj)

    def _give(self, session: Session, req: Request, obj: StoredObject) -> Reply:
        """Item `obj` to the subscriber asking in `req`, on a lease of its own."""
        q: BrokerQueue = obj.queue
        reply = self.objects.describe(session, obj, req.id, shared=True)
        unseen = q.unseen[obj.oid]
        unseen.discard(req.fields["sub"])
        self.registry.journal.given(obj, unseen, session.token, req.id)
        if not unseen:
            self._done_with(q, obj)
        return reply

    def _done_with(self, q: BrokerQueue, obj: StoredObject) -> None:
        """Every subscriber has the item: the queue lets go of it."""
        q.unseen.pop(obj.oid, None)
        q.items.remove(obj)
        self.registry.retire(obj)
        self._note_if_ended(q)

    def _drop_sub(self, q: BrokerQueue, sub: int, gone: bool) -> None:
        """End a subscription: its gets waiting end (QueueClosed: a subscriber's loop ends),
        and the items waiting for it no longer do (nor, if its process is `gone`, the ring
        slots it holds)."""
        assert q.subs is not None
        self.rings.leave(q, sub, q.subs.pop(sub), gone)
        self.registry.journal.queue(q)
        for w in [w for w in q.getters if w.request.fields.get("sub") == sub]:
            ended = QueueClosed(f"the subscription to queue {q.name!r} ended")
            self.objects.answer(w, reply_error(w.request.id, ended))
        for obj in list(q.items):
            unseen = q.unseen[obj.oid]
            unseen.discard(sub)
            if not unseen:
                self._done_with(q, obj)

    def _get_broadcast(
        self, session: Session, route: bytes, req: Request, q: BrokerQueue
    ) -> Reply | None:
        assert q.subs is not None
        sub = req.fields.get("sub")
        if sub is None:
            raise InvalidRequest(
                f"queue {q.name!r} is a broadcast queue: read it through a subscription "
                "(c.subscribe)"
            )
        if q.subs.get(sub) is not session:
            raise InvalidRequest(
                f"this client has no subscription {sub} to queue {q.name!r} (closed, or lost "
                "with this client's state when the broker restarted): subscribe again"
            )
        for obj in q.items:
            if sub in q.unseen[obj.oid]:
                return self._give(session, req, obj)
        self._wait_for_item(session, route, req, q)
        return None

    def _wait_for_item(self, session: Session, route: bytes, req: Request, q: BrokerQueue) -> None:
        """Park a get until an item comes (QueueClosed if none will)."""
        if q.closed:
            raise QueueClosed(f"queue {q.name!r} is closed and drained")
        timeout = req.fields.get("timeout")
        empty = Timeout(f"queue {q.name!r} is empty")
        message = f"queue {q.name!r} stayed empty for {secs(timeout)}"
        w = self.lot.wait(session, route, req, timeout, q.getters, empty, message)
        if q.subs is None:
            self.handoffs.offer(q, w)

    def get(self, session: Session, route: bytes, req: Request) -> Reply | None:
        q = self._queue(req)
        if req.fields.get("mailbox"):  # it waits on its bell (Note [direct handoff])
            self.handoffs.ring_after_reply(route, session)
        again = self.registry.retake(session, req.id)
        if again is not None:  # sent again after a restart: the item it was handed
            return self.objects.describe(session, again, req.id, shared=q.subs is not None)
        if q.subs is not None:
            return self._get_broadcast(session, route, req, q)
        if "sub" in req.fields:
            raise InvalidRequest(f"queue {q.name!r} is an ordinary queue: read it with get")
        if q.items:
            reply = self.objects.describe(session, q.items.popleft(), req.id)
            self._note_if_ended(q)
            return reply
        self._wait_for_item(session, route, req, q)
        return None

    def close(self, session: Session, route: bytes, req: Request) -> Reply:
        q = self.by_id.get(req.fields["queue"])
        if q is None or q.closed:
            return {}  # closing a closed queue succeeds
        q.closed = True
        self.registry.journal.queue(q)
        self.rings.end(q)
        self.handoffs.take_back(q)  # an item handed over already came before the close
        for w in [*q.getters, *q.putters]:
            closed = QueueClosed(f"queue {q.name!r} was closed")
            self.objects.answer(w, reply_error(w.request.id, closed))
        self._note_if_ended(q)
        return {}

    def remove(self, session: Session, route: bytes, req: Request) -> Reply:
        """Remove the queue `name` at once: its waiting consumers and producers get
        QueueClosed, the items waiting in it are freed (an item a consumer holds stays until
        it lets go), its handles fail with QueueClosed, and the name may start a new queue.
        Its journal row stays, closed, until its last item is freed: a broker that restarts
        before then must not free items consumers still hold."""
        name = req.fields["name"]
        q = self.by_name.get(name)
        if q is None:
            raise NotFound(f"there is no queue {name!r} (`tensorbroker ls` lists them)")
        del self.by_name[name], self.by_id[q.id]
        self._ended.pop(q.id, None)
        q.closed = q.removed = True
        self.handoffs.take_back(q)
        for w in [*q.getters, *q.putters]:
            removed = QueueClosed(f"queue {name!r} was removed")
            self.objects.answer(w, reply_error(w.request.id, removed))
        self.rings.end(q)
        for sub, s in list((q.subs or {}).items()):  # what they took stays theirs till let go
            self.rings.leave(q, sub, s, gone=False)
        if q.subs is not None:
            q.subs.clear()
        if q.in_flight:
            self.registry.journal.queue(q)  # closed; gone once its last item is freed
        else:
            self.registry.journal.queue_gone(q)
        items, q.items = list(q.items), deque()
        q.unseen.clear()
        for obj in items:
            self.registry.retire(obj)
        return {}

    def info(self, session: Session, route: bytes, req: Request) -> Reply:
        q = self._queue(req)
        return {
            "name": q.name,
            "len": len(q.items),
            "maxsize": q.maxsize,
            "in_flight": q.in_flight,
            "closed": q.closed,
        }

    def item_freed(self, obj: StoredObject) -> None:
        """The registry freed an item's memory: its slot opens (given by `admit_putters`,
        after the request at hand)."""
        self._slot_back(obj.queue, unsealed=obj.version == 0)  # 0: aborted unsealed

    def _slot_back(self, q: BrokerQueue, unsealed: bool) -> None:
        """An item of `q` is gone: its slot opens (a removed queue's row goes with its last)."""
        q.in_flight -= 1
        if unsealed:
            q.pending -= 1
        if q.removed:
            if not q.in_flight:
                self.registry.journal.queue_gone(q)
                self.rings.close(q)
            return
        self._roomy.add(q)

    def admit_putters(self) -> None:
        """Give freed slots to the producers waiting for them, first come first served."""
        while self._roomy:
            q = self._roomy.pop()
            while q.putters and not q.full:
                w = q.putters[0]
                try:
                    if w.request.op == Op.QCREDIT:
                        self.lot.unpark(w)  # before counting the room left for others
                        result = {"credits": self._credit_ahead(w.session, q, 1)}
                    else:
                        result = self._grant(w.session, q, w.request)
                except BrokerError as exc:
                    self.objects.answer(w, reply_error(w.request.id, exc))
                else:
                    self.objects.answer(w, reply_ok(w.request.id, **result))
            self._note_if_ended(q)

    def _note_if_ended(self, q: BrokerQueue) -> None:
        """A closed queue stays closed: consumers that come late end at once instead of
        waiting for a stream that is over. Only the oldest of many ended queues are forgotten
        (their names then start new queues)."""
        if not q.ended or q.removed or q.id in self._ended:
            return
        self.rings.close(q)
        self._ended[q.id] = q
        while len(self._ended) > ENDED_QUEUES:
            old = self._ended.pop(next(iter(self._ended)))
            del self.by_id[old.id]
            if self.by_name.get(old.name) is old:
                del self.by_name[old.name]
            self.registry.journal.queue_gone(old)

    def adopt(
        self, rows: list[tuple[int, str, int, bool, int, bool, Any, str | None]],
        objects: list[Row], sessions: dict[str, Session],
    ) -> None:  # fmt: skip
        """The queues of a broker that died (Note [recovery] in state.py), each item of the
        journal holding its slot as before; `adopted` orders them once their items are in.
        A broadcast queue keeps the subscriptions of the `sessions` still alive, and its
        ring, with their bits (Note [broadcast ring])."""
        subs_seen = 0
        for qid, name, maxsize, closed, sealed, removed, subs, ring in rows:
            q = BrokerQueue(name, qid, maxsize, closed, sealed=sealed, removed=removed)
            if ring is not None:
                self.rings.adopt(q, ring)
            if subs is not None:
                q.subs = {}
                for sub, token, *ringed in subs:
                    bit, start = ringed if len(ringed) == 2 else (None, 0)
                    if token not in sessions:
                        if bit is not None:  # its bits leave the ring's slots (QueueRings.adopted)
                            ended = self.rings.ended_bits
                            ended[qid] = ended.get(qid, 0) | 1 << bit
                    elif sub is None:  # ended; what it took is held until its process exits
                        if q.ring is not None and bit is not None:
                            q.ring.parted[bit] = sessions[token]
                    else:
                        q.subs[sub] = sessions[token]
                        if q.ring is not None and bit is not None:
                            q.ring.bits[sub], q.ring.starts[sub] = bit, start
                    subs_seen = max(subs_seen, sub or 0)
            self.by_id[qid] = q  # a removed queue only until its items are adopted
            if not removed:
                self.by_name[name] = q
        for row in objects:
            item_of = self.by_id.get(row.queue) if row.queue is not None else None
            if item_of is not None:
                item_of.in_flight += 1
                item_of.pending += row.state == PENDING
        self._ids = itertools.count(max(self.by_id, default=0) + 1)
        self._sub_ids = itertools.count(subs_seen + 1)

    def adopted(self, objects: list[Row]) -> None:
        """The adopted items are in their queues: put them in order (a broadcast queue's
        still to be given to the subscriptions that carried over, as its row in `objects`
        says). Removed queues are known to their items only (gone from the journal once the
        last is freed)."""
        self.rings.adopted()
        for q in [q for q in self.by_id.values() if q.removed]:
            del self.by_id[q.id]
            if not q.in_flight:
                self.registry.journal.queue_gone(q)
                self.rings.close(q)
        unseen = {row.oid: set(row.unseen) for row in objects if row.unseen is not None}
        for q in list(self.by_name.values()):
            q.items = deque(sorted(q.items, key=lambda o: o.version))
            if q.subs is not None:
                for obj in list(q.items):
                    left = unseen.get(obj.oid, set()) & q.subs.keys()
                    if left:
                        q.unseen[obj.oid] = left
                    else:  # every subscription that carried over has it
                        q.items.remove(obj)
                        self.registry.retire_adopted(obj)
                self.registry.journal.queue(q)  # without the subscriptions that ended
            self._note_if_ended(q)

    def stats(self) -> Reply:
        return {
            "queues": len(self.by_name) - len(self._ended),  # not ended yet
            "queued_items": sum(len(q.items) for q in self.by_name.values()),
            "queue_in_flight": sum(q.in_flight for q in self.by_name.values()),
            "ring_items": self.rings.items,  # broadcast items posted to rings
            **self.handoffs.stats(),
        }
