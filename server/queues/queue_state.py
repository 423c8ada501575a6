"""The state of the pipeline queues: each queue's (`BrokerQueue`) and the table of them all by
name and by id, open, draining, or ended and remembered (`QueueTable`). The rooms that answer
queue requests (queues.py, slots.py, subscriptions.py, direct.py) and the broadcast rings
(broadcast.py) all read and change queues through these; none of them is imported here."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...common.errors import QueueClosed, Timeout
from ...common.protocol import Request
from ..store.parking import ParkingLot, Waiter, secs
from ..store.records import Session, StoredObject
from ..store.registry import Registry
from .rings import Ring

if TYPE_CHECKING:
    from .qring_state import QRing

ENDED_QUEUES = 4096  # ended queues remembered, so that a late consumer sees them closed


@dataclass(eq=False)
class BrokerQueue:
    name: str
    id: int  # a new id for each queue ever opened under a name: handles of an ended one fail
    maxsize: int = 0  # items in flight at most; 0: no bound (Note [queue slots] in slots.py)
    closed: bool = False
    closing: bool = False  # closed on another node of a cluster: no more puts, not ended yet
    items: deque[StoredObject] = field(default_factory=deque)  # sealed, not yet taken
    getters: deque[Waiter] = field(default_factory=deque)  # consumers waiting for an item
    putters: deque[Waiter] = field(default_factory=deque)  # producers waiting for a slot
    in_flight: int = 0  # items given memory and not yet freed
    pending: int = 0  # of those, items not sealed yet
    sealed: int = 0  # items numbered so far: an item's version is its place in the stream
    credited: int = 0  # slots granted ahead to producers, not yet used
    # A broadcast queue (Note [broadcast] in subscriptions.py): its subscribers by id, and for
    # each item waiting in `items` the subscribers not yet given it. None: an ordinary queue.
    subs: dict[int, Session] | None = None
    unseen: dict[int, set[int]] = field(default_factory=dict)  # item's oid -> subscribers
    removed: bool = False  # by `qdelete`: its name may start a new queue already
    producer: Any = None  # the session of the last item written: offered direct grants
    ring: Ring | None = None  # a bounded broadcast queue's (Note [broadcast ring])
    qring: QRing | None = None  # a bounded ordinary queue's (Note [queue ring], qrings.py)

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
            and (self.qring is None or not self.qring.view.counts()[1])
        )  # fmt: skip

    def counts(self) -> tuple[int, int]:
        """(items waiting, items in flight), its ring's included (Note [queue ring])."""
        if self.qring is not None:
            return self.qring.view.counts()
        return len(self.items), self.in_flight

    def waiters(self) -> tuple[int, int]:
        """(consumers, producers) waiting: parked here, or asleep on its ring's bells."""
        if self.qring is not None:
            return self.qring.view.sleepers()
        return len(self.getters), len(self.putters)

    def describe(self) -> str:
        bound = f"of {self.maxsize} " if self.maxsize else ""
        return f"queue {self.name!r} ({len(self.items)} waiting, {self.in_flight} {bound}in flight)"

    def check_open(self) -> None:
        if self.closed or self.closing:
            raise QueueClosed(
                f"queue {self.name!r} is closed: it takes no more puts (a closed queue stays "
                "closed; give a new stream a new name)"
            )


class QueueTable:
    """Every queue by name and by id (open, draining, or ended and remembered). `on_end(q)`
    is called when a queue ends (the broadcast rings' `close`: its ring goes)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.by_name: dict[str, BrokerQueue] = {}
        self.by_id: dict[int, BrokerQueue] = {}
        self._ids = itertools.count(1)
        self._ended: dict[int, BrokerQueue] = {}  # ended queues, oldest first
        self._removed: dict[int, str] = {}  # removed queues' names by id, oldest first
        self.on_end: Callable[[BrokerQueue], None] = lambda q: None

    def new_id(self) -> int:
        return next(self._ids)

    def add(self, q: BrokerQueue) -> None:
        """A queue opened (or adopted: a removed one by its id only, until its items are in)."""
        self.by_id[q.id] = q
        if not q.removed:
            self.by_name[q.name] = q

    def remove(self, q: BrokerQueue) -> None:
        """`q` was removed: its name may start a new queue, its handles fail."""
        del self.by_name[q.name], self.by_id[q.id]
        self._ended.pop(q.id, None)
        self._forgot(q)

    def _forgot(self, q: BrokerQueue) -> None:
        """A removed queue leaves: requests that still name it are told it was removed (for
        the last ENDED_QUEUES of them)."""
        self._removed[q.id] = q.name
        while len(self._removed) > ENDED_QUEUES:
            del self._removed[next(iter(self._removed))]

    def number_after_adopted(self) -> None:
        """The queues of a broker that died are in: new ids come after theirs."""
        self._ids = itertools.count(max(self.by_id, default=0) + 1)

    def forget_removed(self) -> list[BrokerQueue]:
        """The adopted items are in: the removed queues, known to them only, leave."""
        removed = [q for q in self.by_id.values() if q.removed]
        for q in removed:
            del self.by_id[q.id]
            self._forgot(q)
        return removed

    def find(self, req: Request) -> BrokerQueue:
        """The queue a request names by id (QueueClosed if it was removed, or ended and was
        forgotten)."""
        q = self.by_id.get(req.fields["queue"])
        if q is None:
            qid = req.fields["queue"]
            name = req.fields.get("name") or self._removed.get(qid, f"#{qid}")
            if qid in self._removed:
                raise QueueClosed(f"queue {name!r} was removed")
            raise QueueClosed(f"queue {name!r} is closed and drained")
        return q

    @property
    def live(self) -> int:
        """Queues not ended yet."""
        return len(self.by_name) - len(self._ended)

    def note_if_ended(self, q: BrokerQueue) -> None:
        """A closed queue stays closed: consumers that come late end at once instead of
        waiting for a stream that is over. Only the oldest of many ended queues are forgotten
        (their names then start new queues)."""
        if not q.ended or q.removed or q.id in self._ended:
            return
        self.on_end(q)
        self._ended[q.id] = q
        while len(self._ended) > ENDED_QUEUES:
            old = self._ended.pop(next(iter(self._ended)))
            del self.by_id[old.id]
            if self.by_name.get(old.name) is old:
                del self.by_name[old.name]
            self.registry.journal.queue_gone(old)


def park_get(
    lot: ParkingLot, session: Session, route: bytes, req: Request, q: BrokerQueue,
    more: bool = False,
) -> Waiter:  # fmt: skip
    """Park a get until an item comes (QueueClosed if none will: `more`, other nodes of a
    cluster may still have items of closed `q`)."""
    if q.closed and not more:
        raise QueueClosed(f"queue {q.name!r} is closed and drained")
    timeout = req.fields.get("timeout")
    empty = Timeout(f"queue {q.name!r} is empty")
    message = f"queue {q.name!r} stayed empty for {secs(timeout)}"
    return lot.wait(session, route, req, timeout, q.getters, empty, message)
