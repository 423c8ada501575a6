"""A client's side of Note [queue ring] (common/qring.py): put into and take from a bounded
queue's ring, sleep on its bells, and let go through `QueueRingLease`. An item the ring
cannot hold goes through the broker, naming the position claimed for it."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from ..common import _shm, host
from ..common.descriptors import TensorDesc
from ..common.errors import InvalidRequest, QueueClosed, Timeout
from ..common.mailbox import item_reply
from ..common.qring import ASK, CLOSED, FULL, INLINE, META_TAIL, REMOVED, QueueRingView
from . import qring_asks as asks
from .shield import shielded
from .tensor import Lease, Tensor

if TYPE_CHECKING:
    from .connection import Connection
    from .reads import Item
    from .transfer import Transfer

RINGS_ENV = "TENSORBROKER_QUEUE_RINGS"  # "off": every queue item through the broker
LOOK = 1.0  # seconds a sleeper sleeps before it looks at its broker
TAILS = 64  # slot tails kept unpacked


Planned = tuple[Any, bytes]  # a WritePlan, and its slot's tail (b"": through the broker)


def follow_broker(conn: Connection, generation: int, lost: str) -> int:
    """Between sleeps on shared memory: a broker that exited is waited for (BrokerUnavailable
    if none comes back); InvalidRequest(`lost`) if the one that came back has not this
    client's state. The generation of now (what was read at `generation` still holds)."""
    if conn.broker_exited():
        conn.reconnect(conn.generation)
    if conn.generation != generation and not conn.resumed:
        raise InvalidRequest(lost)
    return conn.generation


def rings_wanted() -> bool:
    """Whether this process uses queue rings (TENSORBROKER_QUEUE_RINGS=off: no)."""
    return os.environ.get(RINGS_ENV, "").lower() not in ("off", "0", "no", "false")


class WouldWait(Exception):
    """A put or get that does not wait found the ring full or empty."""


def opened(transfer: Transfer, name: str, reply: dict[str, Any]) -> QueueRing | None:
    """The ring the broker's answer to a queue's open names, mapped (None if it names none).
    SegmentGone if its segment is gone: the queue may have ended (closed and drained)
    between the answer and the mapping, the broker unlinking its ring. The caller opens the
    queue again: an answer naming no ring then means it ended (its gets go through the
    broker, which says the queue is closed); one naming a ring whose segment is gone again
    is the error it says."""
    return None if "ring" not in reply else QueueRing(transfer, name, reply["queue"], reply["ring"])


