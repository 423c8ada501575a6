"""The broker's side of Note [direct handoff] (common/mailbox.py): the grants offered to
producers in their mailboxes (members.py has the mailbox tables), and taking them back."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from ...common import _shm
from ...common.errors import InvalidRequest, QueueClosed, Timeout
from ...common.mailbox import CLAIMED, FILLED, IDLE, OPEN, read_body, word
from ...common.protocol import Request, reply_error
from ..store.parking import ParkingLot, Waiter
from ..store.records import Session
from ..store.registry import Registry

if TYPE_CHECKING:
    from ..store.members import MailboxTables

log = logging.getLogger(__name__)

UNKNOWN_RELEASES = 4096  # leases let go that a restarted broker did not know, remembered


@dataclass(eq=False, slots=True)
class Direct:
    """A grant offered to `producer`: its next item of `queue` may go to the get parked in
    `waiter`, through mailbox `index`, as `version`, on lease `lease`. `claimed` once the
    broker knows the producer took it (its item is then counted in flight in the queue)."""

    token: int
    queue: Any  # a BrokerQueue
    waiter: Waiter
    producer: Session
    index: int
    mailbox: int  # its address
    lease: int
    version: int
    claimed: bool = False


@dataclass(slots=True)
class Bound:
    """A direct item as its seal binds it: whose it is (None: no one's any more), and
    whether its claim counted it in flight already."""

    queue: Any
    consumer: Session | None
    lease: int
    version: int
    counted: bool
    back: bool = False  # its consumer gave it back untaken before this seal came


class Handoffs:
    """Direct grants: offered (one per queue, and one per mailbox, at a time), claimed and
    not yet sealed, and the bells to ring after replies. DirectItems (direct.py) makes them
    and gives `retry(waiter)` (handle a consumer's get again) and `undo(d)` (a claimed item
    that never came)."""

    def __init__(
        self,
        registry: Registry,
        lot: ParkingLot,
        retry: Callable[[Waiter], None],
        undo: Callable[[Direct], None],
    ) -> None:
        self.registry, self.lot, self._retry, self._undo = registry, lot, retry, undo
        self.mailboxes: MailboxTables | None = None  # the broker sets it: none, no handoffs
        self.sessions: dict[str, Session] = {}  # the broker's, by token
        self.offered: dict[int, Direct] = {}  # queue id -> its grant
        self.claimed: dict[int, Direct] = {}  # token -> claimed, seal not seen yet
        self._out: dict[int, Direct] = {}  # mailbox index -> its grant, offered or claimed
        self._release_later: set[int] = set()  # mailboxes of clients gone, grants still out
        self._leases: dict[tuple[str, int], Direct] = {}  # consumer's lease set aside
        self._early: set[tuple[str, int]] = set()  # of those, let go before the seal came
        self._back: set[tuple[str, int]] = set()  # or given back (qback) before it came
        self._unknown: dict[tuple[str, int], None] = {}  # let go, unknown (after a restart)
        self._rings: dict[bytes, tuple[int, Session]] = {}  # route -> bell, after its reply
        self._applied: dict[str, tuple[Session, int]] = {}  # seals applied, not yet journaled
        self.handed = 0  # items handed over directly

    def _alive(self, session: Session) -> bool:
        """Still known (a client that closed while its arrays live on is, until it exits)."""
        return self.sessions.get(session.token) is session

    # -- offering ---------------------------------------------------------------------------

    def offer(self, q: Any, w: Waiter) -> None:
        """`w`, a get that waits on its bell, parked on the empty ordinary queue `q`: offer
        the queue's last producer a grant to hand it its next item."""
        mailboxes, consumer, producer = self.mailboxes, w.session, q.producer
        if mailboxes is None or q.subs is not None or q.id in self.offered:
            return
        index = consumer.mailbox
        if index is None or index in self._out or not w.request.fields.get("mailbox"):
            return
        if producer is None or not producer.routes or producer.mailbox is None:
            return  # none yet, gone (or going: its routes go first), or no mailbox
        if not mailboxes.together(index, producer.mailbox):
            return  # clients of two users: neither maps the other's (Note [members])
        token, lease = self.registry.new_id(), self.registry.new_id()
        address = mailboxes.at(index)
        d = Direct(token, q, w, producer, index, address, lease, q.sealed + 1)
        _shm.store(address, word(token, OPEN))
        self.offered[q.id] = self._out[index] = d
        self._leases[consumer.token, lease] = d
        w.at_deadline = partial(self._deadline, d)
        w.on_leave = partial(self._left, d)
        self._write_offer(d)

    def _write_offer(self, d: Direct) -> None:
        """`d` into its producer's offer, with the id of the producer's last seal applied: the
        producer hands over only if it sent none since (its items keep their order)."""
        producer, mailboxes = d.producer, self.mailboxes
        if mailboxes is None or producer.mailbox is None:
            return
        _shm.offer_write(
            mailboxes.at(producer.mailbox), d.queue.id, d.token, mailboxes.local(d.index),
            d.lease, d.version, d.waiter.request.id, producer.applied,
            d.waiter.session.token.encode(),
        )  # fmt: skip

    def applied(self, producer: Session, request_id: int) -> None:
        """`producer`'s seal `request_id` was applied (or refused): its offers say so once
        the journal has it (`committed`)."""
        known = self._applied.get(producer.token)
        if known is None or known[1] < request_id:
            self._applied[producer.token] = (producer, request_id)

    def committed(self) -> None:
        """The journal has the seals applied so far: their producers' offers say so now, not
        before (a broker that died before the journal had a seal would hand its item out
        again after a later one the producer had handed over)."""
        for producer, request_id in self._applied.values():
            producer.applied = max(producer.applied, request_id)
            for d in self.offered.values():
                if d.producer is producer:
                    self._write_offer(d)
        self._applied.clear()

    def take_back(self, q: Any) -> bool:
        """The wait of `q`'s grant ends another way: take the grant back. False if it was;
        True if its producer had claimed it (the item is the consumer's answer, and takes
        its place in the stream now)."""
        d = self.offered.pop(q.id, None)
        if d is None:
            return False
        if _shm.cas(d.mailbox, word(d.token, OPEN), word(0, IDLE)):
            self._forget(d)
            return False
        self._claim(d)
        return True

    def _claim(self, d: Direct) -> None:
        """The producer claimed `d`: its item is in flight, numbered, and answers the get."""
        d.claimed = True
        q = d.queue
        q.sealed = max(q.sealed, d.version)
        q.in_flight += 1  # until it is freed, like any item
        q.pending += 1  # until its seal comes
        self.claimed[d.token] = d
        if not d.waiter.done:
            self.lot.unpark(d.waiter)  # answered by the item, not by the broker

    def cancel(self, session: Session, route: bytes, req: Request) -> dict[str, Any]:
        """A request of this socket that waits in the broker, given up by its caller (an
        asyncio task cancelled, a sync call interrupted): it leaves its line and is never
        answered. Replies on a socket keep their order, so if it was answered already, that
        answer came first; `cancelled` False without one: a producer handed it an item."""
        call = req.fields["call"]
        for w in self.lot.of(session):
            if w.route == route and w.request.id == call:
                self.lot.unpark(w)  # its grant taken back, unless a producer claimed it
                return {"cancelled": not self.answered(w)}
        return {"cancelled": False}

    def answered(self, w: Waiter) -> bool:
        """Whether a producer claimed the grant of get `w` (its item is the answer)."""
        return any(d.waiter is w for d in self.claimed.values())

    def _left(self, d: Direct) -> None:
        """The get left its line (answered, timed out, cancelled, its socket or client gone):
        its grant goes back, unless the producer claimed it first."""
        if self.offered.get(d.queue.id) is d:
            self.take_back(d.queue)

    def _deadline(self, d: Direct) -> bytes | None:
        """A get whose grant was out timed out: its Timeout, unless the grant was claimed
        (when it left its line, `_left`): then the item is its answer."""
        w = d.waiter
        return None if d.claimed else reply_error(w.request.id, Timeout(w.timeout_message))

    def _forget(self, d: Direct) -> None:
        """`d` is over (taken back, sealed, or come to nothing)."""
        key = (d.waiter.session.token, d.lease)
        self._leases.pop(key, None)
        self._early.discard(key)
        self._back.discard(key)
        if self._out.get(d.index) is d:
            del self._out[d.index]
            if d.index in self._release_later and self.mailboxes is not None:
                self._release_later.discard(d.index)
                self.mailboxes.release(d.index)

    # -- the seal ---------------------------------------------------------------------------

    def bind(self, producer: Session, fields: dict[str, Any], queues: dict[int, Any]) -> Bound:
        """The seal of a direct item: the consumer it went to, its lease and version."""
        token, consumer_token, lease, version = fields["direct"]
        d = self.claimed.get(token)
        if d is None:
            d = self.offered.get(fields["queue"])
            if d is None or d.token != token:
                return self._bind_unknown(token, consumer_token, lease, version, fields, queues)
            del self.offered[fields["queue"]]
            self._claim(d)
        del self.claimed[token]
        d.producer = producer  # whoever claimed it handed it over
        consumer = d.waiter.session
        early = (consumer.token, d.lease) in self._early
        back = (consumer.token, d.lease) in self._back
        self._forget(d)
        self.handed += 1
        keeps = self._alive(consumer) and not early and not back
        return Bound(d.queue, consumer if keeps else None, d.lease, d.version, True, back)

    def _bind_unknown(
        self, token: int, consumer_token: str, lease: int, version: int,
        fields: dict[str, Any], queues: dict[int, Any],
    ) -> Bound:  # fmt: skip
        """A seal sent again to a broker that restarted, of an item a grant of the one that
        died handed over: the producer says where it went."""
        first = self.registry.first_id  # ids below it were given by a broker that died
        if not 0 < token < first or not 0 < lease < first:
            raise InvalidRequest(f"write: no direct grant {token} is out (it was taken back)")
        q = queues.get(fields["queue"])
        if q is None:
            raise QueueClosed(f"queue {fields.get('name', fields['queue'])!r} is gone")
        q.sealed = max(q.sealed, version)
        consumer = self.sessions.get(consumer_token)
        let_go = (consumer_token, lease) in self._unknown  # before this seal came
        self._unknown.pop((consumer_token, lease), None)
        self.handed += 1
        return Bound(q, None if let_go else consumer, lease, version, counted=False)

    def undone(self, producer: Session, token: int) -> None:
        """The producer claimed grant `token` and could not fill it (its consumer's mailbox was
        emptied meanwhile): its item comes through the queue instead."""
        d = self.claimed.pop(token, None)
        if d is None:
            return
        self._forget(d)
        self._undo(d)
        if self._alive(d.waiter.session):
            self._retry(d.waiter)

    def given_back_early(self, session: Session, lease: int) -> bool:
        """`session` gives back the item of a direct grant whose seal has not come yet
        (qback): when it comes, the item goes back to its queue. False if no such grant."""
        if (session.token, lease) not in self._leases:
            return False
        self._back.add((session.token, lease))
        return True

    def released_early(self, session: Session, leases: list[int]) -> list[int]:
        """Of the leases `session` let go that the broker does not know, those set aside for
        direct items whose seals have not come yet are noted; the others returned (after a
        restart they are remembered: a seal sent again may name one)."""
        unknown = []
        for lease in leases:
            if (session.token, lease) in self._leases:
                self._early.add((session.token, lease))
            else:
                unknown.append(lease)
        if unknown and self.registry.first_id > 1:
            for lease in unknown:
                self._unknown[session.token, lease] = None
            while len(self._unknown) > UNKNOWN_RELEASES:
                del self._unknown[next(iter(self._unknown))]
        return unknown

    # -- clients that go -------------------------------------------------------------------

    def session_gone(self, session: Session) -> list[tuple[Direct, dict[str, Any]]]:
        """`session` closed or died: its grants go back, and its mailbox once none is out on
        it. Returns the claimed grants its death left unsealed whose mailbox it filled, with
        the body (the broker seals those); a claim it never filled is taken back, and its
        consumer asks again."""
        for route in [r for r, (_, s) in self._rings.items() if s is session]:
            del self._rings[route]
        for d in list(self.offered.values()):  # its own gets took theirs back as they left
            if d.producer is session:
                self.take_back(d.queue)
        left = []
        for d in list(self.claimed.values()):
            if d.producer is session:
                body = self._filled(d)
                if body is not None:
                    left.append((d, body))
        index, session.mailbox = session.mailbox, None
        if index is not None and self.mailboxes is not None:
            if index in self._out:
                self._release_later.add(index)  # a producer may still write into it
            else:
                self.mailboxes.release(index)
        return left

    def _filled(self, d: Direct) -> dict[str, Any] | None:
        """The body its dead producer left in the mailbox; None if it died before filling it
        (then the claim is taken back and its consumer asks again)."""
        state, body = _shm.mailbox_read(d.mailbox)
        if state == word(d.token, CLAIMED) and not _shm.cas(d.mailbox, state, word(0, IDLE)):
            state, body = _shm.mailbox_read(d.mailbox)  # filled meanwhile
        if state == word(d.token, FILLED) and body is not None:
            try:
                return read_body(body)
            except ValueError as exc:
                log.warning("the mailbox of %s held an item it could not read: %s",
                            d.waiter.session, exc)  # fmt: skip
        self.undone(d.producer, d.token)
        return None

    # -- bells --------------------------------------------------------------------------

    def ring_after_reply(self, route: bytes, session: Session) -> None:
        """The get just handled waits on its bell: ring it once its reply is sent."""
        if self.mailboxes is not None and session.mailbox is not None:
            self._rings[route] = (self.mailboxes.at(session.mailbox), session)

    def sent(self, route: bytes) -> None:
        """What was sent to `route` is all there to read: ring the bell it waits on, if it
        does (not before: a consumer woken early would sleep again, up to WATCH_STEP_MS)."""
        rung = self._rings.pop(route, None)
        if rung is not None:
            _shm.ring(rung[0])

    def stats(self) -> dict[str, int]:
        return {"direct_handoffs": self.handed, "direct_offered": len(self.offered)}
