"""The subscriber's side of Note [broadcast ring] (common/ring.py): take the next item of a
broadcast queue from its ring, sleep on the ring's bell, and let go through `RingLease`."""

from __future__ import annotations

import os
import queue
import threading
from typing import TYPE_CHECKING, Any

import msgpack

from ..common import _shm, host
from ..common.config import SHM_DIR
from ..common.descriptors import TensorDesc
from ..common.directory import map_segment
from ..common.mailbox import item_reply
from ..common.ring import R_END, R_MEMBERS, R_WHY, REMOVED
from .tensor import Lease, Tensor

if TYPE_CHECKING:
    from .reads import Item
    from .transfer import Transfer

TAILS = 64  # slot tails a ring keeps unpacked


class RingView:
    """One subscription's view of its queue's ring, mapped read-write (it clears its own
    bits); unmapped once neither the subscription nor an item taken from it needs it."""

    def __init__(
        self, name: str, size: int, slots: int, bit: int, cursor: int, queue_id: int,
        generation: int,
    ) -> None:  # fmt: skip
        self.addr = 0
        self.addr = map_segment(os.path.join(SHM_DIR, name), size, writable=True)
        self.size, self.slots, self.bit, self.mask = size, slots, bit, 1 << bit
        self.cursor = cursor  # the version to take next
        self.queue, self.generation = queue_id, generation
        self.lock = threading.Lock()  # one get at a time takes from it
        self._tails: dict[bytes, Any] = {}

    def __del__(self) -> None:
        addr, self.addr = self.addr, 0
        if addr:
            _shm.unmap(addr, self.size)

    def bell(self) -> int:
        """Read before taking: a publish after that ends `wait` at once."""
        return _shm.bell(self.addr)

    def wait(self, seen: int, timeout: float) -> None:
        _shm.bell_wait(self.addr, seen, timeout)

    def take(self) -> tuple[int, int, int, int, bytes, bool] | bool | None:
        """The item at the cursor, taken (the cursor moves on): (flags, slot, oid, base,
        tail, idle); None if not published yet; False if not for this subscription (it
        ended)."""
        version = self.cursor
        got = _shm.ring_take(self.addr, self.slots, version, self.bit)
        if not isinstance(got, tuple):
            return got
        self.cursor = version + 1
        flags, index, oid, _put, base, tail, idle = got
        return flags, index, oid, base, tail, idle

    def ended(self) -> int:
        """0 while items may still come; else REMOVED once the queue was removed, CLOSED once
        the cursor is past the last item of a closed one, or -1 once this subscription is no
        longer served."""
        # `members` first: the broker writes a removed queue's end before the bits it ends
        members = _shm.load(self.addr + R_MEMBERS)
        end = _shm.load(self.addr + R_END)
        why = int(_shm.load(self.addr + R_WHY)) if end else 0
        if why == REMOVED or (why and self.cursor >= end):
            return why
        if not members & self.mask:
            return -1
        return 0

    def item(
        self, transfer: Transfer, version: int, index: int, oid: int, base: int, tail: bytes
    ) -> Item:
        """The Tensors of the item taken at `version` from slot `index`, held by this
        subscription's bit."""
        unpacked = self._tails.get(tail)
        if unpacked is None:
            if len(self._tails) >= TAILS:
                self._tails.clear()
            unpacked = self._tails[tail] = msgpack.unpackb(tail, raw=False)
        try:
            reply = item_reply(0, 0, version, oid, 0, base, unpacked)
            descs = [TensorDesc.from_wire(w) for w in reply["tensors"]]
            mapping = transfer.segments.get(descs[0].segment)
        except BaseException:
            self.let_go(index, version, transfer.conn.leases.done)
            raise
        lease = RingLease(mapping, self, index, version, transfer.conn.leases.done)
        if not reply["bundle"]:
            return Tensor(reply["key"], version, descs[0], lease)
        return {t.name: Tensor(reply["key"], version, t, lease) for t in descs}

    def let_go(self, index: int, version: int, done: queue.SimpleQueue[tuple[int, int]]) -> None:
        """Clear this subscription's hold on `version` (in slot `index`); the broker is told
        if it was the last."""
        if self.addr and _shm.ring_release(self.addr, index, version, 0, self.mask):
            done.put((self.queue, version))


class RingLease(Lease):
    """An item held by a subscription's bit in its ring slot: letting go clears the bit (no
    message, unless it was the last: then the broker frees the item)."""

    __slots__ = ("_ring", "_index", "_version", "_done", "_pid")

    def __init__(
        self, mapping: Any, ring: RingView, index: int, version: int,
        done: queue.SimpleQueue[tuple[int, int]],
    ) -> None:  # fmt: skip
        super().__init__(None, mapping, None)
        self._ring: RingView | None = ring
        self._index, self._version, self._done, self._pid = index, version, done, host.pid()

    def __del__(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None and host.pid() == self._pid:  # a forked child's is its parent's
            ring.let_go(self._index, self._version, self._done)
