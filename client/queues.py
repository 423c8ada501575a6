"""The queues a client opens: pipeline queues, broadcast queues, and subscriptions to those.
Part of `Client` (client.py), which sends the calls; the queues themselves are queue.py's.
"""

from __future__ import annotations

import logging
from typing import Any

from ..common.errors import InvalidRequest
from ..common.protocol import Op
from .connection import REQUEST_TIMEOUT
from .qring import opened, rings_wanted
from .queue import Queue, Subscription
from .ring import RingView
from .shm import SegmentGone
from .transfer import Transfer

log = logging.getLogger("tensorbroker.client.client")  # (its warnings, as before)


class Queues:
    """What `Client.queue`, `broadcast` and `subscribe` open."""

    _transfer: Transfer

    def _call(self, op: str, wait: float | None = REQUEST_TIMEOUT, **fields: Any) -> dict[str, Any]:
        raise NotImplementedError  # (Client's)

    def queue(self, name: str, maxsize: int = 0) -> Queue:
        """The pipeline queue `name`, made if it does not exist: FIFO, each item to one
        consumer. `maxsize` (0: no bound) bounds its items in flight, from a producer's put
        until the consumer lets go of the item; a put waits for a free slot. The first
        nonzero maxsize asked for a queue holds; 0 takes the queue as it is."""
        return self._open_queue(name, maxsize)

    def broadcast(self, name: str, maxsize: int = 8) -> Queue:
        """The broadcast queue `name`, made if it does not exist, to publish to: `q.put(x)`
        gives x to every subscriber (`subscribe`) from one copy in shared memory, and waits
        while `maxsize` items are in flight: an item is in flight until every subscriber it
        was given to let go of it, so the producer waits for the slowest. `q.close()` ends
        every subscriber's loop once it has what was put before."""
        return self._open_queue(name, maxsize, broadcast=True)

    def subscribe(self, name: str) -> Subscription:
        """A subscription to the broadcast queue `name` (made if it does not exist): each
        item put from now on, in order, zero copy. `for item in sub` until the queue is
        closed; `sub.close()` ends it (so does closing this client, or its process dying)."""
        q = self._open_queue(name, 0, broadcast=True)
        local = self._transfer.reads.directory is not None  # it maps the broker's segments
        conn = self._transfer.conn
        generation = conn.generation
        reply = self._call(Op.QSUB, queue=q._id, name=name, ring=local)
        where = reply.get("ring")
        if where is None:
            return Subscription(self._transfer, name, q._id, reply["sub"], None)
        segment, size, slots, bit, cursor = where
        try:
            if generation != conn.generation:  # a broker that came back meanwhile
                raise ValueError("the broker restarted while it answered")
            ring = RingView(segment, size, slots, bit, cursor, q._id, generation)
        except (OSError, ValueError) as exc:  # its items come through messages: slower
            log.warning("cannot map the ring of queue %r (%s)", name, exc)
            self._call(Op.QUNSUB, queue=q._id, name=name, sub=reply["sub"])
            reply = self._call(Op.QSUB, queue=q._id, name=name)
            return Subscription(self._transfer, name, q._id, reply["sub"], None)
        return Subscription(self._transfer, name, q._id, reply["sub"], ring)

    def _open_queue(self, name: str, maxsize: int, broadcast: bool = False) -> Queue:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
            raise InvalidRequest(
                f"queue {name!r}: maxsize must be an integer >= 0, not {maxsize!r}"
            )
        more = {"broadcast": True} if broadcast else {}
        local = self._transfer.reads.directory is not None  # it maps the broker's segments
        if local and not broadcast and rings_wanted():
            more["ring"] = True  # it can use a queue ring (Note [queue ring])
        reply = self._call(Op.QOPEN, name=name, maxsize=maxsize, **more)
        try:
            ring = opened(self._transfer, name, reply)
        except SegmentGone:  # (it may have ended meanwhile: qring.opened)
            reply = self._call(Op.QOPEN, name=name, maxsize=maxsize, **more)
            ring = opened(self._transfer, name, reply)
        return Queue(self._transfer, name, reply["queue"], reply["maxsize"], ring)
