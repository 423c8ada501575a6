"""The client's side of Note [direct handoff] (common/mailbox.py): a consumer waiting on its
bell, and a producer handing an item to a consumer's mailbox."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack

from ..common import _shm
from ..common.mailbox import CLAIMED, IDLE, OPEN, Mailboxes, item_reply, word

SETTLE_WAIT = 0.2  # seconds a consumer whose broker died waits for a claimed mailbox's fill
TAILS = 64  # body tails a bell keeps unpacked


class Bell:
    """This client's own mailbox (at `address`, named by the broker of `generation`), waited
    on by one get of this client's at a time (`lock`)."""

    def __init__(self, address: int, generation: int) -> None:
        self.address, self.generation = address, generation
        self.lock = threading.Lock()
        self._tails: dict[bytes, Any] = {}  # the body tails seen, unpacked (a few layouts)

    def count(self) -> int:
        """Read before looking for what it rings for: a ring after that ends `wait` at once."""
        return _shm.bell(self.address)

    def wait(self, seen: int, timeout: float) -> None:
        _shm.bell_wait(self.address, seen, timeout)

    def take(self, request_id: int) -> dict[str, Any] | None:
        """The item a producer handed to get `request_id`, as its reply; None if none (an
        item for a get given up earlier stays where it is)."""
        found = _shm.mailbox_take(self.address, request_id)
        if found is None:
            return None
        lease, version, oid, put, base, tail = found
        unpacked = self._tails.get(tail)
        if unpacked is None:
            if len(self._tails) >= TAILS:
                self._tails.clear()
            unpacked = self._tails[tail] = msgpack.unpackb(tail, raw=False)
        return item_reply(request_id, lease, version, oid, put, base, unpacked)

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
    bell: Bell, mailboxes: Mailboxes, queue: int, last: int, oid: int, put: int, base: int,
    tail: bytes,
) -> tuple[str, Any] | None:  # fmt: skip
    """Hand an item of `queue` written at `base` (the block of put `put`, object `oid`) to
    the consumer of the grant offered to this client (at its `bell`), if the broker offered
    it once it had applied seal `last`: the seal's field for it, ("direct", ...) if handed
    over, ("undone", token) if claimed and then taken back before it was filled; None if not
    claimed (no such offer, taken back, or the item does not fit a mailbox): then it goes
    through the broker. `tail`: the body's tail (`body_tail`)."""
    done = _shm.hand_over(
        bell.address, mailboxes.addr, mailboxes.size, queue, last, oid, put, base, tail
    )
    if done is None:
        return None
    handed, token, consumer, lease, version = done
    if handed == 1:
        return "direct", [token, consumer, lease, version]
    return "undone", token
