"""The broker's side of Note [direct handoff] (common/mailbox.py): the mailbox segment, the
grants offered to producers, and taking them back."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgpack

from ..common import _shm
from ..common.directory import REGIONS
from ..common.errors import InvalidRequest, QueueClosed, Timeout
from ..common.mailbox import CLAIMED, FILLED, IDLE, MAILBOX, OPEN, word
from ..common.protocol import reply_error
from .directory import _Mapped
from .parking import ParkingLot, Waiter
from .registry import Registry, Session
from .state import Journal

log = logging.getLogger(__name__)


class MailboxTable(_Mapped):
    """One mailbox per lease-slot region. A new segment for each broker: one that restarts
    needs nothing from the last one's (a seal sent again says where its item went)."""

    def __init__(
        self, shm_dir: str, prefix: str, journal: Journal, regions: int = REGIONS,
        group: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(shm_dir, prefix, regions * MAILBOX, journal, "mailboxes", None, group)

    def at(self, region: int) -> int:
        return self.addr + region * MAILBOX

    def reset(self, region: int) -> None:
        """Its client is gone: whoever has the region next finds no item and no offer."""
        _shm.store(self.at(region), word(0, IDLE))
        _shm.offer_write(self.at(region), 0, 0, 0, 0, 0, b"")

    def offer(self, d: Direct, region: int) -> None:
        """Offer grant `d` to the producer whose mailbox is `region`."""
        consumer = d.waiter.session
        assert consumer.region is not None
        _shm.offer_write(
            self.at(region), d.queue.id, d.token, consumer.region, d.lease, d.version,
            consumer.token.encode(),
        )  # fmt: skip


@dataclass(eq=False, slots=True)
class Direct:
    """A grant offered to `producer`: its next item of `queue` may go to the consumer parked
    in `waiter`, through the mailbox at `mailbox`, as `version`, on lease `lease`."""

    token: int
    queue: Any  # a BrokerQueue
    waiter: Waiter
    producer: Session
    mailbox: int
    lease: int
    version: int
    consumer_gone: bool = False


@dataclass(slots=True)
class Bound:
    """A direct item as its seal binds it: whose it is (None: no one's any more)."""

    queue: Any
    consumer: Session | None
    lease: int
    version: int


class Handoffs:
    """Direct grants: offered (one per queue at a time), claimed and not yet sealed, and the
    bells to ring after replies. `retry(waiter)` handles a consumer's get again."""

    def __init__(
        self, registry: Registry, lot: ParkingLot, retry: Callable[[Waiter], None]
    ) -> None:
        self.registry, self.lot, self._retry = registry, lot, retry
        self.mailboxes: MailboxTable | None = None  # the broker sets it: none, no handoffs
        self.sessions: dict[str, Session] = {}  # the broker's, by token
        self.offered: dict[int, Direct] = {}  # queue id -> its grant
        self.claimed: dict[int, Direct] = {}  # token -> claimed, seal not seen yet
        self._busy: set[int] = set()  # mailboxes holding a claimed item (not offered again)
        self._leases: dict[tuple[str, int], Direct] = {}  # consumer's lease set aside
        self._early: set[tuple[str, int]] = set()  # of those, let go before the seal came
        self._rings: dict[bytes, tuple[int, Session]] = {}  # route -> bell, after its reply
        self.handed = 0  # items handed over directly

    # -- offering ---------------------------------------------------------------------------

    def offer(self, q: Any, w: Waiter) -> None:
        """`w`, a get that waits on its bell, parked on the empty ordinary queue `q`: offer
        the queue's last producer a grant to hand it its next item."""
        mailboxes, consumer = self.mailboxes, w.session
        if mailboxes is None or q.subs is not None or q.id in self.offered:
            return
        if consumer.region is None or q.producer is None or not w.request.fields.get("mailbox"):
            return
        producer = q.producer
        mailbox = mailboxes.at(consumer.region)
        if not producer.routes or producer.region is None or mailbox in self._busy:
            return  # gone (or going: its routes go first), or no mailbox to offer it in
        token, lease = self.registry.new_id(), self.registry.new_id()
        d = Direct(token, q, w, producer, mailbox, lease, q.sealed + 1)
        _shm.store(mailbox, word(token, OPEN))
        self.offered[q.id] = d
        self._leases[consumer.token, lease] = d
        w.at_deadline = partial(self._deadline, d, w.at_deadline)
        mailboxes.offer(d, producer.region)

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
        d.queue.sealed = max(d.queue.sealed, d.version)
        if not d.waiter.done:
            self.lot.unpark(d.waiter)  # answered by the item, not by the broker
        self.claimed[d.token] = d
        self._busy.add(d.mailbox)

    def _deadline(self, d: Direct, then: Callable[[], bytes | None] | None) -> bytes | None:
        """A get whose grant is out timed out: its Timeout, unless the grant was claimed."""
        if self.offered.get(d.queue.id) is d and self.take_back(d.queue):
            return None
        if then is not None:
            return then()
        w = d.waiter
        return reply_error(w.request.id, Timeout(w.timeout_message))

    def _forget(self, d: Direct) -> None:
        key = (d.waiter.session.token, d.lease)
        self._leases.pop(key, None)
        self._early.discard(key)
        self._busy.discard(d.mailbox)

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
        d.producer = producer  # whoever claimed it handed it over
        del self.claimed[token]
        early = (d.waiter.session.token, d.lease) in self._early
        self._forget(d)
        self.handed += 1
        gone = d.consumer_gone or d.waiter.session.closed or early
        return Bound(d.queue, None if gone else d.waiter.session, d.lease, d.version)

    def _bind_unknown(
        self, token: int, consumer_token: str, lease: int, version: int,
        fields: dict[str, Any], queues: dict[int, Any],
    ) -> Bound:  # fmt: skip
        """A seal sent again to a broker that restarted, of an item a grant of the one that
        died handed over: the producer says where it went."""
        if token >= self.registry.first_id:
            raise InvalidRequest(f"write: no direct grant {token} is out (it was taken back)")
        q = queues.get(fields["queue"])
        if q is None:
            raise QueueClosed(f"queue {fields.get('name', fields['queue'])!r} is gone")
        q.sealed = max(q.sealed, version)
        consumer = self.sessions.get(consumer_token)
        self.handed += 1
        return Bound(q, None if consumer is None or consumer.closed else consumer, lease, version)

    def released_early(self, session: Session, leases: list[int]) -> list[int]:
        """Of the leases `session` let go that the broker does not know, those set aside for
        direct items whose seals have not come yet are noted; the others returned."""
        unknown = []
        for lease in leases:
            if (session.token, lease) in self._leases:
                self._early.add((session.token, lease))
            else:
                unknown.append(lease)
        return unknown

    # -- clients that go -------------------------------------------------------------------

    def session_gone(self, session: Session) -> list[tuple[Direct, dict[str, Any] | None]]:
        """`session` closed or died. Its grants go back; those it claimed as a consumer have
        no one to go to. Returns the claimed grants its death left unsealed, each with the
        body it filled (the broker seals it), or None (never filled: its consumer asks
        again)."""
        for route in [r for r, (_, s) in self._rings.items() if s is session]:
            del self._rings[route]
        for d in list(self.offered.values()):
            if d.producer is session or d.waiter.session is session:
                self.take_back(d.queue)
        left = []
        for d in list(self.claimed.values()):
            if d.waiter.session is session:
                d.consumer_gone = True
                self._busy.discard(d.mailbox)
            if d.producer is session:
                left.append((d, self._read_body(d)))
        if self.mailboxes is not None and session.region is not None:
            # A producer that claimed this mailbox and did not fill it yet now fails to: its
            # item goes to the queue (unfilled).
            self.mailboxes.reset(session.region)
        return left

    def unfilled(self, producer: Session, q: Any) -> None:
        """`producer` sent an item of `q` through the broker: a grant of `q` it claimed and
        has not sealed came to nothing (its seals come in order, and a claim it could not
        fill is sent so: its consumer died and the mailbox was emptied)."""
        for d in [d for d in self.claimed.values() if d.producer is producer and d.queue is q]:
            del self.claimed[d.token]
            self._forget(d)

    def _read_body(self, d: Direct) -> dict[str, Any] | None:
        """The body its dead producer filled, or None if it died before (then the mailbox is
        emptied, and the grant forgotten)."""
        state, body = _shm.mailbox_read(d.mailbox)
        if state == word(d.token, FILLED) and body is not None:
            try:
                found = msgpack.unpackb(body, raw=False, strict_map_key=True)
                if isinstance(found, dict):
                    return found
            except (ValueError, msgpack.UnpackException):
                pass
            log.warning("the mailbox of %s held an item it could not read", d.waiter.session)
        elif state == word(d.token, CLAIMED):
            _shm.cas(d.mailbox, state, word(0, IDLE))
        del self.claimed[d.token]
        self._forget(d)
        if not d.consumer_gone and not d.waiter.session.closed:
            self._retry(d.waiter)
        return None

    # -- bells --------------------------------------------------------------------------

    def ring_after_reply(self, route: bytes, session: Session) -> None:
        """The get just handled waits on its bell: ring it once its reply is sent."""
        if self.mailboxes is not None and session.region is not None:
            self._rings[route] = (self.mailboxes.at(session.region), session)

    def sent(self, route: bytes) -> None:
        """A message went to `route`: ring the bell it waits on, if it does."""
        rung = self._rings.pop(route, None)
        if rung is not None:
            _shm.ring(rung[0])

    def stats(self) -> dict[str, int]:
        return {"direct_handoffs": self.handed, "direct_offered": len(self.offered)}
