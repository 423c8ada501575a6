"""One queue's ring as the broker holds it (Note [queue ring] in common/qring.py): its segment
and what only the broker does to it (`BrokerRingView`), the owner number of each client of
the queue, and the items put through the broker for a position (`QRing`). qrings.py has
the rings of all the queues."""

from __future__ import annotations

from typing import Any

from ...common import _shm
from ...common.errors import InvalidRequest
from ...common.qring import (
    FREE,
    MEMBERS,
    Q_TAIL,
    READY,
    WRITING,
    QueueRingView,
    ring_bytes,
    slot_data,
    state,
)
from ...common.qring_sleep import Q_CSLEEP, Q_PSLEEP
from ..durability.journal import Journal
from ..store.directory import Mapped
from ..store.records import Session, StoredObject

RING_BUDGET = 16 << 20  # bytes of slot data in one queue's ring, at most
RING_DATA = 64 << 10  # bytes of data in one slot, at most: a larger item is asked for

Reply = dict[str, Any]


class BrokerRingView(QueueRingView):
    """A ring as the broker sees it: what only it does (end the queue; free, publish or
    finish for a client gone)."""

    __slots__ = ()

    def end(self, why: int) -> int:
        """Close (CLOSED) or remove (REMOVED) the queue at its tail; the end position."""
        at = self.addr + Q_TAIL
        while True:
            t = _shm.load(at)
            if _shm.cas(at, t, t | why):
                break
        self.wake_all()
        return t >> 2

    def sleepers(self) -> tuple[int, int]:
        """(consumers, producers) asleep on the bells."""
        return _shm.load(self.addr + Q_CSLEEP), _shm.load(self.addr + Q_PSLEEP)

    def free(self, slot: int, word: int | None = None) -> None:
        """Free `slot` (its holder or writer gone, or its item freed by the broker): if its
        word is still `word`, when given."""
        if word is None:
            _shm.store(self.meta(slot), FREE)
        elif not _shm.cas(self.meta(slot), word, FREE):
            return
        self.wake_producers()

    def release_entry(self, pos: int) -> None:
        """Publish an entry whose claimant died after it wrote its slot (QUEUED)."""
        _shm.store(self.entry(pos), state(pos, 0, READY))
        self.wake_consumers()

    def untake(self, pos: int) -> None:
        """Finish the take of `pos` by a consumer that died in it."""
        self._taken(self.entry(pos), pos)


class QRing(Mapped):
    """One queue's ring: its segment, the owner number of each client of the queue, and the
    items put through the broker for a position: put (`pending`), sealed (`asks`), and
    handed to the consumer that took the position (`lent`)."""

    def __init__(
        self, shm_dir: str, prefix: str, journal: Journal, slots: int,
        group: int | None = None, existing: str | None = None,
    ) -> None:  # fmt: skip
        data = slot_data(slots, RING_BUDGET, RING_DATA)
        size = ring_bytes(slots, data) if existing is None else 0
        super().__init__(shm_dir, prefix, size, journal, "qring", existing, group)
        if existing is None:
            QueueRingView.format(self.addr, slots, data)
        try:
            self.view = BrokerRingView(self.addr)
        except ValueError:  # (an adopted segment that is no ring)
            super().close(unlink=False)
            raise
        self.owners: dict[str, int] = {}  # session token -> its owner number
        self.pending: dict[int, tuple[int, int, int, int]] = {}  # put id -> position, slot,
        # oid, owner
        self.asks: dict[int, tuple[StoredObject, int, int]] = {}  # position -> item, slot, owner
        self.lent: dict[int, int] = {}  # oid -> slot
        self.staged: list[int] = []  # positions of `asks` to publish after the commit
        self.gone: set[int] = set()  # adopted: owners of clients that did not come back
        self.given_up: set[int] = set()  # positions whose put was given up unanswered

    def row(self) -> list[Any]:
        """What the journal keeps of it (the queue's row)."""
        return [self.name, sorted(self.owners.items())]

    def owner(self, session: Session) -> int:
        return self.owners.get(session.token, 0)

    def join(self, session: Session) -> int:
        """`session`'s owner number (a new one if it has none)."""
        have = self.owners.get(session.token)
        if have is not None:
            return have
        taken = set(self.owners.values())
        for n in range(1, MEMBERS):
            if n not in taken:
                self.owners[session.token] = n
                return n
        raise InvalidRequest(
            f"{MEMBERS - 1} clients use this queue already: close some, or use another queue"
        )

    def claimed(self, pos: int, owner: int) -> int | None:
        """The slot position `pos` names if `owner` claimed it and has not published it
        (nor given up its put: `QueueRingRoom.unclaim`)."""
        view = self.view
        got = view.entry_word(pos)
        if got[:3] != (pos, owner, WRITING) or not owner or pos in self.given_up:
            return None
        slot = got[3]
        if slot >= view.slots or view.slot_word(slot)[:2] != (owner, WRITING):  # (NAMED too)
            return None
        return slot

    def description(self, owner: int) -> Reply:
        """What a client needs to use it."""
        return {"name": self.name, "size": self.size, "owner": owner}
