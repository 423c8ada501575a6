"""Parking: every request that must wait, and its deadline, in one place.

A request that cannot be answered yet (a get of a version not sealed, a queue get on an empty
queue, a queue put on a full one, a device put waiting for memory) parks as a `Waiter` in a
*line*, a FIFO deque owned by what it waits for. The `ParkingLot` knows every waiter and the
deadlines; nothing else knows how waiting works. Whoever can answer takes a waiter out
(`unpark`) and answers it; `expired` hands back the waiters whose deadline passed. No sockets
here: the broker sends the answers.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from ...common.errors import BrokerError
from ...common.protocol import Request
from .records import Session


@dataclass(eq=False, slots=True)
class Waiter:
    """A request parked until it can be answered, or until its deadline passes."""

    session: Session
    route: bytes
    request: Request
    deadline: float | None
    line: deque[Waiter]  # where it waits; it leaves when answered, timed out or dropped
    timeout_message: str
    retry: Callable[[], dict[str, Any]] | None = None  # what a device put tries again
    line_name: Hashable = None  # the lot's own line it waits in (None: its owner's)
    done: bool = False
    # Its answer when the deadline passes (None: a Timeout error; returning None: no answer,
    # it had one another way), and what to tidy when it leaves, however it leaves (a wait
    # for many keys is indexed under each of them).
    at_deadline: Callable[[], bytes | None] | None = None
    on_leave: Callable[[], None] | None = None


class ParkingLot:
    """Every parked request: its line, its deadline, and the lot's named lines (created on
    first use, forgotten once empty)."""

    def __init__(self) -> None:
        self.parked: set[Waiter] = set()
        self.lines: dict[Hashable, deque[Waiter]] = {}
        self._deadlines: list[tuple[float, int, Waiter]] = []
        self._seq = itertools.count()

    def park(
        self,
        session: Session,
        route: bytes,
        request: Request,
        timeout: float | None,
        line: deque[Waiter] | Hashable,
        timeout_message: str,
        *,
        deadline: float | None = None,
        retry: Callable[[], dict[str, Any]] | None = None,
    ) -> Waiter:
        """Park `request` at the back of `line` (a deque, or the name of one of the lot's
        lines) until `timeout` seconds from now (None: no limit), or until `deadline`."""
        name: Hashable = None
        if not isinstance(line, deque):
            name, line = line, self.lines.setdefault(line, deque())
        if deadline is None and timeout is not None:
            deadline = time.monotonic() + timeout
        waiter = Waiter(session, route, request, deadline, line, timeout_message, retry, name)
        line.append(waiter)
        self.parked.add(waiter)
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, next(self._seq), waiter))
        return waiter

    def wait(
        self,
        session: Session,
        route: bytes,
        request: Request,
        timeout: float | None,
        line: deque[Waiter] | Hashable,
        now: BrokerError,
        timeout_message: str,
    ) -> Waiter:
        """The rule of every wait: timeout=0 answers at once (raises `now`); any other
        timeout parks the request in `line` (see park)."""
        if timeout == 0.0:
            raise now
        return self.park(session, route, request, timeout, line, timeout_message)

    def line(self, name: Hashable) -> tuple[Waiter, ...]:
        """The waiters of one of the lot's named lines, first come first."""
        return tuple(self.lines.get(name, ()))

    def unpark(self, w: Waiter) -> None:
        """Take a waiter out of its line, to be answered now (or never: its client is gone)."""
        w.done = True
        self.parked.discard(w)
        if w.on_leave is not None:
            w.on_leave()
        try:
            w.line.remove(w)
        except ValueError:
            pass  # already taken from the front of its line
        if w.line_name is not None and not w.line and self.lines.get(w.line_name) is w.line:
            del self.lines[w.line_name]

    def of(self, session: Session) -> list[Waiter]:
        return [w for w in self.parked if w.session is session]

    def expired(self, now: float) -> list[Waiter]:
        """The waiters whose deadline has passed, taken out of their lines."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, w = heapq.heappop(self._deadlines)
            if not w.done:
                self.unpark(w)
                out.append(w)
        return out

    def next_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None

    def __len__(self) -> int:
        return len(self.parked)


def secs(timeout: float | None) -> str:
    """A timeout as messages say it: '2.5s', or 'ever'."""
    return "ever" if timeout is None else f"{timeout:g}s"
