"""A client's connection to its broker: hello, the broker's pidfd, calls that carry the lease
releases due, the fork check, and reconnection (its wait for a broker: reconnect.py). The
leases it holds, and the release thread, are leases.py's.

Threads may share a connection: each call borrows a socket (a `Channel`) from a small pool,
so a `get` parked in the broker never blocks another thread's call.

When the broker exits, the connection waits (up to `reconnect_timeout`) for a broker at the
same address, says hello again with the same session and the leases this process holds
(`held`), and sends again the calls that were in flight where that is safe (Note [recovery]
in server/durability/state.py): the release thread starts this as soon as the broker's pidfd says it
exited, so that a client that is idle comes back too. If none comes in time, the calls
waiting raise BrokerUnavailable, and the connection looks again at the next call (and the
release thread now and then): a long outage fails calls, never the client.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import zmq

from ..common import host
from ..common.config import check_address, default_address
from ..common.curve import client_keys
from ..common.errors import BrokerError, BrokerUnavailable, ProtocolError
from ..common.protocol import PROTOCOL_VERSION, Op
from .cancel import cancel, given_up
from .leases import ASKED_AGAIN, Leases, ReleaseThread
from .reconnect import HELLO_STEP, Reconnecting
from .resending import check_resent
from .transport import BrokerExited, Channel, ChannelPool, NoReply, Unsent, waits

if TYPE_CHECKING:
    from .handoff import Bell

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 30.0  # for requests the broker answers at once
RECONNECT_TIMEOUT = 30.0  # how long a client waits for a broker that exited to come back
# A CURVE handshake that fails (a wrong key, or none) looks like no broker at all.
_KEYS_HINT = (
    ". A broker that serves with keys answers only a client that has its public key: pass "
    "server_key= (or $TENSORBROKER_SERVER_KEY) as `tensorbroker keys` made it; one that lets "
    "in only some clients (--curve-clients) also needs this client's key in "
    "$TENSORBROKER_CLIENT_KEY"
)


class Connection(Reconnecting):
    """One session with the broker at `address` (else $TENSORBROKER_ADDRESS, else the default
    socket). BrokerUnavailable if no broker answers within `timeout`."""

    closed = True  # class-level defaults: a half-built Connection can still be closed
    pid = -1
    shared: dict[str, Any] = {}  # never mutated: replaced at each broker's first hello
    _broker_pidfd: int | None = None
    _releaser: ReleaseThread | None = None

    def __init__(
        self,
        address: str | None,
        timeout: float,
        on_idle: Callable[[], None] = lambda: None,
        reconnect_timeout: float = RECONNECT_TIMEOUT,
        server_key: str | None = None,
    ) -> None:
        self.address = check_address(address or default_address())
        self.keys = keys = client_keys(self.address, server_key)
        self.pid = os.getpid()
        self.leases = Leases()
        self._calls: set[int] = set()  # ids of the calls waiting for their answers
        self._failed: list[BrokerError] = []  # errors of puts that did not wait, to raise
        self.poll_writes: Callable[[bool, float | None], None] = lambda settle, wait: None
        self.reconnect_timeout = reconnect_timeout
        self.generation = 0  # brokers this connection has said hello to, less one
        self.resumed = True  # whether the broker of this generation kept the session
        self._session = secrets.token_hex(16)
        self._ids = itertools.count(1)
        self._broken: str | None = None
        self._heartbeat: float | None = None
        self._old_pidfds: list[int] = []  # of brokers that exited: closed with the client
        self._reconnecting = threading.Lock()
        self._pool = ChannelPool(self.address, keys)
        self.closed = False
        self.closing = False  # stop_releasing was called: a reconnect wait ends early
        try:
            self._pool.give_back(self._first(timeout))
            releaser_channel = self._first(timeout)
        except BaseException:
            self.close()
            raise
        self._releaser = ReleaseThread(
            weakref.ref(self), self.leases, self._heartbeat, releaser_channel, self._pool,
            on_idle, name=f"tensorbroker-release-{self._session[:6]}",
        )  # fmt: skip

    def hello_message(self) -> dict[str, Any]:
        """The hello of one more socket of this session."""
        return {
            "op": Op.HELLO,
            "id": self.next_id(),
            "version": PROTOCOL_VERSION,
            "session": self._session,
            "pid": self.pid,
            "boot_id": host.boot_id(),
            "start_time": host.start_time(self.pid),
        }

    @property
    def held(self) -> dict[int, int]:
        """The leases this process holds, lease id -> object id (`Leases.held`)."""
        return self.leases.held

    @property
    def broker_pidfd(self) -> int | None:
        """Readable once the broker this connection talks to has exited (None: unknown)."""
        return self._broker_pidfd

    def new_channel(self, timeout: float = REQUEST_TIMEOUT, resume: bool = False) -> Channel:
        """A socket that has said hello (now: `open_channel` waits for a reconnection under
        way); `resume`: the first to a broker that restarted, with the leases this process
        holds."""
        channel = self._pool.new()
        if self._broker_pidfd is not None and not resume:  # a broker that dies during the
            channel.watch_broker(self._broker_pidfd)  # hello: its answer is not coming
        hello = self.hello_message()
        if resume:
            # The calls first: one that ends after, ended holding its lease (`in_flight`).
            hello["calls"] = list(self._calls)
            hello["leases"] = self.leases.resume()
        try:
            reply = channel.call(hello, timeout)
        except BrokerExited:  # a broker that restarted, waiting for a hello with leases
            self._pool.discard(channel)
            raise
        except BrokerUnavailable:  # (NoReply: no broker took it, or none answered in time)
            self._pool.discard(channel)
            raise NoReply(self._no_broker(timeout)) from None
        except BaseException:
            self._pool.discard(channel)
            raise
        self._heartbeat = float(reply.get("heartbeat") or 0.0) or None
        if not self.shared or resume:  # the directory and this session's slot region
            self.shared = {k: reply[k] for k in ("directory", "slots", "mailboxes") if k in reply}
        if resume:
            self.resumed = bool(reply.get("resumed"))
            for lease in reply.get("lost", []) if self.resumed else list(self.held):
                self.leases.forget(lease)
        if self._broker_pidfd is None and reply.get("boot_id") == host.boot_id():
            self._broker_pidfd = host.open_pidfd(reply["pid"], reply.get("start_time"))
        if self._broker_pidfd is not None:
            channel.watch_broker(self._broker_pidfd)
        return channel

    def _no_broker(self, waited: float) -> str:
        return (
            f"no broker answers at {self.address} (waited {waited:.1f}s): start one with "
            f"`tensorbroker serve --address {self.address}`, or set $TENSORBROKER_ADDRESS"
            + (_KEYS_HINT if self.address.startswith("tcp://") else "")
        )

    def _first(self, timeout: float) -> Channel:
        """A socket of the new client within `timeout`: its hello sent again on a new socket
        after HELLO_STEP seconds, then twice as long each time (a hello that reached a broker
        killed before it answered went with it); a broker seen to exit during the hello
        (killed, about to be restarted) is waited for as one that exits later is
        (`reconnect`), for what is left of `timeout`."""
        deadline, step = time.monotonic() + timeout, HELLO_STEP
        while True:
            try:
                return self.new_channel(max(0.001, min(step, deadline - time.monotonic())))
            except BrokerExited:
                self.reconnect(self.generation, window=max(0.0, deadline - time.monotonic()))
            except NoReply:  # (another refusal, such as a socket not open to this user: raised)
                if time.monotonic() >= deadline:
                    raise NoReply(self._no_broker(timeout)) from None
            step *= 2  # (a broker slow to answer gets longer each time)

    def next_id(self) -> int:
        return next(self._ids)

    def send_due(self) -> None:
        """Send the releases and idle ring slots due now, without waiting for an answer (a
        subscriber about to sleep: the producer may be waiting for those slots). Lost if
        the broker has gone: one that comes back finds the slots idle itself."""
        message = self.leases.message()
        if message is None:
            return
        channel = self._pool.borrow()
        try:
            if channel is None:
                channel = self._fresh_channel()
            channel.send(message)
        except (BrokerExited, zmq.ZMQError):
            if channel is not None:
                self._pool.discard(channel)
                channel = None
        finally:
            if channel is not None:
                self._pool.give_back(channel)

    def open_channel(self) -> Channel:
        """A socket of its own that has said hello (a caller that needs one: writes.py)."""
        return self._fresh_channel()

    def discard_channel(self, channel: Channel) -> None:
        self._pool.discard(channel)

    def fail_later(self, error: BrokerError) -> None:
        """An error of a put that did not wait: raised by the next call (check_usable)."""
        self._failed.append(error)

    def call(
        self, op: str, wait: float | None = REQUEST_TIMEOUT, bell: Bell | None = None,
        late: Callable[[dict[str, Any]], None] | None = None, **fields: Any,
    ) -> dict[str, Any]:  # fmt: skip
        """Send one request (with the releases due) and wait up to `wait` seconds for its
        reply; the reply's fields, or the broker's error raised. If the broker exits
        meanwhile, wait for it to come back and send the request again where that is safe
        (RESENT), else raise BrokerUnavailable saying what may be lost. A queue get may wait
        on this client's `bell` (Note [direct handoff] in common/mailbox.py).

        With `late`, a request that waits in the broker and is given up (interrupted: Ctrl-C,
        a signal handler's exception; or no reply in time) is cancelled there, and an answer
        that came anyway is handed to `late` (cancel.py)."""
        self.check_usable(wait=wait)
        message = {"op": op, "id": next(self._ids), **fields}
        releases = self.leases.drain()
        if releases:
            message["rel"] = releases
        with self.in_flight(message["id"]):
            return self._call(message, op, wait, fields, bell, late)

    def fetch_fd(self, op: str, **fields: Any) -> tuple[dict[str, Any], int]:
        """A request whose reply passes a file descriptor over the lane (Op.CHUNK): the reply
        and the descriptor, the caller's to close. Not sent again if the broker exits."""
        self.check_usable()
        channel = self._pool.borrow() or self._fresh_channel()
        try:
            reply = channel.call({"op": op, "id": next(self._ids), **fields}, REQUEST_TIMEOUT)
            fds = channel.take_fds()
        except BrokerExited:
            self._pool.discard(channel)
            raise BrokerUnavailable(f"the broker at {self.address} exited during {op}") from None
        except BaseException:
            self._pool.discard(channel)  # (a descriptor may still be on its way)
            raise
        self._pool.give_back(channel)
        for extra in fds[1:]:
            os.close(extra)
        if not fds:
            raise ProtocolError(f"{op}: the broker's reply passed no file descriptor")
        return reply, fds[0]

    @contextlib.contextmanager
    def in_flight(self, request_id: int) -> Iterator[None]:
        """A call waiting for its answer: named in the hello to a broker that restarted, so
        that an item handed to it then is kept for it when it is sent again."""
        self._calls.add(request_id)
        try:
            yield
        finally:
            self._calls.discard(request_id)

    @property
    def broken(self) -> bool:
        """Whether no broker has come back since the last one exited (the next call looks)."""
        return self._broken is not None

    def _call(
        self, message: dict[str, Any], op: str, wait: float | None, fields: dict[str, Any],
        bell: Bell | None, late: Callable[[dict[str, Any]], None] | None,
    ) -> dict[str, Any]:  # fmt: skip
        began = time.monotonic()
        while True:
            generation, sent = self.generation, True
            channel: Channel | None = None
            try:
                channel = self._pool.borrow() or self._fresh_channel()
                if bell is not None and (bell.generation != generation or not channel.rings):
                    bell = None  # the mailbox named by an earlier broker, or no lane to ring
                    message.pop("mailbox", None)
                epoch = self.leases.epoch  # (before it goes: Leases.leased)
                reply = channel.call(message, wait, bell)
                if self.leases.leased(reply, epoch, again=op in ASKED_AGAIN):
                    return reply  # (else answered by a broker that died: asked again)
            except BrokerExited as exc:
                sent = not isinstance(exc, Unsent) and channel is not None
                if channel is not None:
                    self._pool.discard(channel)
                    channel = None
            except BaseException as exc:
                if channel is not None and late is not None and given_up(exc):
                    if not cancel(channel, message["id"], self.next_id(), bell, late):
                        self._pool.discard(channel)
                        channel = None
                raise
            finally:
                if channel is not None:
                    self._pool.give_back(channel)
            self.reconnect(generation)  # the releases go again: claimed at the hello, maybe
            self.check_resent(op, fields, sent)
            if fields.get("timeout") is not None:  # sent again: it waits what was left
                left = max(0.0, fields["timeout"] - (time.monotonic() - began))
                message["timeout"], wait = waits(left)

    def check_resent(self, op: str, fields: dict[str, Any], sent: bool = True) -> None:
        """Raise BrokerUnavailable if `op` must not be sent again to the broker of now
        (`sent`: it went to the one before, which may have done it): resending.py."""
        check_resent(self.address, self.resumed, op, fields, sent)

    def check_usable(
        self,
        settle: bool = True,
        poll: bool = True,
        wait: float | None = REQUEST_TIMEOUT,
        earlier: bool = True,
    ) -> None:
        """Raise why this client cannot be used, or (`earlier`) the error of a put that did
        not wait (`poll`: after reading the replies to those already there). `settle`: first
        wait (up to `wait` seconds) for the answers to this client's items handed straight
        to a consumer (Note [writes] in writes.py), so that what the broker says next sees
        them."""
        if host.pid() != self.pid:
            raise BrokerError(
                f"this Client was made in process {self.pid} and cannot be used in a forked "
                "child: call tb.connect() in the child (or use the spawn start method)"
            )
        if self.closed:
            raise BrokerError(f"this Client of {self.address} is closed")
        if self._broken:  # no broker came back last time: look again, with a window of its own
            self.reconnect(self.generation)
        if poll:
            self.poll_writes(settle, wait)
        if earlier:
            self.raise_failed()

    def raise_failed(self) -> None:
        """Raise the error of a put that did not wait, if one came (with how many more)."""
        if self._failed:
            failed, self._failed = self._failed, []
            if len(failed) > 1:
                more = "; ".join(str(e) for e in failed[1:4])
                failed[0].add_note(f"and {len(failed) - 1} more puts that did not wait: {more}")
            raise failed[0]

    def stop_releasing(self) -> None:
        """Stop the release thread (the first step of closing): a wait for a broker to come
        back that it is in ends at its next look (`closing`), not at its window's end."""
        self.closing = True
        if self._releaser is not None:
            self._releaser.stop()

    def close(self) -> None:
        """Say bye (with the releases due), keeping the leases of arrays still alive until
        this process exits, and close every socket. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.stop_releasing()
        idle = self._pool.close()
        if idle and not self._broken:  # (a broker that just exited: nothing to say it to)
            with contextlib.suppress(zmq.ZMQError, BrokerUnavailable):
                releases = self.leases.send_all(idle[0])  # the last go with the bye
                idle[0].send({"op": Op.BYE, "id": 0, "keep_leases": True, "rel": releases})
        for channel in idle:
            self._pool.discard(channel)
        if self._broker_pidfd is not None:
            self._old_pidfds.append(self._broker_pidfd)
            self._broker_pidfd = None
        for fd in self._old_pidfds:
            os.close(fd)
        self._old_pidfds.clear()
