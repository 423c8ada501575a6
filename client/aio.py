"""An asyncio client: `c = await tb.aio.connect()` (or `async with tb.aio.connect() as c`).

    async with tb.aio.connect(address) as c:
        await c.put("x", array)
        t = await c.get("x", timeout=None)      # waits without blocking the event loop
        q = await c.queue("frames", maxsize=8)
        await q.put(array)
        async for item in q: ...

Note [the asyncio client]
~~~~~~~~~~~~~~~~~~~~~~~~~
It is a synchronous Client (its session, directory, lease slots, grants, credits, releases
and reconnection) plus one `zmq.asyncio` DEALER that says hello into the same session. Every
request that may wait in the broker (a get of a key not there yet, a watch, a queue get, a
queue put waiting for a slot, a put waiting for memory) goes over that socket: many
coroutines share it, each awaiting the reply with its own id, and a waiting request never
blocks the event loop. What never waits runs in the loop's thread, as the synchronous client
does it (a get from the directory, a small put into a block granted ahead: microseconds).
Copies of more than INLINE_BYTES go to a worker thread.

Cancellation. A task cancelled while its request waits in the broker sends `cancel`: the
broker takes the request out of its line, and nothing is held for it. If the broker had
answered already (the answer crossed the cancel), the answer is undone here: a get's lease
is let go, a queue item is kept for this client's next get of that queue (so no item is
lost; one left when the client closes is let go like any item it took), slots credited go
to this client's credits, memory granted for a put is given back (abort).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Generator, Sequence
from typing import Any

import zmq
import zmq.asyncio

from ..common.cudart import parse_device
from ..common.errors import BrokerUnavailable
from ..common.protocol import Op
from .aio_queue import AsyncQueue, _Turn
from .aiosocket import AsyncChannel, Late, Reply
from .client import Client
from .connection import REQUEST_TIMEOUT
from .leases import ASKED_AGAIN
from .plans import WritePlan
from .qring import opened, rings_wanted
from .reads import Item
from .shm import SegmentGone
from .tensor import Tensor
from .transport import Unsent, waits

log = logging.getLogger(__name__)

INLINE_BYTES = 1 << 20  # copies larger than this run in a worker thread


def connect(
    address: str | None = None,
    timeout: float = 5.0,
    reconnect_timeout: float = 30.0,
    server_key: str | None = None,
) -> _Connecting:
    """An AsyncClient of the broker at `address` (as `tb.connect`): `await` it, or use it
    as `async with tb.aio.connect() as c:` (closed at the end)."""
    return _Connecting(address, timeout, reconnect_timeout, server_key)


class _Connecting:
    def __init__(self, *args: Any) -> None:
        self._args = args
        self._client: AsyncClient | None = None

    async def _open(self) -> AsyncClient:
        sync = await asyncio.to_thread(Client, *self._args)  # hello: may wait for the broker
        client = AsyncClient(sync)
        try:
            await client._socket()
        except BaseException:
            await client.aclose()
            raise
        return client

    def __await__(self) -> Generator[Any, None, AsyncClient]:
        return self._open().__await__()

    async def __aenter__(self) -> AsyncClient:
        self._client = await self._open()
        return self._client

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.aclose()


class AsyncClient:
    """The asyncio face of a Client (see Note [the asyncio client]). Make one with
    `tb.aio.connect()`; many tasks may share it. `sync` is the Client beneath, for what has
    no async form here."""

    def __init__(self, sync: Client) -> None:
        self.sync = sync
        self.address = sync.address
        self._transfer = sync._transfer
        self._ctx = zmq.asyncio.Context()
        self._channel: AsyncChannel | None = None
        self._opening = asyncio.Lock()
        self._closed = False
        self._turns: dict[int, _Turn] = {}  # queue id -> its gets' turn and kept items

    # -- keys ------------------------------------------------------------------------------

    async def put(
        self,
        key: str,
        value: Any,
        *,
        device: Any = None,
        copy: bool = False,
        wait: bool = True,
        evictable: bool = False,
    ) -> int | None:
        """As Client.put; a copy of more than INLINE_BYTES runs in a worker thread (a put
        cancelled once its copy began still lands)."""
        fields: dict[str, Any] = {"key": key, **({"evictable": True} if evictable else {})}
        plan = self._transfer.plan_write(key, value, device, copy, fields)
        return await self._write(plan, Op.PUT, REQUEST_TIMEOUT, wait)

    async def get(
        self, key: str, timeout: float | None = 0.0, *, device: Any = None, copy: bool = False
    ) -> Item:
        """As Client.get: a key not there yet is waited for (up to `timeout` seconds, None:
        as long as it takes) without blocking the event loop."""
        timeout, wait = waits(timeout)
        want = None if device is None else parse_device(device, f"get {key!r}")
        self._transfer.writes.settle(key)
        result = self._transfer.reads.read_directly(key)
        if result is None:
            reply = await self._call(
                Op.GET, wait, Late(self._transfer.reads.let_go), key=key, timeout=timeout
            )
            result = self._transfer.reads.read(reply)
        return self._transfer.reads.move(key, result, want, copy)

    async def watch(self, key: str, timeout: float | None = None) -> AsyncIterator[Item | None]:
        """As Client.watch: `async for v in c.watch(key)`; v is None when the key is
        deleted (or evicted), and then the next version put."""
        timeout, wait = waits(timeout)
        self._transfer.writes.settle(key)
        seen, deletes = 0, False  # deletes: a version was yielded since the last None
        while True:
            more = {"deletes": True} if deletes else {}
            reply = await self._call(
                Op.GET, wait, Late(self._transfer.reads.let_go), key=key, timeout=timeout,
                after=seen, **more,
            )  # fmt: skip
            if reply.get("deleted"):
                deletes = False
                yield None
                continue
            seen, deletes = reply["version"], True
            yield self._transfer.reads.read(reply)

    def create(
        self, key: str, shape: Sequence[int], dtype: Any, device: Any = "cpu"
    ) -> contextlib.AbstractAsyncContextManager[Tensor]:
        """As Client.create: `async with c.create(key, shape, dtype) as buf:`; sealed when
        the block exits, aborted if it raises."""
        return _InThreads(self.sync.create(key, shape, dtype, device))

    async def delete(self, key: str) -> None:
        self._transfer.writes.settle(key)
        await self._call(Op.DELETE, key=key)

    async def exists(self, key: str) -> bool:
        self._transfer.writes.settle(key)
        return bool((await self._call(Op.EXISTS, key=key))["exists"])

    async def keys(self) -> list[str]:
        return list((await self._call(Op.KEYS))["keys"])

    async def stats(self) -> dict[str, Any]:
        reply = await self._call(Op.STATS)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    async def flush(self) -> None:
        """As Client.flush, in a worker thread."""
        await asyncio.to_thread(self.sync.flush)

    # -- queues ----------------------------------------------------------------------------

    async def queue(self, name: str, maxsize: int = 0) -> AsyncQueue:
        """As Client.queue."""
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
            raise ValueError(f"queue {name!r}: maxsize must be an integer >= 0, not {maxsize!r}")
        more: dict[str, Any] = {}
        if self._transfer.reads.directory is not None and rings_wanted():
            more["ring"] = True  # it can use a queue ring (Note [queue ring])
        reply = await self._call(Op.QOPEN, name=name, maxsize=maxsize, **more)
        try:
            ring = opened(self._transfer, name, reply)
        except SegmentGone:  # (it may have ended meanwhile: qring.opened)
            reply = await self._call(Op.QOPEN, name=name, maxsize=maxsize, **more)
            ring = opened(self._transfer, name, reply)
        return AsyncQueue(self, name, reply["queue"], reply["maxsize"], ring)

    async def delete_queue(self, name: str) -> None:
        await self._call(Op.QDELETE, name=name)

    # -- plumbing --------------------------------------------------------------------------

    async def _socket(self) -> AsyncChannel:
        """The session's asyncio socket, opened (again, after a broker restart) on demand."""
        if self._channel is not None and self._channel.broken is None:
            return self._channel
        async with self._opening:
            if self._closed:
                raise BrokerUnavailable(f"this client of {self.address} is closed")
            if self._channel is not None and self._channel.broken is not None:
                old, self._channel = self._channel, None
                await old.close()
                await asyncio.to_thread(self.sync.ping)  # the session is back (reconnects)
            if self._channel is None:
                channel = AsyncChannel(self.sync, self._ctx)
                try:
                    await channel.hello(REQUEST_TIMEOUT)
                except BaseException:
                    await channel.close()
                    raise
                self._channel = channel
        return self._channel

    async def _call(
        self, op: str, wait: float | None = REQUEST_TIMEOUT, late: Late | None = None,
        **fields: Any,
    ) -> Reply:  # fmt: skip
        conn = self.sync._conn
        if conn is None or self._closed:
            raise BrokerUnavailable(f"this client of {self.address} is closed")
        if conn.broken:  # none came back last time: look again, off the event loop
            await asyncio.to_thread(conn.reconnect, conn.generation)
        conn.check_usable(settle=False)  # raises the error of a put that did not wait
        message = {"op": op, "id": conn.next_id(), **fields}
        began = asyncio.get_running_loop().time()
        with conn.in_flight(message["id"]):
            while True:
                channel = await self._socket()
                epoch = conn.leases.epoch
                try:
                    reply = await channel.call(message, wait, late)
                    if conn.leases.leased(reply, epoch, again=op in ASKED_AGAIN):
                        return reply
                    continue  # (a get answered by a broker that died: asked again)
                except BrokerUnavailable as exc:
                    if channel.broken is None or self._closed:  # out of time, or closed
                        raise
                    sent = not isinstance(exc, Unsent)  # (Unsent: no broker acted on it)
                # The broker exited under the call: once one is back (the session with it),
                # the call goes again where that is safe, as the synchronous client's do.
                await self._socket()
                conn.check_resent(op, fields, sent)
                if fields.get("timeout") is not None:  # it waits what was left
                    spent = asyncio.get_running_loop().time() - began
                    message["timeout"], wait = waits(max(0.0, fields["timeout"] - spent))

    async def _write(self, plan: WritePlan, op: str, wait: float | None, block: bool) -> int | None:
        """Finish a planned put: into its block granted ahead, else into memory the broker
        grants (waiting, for a queue's slot or device memory, without blocking the loop)."""
        transfer = self._transfer
        if plan.grant is not None and _nbytes(plan) > INLINE_BYTES:  # (a device's: to 4 GiB)
            return await asyncio.to_thread(transfer.write_granted, plan, wait, block)
        if plan.grant is not None:
            return transfer.write_granted(plan, wait, block)
        epoch = transfer.conn.leases.epoch  # (Leases.hold_put)
        reply = await self._call(op, wait, Late(self._abort), **plan.request)
        if _nbytes(plan) > INLINE_BYTES:
            return await asyncio.to_thread(transfer.fill, plan, reply, block, epoch)
        return transfer.fill(plan, reply, block, epoch)

    def _abort(self, reply: Reply) -> None:
        """Memory granted to a put after it was cancelled: given back."""
        if self._channel is not None and "put" in reply:
            conn = self.sync._conn
            assert conn is not None
            self._channel.send_nowait({"op": Op.ABORT, "id": conn.next_id(), "put": reply["put"]})

    async def aclose(self) -> None:
        """Close the asyncio socket and the Client beneath. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        for queue_id, turn in self._turns.items():  # items kept for gets that will not come:
            while turn.kept:  # given back to their queues as the Client beneath closes
                self._transfer.reads.keep(queue_id, turn.kept.popleft())
        self._ctx.term()
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<tb.aio.AsyncClient {self.address}{' closed' if self._closed else ''}>"


class _InThreads(contextlib.AbstractAsyncContextManager[Tensor]):
    """A synchronous context manager entered and left in worker threads."""

    def __init__(self, sync: contextlib.AbstractContextManager[Tensor]) -> None:
        self._sync = sync

    async def __aenter__(self) -> Tensor:
        return await asyncio.to_thread(self._sync.__enter__)

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await asyncio.to_thread(self._sync.__exit__, *exc)


def _nbytes(plan: WritePlan) -> int:
    return sum(int(getattr(src, "nbytes", 0)) for _, src, _ in plan.items)
