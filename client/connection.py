"""A client's connection to its broker: hello, the broker's pidfd, calls that carry the lease
releases due, the fork check, and the release thread.

Threads may share a connection: each call borrows a socket (a `Channel`) from a small pool,
so a `get` parked in the broker never blocks another thread's call. Lease releases are queued
by finalisers (`releases`) and sent in batches: on the next call, or by the release thread
when the client is idle (that thread also sends heartbeats to a broker that cannot watch this
process, and runs `on_idle`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..common import host
from ..common.config import check_address, default_address
from ..common.errors import BrokerError, BrokerUnavailable
from ..common.protocol import PROTOCOL_VERSION, Op
from .transport import BrokerExited, Channel, ChannelPool

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 30.0  # for requests the broker answers at once
RELEASE_WINDOW = 0.005  # releases wait at most this long for a request to carry them ...
RELEASE_IDLE_WINDOW = 0.1  # ... or this long, in a client that has been idle


class Connection:
    """One session with the broker at `address` (else $TENSORBROKER_ADDRESS, else the default
    socket). BrokerUnavailable if no broker answers within `timeout`."""

    closed = True  # class-level defaults: a half-built Connection can still be closed
    pid = -1
    shared: dict[str, Any] = {}  # never mutated: replaced at the first hello
    _broker_pidfd: int | None = None
    _flusher: threading.Thread | None = None

    def __init__(
        self, address: str | None, timeout: float, on_idle: Callable[[], None] = lambda: None
    ) -> None:
        self.address = check_address(address or default_address())
        self.pid = os.getpid()
        self.releases: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._session = secrets.token_hex(16)
        self._ids = itertools.count(1)
        self._broken: str | None = None
        self._heartbeat: float | None = None
        self._pool = ChannelPool(self.address)
        self.closed = False
        try:
            self._pool.give_back(self._new_channel(timeout))
            flusher_channel = self._new_channel(timeout)
        except BaseException:
            self.close()
            raise
        # The thread holds the queue and its socket, not the Connection, so an unclosed
        # Client can still be collected (and warn).
        self._stop = threading.Event()
        self._flusher = threading.Thread(
            target=_flush_releases,
            args=(self.releases, self._stop, self._heartbeat, flusher_channel, self._pool,
                  on_idle),
            daemon=True,
            name=f"tensorbroker-release-{self._session[:6]}",
        )  # fmt: skip
        self._flusher.start()

    def _new_channel(self, timeout: float) -> Channel:
        channel = self._pool.new()
        hello = {
            "op": Op.HELLO,
            "id": next(self._ids),
            "version": PROTOCOL_VERSION,
            "session": self._session,
            "pid": self.pid,
            "boot_id": host.boot_id(),
            "start_time": host.start_time(self.pid),
        }
        try:
            reply = channel.call(hello, timeout)
        except BrokerUnavailable:
            self._pool.discard(channel)
            raise BrokerUnavailable(
                f"no broker answers at {self.address} (waited {timeout:.1f}s): start one with "
                f"`tensorbroker serve --address {self.address}`, or set $TENSORBROKER_ADDRESS"
            ) from None
        except BaseException:
            self._pool.discard(channel)
            raise
        self._heartbeat = float(reply.get("heartbeat") or 0.0) or None
        if not self.shared:  # the directory and this session's slot region
            self.shared = {k: reply[k] for k in ("directory", "slots") if k in reply}
        if self._broker_pidfd is None and reply.get("boot_id") == host.boot_id():
            self._broker_pidfd = host.open_pidfd(reply["pid"], reply.get("start_time"))
        if self._broker_pidfd is not None:
            channel.watch_broker(self._broker_pidfd)
        return channel

    def call(self, op: str, wait: float | None = REQUEST_TIMEOUT, **fields: Any) -> dict[str, Any]:
        """Send one request (with the releases due) and wait up to `wait` seconds for its
        reply; the reply's fields, or the broker's error raised."""
        self.check_usable()
        message = {"op": op, "id": next(self._ids), **fields}
        releases = _drain(self.releases)
        if releases:
            message["rel"] = releases
        channel = self._pool.borrow() or self._new_channel(REQUEST_TIMEOUT)
        try:
            return channel.call(message, wait)
        except BrokerExited as exc:
            self._broken = str(exc)
            raise
        finally:
            self._pool.give_back(channel)

    def check_usable(self) -> None:
        if os.getpid() != self.pid:
            raise BrokerError(
                f"this Client was made in process {self.pid} and cannot be used in a forked "
                "child: call tb.connect() in the child (or use the spawn start method)"
            )
        if self.closed:
            raise BrokerError(f"this Client of {self.address} is closed")
        if self._broken:
            raise BrokerUnavailable(self._broken)

    def stop_releasing(self) -> None:
        """Stop the release thread (the first step of closing)."""
        if self._flusher is not None:
            self._stop.set()
            self._flusher.join(timeout=5.0)

    def close(self) -> None:
        """Say bye (with the releases due), keeping the leases of arrays still alive until
        this process exits, and close every socket. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.stop_releasing()
        idle = self._pool.close()
        if idle and not self._broken:
            bye = {"op": Op.BYE, "id": 0, "keep_leases": True, "rel": _drain(self.releases)}
            with contextlib.suppress(zmq.ZMQError):
                idle[0].send(bye)
        for channel in idle:
            self._pool.discard(channel)
        fd, self._broker_pidfd = self._broker_pidfd, None
        if fd is not None:
            os.close(fd)


def _drain(releases: queue.SimpleQueue[int]) -> list[int]:
    """The lease ids queued now."""
    out: list[int] = []
    while not releases.empty():  # cheaper than waiting for queue.Empty on the hot path
        try:
            out.append(releases.get_nowait())
        except queue.Empty:  # another thread took the last one
            break
    return out


def _flush_releases(
    releases: queue.SimpleQueue[int],
    stop: threading.Event,
    heartbeat: float | None,
    channel: Channel,
    pool: ChannelPool,
    on_idle: Callable[[], None],
) -> None:
    """The release thread: send the releases no request carried within RELEASE_WINDOW, and
    heartbeats if the broker asked for them.

    It looks at the queue on a timer and never blocks on it: a thread blocked in
    `SimpleQueue.get` is woken by every put and then fights the caller for the GIL, which
    cost a busy client about 35 us per get.
    """
    delay, last_sent = RELEASE_WINDOW, time.monotonic()
    try:
        while not stop.wait(delay):
            try:
                on_idle()  # device leases: record their read-done events, then release them
            except Exception as exc:
                log.warning("settling device leases failed: %s", exc)
            ids, now = _drain(releases), time.monotonic()
            if ids:
                channel.send({"op": Op.RELEASE, "id": 0, "rel": ids})
                delay, last_sent = RELEASE_WINDOW, now
            else:
                delay = min(2 * delay, RELEASE_IDLE_WINDOW)
                if heartbeat is not None and now - last_sent >= heartbeat:
                    channel.send({"op": Op.HEARTBEAT, "id": 0})
                    last_sent = now
            if heartbeat is not None:
                delay = min(delay, heartbeat)
    except zmq.ZMQError as exc:
        log.warning("the release thread stopped: %s", exc)
    finally:
        pool.discard(channel)
