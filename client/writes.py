"""A client's seals, in order over one socket. What its puts take ahead (grants and credits),
which the replies to these seals refill, is ahead.py's; the seals still out when the broker
restarts, reseal.py's.

Note [writes]

Every seal of a client (a `write` into a block granted ahead, or the `seal` of a put that
asked for its block) goes out over one socket, under one lock, so the broker applies a
client's puts in the order it made them, whichever thread made them. A put that waits reads
replies until its own comes; one that does not (`wait=False`) returns once its seal is sent.
The replies of those are read whenever the socket is next used (a put, `flush`, or a read
of a key whose seal is still out): they refill the grants and credits (ahead.py), and an error
in one is kept and raised, with its key, by the client's next call (`Connection.fail_later`).
A get, exists or delete of a key first waits for this client's seal of that key still out
(read your writes); other keys do not wait. A queue item handed straight to a consumer
(Note [direct handoff] in common/mailbox.py) is that consumer's once its mailbox is filled,
at the place in the stream its grant named: a put that waits returns then, with that place,
without waiting for the broker's answer to its seal; the client's next call waits for that
answer first, so that whatever it asks the broker sees the put. Having rung the consumer, the
producer yields its CPU before it sends the seal: on the 2-core VM the woken consumer mostly
ran on the producer's CPU, after it (a traced 4 KiB handoff: the consumer held the item 79 us
into the put without the yield, 70 us with it). If the broker restarts, the seals still out
are sent again, in order, to the one that comes back (it answers a seal it has applied
already by its put id); the grants and credits held are let go (`Ahead.let_go`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..common.errors import BrokerError, error_from_wire
from ..common.protocol import Op
from .ahead import Ahead
from .connection import REQUEST_TIMEOUT, Connection
from .reseal import Out, Resealing
from .shield import shielded
from .transport import BrokerExited, Channel

SEALED_WAIT = 2.0  # seconds a put interrupted once its seal was sent waits for the answer


def _went_in(label: str, version: Any) -> str:
    """What an interrupt's exception says of a put that went in."""
    return f"(the {label} went in first: version {version})"


