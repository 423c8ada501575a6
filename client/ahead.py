"""What a client's puts take ahead: blocks of memory granted ahead (a small host put writes
into one and seals it in one trip) and slots of bounded queues credited ahead.

The replies to this client's seals (Note [writes] in writes.py) refill both: a put's reply
brings grants (and the broker tops them up after a write's), a queue put's brings credits.
A put that finds none left reads the replies still out first (they may hold some), then asks
the broker. If the broker restarts, the grants and credits held are let go.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

from ..common.descriptors import grant_class
from ..common.protocol import Op
from .connection import Connection

NO_GRANTS_BACKOFF = 1.0  # seconds a size class is not asked for again after a refusal


class Grant(NamedTuple):
    """A block granted ahead: its put id (a lease of this client's), object id and place;
    on a device, its chunk's IPC handle and the write event to record after the copy."""

    put: int
    oid: int
    segment: str
    offset: int
    size: int
    device: str = "cpu"
    handle: bytes = b""
    event: Any = None  # [event id, its IPC handle]

    @property
    def stock(self) -> Any:
        """The key of its size class in `Ahead.grants`."""
        return self.size if self.device == "cpu" else (self.device, self.size)


class Seals(Protocol):
    """What refills the grants and credits: this client's seals (`Writes` in writes.py)."""

    @property
    def outstanding(self) -> int: ...

    @property
    def current(self) -> bool: ...

    def renew(self) -> bool: ...

    def catch_up(self) -> None: ...


class Ahead:
    """The blocks granted ahead, by size class, and the slots credited ahead, by queue."""

    def __init__(self, conn: Connection, seals: Seals) -> None:
        self.conn = conn
        self.seals = seals
        self.grants: dict[Any, list[Grant]] = {}  # size class (`Grant.stock`) -> blocks
        self._refused: dict[Any, float] = {}  # size class -> when grants were last refused
        self.credits: dict[int, int] = {}  # queue id -> slots credited ahead
        self._unbounded: set[int] = set()  # queues that need no credits

    def refill(self, reply: dict[str, Any], queue: int | None, epoch: int) -> None:
        """What the reply to a seal (of a put to `queue`, if any) brings, sent at `epoch`
        (`Leases.hold_put`)."""
        self.add_grants(reply.get("grants", ()), epoch)
        credits = reply.get("credits")
        if credits and queue is not None:
            self.credits[queue] = self.credits.get(queue, 0) + credits
        if reply.get("maxsize") and queue is not None:  # bounded since it was found not to be
            self._unbounded.discard(queue)

    def let_go(self) -> None:
        """Grants and credits are the old broker's (or the client closes): let the grants go,
        forget the credits."""
        for stock in self.grants.values():
            for grant in stock:
                self.conn.leases.releases.put(grant.put)
        self.grants.clear()
        self.credits.clear()
        self._unbounded.clear()

    # -- grants ----------------------------------------------------------------------------

    def add_grants(self, grants: Any, epoch: int) -> None:
        """[[put, oid, segment, offset, size], ...], a device's with [device, handle, event]
        after those (Registry.grant), a reply to a request sent at `epoch`."""
        for put, oid, segment, offset, size, *device in grants:
            if not self.conn.leases.hold_put(put, oid, epoch):  # maybe the broker's that died
                continue
            grant = Grant(put, oid, segment, offset, size, *device)
            self.grants.setdefault(grant.stock, []).append(grant)

    def take_grant(self, size: int, device: str = "cpu") -> Grant | None:
        """A block granted ahead on `device` that holds `size` bytes, asking the broker for
        some if none is left; None if the size has none (too big, or the broker has none to
        spare)."""
        size_class = grant_class(size, device != "cpu")
        if size_class is None:
            return None
        if not self.seals.current and not self.seals.renew():
            return None  # gone again: the put asks, and waits for it to be back
        key = size_class if device == "cpu" else (device, size_class)
        stock = self.grants.get(key)
        if not stock:  # the top-ups on their way, and the replies still out, bring some
            self.seals.catch_up()
            stock = self.grants.get(key)
        if not stock:
            if time.monotonic() - self._refused.get(key, -1e9) < NO_GRANTS_BACKOFF:
                return None
            where: dict[str, Any] = {} if device == "cpu" else {"device": device}
            epoch = self.conn.leases.epoch
            self.add_grants(self.conn.call(Op.GRANT, size=size, **where)["grants"], epoch)
            stock = self.grants.get(key)
            if not stock:
                self._refused[key] = time.monotonic()
                return None
        try:
            return stock.pop()
        except IndexError:  # another thread took the last one
            return self.take_grant(size, device)

    def drop_grants(self, device: str) -> int:
        """Let go of the blocks granted ahead on `device` that no put has taken (a put the
        broker had no room for asks again once they are freed): how many."""
        dropped = 0
        for key in list(self.grants):
            if (key[0] if isinstance(key, tuple) else "cpu") != device:
                continue
            stock = self.grants.pop(key, [])
            while True:  # (another thread may pop one meanwhile: each goes to one of us)
                try:
                    grant = stock.pop()
                except IndexError:
                    break
                self.conn.leases.releases.put(grant.put)
                dropped += 1
        return dropped

    def give_back(self, grant: Grant) -> None:
        """A grant taken and not written (the copy failed): kept for the next put."""
        if self.seals.current:
            self.grants.setdefault(grant.stock, []).append(grant)
        else:
            self.conn.leases.releases.put(grant.put)

    # -- credits ---------------------------------------------------------------------------

    def take_credit(self, queue: int, timeout: float | None, wait: float | None) -> bool:
        """A slot of a bounded queue, credited ahead or waited for (up to `timeout`, as a
        put waits). False if the queue needs none (unbounded)."""
        if self.must_ask_credit(queue):
            reply = self.conn.call(Op.QCREDIT, wait, queue=queue, timeout=timeout)
            self.add_credits(queue, reply["credits"])
        if queue in self._unbounded:
            return False
        self.credits[queue] -= 1
        return True

    def must_ask_credit(self, queue: int) -> bool:
        """Whether a put to `queue` must ask the broker for a slot (Op.QCREDIT) first: a
        bounded queue (or one not known yet) with no credit left, once the replies still
        out are read (they may hold credits: asking then could wait for them forever)."""
        if queue in self._unbounded:
            return False
        if self.credits.get(queue, 0) <= 0 and self.seals.outstanding:
            self.seals.catch_up()
        return self.credits.get(queue, 0) <= 0

    def add_credits(self, queue: int, credits: int) -> None:
        """The answer to a QCREDIT: 0 says the queue is unbounded (it needs none)."""
        if not credits:
            self._unbounded.add(queue)
        else:
            self.credits[queue] = self.credits.get(queue, 0) + credits

    def return_credit(self, queue: int) -> None:
        if self.seals.current:
            self.credits[queue] = self.credits.get(queue, 0) + 1
