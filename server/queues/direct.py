"""Items written into blocks granted ahead (`write`), and the queues' side of Note [direct
handoff] (common/mailbox.py): sealing an item its producer handed to a consumer itself, a
claimed item that never came, an item a producer that died left in a mailbox, and a get
asked again when its grant came to nothing. The grants themselves are handoff.py's
`Handoffs`, made and owned here."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...common.errors import BrokerError, InvalidRequest
from ...common.protocol import Op, Request, reply_error, reply_ok
from ..store.objects import Objects
from ..store.parking import Waiter
from ..store.records import Session
from .handoff import Bound, Direct, Handoffs
from .queue_state import BrokerQueue, QueueTable
from .slots import QueueSlots

log = logging.getLogger(__name__)

Reply = dict[str, Any]
Seal = Callable[[Session, int, bool, BrokerQueue], Reply]
Get = Callable[[Session, bytes, Request], Reply | None]


class DirectItems:
    """Writes into granted blocks, and direct items. Queues gives `seal` (an item sealed into
    its queue) and `get` (a consumer's get), which these end in."""

    def __init__(
        self, objects: Objects, table: QueueTable, slots: QueueSlots, seal: Seal, get: Get
    ) -> None:
        self.objects, self.registry = objects, objects.registry
        self.table, self.slots, self._seal, self._get = table, slots, seal, get
        self.handoffs = Handoffs(self.registry, objects.lot, self._get_again, self._undo_claim)
        self.requeue: Callable[[BrokerQueue, Any], Any] = lambda q, obj: None  # Queues sets it

    def write(self, session: Session, route: bytes, req: Request) -> Reply:
        """An item written into a block granted ahead, on a slot credited ahead (an unbounded
        queue needs none): sealed at once; the reply tops up the producer's credits."""
        f, put_id = req.fields, req.fields["put"]
        direct: Bound | None = None
        if "undone" in f:  # a grant it claimed and could not fill: the item comes this way
            self.handoffs.undone(session, f["undone"])
        try:
            granted = self.registry.pending.get(put_id)
            if "direct" in f and granted is not None and granted.device != "cpu":
                raise InvalidRequest("write: a device's block cannot be handed over directly")
            if "direct" in f:  # handed to a consumer already (Note [direct handoff])
                direct = self.handoffs.bind(session, f, self.table.by_id)
                q = direct.queue
            else:
                q = self.table.find(req)
                q.check_open()
            counted = direct is not None and direct.counted  # a claim counts its item already
            credited = self.slots.use_credit(session, q, counted)
            obj = self.registry.fill(
                session, put_id, q.name, f["tensors"], f.get("bundle", False), queue=q
            )
        except BrokerError:
            self.objects.drop_grant(session, put_id)
            raise
        if not counted:
            q.in_flight += 1
            q.pending += 1
        q.producer = session
        if direct is not None:
            reply = self._seal_direct(session, put_id, direct)
        else:
            reply = self._seal(session, put_id, False, q)
        self.objects.refill_later(session, route, obj.block.size, obj.device)
        credits = self.slots.credit_ahead(session, q, 0)
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
        elif direct.back:  # its consumer gave it back untaken: the queue's again
            self.requeue(q, obj)
        else:  # its consumer is gone (or let go of it before this seal came)
            self.registry.retire(obj)
        if q.getters:
            self.handoffs.offer(q, q.getters[0])
        self.table.note_if_ended(q)
        return {"version": obj.version}

    def _undo_claim(self, d: Direct) -> None:
        """A claimed item that never came: it no longer holds a slot."""
        self.slots.slot_back(d.queue, unsealed=True)
        if not d.queue.removed:
            self.table.note_if_ended(d.queue)

    def session_gone(self, session: Session) -> None:
        """A client closed or died: its direct grants are taken back (or sealed, if it
        handed an item over)."""
        for d, body in self.handoffs.session_gone(session):
            if body is not None:
                self._seal_left(session, d, body)

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
            reply = self._get(w.session, w.route, w.request)
        except BrokerError as exc:
            self.objects.answer(w, reply_error(w.request.id, exc))
        else:
            if reply is not None:
                self.objects.answer(w, reply_ok(w.request.id, **reply))
