"""The client's side of Note [direct handoff] (common/mailbox.py): a consumer waiting on its
bell, and a producer handing an item to a consumer's mailbox."""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

import msgpack

from ..common import _shm
from ..common.descriptors import object_wire
from ..common.mailbox import CLAIMED, FILLED, IDLE, MAILBOX_BODY, OPEN, Mailboxes, word

SETTLE_WAIT = 0.2  # seconds a consumer whose broker died waits for a claimed mailbox's fill


class DirectGrant(NamedTuple):
    """A grant offered to this client as a producer (read from its mailbox's offer): its
    next item of `queue` may go to get `request` of the consumer `consumer`, through mailbox
    number `mailbox`, as `version`, on lease `lease`; `applied`: the id of this client's
    last seal the broker had applied then."""

    queue: int
    token: int
    mailbox: int
    lease: int
    version: int
    request: int
    applied: int
    consumer: str  # its session token


class Bell:
    """This client's own mailbox (at `address`, named by the broker of `generation`), waited
    on by one get of this client's at a time (`lock`)."""

    def __init__(self, address: int, generation: int) -> None:
        self.address, self.generation = address, generation
        self.lock = threading.Lock()

    def offer(self) -> DirectGrant | None:
        """The grant offered to this client as a producer, if any (maybe taken back since)."""
        found = _shm.offer_read(self.address)
        return None if found is None else DirectGrant(*found)

    def count(self) -> int:
        """Read before looking for what it rings for: a ring after that ends `wait` at once."""
        return _shm.bell(self.address)

    def wait(self, seen: int, timeout: float) -> None:
        _shm.bell_wait(self.address, seen, timeout)

    def take(self, request_id: int) -> dict[str, Any] | None:
        """The item a producer handed to get `request_id`, as its reply; None if none (an
        item for a get given up earlier stays where it is)."""
        state, body = _shm.mailbox_read(self.address)
        if body is None or state & 0xFF != FILLED:
            return None
        reply: dict[str, Any] = msgpack.unpackb(body, raw=False)
        if reply.get("for") != request_id:
            return None
        reply["id"], reply["ok"] = request_id, True
        return reply

    def settle(self, request_id: int, wait: float = SETTLE_WAIT) -> dict[str, Any] | None:
        """The broker died while get `request_id` waited (or it was given up after a
        producer claimed its grant): the item a producer handed to it, if one did (waiting
        up to `wait` seconds for a fill under way); else the grant is taken back here, so
        that no producer hands it one after the get is sent again elsewhere."""
        deadline = time.monotonic() + wait
        while True:
            state = _shm.load(self.address)
            if state & 0xFF == OPEN and _shm.cas(self.address, state, word(0, IDLE)):
                return None
            if state & 0xFF != CLAIMED or time.monotonic() > deadline:
                return self.take(request_id)
            time.sleep(0.001)


def hand_over(
    mailboxes: Mailboxes, grant: DirectGrant, name: str, bundle: bool, wires: list[Any],
    oid: int, put: int,
) -> tuple[str, Any] | None:  # fmt: skip
    """Hand an item written at `wires` (the block of put `put`, object `oid`) to the consumer
    of `grant`: the seal's field for it, ("direct", ...) if handed over, ("undone", token)
    if claimed and then taken back before it was filled; None if not claimed (the grant was
    taken back, or the item does not fit a mailbox): then it goes through the broker."""
    body = object_wire(name, grant.version, bundle, wires, grant.lease)
    body["oid"], body["put"], body["for"] = oid, put, grant.request
    packed = msgpack.packb(body)
    if len(packed) > MAILBOX_BODY:
        return None
    try:
        address = mailboxes.at(grant.mailbox)
    except ValueError:
        return None
    done = _shm.mailbox_hand(address, grant.token, packed)
    if done == 1:
        return "direct", [grant.token, grant.consumer, grant.lease, grant.version]
    if done == 2:
        return "undone", grant.token
    return None
