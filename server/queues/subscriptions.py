"""Broadcast queues' subscriptions (`subscribe`, `unsubscribe`, and the gets of subscribers):
which subscriber each item waiting in a broadcast queue is still for, and giving it to each.
The rings some subscribers read through are broadcast.py's.

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
from collections.abc import Callable
from typing import Any

from ...common.errors import InvalidRequest, QueueClosed
from ...common.protocol import Request, reply_error, reply_ok
from ..store.objects import Objects
from ..store.records import Session, StoredObject
from .broadcast import QueueRings
from .queue_state import BrokerQueue, QueueTable, park_get

Reply = dict[str, Any]


class Broadcasts:
    """The subscriptions of the broadcast queues in `table` (Note [broadcast]), numbered
    across all of them."""

    def __init__(self, objects: Objects, table: QueueTable, rings: QueueRings) -> None:
        self.objects, self.registry, self.lot = objects, objects.registry, objects.lot
        self.table, self.rings = table, rings
        self._sub_ids = itertools.count(1)

    def subscribe(self, session: Session, route: bytes, req: Request) -> Reply:
        """A new subscription: the items sealed from now on, each given to it too."""
        q = self.table.find(req)
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
        q = self.table.by_id.get(req.fields["queue"])
        sub = req.fields["sub"]
        if q is not None and q.subs is not None and q.subs.get(sub) is session:
            self._drop_sub(q, sub, gone=False)
        return {}

    def publish(self, q: BrokerQueue, obj: StoredObject) -> None:
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
        self.table.note_if_ended(q)

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

    def get(self, session: Session, route: bytes, req: Request, q: BrokerQueue) -> Reply | None:
        """A subscriber's get: the first item waiting for its subscription, or it waits."""
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
        park_get(self.lot, session, route, req, q)
        return None

    def session_gone(self, session: Session, gone: bool) -> None:
        """A client closed or died (`gone`: its process too): its subscriptions end, and if
        it is `gone`, what its ended subscriptions held in rings is let go."""
        for bq in list(self.table.by_id.values()):
            if bq.subs is not None:
                for sub in [sub for sub, s in bq.subs.items() if s is session]:
                    self._drop_sub(bq, sub, gone)
        if gone:
            self.rings.session_gone(session)

    def removed(self, q: BrokerQueue) -> None:
        """`q` was removed: its subscriptions end (what they took stays theirs till let go)."""
        for sub, s in list((q.subs or {}).items()):
            self.rings.leave(q, sub, s, gone=False)
        if q.subs is not None:
            q.subs.clear()

    # -- a broker that died (Note [recovery] in state.py) -------------------------------------

    def adopt(self, q: BrokerQueue, subs: Any, sessions: dict[str, Session]) -> int:
        """The subscriptions of adopted queue `q` (its journal row's): those of the `sessions`
        still alive carry over, with their ring bits (Note [broadcast ring]). Returns the
        highest subscription id it had (0: none)."""
        q.subs = {}
        seen = 0
        for sub, token, *ringed in subs:
            bit, start = ringed if len(ringed) == 2 else (None, 0)
            if token not in sessions:
                if bit is not None:  # its bits leave the ring's slots (QueueRings.adopted)
                    ended = self.rings.ended_bits
                    ended[q.id] = ended.get(q.id, 0) | 1 << bit
            elif sub is None:  # ended; what it took is held until its process exits
                if q.ring is not None and bit is not None:
                    q.ring.parted[bit] = sessions[token]
            else:
                q.subs[sub] = sessions[token]
                if q.ring is not None and bit is not None:
                    q.ring.bits[sub], q.ring.starts[sub] = bit, start
            seen = max(seen, sub or 0)
        return seen

    def number_after(self, seen: int) -> None:
        """Subscriptions made from now on are numbered after `seen` (the adopted ones')."""
        self._sub_ids = itertools.count(seen + 1)

    def adopted(
        self, q: BrokerQueue, unseen: dict[int, set[int]], retire: Callable[[StoredObject], None]
    ) -> None:
        """The adopted items of `q` are in it: each still to be given to the subscriptions
        that carried over (`unseen`: by the item's oid, as its journal row says); one that
        every such subscription has is let go (`retire`)."""
        assert q.subs is not None
        for obj in list(q.items):
            left = unseen.get(obj.oid, set()) & q.subs.keys()
            if left:
                q.unseen[obj.oid] = left
            else:  # every subscription that carried over has it
                q.items.remove(obj)
                retire(obj)  # held until every client is back
        self.registry.journal.queue(q)  # without the subscriptions that ended
