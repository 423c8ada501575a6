"""A connection's reconnection (Note [recovery] in server/durability/state.py): when the broker
it said hello to exits, the first thread to see it waits (up to the client's
`reconnect_timeout`) for a broker at the same address and says hello again with the same
session; the others wait for it, then go on. If none comes in time, the connection stays
broken until a later call (or the release thread) looks again.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable

from ..common.errors import BrokerUnavailable
from .transport import BrokerExited, Channel, ChannelPool

log = logging.getLogger(__name__)

HELLO_STEP = 0.5  # each hello to a broker that may not be there yet waits this long


class Reconnecting:
    """Connection's side that finds a broker again (what it uses of Connection is named
    here)."""

    address: str
    closed: bool
    closing: bool
    generation: int
    resumed: bool
    reconnect_timeout: float
    new_channel: Callable[..., Channel]
    _broken: str | None
    _broker_pidfd: int | None
    _old_pidfds: list[int]
    _pool: ChannelPool
    _reconnecting: threading.Lock

    def _fresh_channel(self) -> Channel:
        """A new socket, once no reconnection is under way (its hello would come first).
        BrokerExited while no broker has come back since the last one exited: the caller
        reconnects (`reconnect`)."""
        with self._reconnecting:
            if self._broken:
                raise BrokerExited(self._broken)
        return self.new_channel()

    def broker_exited(self) -> bool:
        """Whether the broker this connection said hello to has exited (pidfd readable)."""
        fd = self._broker_pidfd
        return fd is not None and bool(select.select([fd], [], [], 0)[0])

    def reconnect(self, generation: int, window: float | None = None) -> None:
        """The broker of `generation` exited: wait up to `window` seconds (None: the
        client's `reconnect_timeout`; 0: one hello) for one at the same address, and say
        hello again with this session and the leases this process holds (once, whichever
        thread comes first). BrokerUnavailable if none comes in time; the client stays
        usable: its next call (and the release thread, every RETRY_IDLE seconds) tries
        again, with a window of its own, and carries the leases over just the same."""
        with self._reconnecting:
            if generation != self.generation:
                return  # another thread has done it
            exited = f"the broker at {self.address} exited"
            if window is None:
                window = self.reconnect_timeout
            if self._broken is None:  # its sockets and pidfd are the dead broker's
                self._broken = exited
                self._pool.renew()
                if self._broker_pidfd is not None:  # other threads may still poll it
                    self._old_pidfds.append(self._broker_pidfd)
                    self._broker_pidfd = None
                if window <= 0:  # connect(reconnect_timeout=0): the call that saw it fails
                    raise BrokerUnavailable(f"{exited} (the next call looks for one again)")
                log.warning("%s: waiting up to %.0fs for it to come back", exited, window)
            deadline = time.monotonic() + window
            while True:
                try:
                    channel = self.new_channel(HELLO_STEP, resume=True)
                    break
                except BrokerUnavailable:
                    if time.monotonic() >= deadline or self.closed or self.closing:
                        self._broken = (
                            f"{exited} and no broker came back within {window:g}s "
                            f"(connect(reconnect_timeout=...)); start one with `tensorbroker "
                            f"serve --address {self.address}`: this client's next call "
                            "looks for it again"
                        )
                        raise BrokerUnavailable(self._broken) from None
            self._broken = None
            self.generation += 1
            self._pool.give_back(channel)
            log.warning(
                "the broker at %s is back; %s", self.address,
                "this client's leases carried over" if self.resumed else "its state was lost",
            )  # fmt: skip
