"""Sockets to the broker. One `Channel` is one DEALER socket that has said hello; a Client
keeps a small pool of them so that threads never share a socket."""

from __future__ import annotations

import math
import select
import threading
import time
from typing import Any

import zmq

from ..common.errors import BrokerUnavailable, SessionUnknown, error_from_wire
from ..common.protocol import decode, encode

MAX_REPLY_BYTES = 256 << 20  # replies can list many keys; requests stay small
WATCH_STEP_MS = 100  # how often a waiting call looks whether the broker has exited
WAIT_GRACE = 5.0  # extra time for the answer to a request that waits in the broker
EXIT_GRACE_MS = 20  # a broker that exited may have sent a reply still on its way


class BrokerExited(BrokerUnavailable):
    """The broker process this client talked to has exited (or no longer knows it): the
    connection waits for a broker to come back (Connection.reconnect)."""


class Channel:
    """One DEALER socket. A call blocks in `recv` (cheaper than a poller on the hot path) in
    steps of WATCH_STEP_MS, and between steps looks whether the broker process has exited."""

    def __init__(self, ctx: zmq.Context[Any], address: str, generation: int = 0) -> None:
        self.address = address
        self.generation = generation  # of the broker it says hello to (ChannelPool.renew)
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, WATCH_STEP_MS)
        self.socket.connect(address)
        self._broker: select.poll | None = None

    def watch_broker(self, pidfd: int) -> None:
        """Fail a waiting call when the broker process exits (pidfd readable)."""
        self._broker = select.poll()
        self._broker.register(pidfd, select.POLLIN)

    def send(self, message: dict[str, Any]) -> None:
        self.socket.send(encode(message), copy=True)

    def call(self, message: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """Send a request and wait for the reply with its id; raise the error it carries.

        timeout None waits as long as the broker lives.
        """
        self.send(message)
        request_id = message["id"]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            reply = self.receive()
            if reply is None:
                if deadline is None or time.monotonic() < deadline:
                    continue
                raise BrokerUnavailable(
                    f"no reply from the broker at {self.address} within {timeout:.1f}s "
                    f"(op {message['op']!r}); is it running? Try `tensorbroker ping --address "
                    f"{self.address}`"
                ) from None
            if reply.get("id") == request_id:
                return self.check(reply)
            # A reply to an earlier request that timed out: drop it and keep waiting.

    def receive(self, block: bool = True) -> dict[str, Any] | None:
        """The next reply, waiting at most WATCH_STEP_MS (`block`) or not at all; None if
        none came. BrokerExited once the broker process has exited."""
        try:
            frame = self.socket.recv(0 if block else zmq.NOBLOCK)
        except zmq.Again:
            if block and self._broker is not None and self._broker.poll(0):
                if self.socket.poll(EXIT_GRACE_MS):  # a reply sent before it died
                    return self.receive()
                raise BrokerExited(f"the broker at {self.address} exited") from None
            return None
        return decode(frame, MAX_REPLY_BYTES)

    def check(self, reply: dict[str, Any]) -> dict[str, Any]:
        """`reply`, or the error it carries raised."""
        if not reply.get("ok"):
            if reply.get("code") == SessionUnknown.code:  # a broker that restarted
                raise BrokerExited(f"the broker at {self.address} does not know this client")
            raise error_from_wire(str(reply.get("code")), str(reply.get("error")))
        return reply

    def close(self) -> None:
        self.socket.close(linger=0)


def waits(timeout: float | None) -> tuple[float | None, float | None]:
    """How long a request may wait in the broker (None: no limit), and how long the client
    then waits for its answer."""
    if timeout is not None and math.isinf(timeout):
        timeout = None
    return timeout, None if timeout is None else timeout + WAIT_GRACE


class ChannelPool:
    """The sockets of one Client: borrowed one per call, so threads never share one.

    It outlives the Client's last channel: the ZeroMQ context ends with the last socket.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._ctx: zmq.Context[Any] | None = zmq.Context()
        self._lock = threading.Lock()
        self._idle: list[Channel] = []
        self._open = 0
        self._generation = 0
        self.closed = False

    def new(self) -> Channel:
        with self._lock:
            if self._ctx is None:
                raise BrokerUnavailable(f"the client of {self.address} is closed")
            channel = Channel(self._ctx, self.address, self._generation)
            self._open += 1
        return channel

    def renew(self) -> None:
        """The broker exited: its channels are closed, now (idle) or when given back."""
        with self._lock:
            self._generation += 1
            idle, self._idle = self._idle, []
        for channel in idle:
            self.discard(channel)

    def borrow(self) -> Channel | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def give_back(self, channel: Channel) -> None:
        with self._lock:
            if not self.closed and channel.generation == self._generation:
                self._idle.append(channel)
                return
        self.discard(channel)

    def discard(self, channel: Channel) -> None:
        channel.close()
        with self._lock:
            self._open -= 1
            self._term_if_done()

    def close(self) -> list[Channel]:
        """Stop lending; returns the idle channels (the caller says bye, then discards them)."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
            self._term_if_done()
        return idle

    def _term_if_done(self) -> None:
        if self.closed and self._open == 0 and self._ctx is not None:
            self._ctx.term()
            self._ctx = None
