"""A client's seals, in order over one socket, and what puts take ahead: blocks of memory
granted ahead and slots of bounded queues credited ahead.

Note [writes]

Every seal of a client (a `write` into a block granted ahead, or the `seal` of a put that
asked for its block) goes out over one socket, under one lock, so the broker applies a
client's puts in the order it made them, whichever thread made them. A put that waits reads
replies until its own comes; one that does not (`wait=False`) returns once its seal is sent.
The replies of those are read whenever the socket is next used (a put, `flush`, or a read
of a key whose seal is still out): they refill the grants and credits, and an error in one
is kept and raised, with its key, by the client's next call (`Connection.fail_later`).
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
already by its put id); the grants and credits held are let go.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..common.descriptors import grant_class
from ..common.errors import BrokerError, BrokerUnavailable, error_from_wire
from ..common.protocol import Op
from .connection import REQUEST_TIMEOUT, Connection
from .transport import BrokerExited, Channel

NO_GRANTS_BACKOFF = 1.0  # seconds a size class is not asked for again after a refusal


class Grant(NamedTuple):
    """A block granted ahead: its put id (a lease of this client's), object id and place."""

    put: int
    oid: int
    segment: str
    offset: int
    size: int


@dataclass(slots=True)
class _Out:
    """A seal sent and not yet answered."""

    message: dict[str, Any]
    key: str | None  # the key it puts (None: a queue item)
    label: str  # how its errors name it
    put: int | None  # its put lease, which ends with the answer (None: it is kept)
    wait: bool  # whether a caller waits for the answer (else errors are raised later)


class Writes:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()  # the socket, and the tables below
        self._channel: Channel | None = None
        self._generation = conn.generation  # of the broker the channel talks to
        self._out: dict[int, _Out] = {}  # request id -> seal not answered yet, in order
        self._keys: dict[str, int] = {}  # key -> the request id of its last seal out
        self._owed: set[int] = set()  # seals of items handed over, returned before answered
        self.last = 0  # the request id of the last seal sent
        self._answers: dict[int, dict[str, Any]] = {}  # replies waited for, not yet taken
        self.grants: dict[int, list[Grant]] = {}  # size class -> blocks granted ahead
        self._refused: dict[int, float] = {}  # size class -> when grants were last refused
        self.credits: dict[int, int] = {}  # queue id -> slots credited ahead
        self._stale = False  # a reply said the broker does not know this client
        self._unbounded: set[int] = set()  # queues that need no credits
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
        call (the caller raised those already there before it wrote)."""
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
                        self._file(rid, _Out(message, key, label, put, wait))
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

    def _file(self, rid: int, out: _Out) -> None:
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
            self._file(rid, _Out(message, key, label, put, False))
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
                    got = channel.receive()
                    if got is not None:
                        self._take(got)
                    if not self._stale:
                        continue
                except BrokerExited:
                    pass
            self._broker_exited(generation)

    def _take_ready(self, channel: Channel) -> None:
        """Read the replies already there (no waiting)."""
        while (reply := channel.receive(block=False)) is not None:
            self._take(reply)

    def _take(self, reply: dict[str, Any]) -> None:
        """One reply: refill what it brings, and file it for its caller or as an error."""
        rid = reply.get("id")
        out = self._out.get(rid) if isinstance(rid, int) else None
        if out is None:
            if rid == 0 and reply.get("ok"):  # grants topped up after a write's reply
                self.add_grants(reply.get("grants", ()))
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
            self.conn.forget(out.put)
        self.add_grants(reply.get("grants", ()))
        credits = reply.get("credits")
        queue = out.message.get("queue")
        if credits and queue is not None:
            self.credits[queue] = self.credits.get(queue, 0) + credits
        if reply.get("maxsize") and queue is not None:  # bounded since it was found not to be
            self._unbounded.discard(queue)
        if out.wait:
            self._answers[rid] = reply  # type: ignore[index]
        elif not reply.get("ok"):
            error = error_from_wire(str(reply.get("code")), str(reply.get("error")))
            how = "handed to its consumer first" if handed else "a put that did not wait"
            self.conn.fail_later(type(error)(f"{out.label} ({how}): {error}"))

    # -- the broker restarted (Note [recovery] in server/state.py) ---------------------------

    def _ready(self) -> Channel:
        """The socket to the broker of now; after a restart, a new one, on which the seals
        still out go again, in order. Called with the lock held."""
        channel = self._channel
        if channel is not None and self._generation == self.conn.generation:
            return channel
        if channel is not None:
            self._channel = None
            self.conn.discard_channel(channel)
            self._lost_ahead()
        channel = self._channel = self.conn.open_channel()
        self._generation = self.conn.generation  # after: a hello waits for a reconnection
        self._stale = False
        if self._out and not self.conn.resumed:
            self._lose_out()
        for out in self._out.values():
            channel.send(out.message)
        return channel

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

    def _lost_ahead(self) -> None:
        """Grants and credits are the old broker's: let the grants go, forget the credits."""
        for stock in self.grants.values():
            for grant in stock:
                self.conn.releases.put(grant.put)
        self.grants.clear()
        self.credits.clear()
        self._unbounded.clear()

    # -- grants and credits ----------------------------------------------------------------

    def add_grants(self, grants: Any) -> None:
        for put, oid, segment, offset, size in grants:
            self.conn.hold(put, oid)
            self.grants.setdefault(size, []).append(Grant(put, oid, segment, offset, size))

    def take_grant(self, size: int) -> Grant | None:
        """A block granted ahead that holds `size` bytes, asking the broker for some if none
        is left; None if the size has none (too big, or the broker has none to spare)."""
        size_class = grant_class(size)
        if size_class is None:
            return None
        if self.conn.generation != self._generation:
            with self._lock:
                try:
                    self._ready()
                except BrokerExited:  # gone again: the put asks, and waits for it to be back
                    return None
        stock = self.grants.get(size_class)
        if not stock:  # the top-ups on their way, and the replies still out, bring some
            self._refill()
            stock = self.grants.get(size_class)
        if not stock:
            if time.monotonic() - self._refused.get(size_class, -1e9) < NO_GRANTS_BACKOFF:
                return None
            self.add_grants(self.conn.call(Op.GRANT, size=size)["grants"])
            stock = self.grants.get(size_class)
            if not stock:
                self._refused[size_class] = time.monotonic()
                return None
        try:
            return stock.pop()
        except IndexError:  # another thread took the last one
            return self.take_grant(size)

    def _refill(self) -> None:
        """Read the top-ups already there, and wait for the replies still out."""
        with self._lock:
            if self._channel is not None and self._generation == self.conn.generation:
                self._take_ready(self._channel)
            last = next(reversed(self._out), None)
        if last is not None:
            self._wait(last, take=False)

    def give_back(self, grant: Grant) -> None:
        """A grant taken and not written (the copy failed): kept for the next put."""
        if self.conn.generation == self._generation:
            self.grants.setdefault(grant.size, []).append(grant)
        else:
            self.conn.releases.put(grant.put)

    def take_credit(self, queue: int, timeout: float | None, wait: float | None) -> bool:
        """A slot of a bounded queue, credited ahead or waited for (up to `timeout`, as a
        put waits). False if the queue needs none (unbounded)."""
        if self.must_ask_credit(queue):
            reply = self.conn.call(Op.QCREDIT, wait, queue=queue, timeout=timeout)
            self.add_credits(queue, reply["credits"])
        if queue in self._unbounded:
            return False
        self.credits[queue] -= 1
        return True

    def must_ask_credit(self, queue: int) -> bool:
        """Whether a put to `queue` must ask the broker for a slot (Op.QCREDIT) first: a
        bounded queue (or one not known yet) with no credit left, once the replies still
        out are read (they may hold credits: asking then could wait for them forever)."""
        if queue in self._unbounded:
            return False
        if self.credits.get(queue, 0) <= 0 and self._out:
            self._refill()
        return self.credits.get(queue, 0) <= 0

    def add_credits(self, queue: int, credits: int) -> None:
        """The answer to a QCREDIT: 0 says the queue is unbounded (it needs none)."""
        if not credits:
            self._unbounded.add(queue)
        else:
            self.credits[queue] = self.credits.get(queue, 0) + credits

    def return_credit(self, queue: int) -> None:
        if self.conn.generation == self._generation:
            self.credits[queue] = self.credits.get(queue, 0) + 1

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Let go of the grants (the caller flushed first) and close the socket."""
        with self._lock:
            channel = self._channel
            if channel is not None and self._generation == self.conn.generation:
                with contextlib.suppress(BrokerError):
                    self._read_to_end(channel)
            for stock in self.grants.values():
                for grant in stock:
                    self.conn.releases.put(grant.put)
            self.grants.clear()
            self.credits.clear()
            if self._channel is not None:
                self.conn.discard_channel(self._channel)
                self._channel = None
