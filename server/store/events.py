"""Store-wide notifications: every put and delete of a key, numbered, for `watch_prefix`.

The broker keeps the last LOG_EVENTS events (up to twice that, trimmed in halves). A
watcher asks for the events after the last number it saw (`after`) whose keys start with
its prefix: it gets them at once, or parks until one comes. One that falls more than
LOG_EVENTS behind (or asks a broker that restarted, whose numbers began again) may be told
it overflowed, and goes on from now. So a watcher that keeps up never misses an event, and
one that does not always knows it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ...common.protocol import Request, reply_ok
from .parking import ParkingLot, secs
from .records import Session

LOG_EVENTS = 16384  # events kept for watchers that fall behind
BATCH = 1024  # events in one answer at most
WATCHERS = "watch_prefix"  # the lot's line of parked watchers

Event = tuple[int, str, str, int]  # number, "put" or "delete", key, version


class EventLog:
    def __init__(self, lot: ParkingLot, send: Callable[[bytes, bytes], None]) -> None:
        self.lot, self._send = lot, send
        self._events: list[Event] = []
        self._first = 1  # the number of _events[0]
        self.last = 0  # the number of the last event
        # This broker's numbering: a watcher that saw another's (a broker that restarted
        # numbers from 1 again) may have missed events, and is told so.
        self.run = int.from_bytes(os.urandom(6), "big")

    def record(self, kind: str, key: str, version: int) -> None:
        self.last += 1
        self._events.append((self.last, kind, key, version))
        if len(self._events) > 2 * LOG_EVENTS:  # drop the oldest half at once: amortised
            del self._events[:LOG_EVENTS]
            self._first = self._events[0][0]
        for w in self.lot.line(WATCHERS):
            if not w.done and key.startswith(w.request.fields["prefix"]):
                self.lot.unpark(w)
                answer = self._since(w.request.fields["prefix"], w.request.fields["after"])
                self._send(w.route, reply_ok(w.request.id, **answer))

    def watch(self, session: Session, route: bytes, req: Request) -> dict[str, Any] | None:
        """The events after `after` under `prefix`; without `after`, where the log is now."""
        prefix, after = req.fields["prefix"], req.fields.get("after")
        if after is None:
            return {"events": [], "next": self.last, "run": self.run}
        restarted = req.fields.get("run", self.run) != self.run or after > self.last
        if restarted or after < self._first - 1:  # or fell behind
            return {"events": [], "next": self.last, "run": self.run, "overflowed": True}
        answer = self._since(prefix, after)
        if answer["events"] or req.fields.get("timeout", None) == 0.0:
            return answer
        timeout = req.fields.get("timeout")
        message = f"no put or delete under {prefix!r} within {secs(timeout)}"
        # Parked with `after` as it is: nothing under the prefix came since, so the first
        # event recorded under it is the answer.
        self.lot.park(session, route, req, timeout, WATCHERS, message)
        return None

    def _since(self, prefix: str, after: int) -> dict[str, Any]:
        """Up to BATCH events after `after` under `prefix`, and the number to ask after
        next (past the events looked at that are not under it)."""
        out: list[Event] = []
        start = after + 1 - self._first
        for event in self._events[start:]:
            if event[2].startswith(prefix):
                out.append(event)
                if len(out) == BATCH:
                    return {"events": out, "next": event[0], "run": self.run}
        return {"events": out, "next": self.last, "run": self.run}
