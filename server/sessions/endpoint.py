"""The broker's sockets: the ZeroMQ ROUTER on its address (with CURVE keys, and the thread
that checks clients' keys on tcp://), the Unix stream lanes beside an ipc:// address
(lanes.py), the replies ZeroMQ would not take yet (backlog.py), and the pair of sockets that
wakes the loop from signal handlers and other threads. It reads requests off them for the
loop and sends replies on the socket each request came from; it knows nothing of what the
requests mean.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
from collections.abc import Callable, Container
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, cast

import zmq

from ...common import curve
from ...common.config import ipc_path, lane_path
from ...common.errors import ProtocolError
from ...common.protocol import MAX_MESSAGE_BYTES, Budget, decode_request
from ..store.records import Peer
from . import backlog
from .lanes import Lanes
from .sockets import AddressInUse, frame_peer, raise_fd_limit, share_sockets

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

# Requests ZeroMQ reads ahead per client: one that sends faster than the broker answers waits
# in its own socket (nothing is dropped), and holds at most RCVHWM frames here.
RCVHWM = 128
DRAIN_BATCH = 512  # requests handled before the loop looks at timers and pidfds again
# plain ints: enum arithmetic costs
_EVENTS, _POLLIN, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)

Refuse = Callable[[bytes, Exception], None]  # a message that would not decode, and why


class Handle(Protocol):
    """A request as read: its route, the decoded message, and the ZeroMQ frame it came in
    (None: a lane's)."""

    def __call__(self, route: bytes, message: Any, frame: zmq.Frame | None = None) -> None: ...


class Endpoint:
    def __init__(
        self,
        address: str,
        keys: curve.ServerKeys | None,
        gid: int | None,
        route_gone: Callable[[bytes], None],
        rung: Callable[[bytes], None],
    ) -> None:
        """`route_gone`: a client's socket closed or was cut off; `rung`: a reply was
        written to a lane (a direct handoff's bell rings then, Note [direct handoff])."""
        self.address, self._keys, self._gid = address, keys, gid
        self._route_gone, self._rung = route_gone, rung
        self.poller = zmq.Poller()
        self._budget = Budget()
        self._ctx = zmq.Context()
        self._router: zmq.Socket[bytes] | None = None
        self._authenticator: ThreadAuthenticator | None = None
        self._backlogs: backlog.Backlogs | None = None  # replies the router would not take yet
        self._ipc_inode: int | None = None
        self._ipc = False  # serving an ipc:// address, where the kernel names each peer
        self.lanes: Lanes | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)

    def bind(self) -> None:
        """Bind the address; AddressInUse if another broker answers there."""
        raise_fd_limit()
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        router.setsockopt(zmq.SNDHWM, backlog.SNDHWM)  # the rest wait in Backlogs
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises zmq.Again
        router.setsockopt(zmq.RCVHWM, RCVHWM)
        if self._keys is not None:
            self._keys.apply(router)
            if self._keys.clients is not None:  # ZeroMQ asks this thread about each client
                from zmq.auth.thread import ThreadAuthenticator  # (asyncio: only here)

                self._authenticator = ThreadAuthenticator(self._ctx, log=log)
                self._authenticator.start()
                self._authenticator.configure_curve(domain="*", location=self._keys.clients)
        elif self.address.startswith("tcp://"):
            log.warning(
                "serving %s WITHOUT KEYS (--insecure-tcp): every local user can read, write "
                "and delete every tensor here; use --curve-secret for anything else",
                self.address,
            )
        try:
            router.bind(self.address)
        except zmq.ZMQError as exc:
            router.close()
            if self._authenticator is not None:
                self._authenticator.stop()
                self._authenticator = None
            raise AddressInUse(
                f"cannot serve on {self.address}: {exc}. Is another broker running there? "
                "Stop it or choose another --address."
            ) from None
        self._router = router
        self._backlogs = backlog.Backlogs(router, self._route_gone)
        path = ipc_path(self.address)
        if path is not None:  # zmq leaves the socket file: remove it at close
            self._ipc_inode, self._ipc = os.stat(path).st_ino, True
        lane = lane_path(self.address)
        if lane is not None:
            self.lanes = Lanes(
                lane, self._watch, self.poller.unregister, self._route_gone,
                self._rung,  # a bell rings once the reply is there to read
            )  # fmt: skip
            self.lanes.listen()
        if path is not None and self._gid is not None:
            share_sockets(self._gid, path, lane)
        self.poller.register(router, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)

    @property
    def bound(self) -> bool:
        return self._router is not None

    def wake(self) -> None:
        """Make the loop run a batch; safe from any thread and from signal handlers."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def install_signals(self, stop: Callable[[], None]) -> Callable[[], None]:
        """SIGINT and SIGTERM call `stop` (and wake the loop); what puts the old handlers
        back. Only on the main thread (elsewhere nothing changes)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("signal %s: stopping", signal.Signals(signum).name)
            stop()

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        old_fd = signal.set_wakeup_fd(self._wake_w.fileno())

        def restore() -> None:
            signal.set_wakeup_fd(old_fd)
            for s, handler in old.items():
                signal.signal(s, handler)

        return restore

    # -- requests in, replies out ------------------------------------------------------------

    def ready(
        self, events: list[tuple[Any, int]], others: Container[Any], handle: Handle, refuse: Refuse
    ) -> list[Any]:
        """Read the requests of the sockets `events` says are ready and `handle` each (or
        `refuse` it, one that does not decode); the ready items in `others`, which are not
        this room's (the pidfds of clients)."""
        router, rest = self._router, []
        for item, flags in events:
            if item is router and router is not None:
                self._drain(router, handle, refuse)
            elif item is self._wake_r:
                self._wake_r.recv(4096)
            elif item in others:
                rest.append(item)
            elif self.lanes is not None:
                self._lane_ready(self.lanes, item, flags, handle)
        return rest

    def _drain(self, router: zmq.Socket[bytes], handle: Handle, refuse: Refuse) -> None:
        """Handle the requests waiting on the ZeroMQ socket, up to DRAIN_BATCH."""
        for _ in range(DRAIN_BATCH):
            # Asking for the socket's events is cheaper than a recv that raises zmq.Again.
            if not cast(int, router.getsockopt(_EVENTS)) & _POLLIN:
                break
            frames = router.recv_multipart(copy=False)  # a Frame carries its sender's pid
            if len(frames) != 2:
                log.warning("dropped a message of %d frames (expected 2)", len(frames))
                continue
            route = frames[0].bytes
            try:
                message = decode_request(frames[1].bytes, self._budget)
            except ProtocolError as exc:
                refuse(route, exc)
                continue
            handle(route, message, frames[1])

    def _lane_ready(self, lanes: Lanes, fd: int, flags: int, handle: Handle) -> None:
        if lanes.is_listener(fd):
            lanes.accept()
            return
        if flags & _POLLOUT:
            lanes.write(fd)
        if flags & ~_POLLOUT and fd in lanes.by_fd:  # readable, or an error a read reports
            lanes.read(fd, handle)

    def _watch(self, fd: int, writable: bool) -> None:
        self.poller.register(fd, _POLLIN | _POLLOUT if writable else _POLLIN)

    def peer(self, route: bytes, frame: zmq.Frame | None) -> Peer | None:
        """The process that sent a request on `route`, as the kernel says (None where it
        cannot: tcp://)."""
        if frame is not None:
            return frame_peer(frame) if self._ipc else None
        return None if self.lanes is None else self.lanes.peer(route)

    def send(self, route: bytes, payload: bytes, fd: int | None = None) -> None:
        """A reply to `route`, with descriptor `fd` passed along (a lane's only: the caller
        checked `is_lane`)."""
        if self.lanes is not None and self.lanes.send(route, payload, fd):
            return
        if self._backlogs is not None:
            self._backlogs.send(route, payload)

    def is_lane(self, route: bytes) -> bool:
        """Whether `route` is a lane's (a Unix socket that can pass descriptors)."""
        return self.lanes is not None and route in self.lanes.by_route

    def after_batch(self, now: float) -> None:
        """The loop handled a batch: lanes let go of are closed (only now may their
        descriptors be reused), replies held back are tried again, accepts resume."""
        if self.lanes is not None:
            self.lanes.close_let_go()
            self.lanes.resume(now)
        if self._backlogs:
            self._backlogs.flush()

    def next_deadline(self, deadline: float | None) -> float | None:
        """`deadline`, or sooner if this room has work due then."""
        if self.lanes is not None and self.lanes.paused_until is not None:
            deadline = min(deadline or math.inf, self.lanes.paused_until)
        return deadline

    @property
    def backlogged(self) -> bool:
        """Whether replies wait for their client's socket (tried every backlog.RETRY_S)."""
        return bool(self._backlogs)

    @property
    def lanes_open(self) -> int:
        return 0 if self.lanes is None else len(self.lanes.by_fd)

    def close(self) -> None:
        """Close every socket and remove the socket file this broker made. Idempotent."""
        if self.lanes is not None:
            self.lanes.close()
            self.lanes = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = self._backlogs = None
            self._unlink_socket_file()
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    def _unlink_socket_file(self) -> None:
        path = ipc_path(self.address)
        try:
            if path and self._ipc_inode is not None and os.stat(path).st_ino == self._ipc_inode:
                os.unlink(path)
        except FileNotFoundError:
            pass
