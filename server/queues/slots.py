"""The slots of the pipeline queues: puts and credit requests (`put`, `credit`) and the
memory they are granted, slots taken and given back, credits granted ahead and spent, and the
producers waiting for a slot, admitted as slots open.

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
A producer that closes or dies gives its credits back. An item handed straight to a consumer
(Note [direct handoff]) counts in flight from its claim, before its seal spends the credit
it was put on: the slot that credit held opens then, to a producer waiting for one.
"""

from __future__ import annotations

import logging
from typing import Any

from ...common.errors import BrokerError, Timeout
from ...common.protocol import Op, Request, reply_error, reply_ok
from ..store.objects import Objects
from ..store.parking import secs
from ..store.records import Session, StoredObject
from .broadcast import QueueRings
from .qrings import QueueRingRoom
from .queue_state import BrokerQueue, QueueTable

log = logging.getLogger(__name__)

CREDITS_AHEAD = 8  # slots of a bounded queue a producer may hold ahead, at most

Reply = dict[str, Any]


class QueueSlots:
    """The slots of every queue in `table` (Note [queue slots]), and the queues that freed one
    since the last look (`admit_putters` gives them out)."""

    def __init__(
        self, objects: Objects, table: QueueTable, rings: QueueRings, qrings: QueueRingRoom
    ) -> None:
        self.objects, self.registry, self.lot = objects, objects.registry, objects.lot
        self.table, self.rings, self.qrings = table, rings, qrings
        self._roomy: set[BrokerQueue] = set()  # queues that freed a slot since the last look

    def put(self, session: Session, route: bytes, req: Request) -> Reply | None:
        q = self.table.find(req)
        pos = req.fields.get("ring")
        if pos is not None:  # its ring's slot is its slot (Note [queue ring])
            self.qrings.put(session, q, pos)
            return self.objects.grant_or_wait(
                session, route, req, lambda: self._grant_ring(session, q, req, pos)
            )
        q.check_open()
        if not q.full and not q.putters:
            return self.objects.grant_or_wait(
                session, route, req, lambda: self._grant_open(session, q, req)
            )
        self._wait_for_slot(session, route, req, q)
        return None

    def use_credit(self, session: Session, q: BrokerQueue, counted: bool = False) -> bool:
        """Spend one of the producer's credits on an item; False if it had none. `counted`:
        the item's claim counted it in flight already (a direct item), so the slot its credit
        held opens, to a producer waiting for one."""
        have = session.credits.get(q.id, 0)
        if have:
            session.credits[q.id] = have - 1
            q.credited -= 1
            if counted:
                self._roomy.add(q)
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
        q = self.table.find(req)
        q.check_open()
        if not q.maxsize:
            return {"credits": 0}  # nothing to wait for
        if not q.full and not q.putters:
            return {"credits": self.credit_ahead(session, q, 1)}
        self._wait_for_slot(session, route, req, q)
        return None

    def _wait_for_slot(self, session: Session, route: bytes, req: Request, q: BrokerQueue) -> None:
        """Park a put or a credit request until a slot is free (admit_putters) or its
        timeout passes."""
        timeout = req.fields.get("timeout")
        message = f"{q.describe()} stayed full for {secs(timeout)}: is a consumer keeping up?"
        self.lot.wait(session, route, req, timeout, q.putters, Timeout(f"{q.describe()} is full"),
                      message)  # fmt: skip

    def credit_ahead(self, session: Session, q: BrokerQueue, due: int) -> int:
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

    def give_back(self, session: Session) -> None:
        """A producer closed or died: its credits go back to their queues."""
        for qid, n in session.credits.items():
            q = self.table.by_id.get(qid)
            if q is not None and n:
                q.credited -= n
                self._roomy.add(q)
        session.credits.clear()

    def _grant_open(self, session: Session, q: BrokerQueue, req: Request) -> Reply:
        q.check_open()  # a put that waited for device memory may find it closed
        return self._grant(session, q, req)

    def _grant_ring(self, session: Session, q: BrokerQueue, req: Request, pos: int) -> Reply:
        slot = self.qrings.put(session, q, pos)  # (a put that waited for memory: still its own?)
        reply = self._grant(session, q, req)
        self.qrings.begun(session, q, reply["put"], pos, slot, reply["oid"])
        return reply

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

    def item_freed(self, obj: StoredObject) -> None:
        """The registry freed an item's memory: its slot opens (given by `admit_putters`,
        after the request at hand)."""
        self.slot_back(obj.queue, unsealed=obj.version == 0)  # 0: aborted unsealed

    def slot_back(self, q: BrokerQueue, unsealed: bool) -> None:
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
                        result = {"credits": self.credit_ahead(w.session, q, 1)}
                    else:
                        result = self._grant(w.session, q, w.request)
                except BrokerError as exc:
                    self.objects.answer(w, reply_error(w.request.id, exc))
                else:
                    self.objects.answer(w, reply_ok(w.request.id, **result))
            self.table.note_if_ended(q)
