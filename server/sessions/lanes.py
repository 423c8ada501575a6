"""Lanes: plain Unix stream sockets beside an ipc:// address, carrying the same msgpack
messages as the ZeroMQ socket.

Note [lanes]
~~~~~~~~~~~~
A ZeroMQ round trip in Python crosses six threads: the caller, its context's I/O thread, the
broker's I/O thread, the broker, and back. On this 2-core VM that costs about 100 us; the
same message over a Unix socket polled by the broker's own thread costs 12-17 us (same run,
/tmp/lane.py). Below 1 MiB that difference is most of a put or a queue handoff, so a broker
at `ipc://PATH` also listens on `PATH.lane`, and clients on the same host send over it.

A lane is a stream, framed by msgpack itself (a message is one msgpack map; the Unpacker
finds where it ends), with the request and reply formats of the protocol unchanged. Each
connection says hello and gets a route of its own, so the rest of the broker cannot tell a
lane from a ZeroMQ socket. The broker never blocks on one: a reply the kernel does not take
at once waits in the lane's buffer until the socket is writable, and a client that lets
LANE_BACKLOG bytes of replies pile up unread is cut off. A lane that closes (the client's
socket closed, or its process died) ends its route; the session ends by its own rules.

ZeroMQ stays the protocol for tcp:// and for any client that cannot reach the lane (another
mount namespace, TENSORBROKER_LANES=off); both can be used at once by one client.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import msgpack

from ...common.errors import ProtocolError
from ...common.protocol import MAX_MESSAGE_BYTES, Budget
from ..store.records import Peer

log = logging.getLogger(__name__)

READ_BYTES = 256 << 10  # read per readable lane, then the loop moves on
LANE_BACKLOG = 64 << 20  # unread replies after which a client is cut off
ACCEPT_PAUSE = 1.0  # seconds the listener rests after an accept failed
ROUTE_PREFIX = b"lane"  # ZeroMQ's own routing ids are 5 bytes starting with a zero byte

Dispatch = Callable[[bytes, Any], None]  # route, one decoded message


class Lane:
    """One client connection: its route, its unpacker and the replies not yet written."""

    __slots__ = ("sock", "route", "budget", "unpacker", "out", "peer", "fds")

    def __init__(self, sock: socket.socket, route: bytes) -> None:
        self.sock, self.route = sock, route
        # The kernel's word for the process at the other end (SO_PEERCRED, at connect), in
        # this broker's namespaces; no pid where it cannot say (another namespace: 0).
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        pid, uid, _ = struct.unpack("3i", creds)
        self.peer = Peer(pid or None, uid)
        # Each message is unpacked within the limits of a request (`budget`, reset after each
        # one); the buffer holds twice the largest: one partly received plus the next read.
        self.budget = Budget()
        self.unpacker = msgpack.Unpacker(
            max_buffer_size=2 * MAX_MESSAGE_BYTES, **self.budget.options
        )
        self.out = bytearray()
        # Descriptors to pass with replies still in `out`: (offset in out, fd) (Lanes.send)
        self.fds: list[tuple[int, int]] = []


class Lanes:
    """The listening socket and its connections. `watch(fd, writable)` puts a descriptor in
    the broker's poller (again, to change what it waits for); `unwatch(fd)` takes it out;
    `route_gone(route)` is told when a lane closes; `delivered(route)` when the replies
    sent to a lane are all in the kernel's hands (none left in its buffer)."""

    def __init__(
        self,
        path: str,
        watch: Callable[[int, bool], None],
        unwatch: Callable[[int], None],
        route_gone: Callable[[bytes], None],
        delivered: Callable[[bytes], None] = lambda route: None,
    ) -> None:
        self.path = path
        self._watch, self._unwatch, self._route_gone = watch, unwatch, route_gone
        self._delivered = delivered
        self.by_fd: dict[int, Lane] = {}
        self.by_route: dict[bytes, Lane] = {}
        self._to_close: list[socket.socket] = []
        self._ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._inode: int | None = None
        self.paused_until: float | None = None  # accepts rest until then (accept)

    def is_listener(self, fd: int) -> bool:
        return self._listener is not None and fd == self._listener.fileno()

    def listen(self) -> None:
        """Bind `path`; a file left there by a broker that died is replaced (the ZeroMQ
        socket beside it was bound first, so no live broker owns it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.path)
            listener.listen(128)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._inode = os.stat(self.path).st_ino
        self._watch(listener.fileno(), False)

    def accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of descriptors, say: the listener would stay
                # readable and the loop spin, so it rests; connections wait in the backlog
                log.warning(
                    "could not accept a lane (%s): trying again in %.0fs", exc, ACCEPT_PAUSE
                )
                self._unwatch(self._listener.fileno())
                self.paused_until = time.monotonic() + ACCEPT_PAUSE
                return
            sock.setblocking(False)
            lane = Lane(sock, ROUTE_PREFIX + next(self._ids).to_bytes(8, "little"))
            self.by_fd[sock.fileno()] = lane
            self.by_route[lane.route] = lane
            self._watch(sock.fileno(), False)

    def peer(self, route: bytes) -> Peer | None:
        """The process behind a lane's route, as the kernel says; None for a ZeroMQ route."""
        lane = self.by_route.get(route)
        return None if lane is None else lane.peer

    def resume(self, now: float) -> None:
        """Listen again once a pause after a failed accept is over."""
        if self.paused_until is not None and now >= self.paused_until and self._listener:
            self.paused_until = None
            self._watch(self._listener.fileno(), False)

    def read(self, fd: int, dispatch: Dispatch) -> None:
        """Read what one lane has and dispatch each whole message in it."""
        lane = self.by_fd[fd]
        try:
            data = lane.sock.recv(READ_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            log.debug("lane %s: %s", lane.route.hex(), exc)
            data = b""
        if not data:
            self._close(lane)
            return
        try:
            lane.unpacker.feed(data)
            for message in lane.unpacker:
                lane.budget.reset()
                dispatch(lane.route, message)
        except (ValueError, msgpack.UnpackException, ProtocolError) as exc:  # BufferFull, ...
            log.warning("closed a lane that sent an undecodable message: %s", exc)
            self._close(lane)

    def send(self, route: bytes, payload: bytes, fd: int | None = None) -> bool:
        """Write a reply to the lane of `route`, passing descriptor `fd` with it if given
        (SCM_RIGHTS: it travels with the reply's first byte); False if `route` is not a
        lane's."""
        lane = self.by_route.get(route)
        if lane is None:
            if not route.startswith(ROUTE_PREFIX):
                return False
            self._delivered(route)  # a lane that closed: the reply is dropped
            return True
        if lane.out:
            if fd is not None:
                lane.fds.append((len(lane.out), fd))
            lane.out += payload
        else:
            try:
                sent = _send(lane.sock, payload, fd)
            except BlockingIOError:
                sent = 0
            except OSError as exc:  # the client is gone; its read of EOF closes the lane
                if fd is not None:  # (or the descriptor could not go: ETOOMANYREFS, say)
                    log.warning("could not pass a descriptor on lane %s: %s", route.hex(), exc)
                return True
            if sent == len(payload):
                self._delivered(route)
                return True
            if fd is not None and not sent:
                lane.fds.append((0, fd))
            lane.out += payload[sent:]
            self._watch(lane.sock.fileno(), True)
        if len(lane.out) > LANE_BACKLOG:
            log.warning(
                "cut off a client that left %d bytes of replies unread on its lane",
                len(lane.out),
            )
            self._close(lane)
        return True

    def write(self, fd: int) -> None:
        """The socket of a lane with replies waiting is writable."""
        lane = self.by_fd.get(fd)
        if lane is None or not lane.out:  # an event of the batch before it drained
            return
        while lane.out:
            offset, passed = lane.fds[0] if lane.fds else (len(lane.out), None)
            passing = offset == 0 and passed is not None  # a reply that carries a descriptor
            upto = offset  # up to the next reply that carries one, or its end
            if passing:
                upto = lane.fds[1][0] if len(lane.fds) > 1 else len(lane.out)
            try:
                if not lane.fds:  # (no copy of the backlog: it may be tens of MiB)
                    sent = lane.sock.send(lane.out)
                else:
                    with memoryview(lane.out) as view, view[:upto] as part:
                        sent = _send(lane.sock, part, passed if passing else None)
            except BlockingIOError:
                return
            except OSError:
                self._close(lane)
                return
            del lane.out[:sent]
            if passing and sent:
                lane.fds.pop(0)
            lane.fds = [(offset - sent, f) for offset, f in lane.fds]
            if sent < upto:
                return
        if not lane.out:
            self._watch(fd, False)
            self._delivered(lane.route)

    def _close(self, lane: Lane) -> None:
        fd = lane.sock.fileno()
        self._unwatch(fd)
        del self.by_fd[fd]
        del self.by_route[lane.route]
        self._to_close.append(lane.sock)  # after the batch: see Sessions.to_close
        self._route_gone(lane.route)

    def close_let_go(self) -> None:
        """Close the sockets of the lanes closed during the last batch."""
        socks, self._to_close = self._to_close, []
        for sock in socks:
            sock.close()

    def close(self) -> None:
        for lane in list(self.by_fd.values()):
            self._close(lane)
        self.close_let_go()
        if self._listener is not None:
            if self.paused_until is None:
                self._unwatch(self._listener.fileno())
            self._listener.close()
            self._listener = None
            try:
                if os.stat(self.path).st_ino == self._inode:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass


def _send(sock: socket.socket, data: Any, fd: int | None) -> int:
    """Bytes of `data` written, with descriptor `fd` passed alongside (if given)."""
    if fd is None:
        return sock.send(data)
    return sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
