"""The reads of a client, for keys and queues alike: the Tensors of a get with their leases,
taken from the broker or, for a listed object, straight from the directory (Note [directory
and lease slots] in common/directory.py); a queue's items, one a producer handed over
included (Note [direct handoff] in common/mailbox.py).

It owns what the broker named at hello and this client maps: the directory view and the lease
slots, and the mailboxes with this client's own (its `bell`); and the items answered to
queue gets given up, kept for the next. It talks to the broker only through its `Connection`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..common import _shm, host
from ..common.config import SHM_DIR
from ..common.cudart import device_index
from ..common.descriptors import TensorDesc
from ..common.directory import DirectoryView, decode_desc, map_segment
from ..common.errors import BrokerError
from ..common.mailbox import Mailboxes
from ..common.protocol import Op
from . import placement
from .connection import Connection
from .cuda import DeviceLink
from .handoff import Bell
from .shm import SegmentCache
from .tensor import DeviceLease, Lease, SlotLease, Tensor

log = logging.getLogger(__name__)

Item = Tensor | dict[str, Tensor]
DESC_CACHE = 4096  # descriptors decoded, by object id


class LeaseSlots:
    """This client's region of lease slots, mapped read-write. Free slots are a deque, taken
    from the front and given back at the end (popleft and append are atomic under the GIL,
    and `give_back` runs from finalisers on any thread): a slot let go keeps the id of what
    it held, for the broker's LRU, until its turn comes again (Note [eviction] in
    server/store/eviction.py). The mapping lives while any SlotLease holds this object."""

    def __init__(self, path: str, offset: int, count: int) -> None:
        self.pid = os.getpid()
        self.size = count * 8
        self.addr = map_segment(path, self.size, writable=True, offset=offset)
        self._free = collections.deque(self.addr + 8 * i for i in range(count))

    def take(self) -> int | None:
        try:
            return self._free.popleft()
        except IndexError:  # every slot holds an object: the broker leases the next ones
            return None

    def give_back(self, slot: int) -> None:
        if host.pid() != self.pid:  # a forked child's copy: the slot is its parent's
            return
        _shm.slot_clear(slot)
        self._free.append(slot)

    def __del__(self) -> None:
        if not sys.is_finalizing() and os.getpid() == self.pid:
            _shm.unmap(self.addr, self.size)


class Reads:
    """A client's gets, and what they map and keep (see above)."""

    def __init__(self, conn: Connection, devices: DeviceLink, segments: SegmentCache) -> None:
        self.conn = conn
        self.devices = devices
        self.segments = segments  # the Transfer's, which puts use too
        self.directory: DirectoryView | None = None
        self.slots: LeaseSlots | None = None
        self.mailboxes: Mailboxes | None = None  # Note [direct handoff] in common/mailbox.py
        self.bell: Bell | None = None  # this client's own mailbox
        self._descs: dict[int, tuple[bool, tuple[TensorDesc, ...]]] = {}
        # Items answered to queue gets given up: (queue, subscription) -> their replies,
        # taken by this client's next gets of that line (`queue_get`).
        self._kept: dict[tuple[int, int | None], collections.deque[dict[str, Any]]] = {}
        self._shared: dict[str, Any] = {}
        self._generation = -1
        self._attach()

    def _attach(self) -> None:
        """Map the directory and the lease slots the broker named at hello (again after it
        restarted, if they changed)."""
        shared, self._generation = self.conn.shared, self.conn.generation
        try:
            where = shared.get("directory")
            if where != self._shared.get("directory"):
                if self.directory is not None:
                    self.directory.close()
                    self.directory = None
                if where is not None:
                    self.directory = DirectoryView(SHM_DIR, *where)
            where = shared.get("mailboxes")
            if where != self._shared.get("mailboxes"):
                self.mailboxes = self.bell = None
                if where is not None:
                    name, size, region = where
                    self.mailboxes = Mailboxes(os.path.join(SHM_DIR, name), size)
                    self.bell = Bell(self.mailboxes.at(region), self._generation)
            elif self.bell is not None:
                self.bell.generation = self._generation
            where = shared.get("slots")
            if where != self._shared.get("slots"):
                self.slots = None  # unmapped once no SlotLease holds it
                if where is not None:
                    name, offset, count = where
                    self.slots = LeaseSlots(os.path.join(SHM_DIR, name), offset, count)
            self._descs.clear()
        except (OSError, ValueError) as exc:  # every get asks the broker: slower, not wrong
            log.warning("cannot map the broker's directory or lease slots (%s)", exc)
        self._shared = shared

    # -- reading without the broker --------------------------------------------------------

    def read_directly(self, key: str) -> Item | None:
        """The live version of `key` read from the directory, leased through a slot; None
        when the broker must answer (not listed, no free slot, moved, or replaced under
        this get too often)."""
        if self._generation != self.conn.generation:  # the broker restarted
            self._attach()
        directory, slots = self.directory, self.slots
        if directory is None or slots is None:
            return None
        self.conn.check_usable(settle=False)  # no queue item can change a key
        try:
            leased = directory.lease(key.encode(), slots)
        except (OSError, ValueError):  # moved where the view cannot follow: ask the broker
            self._reattach()
            return None
        if leased is None:
            return None
        return self._item(key, *leased)

    def read_many(self, keys: Sequence[str]) -> dict[str, Item]:
        """`read_directly` of each of `keys` at once: the ones read, by key (the others the
        broker must answer)."""
        if self._generation != self.conn.generation:
            self._attach()
        directory, slots = self.directory, self.slots
        if directory is None or slots is None:
            return {}
        self.conn.check_usable(settle=False)  # no queue item can change a key
        try:
            found = directory.lease_many([key.encode() for key in keys], slots)
        except (OSError, ValueError):  # moved where the view cannot follow: ask the broker
            self._reattach()
            return {}
        out: dict[str, Item] = {}
        item = self._item
        try:
            for i, leased in enumerate(found):
                if leased is not None:
                    found[i] = None  # `_item` owns its slot: given back once, whatever happens
                    key = keys[i]
                    out[key] = item(key, *leased)
        finally:
            for leased in found:
                if leased is not None:  # an item not built: its slot goes back
                    slots.give_back(leased[3])
        return out

    def _item(self, key: str, oid: int, version: int, desc: bytes, slot: int) -> Item:
        """The Tensors of `key` leased through `slot`, which is given back if this raises,
        or by the SlotLease once the Tensors are gone (never both)."""
        slots = self.slots
        assert slots is not None
        try:
            bundle, tensors = self._desc(oid, desc)
            mapping = self.segments.get(tensors[0].segment)
        except BaseException:
            slots.give_back(slot)
            raise
        lease = SlotLease(mapping, slot, slots)  # from here on the slot is the lease's
        if not bundle:
            return Tensor(key, version, tensors[0], lease)
        return {t.name: Tensor(key, version, t, lease) for t in tensors}

    def _desc(self, oid: int, desc: bytes) -> tuple[bool, tuple[TensorDesc, ...]]:
        found = self._descs.get(oid)
        if found is None:
            if len(self._descs) >= DESC_CACHE:
                self._descs.clear()
            bundle, wires = decode_desc(desc)
            found = self._descs[oid] = (bundle, tuple(TensorDesc.from_wire(w) for w in wires))
        return found

    def _reattach(self) -> None:
        """The directory moved where the view could not follow: ask the broker where."""
        where = self.conn.call(Op.PING).get("directory")
        if where is not None and self.directory is not None:
            with contextlib.suppress(OSError, ValueError):
                self.directory.attach(*where)

    # -- reading ---------------------------------------------------------------------------

    def read(self, reply: dict[str, Any]) -> Item:
        """The Tensors of an object descriptor the broker sent, with its lease."""
        try:
            return self.build(reply)[0]
        except BaseException:
            self.conn.leases.releases.put(reply["lease"])
            raise

    def build(self, reply: dict[str, Any]) -> tuple[Item, Lease]:
        """`read`'s Tensors and their lease; one that fails leaves the lease to the caller
        (a queue ring's get gives its item back on it)."""
        lease_id, key, version = reply["lease"], reply["key"], reply["version"]
        descs = [TensorDesc.from_wire(w) for w in reply["tensors"]]
        lease = self.lease(lease_id, descs[0], reply, reader=True)
        try:
            if not reply["bundle"]:
                item: Item = Tensor(key, version, descs[0], lease)
            else:
                item = {t.name: Tensor(key, version, t, lease) for t in descs}
        except BaseException:
            lease.disarm()
            raise
        self.conn.leases.hold(lease_id, reply["oid"])
        return item, lease

    def move(self, key: str, result: Item, want: str | None, copy: bool) -> Item:
        """`result` on the device `want` (see placement.move)."""
        return placement.move(self.devices, key, result, want, copy)

    def lease(self, lease_id: int, desc: TensorDesc, reply: dict[str, Any], reader: bool) -> Lease:
        """A lease over the memory `desc` names: a mapped segment, or an opened device chunk
        with the object's events (opened once per Client)."""
        if desc.device == "cpu":
            mapping = self.segments.get(desc.segment)
            return Lease(lease_id, mapping, self.conn.leases.releases)
        index, link = device_index(desc.device), self.devices
        chunk = link.chunk(index, desc.segment, reply["handle"])
        write = link.event(index, *reply["event"])
        read = link.event(index, *reply["done"]) if reader else None
        return DeviceLease(lease_id, chunk, self.conn.leases.releases, link, write, read)

    def queue_get(self, timeout: float | None, wait: float | None, **fields: Any) -> Item:
        """A queue's (or a subscription's, `sub`) next item: one answered to a get of this
        client's given up before, the broker's reply, or (waiting on this client's bell, if
        no other thread does) one a producer handed over."""
        line = (fields["queue"], fields.get("sub"))
        kept = self._kept.get(line)
        while kept:
            try:
                reply = kept.popleft()
            except IndexError:  # another thread took it
                break
            if self.still_held(reply):
                return self.read(reply)
        late = functools.partial(self._keep, line)
        if self._generation != self.conn.generation:
            self._attach()
        bell = self.bell
        if bell is None or timeout == 0 or "sub" in fields or not bell.lock.acquire(False):
            return self.read(self.conn.call(Op.QGET, wait, late=late, timeout=timeout, **fields))
        try:
            reply = self.conn.call(
                Op.QGET, wait, bell, late, timeout=timeout, mailbox=True, **fields
            )  # fmt: skip
        finally:
            bell.lock.release()
        return self.read(reply)

    def _keep(self, line: tuple[int, int | None], reply: dict[str, Any]) -> None:
        """An item answered to a get given up: the next get of `line` takes it, in order."""
        self.conn.leases.hold(reply["lease"], reply["oid"])  # claimed again after a restart
        self._kept.setdefault(line, collections.deque()).append(reply)

    def still_held(self, reply: dict[str, Any]) -> bool:
        """Whether this client still holds the lease of a kept item: not if the broker
        restarted without the state (every lease lost: ids start again), or lost it."""
        return bool(self.conn.leases.held.get(reply["lease"]) == reply["oid"])

    def forget_kept(self, line: tuple[int, int | None]) -> None:
        """The items kept for `line` (a subscription that ends) are let go."""
        kept = self._kept.pop(line, None)
        while kept:
            reply = kept.popleft()
            if self.still_held(reply):
                self.let_go(reply)

    def let_go(self, reply: dict[str, Any]) -> None:
        """An object answered to a get given up: its lease goes back (a watch told its key
        was deleted holds none)."""
        if "lease" in reply:
            self.conn.leases.releases.put(reply["lease"])

    # -- closing ---------------------------------------------------------------------------

    def finish(self) -> None:
        """Before bye: items kept for gets that will not come go back to their queues (for
        the next get of any consumer: they were never taken); a subscription's, which no
        other reader wants, are let go."""
        for line in list(self._kept):
            if line[1] is None:
                self._give_back(line)
            self.forget_kept(line)

    def _give_back(self, line: tuple[int, int | None]) -> None:
        kept = self._kept.get(line, collections.deque())
        leases = [r["lease"] for r in kept if self.still_held(r)]
        if not leases:
            return
        try:
            back = set(self.conn.call(Op.QBACK, queue=line[0], leases=leases)["back"])
        except BrokerError as exc:  # (a broker gone: what it handed out went with it)
            log.warning("could not give back %d queue items never taken: %s", len(leases), exc)
            return
        for reply in [r for r in kept if r["lease"] in back]:
            kept.remove(reply)
            self.conn.leases.forget(reply["lease"])  # the broker's again, not ours to let go

    def keep(self, queue: int, reply: dict[str, Any]) -> None:
        """An item answered to a get of queue `queue` given up elsewhere (an asyncio get's),
        kept here: given back at close like this client's own."""
        self._keep((queue, None), reply)

    def close(self) -> None:
        """Forget what was mapped (each closes once no array uses it)."""
        if self.directory is not None:
            self.directory.close()
            self.directory = None
        self.slots = None  # unmapped once no SlotLease holds it
