"""The asyncio face of a queue (`AsyncQueue`), for the AsyncClient of aio.py (Note [the
asyncio client] there): gets and puts that wait without blocking the event loop, through
the broker or the queue's ring (Note [queue ring] in common/qring.py)."""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from ..common.errors import QueueClosed, Timeout
from ..common.protocol import Op
from .aiosocket import Late, Reply
from .leases import Leases
from .qring import QueueRing, WouldWait
from .reads import Item
from .shield import begin, done
from .transport import waits

if TYPE_CHECKING:
    from .transfer import Transfer


class AsyncClient(Protocol):
    """What a queue uses of its AsyncClient (aio.py, which makes the queues: named here, not
    imported, so that neither module imports the other)."""

    _transfer: Transfer
    _turns: dict[int, _Turn]

    async def _call(self, op: str, wait: float | None = ..., late: Late | None = ...,
                    **fields: Any) -> Reply: ...  # fmt: skip

    async def _write(self, plan: Any, op: str, wait: float | None, block: bool) -> int | None: ...

    async def flush(self) -> None: ...


class AsyncQueue:
    """The asyncio face of a Queue: `await q.put(x)`, `await q.get()`, `async for item in
    q`, `await q.close()`. Make one with `await c.queue(name)`."""

    def __init__(
        self, client: AsyncClient, name: str, queue_id: int, maxsize: int,
        ring: QueueRing | None = None,
    ) -> None:  # fmt: skip
        self.name, self.maxsize = name, maxsize
        self._client, self._id = client, queue_id
        self._turn = client._turns.setdefault(queue_id, _Turn())
        self._ring = ring  # its items go through its ring (Note [queue ring])

    async def put(
        self,
        value: Any,
        timeout: float | None = None,
        *,
        device: Any = None,
        copy: bool = False,
        wait: bool = True,
    ) -> int | None:
        """As Queue.put: waits for a free slot (up to `timeout` seconds) without blocking
        the event loop; a put cancelled while it waits takes no slot."""
        client, transfer = self._client, self._client._transfer
        ahead = transfer.writes.ahead
        timeout, until = waits(timeout)
        ring = self._ring
        if ring is not None:
            version = await self._ring_put(ring, value, timeout, until, device, copy, wait)
            return version if wait else None
        fields = {"queue": self._id, "name": self.name, "timeout": timeout}
        plan = transfer.plan_write(self.name, value, device, copy, fields)
        if plan.grant is not None and ahead.must_ask_credit(self._id):
            try:
                reply = await client._call(
                    Op.QCREDIT, until, Late(lambda r: ahead.add_credits(self._id, r["credits"])),
                    queue=self._id, name=self.name, timeout=timeout,
                )  # fmt: skip
            except BaseException:
                ahead.give_back(plan.grant)
                raise
            ahead.add_credits(self._id, reply["credits"])  # write_granted takes one
        return await client._write(plan, Op.QPUT, until, wait)

    async def get(self, timeout: float | None = None) -> Item:
        """As Queue.get: the oldest item, waited for (up to `timeout` seconds, None: as long
        as it takes) without blocking the event loop."""
        transfer, turn = self._client._transfer, self._turn
        if self._ring is not None:
            return await self._ring_get(self._ring, timeout)
        await turn.lock.acquire()
        late = Late(functools.partial(_keep, transfer.conn.leases, turn), turn.lock.release)
        try:
            while turn.kept:
                kept = turn.kept.popleft()
                if transfer.reads.still_held(kept):  # (not if a restart lost it)
                    return transfer.reads.read(kept)
            timeout, wait = waits(timeout)
            reply = await self._client._call(
                Op.QGET, wait, late, queue=self._id, name=self.name, timeout=timeout
            )
            return transfer.reads.read(reply)
        finally:
            if not late.pending:  # else the turn passes once the broker has answered
                turn.lock.release()

    async def _ring_put(
        self, ring: QueueRing, value: Any, timeout: float | None, until: float | None,
        device: Any, copy: bool, wait: bool,
    ) -> int | None:  # fmt: skip
        """A put through the ring: a slot waited for in a worker thread, which takes none (an
        item the ring cannot hold is put through the broker in one, and carries on there if
        the put is cancelled)."""
        planned = ring.plan(value, timeout, device, copy)
        if not planned[1]:
            return await asyncio.to_thread(ring.put, planned, timeout, until, wait)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while True:
            begin()  # (interrupted: the exception says whether the item went in: shield.py)
            try:
                return ring.put(planned, 0, until, wait)
            except WouldWait:
                pass
            finally:
                done()
            await _asleep(ring, True, _left(deadline, timeout, ring, True))

    async def _ring_get(self, ring: QueueRing, timeout: float | None) -> Item:
        """A get from the ring: an item waited for in a worker thread, which takes none."""
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while True:
            begin()  # (a signal once it took the item comes after it returned: shield.py)
            try:
                return ring.get(0)
            except WouldWait:
                pass
            finally:
                done()
            await _asleep(ring, False, _left(deadline, timeout, ring, False))

    async def close(self) -> None:
        """As Queue.close (this client's puts that did not wait go first)."""
        await self._client.flush()
        await self._client._call(Op.QCLOSE, queue=self._id, name=self.name)

    async def __aiter__(self) -> AsyncIterator[Item]:
        while True:
            try:
                item = await self.get()
            except QueueClosed:
                return
            yield item
            del item  # the generator frame must not keep the item's slot

    def __repr__(self) -> str:
        bound = f" maxsize={self.maxsize}" if self.maxsize else ""
        return f"<tb.aio.AsyncQueue {self.name!r}{bound}>"


async def _asleep(ring: QueueRing, producer: bool, timeout: float | None) -> None:
    """Sleep on a ring's bell in a worker thread; one cancelled is woken, so that it goes."""
    try:
        await asyncio.to_thread(ring.wait, producer, timeout)
    except asyncio.CancelledError:
        ring.view.wake_all()
        raise


def _left(
    deadline: float | None, timeout: float | None, ring: QueueRing, put: bool
) -> float | None:
    """Seconds a ring wait may sleep (None: a while); Timeout once `deadline` passed."""
    if deadline is None:
        return None
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        if put:
            raise Timeout(f"queue {ring.name!r} stayed full for {timeout:g}s")
        raise Timeout(f"queue {ring.name!r} stayed empty for {timeout:g}s")
    return left


def _keep(leases: Leases, turn: _Turn, reply: Reply) -> None:
    """An item answered to a get given up: the next get takes it, its lease held (claimed
    again if the broker restarts, as any: else the broker after it frees the item)."""
    leases.hold(reply["lease"], reply["oid"])
    turn.kept.append(reply)


class _Turn:
    """The gets of one queue in one client: one at a time asks the broker, and a get given
    up holds the turn until its fate is known; an item handed to it meanwhile is kept for
    the next get (of any handle of the queue), so items come in the queue's order."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.kept: collections.deque[Reply] = collections.deque()