class Writes(Resealing):
    """This client's seals over one socket (Note [writes]): the socket, the seals still out and
    the replies waited for; and what puts take ahead (`ahead`), which their replies refill."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()  # the socket, and the tables below
        self._channel: Channel | None = None
        self._generation = conn.generation  # of the broker the channel talks to
        self._epoch = conn.leases.epoch  # when the channel was opened (Leases.hold_put)
        self._out: dict[int, Out] = {}  # request id -> seal not answered yet, in order
        self._keys: dict[str, int] = {}  # key -> the request id of its last seal out
        self._owed: set[int] = set()  # seals of items handed over, returned before answered
        self.last = 0  # the request id of the last seal sent
        self._answers: dict[int, dict[str, Any]] = {}  # replies waited for, not yet taken
        self._stale = False  # a reply said the broker does not know this client
        self.ahead = Ahead(conn, self)  # what the replies refill
        conn.poll_writes = self.poll

    # -- sending ---------------------------------------------------------------------------

    def seal(
        self, message: dict[str, Any], key: str | None, label: str, put: int | None, wait: bool,
        hand_over: Callable[[dict[str, Any], int], None] | None = None,
    ) -> dict[str, Any] | None:  # fmt: skip
        """Send a seal (`message`: a write or a seal) after every earlier one; its reply if
        `wait`, else None at once. `put`: the put lease that ends with the reply.
        `hand_over(message, last)` may hand the item to a consumer first (Note [direct
        handoff] in common/mailbox.py), if the broker had applied seal `last`, this client's
        last sent, when it offered the grant; it runs under the lock, so that no seal of
        another thread's goes between it and this seal. It raises no error of an earlier put
        that did not wait: what it seals is written already, so those come with the next
        call (the caller raised those already there before it wrote). Interrupted (Ctrl-C,
        a signal handler's exception): see `_interrupted`."""
        try:
            return self._seal(message, key, label, put, wait, hand_over)
        except BaseException as exc:
            if not isinstance(exc, BrokerError):
                self._interrupted(message, label, exc)
            raise

    def _interrupted(self, message: dict[str, Any], label: str, exc: BaseException) -> None:
        """A seal interrupted (Note [shielded steps] in shield.py): not sent, its put is
        aborted (its block freed, a ring position passed over); sent, it goes in unless the
        broker refuses it, and `exc` gets a note saying which, with the version, once the
        answer comes (waited for up to SEALED_WAIT, the interrupt held meanwhile)."""
        rid: int = message.get("id", -1)
        put = message.get("put")
        with shielded():
            with self._lock:
                out, answered = self._out.get(rid), rid in self._answers
            if out is None and not answered:  # never sent
                if put is not None and not self.conn.closed:
                    with contextlib.suppress(BrokerError):
                        self.conn.call(Op.ABORT, put=put, keep=message.get("keep", False))
                return
            if out is not None and not out.wait:
                exc.add_note(f"(the {label} was sent: it goes in unless the broker refuses it, "
                             "which this client's next call raises)")  # fmt: skip
                return
            try:
                reply = self._wait(rid, deadline=time.monotonic() + SEALED_WAIT)
            except BrokerError as err:
                exc.add_note(f"(the {label} did not go in: {err})")
                return
            if reply is None:
                with self._lock:
                    if rid in self._out:  # its answer goes the way of one not waited for
                        self._out[rid].wait = False
                exc.add_note(f"(the {label} was sent, and not answered within {SEALED_WAIT:g}s: "
                             "it goes in unless the broker refuses it, which this client's "
                             "next call raises)")  # fmt: skip
                return
            exc.add_note(_went_in(label, reply.get("version")))

    def _seal(
        self, message: dict[str, Any], key: str | None, label: str, put: int | None, wait: bool,
        hand_over: Callable[[dict[str, Any], int], None] | None,
    ) -> dict[str, Any] | None:  # fmt: skip
        self.conn.check_usable(settle=False, poll=False, earlier=False)
        while True:
            with self._lock:
                generation = self.conn.generation
                try:
                    channel = self._ready()
                except BrokerExited:  # a broker that restarted, not yet come back to
                    pass
                else:
                    if "id" not in message:  # under the lock: the ids rise as the seals go
                        message["id"] = self.conn.next_id()
                    rid, sent = message["id"], False
                    try:
                        if hand_over is not None:
                            hand_over(message, self.last)
                            if "direct" in message:  # its consumer first (see the Note)
                                os.sched_yield()
                            else:  # the replies there: credits, grants, errors for the next call
                                self._take_ready(channel)
                        handed = wait and "direct" in message  # the consumer has it: done
                        if handed:
                            wait = False
                            self._owed.add(rid)
                        with shielded():  # filed and sent, or neither
                            self._file(rid, Out(message, key, label, put, wait))
                            try:
                                channel.send(message)
                                sent, stale = True, self._stale
                            except BrokerExited:  # it goes again, with the rest, once one is back
                                sent, stale = True, True
                    except BaseException:
                        if "direct" in message and not sent:  # interrupted (Ctrl-C), once its
                            self._seal_handed(channel, message, key, label, put)  # consumer has it
                        raise
                    break
            self._broker_exited(generation)
        if stale:  # the broker restarted: come back to it now, the seals go again
            self._broker_exited(generation)
        if handed:
            return {"ok": True, "version": message["direct"][3]}
        return self._wait(rid) if wait else None

    def _file(self, rid: int, out: Out) -> None:
        """Seal `rid` is out (with the lock held)."""
        self._out[rid] = out
        if out.key is not None:
            self._keys[out.key] = rid
        self.last = rid

    def _seal_handed(
        self,
        channel: Channel,
        message: dict[str, Any],
        key: str | None,
        label: str,
        put: int | None,
    ) -> None:
        """The seal of an item its consumer has goes out whatever interrupted its sending: else
        the broker never learns of the item, and its slot and block stay taken. Sent twice
        (interrupted between its send and the flag) is harmless: the broker refuses the
        second, whose answer is dropped (its id was answered)."""
        rid = message["id"]
        if rid not in self._out:
            self._owed.add(rid)
            self._file(rid, Out(message, key, label, put, False))
        with contextlib.suppress(BrokerExited):  # it goes again, with the rest, once one is back
            channel.send(message)

    # -- waiting ---------------------------------------------------------------------------

    def poll(self, settle: bool = True, wait: float | None = REQUEST_TIMEOUT) -> None:
        """Read the replies already there, if no other thread is reading (every call does
        this first, so that an error of a put that did not wait is raised by the next one);
        `settle`: first wait up to `wait` seconds (None: as long as the broker lives) for
        those to the items handed over (see the Note)."""
        if settle and self._owed:
            with self._lock:
                last = max(self._owed, default=None)
            if last is not None:
                deadline = None if wait is None else time.monotonic() + wait
                self._wait(last, take=False, deadline=deadline)
        if self._out and self._channel is not None and self._lock.acquire(blocking=False):
            try:
                self._take_ready(self._channel)
            finally:
                self._lock.release()

    def settle(self, key: str) -> None:
        """Wait until this client's seal of `key` still out (if any) is answered."""
        rid = self._keys.get(key)
        if rid is not None:
            self._wait(rid, take=False)
        self.conn.check_usable(settle=False)  # no queue item can change a key

    def flush(self) -> None:
        """Wait until every seal sent is answered; raise the first error of a put that did
        not wait."""
        while True:
            with self._lock:
                last = next(reversed(self._out), None)
            if last is None:
                break
            self._wait(last, take=False)
        self.conn.check_usable()

    @property
    def outstanding(self) -> int:
        """Seals sent and not answered yet."""
        return len(self._out)

    def catch_up(self) -> None:
        """Read the top-ups already there, and wait for the replies still out."""
        with self._lock:
            if self._channel is not None and self.current:
                self._take_ready(self._channel)
            last = next(reversed(self._out), None)
        if last is not None:
            self._wait(last, take=False)

    def _wait(
        self, rid: int, take: bool = True, deadline: float | None = None
    ) -> dict[str, Any] | None:
        """Read replies until the one to `rid` came (or `deadline` passed: then None). `take`
        (its caller): the reply if the seal was waited for (its error raised), else None."""
        while True:
            if deadline is not None and time.monotonic() > deadline:
                return None
            with self._lock:
                if rid not in self._out:
                    reply = self._answers.pop(rid, None) if take else None
                    if reply is not None and not reply.get("ok"):
                        raise error_from_wire(str(reply.get("code")), str(reply.get("error")))
                    return reply
                generation = self.conn.generation
                try:
                    channel = self._ready()
                    with shielded() as step:  # a reply read is taken, whatever interrupts
                        got = channel.receive()
                        if got is not None:
                            out = (
                                self._out.get(rid) if step.noting and got.get("id") == rid else None
                            )
                            self._take(got)
                            if out is not None and got.get("ok"):
                                step.note = _went_in(out.label, got.get("version"))
                    if not self._stale:
                        continue
                except BrokerExited:
                    pass
            self._broker_exited(generation)

    def _take_ready(self, channel: Channel) -> None:
        """Read the replies already there (no waiting)."""
        while True:
            with shielded():
                reply = channel.receive(block=False)
                if reply is None:
                    return
                self._take(reply)

    def _take(self, reply: dict[str, Any]) -> None:
        """One reply: refill what it brings, and file it for its caller or as an error."""
        rid = reply.get("id")
        out = self._out.get(rid) if isinstance(rid, int) else None
        if out is None:
            if rid == 0 and reply.get("ok"):  # grants topped up after a write's reply
                self.ahead.add_grants(reply.get("grants", ()), self._epoch)
            return
        if not reply.get("ok") and reply.get("code") == "hello_first":
            self._stale = True  # a broker that restarted: sent again once it knows us
            return
        del self._out[rid]  # type: ignore[arg-type]
        handed = rid in self._owed
        self._owed.discard(rid)
        if out.key is not None and self._keys.get(out.key) == rid:
            del self._keys[out.key]
        if out.put is not None:  # the put lease ends with the answer, whatever it is
            self.conn.leases.forget(out.put)
        self.ahead.refill(reply, out.message.get("queue"), self._epoch)
        if out.wait:
            self._answers[rid] = reply  # type: ignore[index]
        elif not reply.get("ok"):
            error = error_from_wire(str(reply.get("code")), str(reply.get("error")))
            how = "handed to its consumer first" if handed else "a put that did not wait"
            self.conn.fail_later(type(error)(f"{out.label} ({how}): {error}"))

    def _read_to_end(self, channel: Channel) -> None:
        """Read every message the broker sent so far (the top-ups of grants come after the
        replies): a ping's answer comes after them all."""
        rid = self.conn.next_id()
        channel.send({"op": Op.PING, "id": rid})
        deadline = time.monotonic() + REQUEST_TIMEOUT
        while time.monotonic() < deadline:
            reply = channel.receive()
            if reply is not None and reply.get("id") == rid:
                return
            if reply is not None:
                self._take(reply)

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Let go of the grants (the caller flushed first) and close the socket."""
        with self._lock:
            channel = self._channel
            if channel is not None and self.current:
                with contextlib.suppress(BrokerError):
                    self._read_to_end(channel)
            self.ahead.let_go()
            if self._channel is not None:
                self.conn.discard_channel(self._channel)
                self._channel = None
