"""A client's seals still out when its broker restarts (Note [writes] in writes.py; Note
[recovery] in server/durability/state.py): sent again, in order, on a new socket to the
broker that comes back, if it kept this client's session; each failed, if it did not (or
none came back).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..common.errors import BrokerError, BrokerUnavailable
from .ahead import Ahead
from .connection import Connection
from .transport import BrokerExited, Channel


@dataclass(slots=True)
class Out:
    """A seal sent and not yet answered."""

    message: dict[str, Any]
    key: str | None  # the key it puts (None: a queue item)
    label: str  # how its errors name it
    put: int | None  # its put lease, which ends with the answer (None: it is kept)
    wait: bool  # whether a caller waits for the answer (else errors are raised later)


class Resealing:
    """Writes' side that comes to a broker that restarted (what it uses of Writes is named
    here)."""

    conn: Connection
    ahead: Ahead
    _lock: threading.Lock
    _channel: Channel | None
    _generation: int
    _epoch: int
    _out: dict[int, Out]
    _keys: dict[str, int]
    _owed: set[int]
    _answers: dict[int, dict[str, Any]]
    _stale: bool

    @property
    def current(self) -> bool:
        """Whether the socket is (still) the one to the broker of now."""
        return self._generation == self.conn.generation

    def _ready(self) -> Channel:
        """The socket to the broker of now; after a restart, a new one, on which the seals
        still out go again, in order. Called with the lock held."""
        channel = self._channel
        if channel is not None and self.current:
            return channel
        if channel is not None:
            self._channel = None
            self.conn.discard_channel(channel)
            self.ahead.let_go()  # the old broker's
        self._epoch = self.conn.leases.epoch  # before: its replies are of a later broker
        channel = self._channel = self.conn.open_channel()
        self._generation = self.conn.generation  # after: a hello waits for a reconnection
        self._stale = False
        if self._out and not self.conn.resumed:
            self._lose_out()
        for out in self._out.values():
            channel.send(out.message)
        return channel

    def renew(self) -> bool:
        """Come to the broker of now, if it is not the socket's (`_ready`); False if that one
        has exited too."""
        with self._lock:
            try:
                self._ready()
            except BrokerExited:
                return False
        return True

    def _broker_exited(self, generation: int) -> None:
        try:
            self.conn.reconnect(generation)
        except BrokerError:
            with self._lock:
                self._lose_out()
            raise

    def _lose_out(self) -> None:
        """The broker of now does not have the seals still out: each fails."""
        gone = (
            f"the broker at {self.conn.address} restarted without the state of the one "
            "before (or did not come back): this put was lost; put it again"
        )
        handed_gone = (
            f"the broker at {self.conn.address} restarted without the state of the one "
            "before: this item was handed to its consumer, which has it, but the broker "
            "does not know of it (its queue is new); do not put it again"
        )
        for rid, out in list(self._out.items()):
            del self._out[rid]
            if out.wait:
                self._answers[rid] = {"id": rid, "ok": False, "code": "unavailable", "error": gone}
            else:
                why = handed_gone if rid in self._owed else gone
                self.conn.fail_later(BrokerUnavailable(f"{out.label}: {why}"))
        self._owed.clear()
        self._keys.clear()
