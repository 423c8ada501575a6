"""Sockets to the broker. One `Channel` is one socket that has said hello: a lane (a Unix
stream socket beside an ipc:// address, Note [lanes] in server/sessions/lanes.py) where the
broker has one, else a ZeroMQ DEALER. A Client keeps a small pool of them so that threads
never share one.
"""

from __future__ import annotations

import array
import math
import os
import select
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from ..common.config import lane_path
from ..common.curve import ClientKeys
from ..common.errors import BrokerUnavailable, ProtocolError, SessionUnknown, error_from_wire
from ..common.protocol import decode, encode
from .shield import shielded

if TYPE_CHECKING:
    from .handoff import Bell

MAX_REPLY_BYTES = 256 << 20  # replies can list many keys; requests stay small
WATCH_STEP_MS = 100  # how often a waiting call looks whether the broker has exited
WAIT_GRACE = 5.0  # extra time for the answer to a request that waits in the broker
EXIT_GRACE_MS = 20  # a broker that exited may have sent a reply still on its way
LANES_ENV = "TENSORBROKER_LANES"  # "off": ZeroMQ only
LANE_READ_BYTES = 256 << 10
_FDS_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)  # descriptors a read may bring


class BrokerExited(BrokerUnavailable):
    """The broker process this client talked to has exited (or no longer knows it): the
    connection waits for a broker to come back (Connection.reconnect)."""


class Unsent(BrokerExited):
    """The broker had exited before the request went out, or the one of now refused it (it
    does not know this client): no broker acted on it, and it may be sent again."""


class NoReply(BrokerUnavailable):
    """No reply came within the time a call waits for one (the broker may still answer)."""


class Channel:
    """One socket that has said hello. A call blocks in a receive (cheaper than a poller on
    the hot path) in steps of WATCH_STEP_MS, so that a deadline is seen."""

    address: str
    generation: int  # of the broker it says hello to (ChannelPool.renew)
    ended = False  # a look that did not wait found the broker's end closed
    rings = False  # whether a get may wait on its bell instead (only a lane: see `call`)
    kept: dict[int, dict[str, Any]]  # answers read as a signal came: the caller's `cancel`

    def take_fds(self) -> list[int]:
        """The file descriptors the broker passed with the replies read so far (a lane's;
        the caller closes them)."""
        return []

    def send(self, message: dict[str, Any], timeout: float | None = None) -> None:
        """Send a request; NoReply if the broker takes none within `timeout` seconds (None:
        as long as it lives)."""
        raise NotImplementedError

    def receive(self, block: bool = True) -> dict[str, Any] | None:
        """The next reply, waiting at most WATCH_STEP_MS (`block`) or not at all; None if
        none came. BrokerExited once the broker process has exited."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def watch_broker(self, pidfd: int) -> None:
        """Fail a waiting call when the broker process exits (pidfd readable)."""

    def call(
        self, message: dict[str, Any], timeout: float | None, bell: Bell | None = None
    ) -> dict[str, Any]:
        """Send a request and wait for the reply with its id; raise the error it carries.

        timeout None waits as long as the broker lives. With a `bell` (a get that waits on
        its mailbox, Note [direct handoff] in common/mailbox.py) it sleeps on the bell, which
        rings for a reply on this socket as well as for an item handed over.
        """
        self.send(message, timeout)
        request_id = message["id"]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if bell is None:
                with shielded() as step:  # (a reply read is kept, whatever interrupts)
                    reply = self.receive()
                    if reply is not None and reply.get("id") == request_id and step.pending:
                        self.kept[request_id] = reply  # for `cancel`: its handler raises now
            else:  # the mailbox first: a look there costs no system call
                seen = bell.count()
                handed = bell.take(request_id)
                if handed is not None:
                    return handed
                with shielded() as step:
                    reply = self.receive(block=False)
                    if reply is not None and reply.get("id") == request_id and step.pending:
                        self.kept[request_id] = reply
                if reply is None:
                    if self.ended:  # what was handed over before it died is ours still
                        handed = bell.settle(request_id)
                        if handed is not None:
                            return handed
                        raise BrokerExited(f"the broker at {self.address} exited")
                    bell.wait(seen, WATCH_STEP_MS / 1000)
            if reply is None:
                if deadline is None or time.monotonic() < deadline:
                    continue
                raise NoReply(
                    f"no reply from the broker at {self.address} within {timeout:.1f}s "
                    f"(op {message['op']!r}); is it running? Try `tensorbroker ping --address "
                    f"{self.address}`"
                ) from None
            if reply.get("id") == request_id:
                return self.check(reply)
            # A reply to an earlier request that timed out: drop it and keep waiting.

    def check(self, reply: dict[str, Any]) -> dict[str, Any]:
        """`reply`, or the error it carries raised."""
        if not reply.get("ok"):
            if reply.get("code") == SessionUnknown.code:  # a broker that restarted
                raise Unsent(f"the broker at {self.address} does not know this client")
            raise error_from_wire(str(reply.get("code")), str(reply.get("error")))
        return reply


class ZmqChannel(Channel):
    """A DEALER socket; between steps it looks whether the broker process has exited."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        address: str,
        generation: int = 0,
        keys: ClientKeys | None = None,
    ) -> None:
        self.address, self.generation = address, generation
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, WATCH_STEP_MS)
        # A DEALER whose only peer was dropped (a CURVE handshake refused) blocks in send.
        self.socket.setsockopt(zmq.SNDTIMEO, WATCH_STEP_MS)
        if keys is not None:
            keys.apply(self.socket)
        self.socket.connect(address)
        self._broker: select.poll | None = None
        self.kept = {}

    def watch_broker(self, pidfd: int) -> None:
        self._broker = select.poll()
        self._broker.register(pidfd, select.POLLIN)

    def send(self, message: dict[str, Any], timeout: float | None = None) -> None:
        frame = encode(message)
        if self._broker is not None and self._broker.poll(0):  # (before: no broker took it)
            raise Unsent(f"the broker at {self.address} exited")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                self.socket.send(frame, copy=True)
                return
            except zmq.Again:
                if self._broker is not None and self._broker.poll(0):
                    raise BrokerExited(f"the broker at {self.address} exited") from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise NoReply(
                        f"the broker at {self.address} took no request within {timeout:.1f}s "
                        f"(op {message['op']!r}); is it running, and does it take this "
                        "client's keys?"
                    ) from None

    def receive(self, block: bool = True) -> dict[str, Any] | None:
        try:
            frame = self.socket.recv(0 if block else zmq.NOBLOCK)
        except zmq.Again:
            if block and self._broker is not None and self._broker.poll(0):
                if self.socket.poll(EXIT_GRACE_MS):  # a reply sent before it died
                    return self.receive()
                raise BrokerExited(f"the broker at {self.address} exited") from None
            return None
        return decode(frame, MAX_REPLY_BYTES)

    def close(self) -> None:
        self.socket.close(linger=0)


