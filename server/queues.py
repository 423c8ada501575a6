"""Parked requests, and the state of one pipeline queue. No sockets here: the broker answers.

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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..common.protocol import Request
from .registry import Session, StoredObject


@dataclass(eq=False, slots=True)
class Waiter:
    """A request parked until it can be answered, or until its deadline passes."""

    session: Session
    route: bytes
    request: Request
    deadline: float | None
    line: deque[Waiter]  # where it waits; it leaves when answered, timed out or dropped
    timeout_message: str
    done: bool = False


@dataclass(eq=False)
class BrokerQueue:
    name: str
    id: int  # a new id for each queue ever opened under a name: handles of an ended one fail
    maxsize: int = 0  # items in flight at most; 0: no bound
    closed: bool = False
    items: deque[StoredObject] = field(default_factory=deque)  # sealed, not yet taken
    getters: deque[Waiter] = field(default_factory=deque)  # consumers waiting for an item
    putters: deque[Waiter] = field(default_factory=deque)  # producers waiting for a slot
    in_flight: int = 0  # items given memory and not yet freed
    pending: int = 0  # of those, items not sealed yet
    sealed: int = 0  # items numbered so far: an item's version is its place in the stream

    @property
    def full(self) -> bool:
        return self.maxsize > 0 and self.in_flight >= self.maxsize

    @property
    def ended(self) -> bool:
        """Closed, and nothing left to take or still being written."""
        return self.closed and not self.items and self.pending == 0

    def describe(self) -> str:
        bound = f"of {self.maxsize} " if self.maxsize else ""
        return f"queue {self.name!r} ({len(self.items)} waiting, {self.in_flight} {bound}in flight)"
