"""Replies to ZeroMQ clients that their socket would not take yet, held per client and bounded.

A ROUTER socket queues at most SNDHWM messages per client (and ROUTER_MANDATORY makes it say
so, with zmq.Again, instead of dropping the reply). A client that is only slow, or that sent
a burst of requests, has the rest of its replies held here, in order, and sent as its socket
takes them (`flush`, each turn of the broker's loop). A client that leaves REPLY_BACKLOG bytes
unread is cut off, as a lane is (Note [lanes] in lanes.py): the broker drops its replies and
ends its route, and drops what it would send it later while its socket stays full. So a
client that never reads costs the broker at most SNDHWM replies plus REPLY_BACKLOG bytes,
however much it asks.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)

SNDHWM = 64  # replies queued in ZeroMQ per client; the rest wait here
REPLY_BACKLOG = 64 << 20  # bytes of replies held here after which a client is cut off
RETRY_S = 0.01  # how often the broker's loop tries again while replies wait here
CUT_REMEMBERED = 4096  # routes cut off, remembered (forgetting one costs only a new backlog)


class Backlogs:
    """The replies held per route. `cut_off(route)` is told when a client is cut off."""

    def __init__(self, router: zmq.Socket[bytes], cut_off: Callable[[bytes], None]) -> None:
        self._router, self._cut_off = router, cut_off
        self._held: dict[bytes, deque[bytes]] = {}
        self._bytes: dict[bytes, int] = {}
        self._cut: set[bytes] = set()  # routes cut off, until their socket takes a reply

    def __bool__(self) -> bool:
        return bool(self._held)

    def send(self, route: bytes, payload: bytes) -> None:
        held = self._held.get(route)
        if held is None:
            try:
                self._router.send_multipart([route, payload], zmq.NOBLOCK)
                if self._cut:
                    self._cut.discard(route)
                return
            except zmq.Again:
                if route in self._cut:
                    return  # still not reading
                held = self._held[route] = deque()
                self._bytes[route] = 0
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the client disconnected
                log.debug("dropped a reply to a client that left: %s", exc)
                return
        held.append(payload)
        self._bytes[route] += len(payload)
        if self._bytes[route] > REPLY_BACKLOG:
            log.warning("cut off a client that left %d bytes of replies unread", self._bytes[route])
            self._forget(route)
            if len(self._cut) >= CUT_REMEMBERED:  # routes that went away never send again
                self._cut.clear()
            self._cut.add(route)
            self._cut_off(route)

    def flush(self) -> None:
        """Send what each client's socket takes now."""
        for route, held in list(self._held.items()):
            try:
                while held:
                    self._router.send_multipart([route, held[0]], zmq.NOBLOCK)
                    self._bytes[route] -= len(held.popleft())
            except zmq.Again:
                continue
            except zmq.ZMQError:  # the client disconnected
                held.clear()
            self._forget(route)

    def _forget(self, route: bytes) -> None:
        del self._held[route], self._bytes[route]
