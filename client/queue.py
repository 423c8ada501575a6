"""`Queue`: a pipeline queue held by the broker, seen from one client.

Many producers and many consumers; each item goes to exactly one consumer, in FIFO order.
Items are objects in the broker's shared memory like any other: one copy in, zero copies
out. `maxsize` bounds the items in flight (see Note [queue slots] in server/queues.py): a
`put` waits in the broker, not in a polling loop, until a consumer lets go of an item.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, overload

from ..common.errors import QueueClosed
from ..common.protocol import Op
from .tensor import Tensor
from .transfer import Transfer
from .transport import waits

Item = Tensor | dict[str, Tensor]


class Queue:
    """A FIFO of tensors (or bundles) between processes. Make one with `client.queue(name)`.

    `q.put(x)` one copy into shared memory (waits while the queue is full); `q.get()` the
    oldest item, zero copy; `q.close()` ends the stream: consumers drain what is left, then
    `get` raises QueueClosed and `for item in q` ends.
    """

    def __init__(self, transfer: Transfer, name: str, queue_id: int, maxsize: int) -> None:
        self.name = name
        self.maxsize = maxsize
        self._transfer = transfer
        self._id = queue_id

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
        return self._transfer.write(
            self.name, value, Op.QPUT, until, device, copy, wait,
            queue=self._id, name=self.name, timeout=timeout,
        )  # fmt: skip

    def create(
        self, shape: Sequence[int], dtype: Any, timeout: float | None = None, device: Any = "cpu"
    ) -> contextlib.AbstractContextManager[Tensor]:
        """Write an item in place: `with q.create(shape, dtype) as buf:` yields a writable
        Tensor in shared memory; the item is queued when the block exits, dropped if it
        raises. Waits for a free slot like `put`."""
        timeout, wait = waits(timeout)
        return self._transfer.create(
            self.name, shape, dtype, device, Op.QPUT, wait,
            queue=self._id, name=self.name, timeout=timeout,
        )  # fmt: skip

    def get(self, timeout: float | None = None) -> Item:
        """The oldest item, zero copy (its `version` is its place in the stream). Waits up to
        `timeout` seconds for one (None: as long as it takes; 0: Timeout at once if empty).
        QueueClosed once the queue is closed and drained."""
        timeout, wait = waits(timeout)
        return self._transfer.queue_get(timeout, wait, queue=self._id, name=self.name)

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

    def __init__(self, transfer: Transfer, name: str, queue_id: int, sub: int) -> None:
        self.name = name
        self._transfer = transfer
        self._id, self._sub = queue_id, sub

    def get(self, timeout: float | None = None) -> Item:
        """The next item, zero copy (its `version` is its place in the stream). Waits up to
        `timeout` seconds (None: as long as it takes; 0: Timeout at once). QueueClosed once
        the queue is closed and this subscription has every item put before."""
        timeout, wait = waits(timeout)
        return self._transfer.queue_get(
            timeout, wait, queue=self._id, name=self.name, sub=self._sub
        )  # fmt: skip

    def close(self) -> None:
        """End the subscription: the items waiting for it are no longer kept for it."""
        self._transfer.forget_kept((self._id, self._sub))
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
