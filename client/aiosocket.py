"""The asyncio client's socket (Note [the asyncio client] in aio.py): one zmq.asyncio DEALER
that says hello into a synchronous Client's session and carries the requests of many tasks,
each reply to the future of its id; a request its caller gives up is cancelled in the
broker, and `Late` is told what becomes of it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from ..common.errors import BrokerUnavailable, SessionUnknown, error_from_wire
from ..common.protocol import Op, decode, encode
from .client import Client
from .transport import MAX_REPLY_BYTES, Unsent

Reply = dict[str, Any]


class Late:
    """What becomes of a request its caller gave up on (cancelled, or timed out): `undo`
    takes its answer if one comes after all; `settled` is told once its fate is known (an
    answer came, or the broker dropped it). `pending` meanwhile."""

    __slots__ = ("undo", "settled", "pending")

    def __init__(
        self, undo: Callable[[Reply], None], settled: Callable[[], None] | None = None
    ) -> None:
        self.undo, self.settled, self.pending = undo, settled, False

    def settle(self, reply: Reply | None) -> None:
        self.pending = False
        if reply is not None and reply.get("ok"):
            self.undo(reply)
        if self.settled is not None:
            self.settled()


class AsyncChannel:
    """The session's zmq.asyncio DEALER: requests out, each reply to the future of its id."""

    def __init__(self, sync: Client, ctx: zmq.asyncio.Context) -> None:
        assert sync._conn is not None
        self._conn = sync._conn
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if self._conn.keys is not None:
            self._conn.keys.apply(self.socket)
        self.socket.connect(self._conn.address)
        self._waiting: dict[int, asyncio.Future[Reply]] = {}
        self._late: dict[int, Late] = {}  # requests given up whose answer may still come
        self._cancels: dict[int, int] = {}  # id of a cancel sent -> id of what it cancels
        # Answers that came after their caller's future was cancelled, before the caller
        # gave up (_give_up runs when the cancelled task resumes): it takes them there.
        self._crossed: dict[int, Reply] = {}
        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read())
        self.broken: BrokerUnavailable | None = None
        self.generation = self._conn.generation  # of the broker it says hello to
        self._pidfd = self._conn.broker_pidfd  # readable once the broker exits
        if self._pidfd is not None:
            self._loop.add_reader(self._pidfd, self._broker_exited)

    async def hello(self, timeout: float) -> None:
        try:
            await self.call(self._conn.hello_message(), timeout)
        except BrokerUnavailable as exc:
            raise BrokerUnavailable(f"no broker answers at {self._conn.address}: {exc}") from None

    async def call(self, message: Reply, wait: float | None, late: Late | None = None) -> Reply:
        """Send `message` and await its reply (up to `wait` seconds: None, as long as the
        broker lives); the error it carries raised. If the caller gives up (cancelled, or
        out of time) after sending, `late` is told what becomes of the request. Unsent if
        no broker acted on it: the broker had exited before it went, or the one of now
        refused it (it does not know this client)."""
        if self.broken is not None:
            raise Unsent(str(self.broken))
        conn = self._conn  # (the loop may not have run since its broker exited: its pidfd
        if conn.generation != self.generation or conn.broker_exited():  # not read yet)
            self._broker_exited()
            raise Unsent(str(self.broken))
        rid = message["id"]
        future: asyncio.Future[Reply] = self._loop.create_future()
        self._waiting[rid] = future
        try:
            await self.socket.send(encode(message))
        except BaseException:  # not sent: nothing to take back
            self._waiting.pop(rid, None)
            raise
        try:
            async with asyncio.timeout(wait):
                reply = await future
        except (asyncio.CancelledError, TimeoutError) as exc:
            self._give_up(rid, future, message["op"], late)
            if isinstance(exc, TimeoutError):
                raise BrokerUnavailable(
                    f"no reply from the broker at {self._conn.address} within {wait:.1f}s "
                    f"(op {message['op']!r})"
                ) from None
            raise
        if not reply.get("ok"):
            if reply.get("code") == SessionUnknown.code:
                self._fail_all(
                    BrokerUnavailable(f"the broker at {self._conn.address} restarted: call again")
                )
                raise Unsent(f"the broker at {self._conn.address} does not know this client")
            raise error_from_wire(str(reply.get("code")), str(reply.get("error")))
        return reply

    def _give_up(self, rid: int, future: asyncio.Future[Reply], op: str, late: Late | None) -> None:
        """The caller stopped waiting: ask the broker to drop the request, and undo its
        answer if it came (or comes) anyway."""
        self._waiting.pop(rid, None)
        if future.done() and not future.cancelled():  # answered as the task was cancelled
            crossed: Reply | None = future.result()
        else:
            crossed = self._crossed.pop(rid, None)
        if crossed is not None:
            if late is not None and crossed.get("ok"):
                late.undo(crossed)
            return
        if late is not None:
            late.pending = True
            self._late[rid] = late
        if self.broken is None and op != Op.HELLO:
            cancel = self._conn.next_id()
            self._cancels[cancel] = rid
            self.send_nowait({"op": Op.CANCEL, "id": cancel, "call": rid})

    def send_nowait(self, message: Reply) -> None:
        """A message whose answer no one awaits (read and dropped)."""
        self.socket.send(encode(message))

    async def _read(self) -> None:
        try:
            while True:
                reply = decode(await self.socket.recv(), MAX_REPLY_BYTES)
                rid = reply.get("id")
                future = self._waiting.pop(rid, None) if isinstance(rid, int) else None
                if future is not None:
                    if not future.done():
                        future.set_result(reply)
                    else:  # cancelled: its task has yet to give up (_give_up)
                        self._crossed[rid] = reply  # type: ignore[index]
                    continue
                late = self._late.pop(rid, None) if isinstance(rid, int) else None
                if late is not None:
                    late.settle(reply)
                cancelled = self._cancels.pop(rid, None) if isinstance(rid, int) else None
                if cancelled is not None and reply.get("cancelled"):  # it gets no answer
                    late = self._late.pop(cancelled, None)
                    if late is not None:
                        late.settle(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the socket closed, or a reply that cannot be read
            self._fail_all(BrokerUnavailable(f"the connection to the broker failed: {exc}"))

    def _broker_exited(self) -> None:
        self._fail_all(
            BrokerUnavailable(
                f"the broker at {self._conn.address} exited: call again (once a broker is "
                "back, the client carries on)"
            )
        )

    def _fail_all(self, error: BrokerUnavailable) -> None:
        """This socket is done: every call waiting on it raises `error`, and every request
        given up is settled (the broker that answers next holds nothing for them)."""
        if self.broken is None:
            self.broken = error
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            self._pidfd = None
        waiting, self._waiting = list(self._waiting.values()), {}
        for future in waiting:
            if not future.done():
                future.set_exception(self.broken)
        lates, self._late = list(self._late.values()), {}
        self._cancels.clear()
        self._crossed.clear()
        for late in lates:
            late.settle(None)

    async def close(self) -> None:
        self._fail_all(BrokerUnavailable("the asyncio client is closed"))
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self.socket.close(linger=0)