class LaneChannel(Channel):
    """A Unix stream socket to the broker's lane; msgpack frames the messages. The broker's
    end closes when it exits, so the replies it sent are read first, then end of file."""

    rings = True  # the broker's reply is on the socket before it rings the bell

    def __init__(self, path: str, address: str, generation: int = 0) -> None:
        """OSError if no broker listens at `path`."""
        self.address, self.generation = address, generation
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.socket.connect(path)
        except BaseException:
            self.socket.close()
            raise
        # A kernel timeout, not socket.settimeout (which polls before every recv).
        step = struct.pack("ll", 0, WATCH_STEP_MS * 1000)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, step)
        self._unpacker = msgpack.Unpacker(
            raw=False, strict_map_key=True, max_buffer_size=MAX_REPLY_BYTES
        )
        self._fds: list[int] = []  # passed with replies (SCM_RIGHTS), not yet taken
        self.kept = {}

    def take_fds(self) -> list[int]:
        fds, self._fds = self._fds, []
        return fds

    def send(self, message: dict[str, Any], timeout: float | None = None) -> None:
        try:
            with shielded():  # a message cut short would garble the stream
                self.socket.sendall(encode(message), socket.MSG_NOSIGNAL)
        except OSError as exc:  # EPIPE, ECONNRESET: the broker had gone, and read none of it
            raise Unsent(f"the broker at {self.address} exited ({exc})") from None

    def receive(self, block: bool = True) -> dict[str, Any] | None:
        unpacker = self._unpacker
        while True:
            try:
                reply = next(unpacker)
            except StopIteration:
                pass
            else:
                if not isinstance(reply, dict):
                    raise ProtocolError(f"the broker sent a {type(reply).__name__}, not a map")
                return reply
            with shielded():  # the bytes read are fed whole: the stream's framing holds
                if self._read(block):
                    continue
                return None

    def _read(self, block: bool) -> bool:
        """Read what came into the unpacker; False if nothing did (BrokerExited at the end,
        if `block`)."""
        try:  # (recvmsg: a descriptor passed with a reply would be lost to a recv)
            flags = socket.MSG_CMSG_CLOEXEC | (0 if block else socket.MSG_DONTWAIT)
            data, ancillary, _, _ = self.socket.recvmsg(LANE_READ_BYTES, _FDS_SPACE, flags)
        except BlockingIOError:  # the step passed, or nothing there
            return False
        except OSError as exc:
            data, why = b"", f" ({exc})"
        else:
            why = ""
            for level, kind, passed in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(passed[: len(passed) - len(passed) % fds.itemsize])
                    self._fds.extend(fds)
        if not data:  # the end stays: a look that does not wait leaves it to a wait
            if not block:
                self.ended = True
                return False
            raise BrokerExited(f"the broker at {self.address} exited{why}")
        self._unpacker.feed(data)
        return True

    def close(self) -> None:
        for fd in self.take_fds():
            os.close(fd)
        self.socket.close()


def open_channel(
    ctx: zmq.Context[Any],
    address: str,
    generation: int,
    lanes: bool,
    keys: ClientKeys | None = None,
) -> Channel:
    """A lane where the broker at `address` has one (and `lanes`), else a DEALER (a CURVE
    client with `keys`)."""
    path = lane_path(address) if lanes else None
    if path is not None:
        try:
            return LaneChannel(path, address, generation)
        except PermissionError:
            raise BrokerUnavailable(
                f"the broker at {address} is not open to this user (uid {os.getuid()}): a "
                "broker serves its own user, and the members of the group it serves "
                "(`tensorbroker serve --group NAME`): ask for that, and join the group"
            ) from None
        except OSError:  # not there (yet): the DEALER waits for a broker to bind
            pass
    return ZmqChannel(ctx, address, generation, keys)


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

    def __init__(self, address: str, keys: ClientKeys | None = None) -> None:
        self.address, self._keys = address, keys
        self._ctx: zmq.Context[Any] | None = zmq.Context()
        self._lock = threading.Lock()
        self._idle: list[Channel] = []
        self._open = 0
        self._generation = 0
        self._lanes = os.environ.get(LANES_ENV, "").lower() not in ("off", "0", "no", "false")
        self.closed = False

    def new(self) -> Channel:
        with self._lock:
            if self._ctx is None:
                raise BrokerUnavailable(f"the client of {self.address} is closed")
            channel = open_channel(
                self._ctx, self.address, self._generation, self._lanes, self._keys
            )
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