class QueueRing:
    """One client's use of one queue's ring (owner number `owner`)."""

    def __init__(self, transfer: Transfer, name: str, queue_id: int, ring: dict[str, Any]) -> None:
        self.transfer, self.name, self.queue_id = transfer, name, queue_id
        self.segment = ring["name"]
        self.mapping = transfer.segments.get(self.segment)
        self.view = QueueRingView(self.mapping.address)
        self.owner = int(ring["owner"])
        self.generation = transfer.conn.generation
        self._tails: dict[bytes, Any] = {}
        self.asking: tuple[int, int] | None = None  # an item taken for the broker to hand over

    # -- putting ---------------------------------------------------------------------------

    def plan(self, value: Any, timeout: float | None, device: Any, copy: bool) -> Planned:
        """Where `value` goes: its plan, and its tail if its slot can hold it (else b"")."""
        fields: dict[str, Any] = {"queue": self.queue_id, "name": self.name, "timeout": timeout}
        plan = self.transfer.plan_write(self.name, value, device, copy, fields, grant=False)
        if plan.target != "cpu" or plan.size > self.view.data:
            return plan, b""
        tail = plan.tail(self.segment)
        return plan, tail if len(tail) <= META_TAIL else b""

    def put(
        self, planned: Planned, claim: float | None, until: float | None, block: bool
    ) -> int | None:
        """Put a planned item: into its slot if the ring can hold it, else through the
        broker, waiting up to `claim` seconds for a slot. Its version; None if not `block`
        and it went through the broker. Interrupted (Note [shielded steps]): an item put
        into its slot went in whole, and the interrupt's exception says so with its
        version; one through the broker went in only if its put returned."""
        plan, tail = planned
        if tail:
            deadline = None if claim is None else time.monotonic() + max(claim, 0.0)
            return self.wait_for(lambda _o: self._put_inline(plan, tail), deadline, claim)
        return asks.put(self, plan, claim, until, block)

    def _put_inline(self, plan: Any, tail: bytes) -> int:
        """One try of a put into a slot, shielded: its version, or FULL, -CLOSED, -REMOVED."""
        view, owner = self.view, self.owner
        with shielded() as step:
            slot = view.alloc(owner)
            if slot < 0:
                return slot
            try:
                self._copy(plan, slot)
                pos = view.claim(owner)
            except BaseException:
                view.unalloc(slot, owner)
                raise
            if pos < 0:
                view.unalloc(slot, owner)
                return pos
            view.name(pos, slot, INLINE, tail)
            view.publish(pos, slot, owner)
            step.note = f"(the put into queue {self.name!r} went in first: version {pos + 1})"
            return pos + 1

    def wait_for(
        self, attempt: Callable[[int], int], deadline: float | None, timeout: float | None
    ) -> int:
        """`attempt(owner)` (an alloc, a claim, or a whole put) until it is not FULL,
        sleeping on the producers' bell."""
        view, owner = self.view, self.owner
        got = attempt(owner)
        while got < 0:
            if got != FULL:
                raise self._ended(-got, put=True)
            if timeout == 0:
                raise WouldWait()
            seen = view.producer_bell()
            with Sleeper(self, True):
                got = attempt(owner)
                if got == FULL:
                    view.sleep(True, seen, self._left(deadline, timeout, put=True))
                    got = attempt(owner)
        return got

    def create(
        self, shape: Sequence[int], dtype: Any, device: Any, timeout: float | None,
        until: float | None,
    ) -> contextlib.AbstractContextManager[Tensor]:  # fmt: skip
        """`Queue.create`: the item is written in place through the broker (asks.create)."""
        return asks.create(self, shape, dtype, device, timeout, until)

    def _copy(self, plan: Any, slot: int) -> None:
        mapping = self.mapping
        base = self.view.offset(slot)
        for (_, src, dt), offset in zip(plan.items, plan.offsets, strict=True):
            if src.flags.c_contiguous:
                _shm.copy_in(mapping.address + base + offset, src)
                continue
            dst = np.frombuffer(mapping.mmap, np.dtype(dt.typestr), src.size, base + offset)
            np.copyto(dst.reshape(src.shape), src)

    # -- taking ----------------------------------------------------------------------------

    def get(self, timeout: float | None) -> Item:
        """The next item, waiting up to `timeout` seconds (0: WouldWait at once). A get
        interrupted before it returns leaves the item first in the queue (Note [shielded
        steps]), one put through the broker too (`_ask`)."""
        view = self.view
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        try:
            while True:
                got = self._take()
                while got is None:
                    if timeout == 0:
                        raise WouldWait()
                    seen = view.consumer_bell()
                    with Sleeper(self, False):
                        got = self._take()
                        if got is None:
                            view.sleep(False, seen, self._left(deadline, timeout, put=False))
                            got = self._take()
                if isinstance(got, tuple):  # taken for the broker to hand over
                    got = asks.ask(self, *got)
                if got is not None:
                    return got
        except BaseException:
            if self.asking is not None:  # interrupted before `ask` began: given back
                with shielded():
                    if self.asking is not None:
                        asks.unask(self, *self.asking, None)
            raise

    def _take(self) -> Item | tuple[int, int] | None:
        """One try of a take, shielded: the item built, committed only if no signal came
        meanwhile (else given back, first in the queue); (position, slot) of one to ask
        the broker for, taken; None if there is none yet. QueueClosed once the queue ended."""
        view, owner = self.view, self.owner
        with shielded() as step:
            got = view.take(owner)
            if not isinstance(got, tuple):
                if got is not None:
                    raise self._ended(-got, put=False)
                return None
            pos, slot, flags, tail = got
            if flags & ASK:  # still TAKEN while the broker is asked for it (asks.ask)
                if step.pending:
                    view.back(pos, slot, owner)
                    return None
                self.asking = (pos, slot)  # (till it is committed or given back)
                return pos, slot
            try:
                item, lease = self.item(pos, slot, tail)
            except BaseException:
                view.back(pos, slot, owner)
                raise
            if step.pending:  # interrupted: the item stays in the queue
                lease.disarm()
                view.back(pos, slot, owner)
                return None
            view.commit(pos)
            if step.noting:  # a signal from now on comes again once the get returned
                step.deferring = True
            return item

    def item(self, pos: int, slot: int, tail: bytes) -> tuple[Item, QueueRingLease]:
        """The Tensors of the item taken at `pos`, held in `slot` (let go with them), and
        their lease."""
        unpacked = self._tails.get(tail)
        if unpacked is None:
            if len(self._tails) >= TAILS:
                self._tails.clear()
            unpacked = self._tails[tail] = msgpack.unpackb(tail, raw=False)
        reply = item_reply(0, 0, pos + 1, 0, 0, self.view.offset(slot), unpacked)
        descs = [TensorDesc.from_wire(w) for w in reply["tensors"]]
        lease = QueueRingLease(self.mapping, self.view, slot, self.owner)
        key = reply["key"]
        try:
            if not reply["bundle"]:
                return Tensor(key, pos + 1, descs[0], lease), lease
            return {t.name: Tensor(key, pos + 1, t, lease) for t in descs}, lease
        except BaseException:
            lease.disarm()  # (the item goes back: its slot is not let go)
            raise

    # -- waiting ---------------------------------------------------------------------------

    def wait(self, producer: bool, timeout: float | None) -> None:
        """Sleep until a claim (`producer`) or a take may not wait, at most `timeout` seconds
        (None: LOOK); Timeout once none is left. For callers that must not block where they
        claim and take (asyncio)."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        view = self.view
        seen = view.producer_bell() if producer else view.consumer_bell()
        with Sleeper(self, producer):
            if not view.ready(producer):
                view.sleep(producer, seen, self._left(deadline, timeout, put=producer))

    def _left(self, deadline: float | None, timeout: float | None, put: bool) -> float:
        """Seconds to sleep next; Timeout once `deadline` passed. Between sleeps, a broker
        that exited is waited for, and one that came back without this client's state has
        no such queue any more."""
        self.look()
        if deadline is None:
            return LOOK
        left = deadline - time.monotonic()
        if left <= 0:
            if put:
                ready, busy = self.view.counts()
                raise Timeout(
                    f"queue {self.name!r} ({ready} waiting, {busy} of {self.view.slots} in "
                    f"flight) stayed full for {timeout:g}s: is a consumer keeping up?"
                )
            raise Timeout(f"queue {self.name!r} stayed empty for {timeout:g}s")
        return min(left, LOOK)

    def look(self) -> None:
        conn = self.transfer.conn
        conn.check_usable(settle=False, poll=False, earlier=False)
        self.generation = follow_broker(
            conn, self.generation,
            f"queue {self.name!r} was lost with the state of a broker that restarted without "
            "it: open it again",
        )  # fmt: skip

    def _ended(self, why: int, put: bool) -> QueueClosed:
        if why == REMOVED:
            return QueueClosed(f"queue {self.name!r} was removed")
        assert why == CLOSED
        if put:
            return QueueClosed(
                f"queue {self.name!r} is closed: it takes no more puts (a closed queue stays "
                "closed; give a new stream a new name)"
            )
        return QueueClosed(f"queue {self.name!r} is closed and drained")


class Sleeper:
    """`with Sleeper(self, producer):` counted among a ring's sleepers while it sleeps,
    counted in and out in shielded steps (a count left behind costs every later put or
    release a wake-up call)."""

    __slots__ = ("view", "producer", "owner", "counted")

    def __init__(self, ring: QueueRing, producer: bool) -> None:
        self.view, self.producer, self.owner, self.counted = ring.view, producer, ring.owner, False

    def __enter__(self) -> None:
        with shielded():
            self.view.sleeping(self.producer, 1, self.owner)
            self.counted = True

    def __exit__(self, *exc: object) -> None:
        if self.counted:
            with shielded():
                self.view.sleeping(self.producer, -1, self.owner)
                self.counted = False


class QueueRingLease(Lease):
    """An item held in its ring slot: letting go opens the slot (no message)."""

    __slots__ = ("_view", "_slot", "_owner", "_pid")

    def __init__(self, mapping: Any, view: QueueRingView, slot: int, owner: int) -> None:
        self.id, self.mapping, self._releases = None, mapping, None
        self._view: QueueRingView | None = view
        self._slot, self._owner, self._pid = slot, owner, host.pid()

    def disarm(self) -> None:
        self._view = None

    def __del__(self) -> None:
        view, self._view = self._view, None
        if view is not None and host.pid() == self._pid:  # a forked child's is its parent's
            view.release(self._slot, self._owner)
