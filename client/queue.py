"""`Queue`: a pipeline queue held by the broker, seen from one client.

Many producers and many consumers; each item goes to exactly one consumer, in FIFO order.
Items are objects in the broker's shared memory like any other: one copy in, zero copies
out. `maxsize` bounds the items in flight (see Note [queue slots] in server/queues/slots.py): a
`put` waits in the broker, not in a polling loop, until a consumer lets go of an item.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, overload

from ..common.errors import QueueClosed, Timeout
from ..common.protocol import Op
from ..common.ring import ASK, REMOVED
from .qring import QueueRing, WouldWait, follow_broker
from .ring import RingView
from .shield import begin, done
from .tensor import Tensor
from .transfer import Transfer
from .transport import waits

RING_LOOK = 1.0  # seconds a subscriber sleeps on its ring before it looks at its broker

Item = Tensor | dict[str, Tensor]


class Queue:
    """A FIFO of tensors (or bundles) between processes. Make one with `client.queue(name)`.

    `q.put(x)` one copy into shared memory (waits while the queue is full); `q.get()` the
    oldest item, zero copy; `q.close()` ends the stream: consumers drain what is left, then
    `get` raises QueueClosed and `for item in q` ends.
    """

    def __init__(
        self, transfer: Transfer, name: str, queue_id: int, maxsize: int,
        ring: QueueRing | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.maxsize = maxsize
        self._transfer = transfer
        self._id = queue_id
        self._ring = ring  # its items go through its ring (Note [queue ring])

    @overload
    def put(
        self,
        value: Any,
        timeout: float | None = ...,
        *,
        device: Any = ...,
        copy: bool = ...,
        wait: Literal[True] = ...,
    ) -> int: ...
    @overload
    def put(
        self,
        value: Any,
        timeout: float | None = ...,
        *,
        device: Any = ...,
        copy: bool = ...,
        wait: bool,
    ) -> int | None: ...
    def put(
        self,
        value: Any,
        timeout: float | None = None,
        *,
        device: Any = None,
        copy: bool = False,
        wait: bool = True,
    ) -> int | None:
        """Add a tensor or a bundle (a dict of tensors); return its place in the stream
        (1, 2, ...). Waits up to `timeout` seconds for a free slot (None: as long as it
        takes), then Timeout. QueueClosed if the queue is closed. A CUDA tensor's item is
        stored on its GPU; `device=` and `copy=` as for `Client.put`.

        wait=False returns None once the item is written and sent, without waiting for the
        broker (a slot credited ahead, or one waited for, holds it): this client's items go
        in the order they were put, and an error (a closed queue) is raised by the client's
        next call or `flush()`."""
        timeout, until = waits(timeout)
        ring = self._ring
        begin()  # (interrupted before it returns: the exception says if the item went in)
        try:
            if ring is not None:
                version = ring.put(ring.plan(value, timeout, device, copy), timeout, until, wait)
                return version if wait else None
            return self._transfer.write(
                self.name, value, Op.QPUT, until, device, copy, wait,
                queue=self._id, name=self.name, timeout=timeout,
            )  # fmt: skip
        finally:
            done()

    def create(
        self, shape: Sequence[int], dtype: Any, timeout: float | None = None, device: Any = "cpu"
    ) -> contextlib.AbstractContextManager[Tensor]:
        """Write an item in place: `with q.create(shape, dtype) as buf:` yields a writable
        Tensor in shared memory; the item is queued when the block exits, dropped if it
        raises. Waits for a free slot like `put`."""
        timeout, wait = waits(timeout)
        if self._ring is not None:
            return self._ring.create(shape, dtype, device, timeout, wait)
        return self._transfer.create(
            self.name, shape, dtype, device, Op.QPUT, wait,
            queue=self._id, name=self.name, timeout=timeout,
        )  # fmt: skip

    def get(self, timeout: float | None = None) -> Item:
        """The oldest item, zero copy (its `version` is its place in the stream). Waits up to
        `timeout` seconds for one (None: as long as it takes; 0: Timeout at once if empty).
        QueueClosed once the queue is closed and drained."""
        timeout, wait = waits(timeout)
        if self._ring is not None:
            begin()  # (a signal once it took the item comes after it returned: shield.py)
            try:
                return self._ring.get(timeout)
            except WouldWait:
                raise Timeout(f"queue {self.name!r} is empty") from None
            finally:
                done()
        return self._transfer.reads.queue_get(timeout, wait, queue=self._id, name=self.name)

    def close(self) -> None:
        """End the stream: no more puts (waiting ones raise QueueClosed); consumers get what
        is left, then QueueClosed. Closing a closed queue does nothing. This client's puts
        that did not wait go first."""
        self._transfer.writes.flush()
        self._transfer.conn.call(Op.QCLOSE, queue=self._id, name=self.name)

    @property
    def closed(self) -> bool:
        info = self._info()
        return info is None or bool(info["closed"])

    def __len__(self) -> int:
        """Items waiting for a consumer (sealed, not yet taken)."""
        info = self._info()
        return 0 if info is None else int(info["len"])

    def in_flight(self) -> int:
        """Items holding a slot: being written, waiting, or held by a consumer."""
        info = self._info()
        return 0 if info is None else int(info["in_flight"])

    def _info(self) -> dict[str, Any] | None:
        try:
            return self._transfer.conn.call(Op.QINFO, queue=self._id, name=self.name)
        except QueueClosed:
            return None  # ended: closed and drained

    def __iter__(self) -> Iterator[Item]:
        """Items as they come, until the queue is closed and drained."""
        return _until_closed(self.get)

    def __repr__(self) -> str:
        bound = f" maxsize={self.maxsize}" if self.maxsize else ""
        return f"<tb.Queue {self.name!r}{bound}>"


class Subscription:
    """Every item put to a broadcast queue since it was made, in order, zero copy. Make one
    with `client.subscribe(name)`; `for item in sub` until the queue is closed."""

    def __init__(
        self, transfer: Transfer, name: str, queue_id: int, sub: int, ring: RingView | None
    ) -> None:
        self.name = name
        self._transfer = transfer
        self._id, self._sub = queue_id, sub
        self._ring = ring  # its items come through the queue's ring (Note [broadcast ring])
        self._ended = False
        self._asking = False  # the item taken from the ring is being asked for

    def get(self, timeout: float | None = None) -> Item:
        """The next item, zero copy (its `version` is its place in the stream). Waits up to
        `timeout` seconds (None: as long as it takes; 0: Timeout at once). QueueClosed once
        the queue is closed and this subscription has every item put before."""
        if self._ring is not None:
            return self._take(timeout)
        timeout, wait = waits(timeout)
        return self._ask(timeout, wait)

    def _ask(self, timeout: float | None, wait: float | None) -> Item:
        return self._transfer.reads.queue_get(
            timeout, wait, queue=self._id, name=self.name, sub=self._sub
        )  # fmt: skip

    def _take(self, timeout: float | None) -> Item:
        """The next item from the ring: no message, unless it is one the ring does not
        describe (then it is asked for), or this subscriber let go of the last hold on a
        slot (then the broker is told, first)."""
        ring, transfer = self._ring, self._transfer
        assert ring is not None
        conn = transfer.conn
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        if not ring.lock.acquire(timeout=-1 if deadline is None else max(timeout or 0.0, 0.0)):
            raise self._empty(timeout)  # another thread's get took the whole wait
        try:
            if self._asking:  # an item asked for whose get was given up: it comes first
                return self._asked()
            if not conn.leases.done.empty():  # slots let go since: a producer may wait for them
                conn.send_due()
            while True:
                if self._ended:
                    raise QueueClosed(f"the subscription to queue {self.name!r} ended")
                conn.check_usable(settle=False)
                seen = ring.bell()
                got = ring.take()
                if isinstance(got, tuple):
                    break
                self._end(ring.ended() or (-1 if got is False else 0))
                self._look(ring)
                conn.send_due()  # the slots this subscriber let go of: a producer may wait
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise self._empty(timeout)
                ring.wait(seen, RING_LOOK if left is None else min(left, RING_LOOK))
            flags, index, oid, base, tail, idle = got
            version = ring.cursor - 1
            if not flags & ASK:
                return ring.item(transfer, version, index, oid, base, tail)
            if idle:
                conn.leases.done.put((self._id, version))
            self._asking = True
            return self._asked()
        finally:
            ring.lock.release()

    def _asked(self) -> Item:
        """The item the ring said to ask the broker for (ready there for this subscription;
        one answered to a get given up is kept for the next)."""
        item = self._ask(None, None)
        self._asking = False
        return item

    def _empty(self, timeout: float | None) -> Timeout:
        if not timeout:
            return Timeout(f"queue {self.name!r} is empty")
        return Timeout(f"queue {self.name!r} stayed empty for {timeout:g}s")

    def _end(self, why: int) -> None:
        if why == REMOVED:
            raise QueueClosed(f"queue {self.name!r} was removed")
        if why > 0:
            raise QueueClosed(f"queue {self.name!r} is closed and drained")
        if why < 0:
            self._ended = True
            raise QueueClosed(f"the subscription to queue {self.name!r} ended")

    def _look(self, ring: RingView) -> None:
        """Between sleeps: a broker that exited is waited for (BrokerUnavailable if none
        comes back), and one that came back without the state of the one before has no
        ring for this subscription."""
        ring.generation = follow_broker(
            self._transfer.conn, ring.generation,
            f"this client has no subscription to queue {self.name!r} (lost with this client's "
            "state when the broker restarted): subscribe again",
        )  # fmt: skip

    def close(self) -> None:
        """End the subscription: the items waiting for it are no longer kept for it."""
        self._ended = True
        self._transfer.reads.forget_kept((self._id, self._sub))
        self._transfer.conn.call(Op.QUNSUB, queue=self._id, name=self.name, sub=self._sub)

    def __iter__(self) -> Iterator[Item]:
        """Items as they come, until the queue is closed (or the subscription ends)."""
        return _until_closed(self.get)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(QueueClosed):
            self.close()

    def __repr__(self) -> str:
        return f"<tb.Subscription {self.name!r}>"


def _until_closed(get: Callable[[], Item]) -> Iterator[Item]:
    while True:
        try:
            item = get()
        except QueueClosed:
            return
        yield item
        del item  # the generator frame must not keep the item's slot
