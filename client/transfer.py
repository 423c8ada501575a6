"""The transfer of bytes, for keys and queues alike: the copy of a put into the broker's
memory, in-place writes (`create`), and the Tensors of a get with their leases, taken from
the broker or, for a listed object, straight from the directory (Note [directory and lease
slots] in common/directory.py).

It owns what a client has mapped and opened: the segment cache (host shared memory), the
directory view and the lease slots, the `DeviceLink` (CUDA handles, events and streams), and
the copier of large host puts. It talks to the broker only through its `Connection`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..common import _shm, host
from ..common.config import SHM_DIR
from ..common.cudart import STREAM_LEGACY, device_index, parse_device
from ..common.descriptors import TensorDesc, compact_strides, layout
from ..common.directory import DirectoryView, decode_desc, map_segment
from ..common.dtypes import DType
from ..common.dtypes import dtype as lookup_dtype
from ..common.errors import BrokerError
from ..common.mailbox import Mailboxes, Template, body_tail
from ..common.protocol import Op
from . import placement
from .connection import Connection
from .copy import Copier
from .cuda import DeviceLink
from .handoff import Bell, hand_over
from .shm import SegmentCache
from .sources import Source, entries
from .tensor import DeviceLease, Lease, SlotLease, Tensor
from .writes import Grant, Writes

log = logging.getLogger(__name__)

Item = Tensor | dict[str, Tensor]
DESC_CACHE = 4096  # descriptors decoded, by object id
PLAN_CACHE = 256  # put plans of plain NumPy arrays, by dtype and shape


class WritePlan:
    """A put under way: its tensors placed, and the block granted ahead it writes into (None:
    the broker is asked for memory with `request`)."""

    __slots__ = (
        "label", "items", "target", "specs", "bundle", "fields", "offsets", "grant", "raw",
        "tails",
    )  # fmt: skip

    def __init__(
        self,
        label: str,
        items: list[tuple[str, Source, DType]],
        target: str,
        specs: list[list[Any]],
        bundle: bool,
        fields: dict[str, Any],
    ) -> None:
        self.label, self.items, self.target = label, items, target
        self.specs, self.bundle, self.fields = specs, bundle, fields
        self.offsets: list[int] = []
        self.grant: Grant | None = None
        self.raw = False  # its one array is stored byte for byte as it is (a plain ndarray)
        self.tails: dict[tuple[str, str], bytes] | None = None  # kept with a plan reused

    @property
    def request(self) -> dict[str, Any]:
        return {"tensors": self.specs, "bundle": self.bundle, **self.fields}

    def tail(self, segment: str) -> bytes:
        """The tail of a mailbox body for this item in `segment` (`body_tail`): packed once
        per queue and segment for a plan reused (`tails`)."""
        name = self.fields.get("name", "")
        tails = self.tails
        found = None if tails is None else tails.get((name, segment))
        if found is not None:
            return found
        template: Template = [
            (tensor, dtype, shape, list(compact_strides(tuple(shape))), offset)
            for (tensor, dtype, shape), offset in zip(self.specs, self.offsets, strict=True)
        ]
        tail = body_tail(name, self.bundle, segment, template)
        if tails is not None:
            if len(tails) >= PLAN_CACHE:
                tails.clear()
            tails[name, segment] = tail
        return tail


class LeaseSlots:
    """This client's region of lease slots, mapped read-write. Free slots are a deque, taken
    from the front and given back at the end (popleft and append are atomic under the GIL,
    and `give_back` runs from finalisers on any thread): a slot let go keeps the id of what
    it held, for the broker's LRU, until its turn comes again (Note [eviction] in
    server/eviction.py). The mapping lives while any SlotLease holds this object."""

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


class Transfer:
    def __init__(self, conn: Connection, devices: DeviceLink) -> None:
        self.conn = conn
        self.devices = devices
        self.segments = SegmentCache()
        self.writes = Writes(conn)
        self.copier = Copier()
        self.directory: DirectoryView | None = None
        self.slots: LeaseSlots | None = None
        self.mailboxes: Mailboxes | None = None  # Note [direct handoff] in common/mailbox.py
        self.bell: Bell | None = None  # this client's own mailbox
        self._descs: dict[int, tuple[bool, tuple[TensorDesc, ...]]] = {}
        # Plans of plain NumPy puts: (dtype, shape) -> its DType, specs, offsets, block size.
        self._plans: dict[tuple[Any, ...], tuple[Any, ...]] = {}
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
        try:
            for i, (key, leased) in enumerate(zip(keys, found, strict=True)):
                if leased is not None:
                    found[i] = None  # `_item` owns its slot: given back once, whatever happens
                    out[key] = self._item(key, *leased)
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
        lease_id, key, version = reply["lease"], reply["key"], reply["version"]
        self.conn.hold(lease_id, reply["oid"])
        try:
            descs = [TensorDesc.from_wire(w) for w in reply["tensors"]]
            lease = self.lease(lease_id, descs[0], reply, reader=True)
        except BaseException:
            self.conn.releases.put(lease_id)
            raise
        if not reply["bundle"]:
            return Tensor(key, version, descs[0], lease)
        return {t.name: Tensor(key, version, t, lease) for t in descs}

    def move(self, key: str, result: Item, want: str | None, copy: bool) -> Item:
        """`result` on the device `want` (see placement.move)."""
        return placement.move(self.devices, key, result, want, copy)

    def lease(self, lease_id: int, desc: TensorDesc, reply: dict[str, Any], reader: bool) -> Lease:
        """A lease over the memory `desc` names: a mapped segment, or an opened device chunk
        with the object's events (opened once per Client)."""
        if desc.device == "cpu":
            mapping = self.segments.get(desc.segment, populate=not reader)
            return Lease(lease_id, mapping, self.conn.releases)
        index, link = device_index(desc.device), self.devices
        chunk = link.chunk(index, desc.segment, reply["handle"])
        write = link.event(index, *reply["event"])
        read = link.event(index, *reply["done"]) if reader else None
        return DeviceLease(lease_id, chunk, self.conn.releases, link, write, read)

    # -- writing ---------------------------------------------------------------------------

    def write(
        self,
        label: str,
        value: Any,
        op: str,
        wait: float | None,
        device: Any = None,
        copy: bool = False,
        block: bool = True,
        **fields: Any,
    ) -> int | None:
        """Put `value` through `op` (a put, or a queue put with `queue` in `fields`): one
        copy, then the seal, after this client's earlier ones (Note [writes] in writes.py).
        The version, or None at once if not `block`. A small host put writes into a block
        granted ahead and seals it in one trip (Note [grants] in server/registry.py)."""
        plan = self.plan_write(label, value, device, copy, fields)
        if plan.grant is not None:
            return self.write_granted(plan, wait, block)
        return self.fill(plan, self.conn.call(op, wait=wait, **plan.request), block)

    def plan_write(
        self, label: str, value: Any, device: Any, copy: bool, fields: dict[str, Any]
    ) -> WritePlan:
        """What a put of `value` writes where, with a block granted ahead taken if it fits
        one (then `write_granted`; else the broker is asked with `plan.request`, and `fill`
        writes into what it answers). A plain NumPy array's plan is made once for its dtype
        and shape (`_plans`)."""
        plain = (value.dtype, value.shape) if type(value) is np.ndarray and device is None else None
        if plain is not None:
            known = self._plans.get(plain)
            if known is not None:
                dt, specs, offsets, size, tails = known
                plan = WritePlan(label, [("", value, dt)], "cpu", specs, False, fields)
                plan.offsets, plan.grant = offsets, self.writes.take_grant(size)
                plan.raw, plan.tails = True, tails
                return plan
        items, bundle = entries(label, value)
        target, items = placement.place(self.devices, label, items, device, copy)
        specs = [[name, dt.name, list(src.shape)] for name, src, dt in items]
        plan = WritePlan(label, items, target, specs, bundle, fields)
        if target == "cpu":
            plan.offsets, size, _ = layout([(n, dt.name, tuple(src.shape)) for n, src, dt in items])
            plan.grant = self.writes.take_grant(size)
            if plain is not None and items[0][1] is value:  # stored as it is (no view, no swap)
                if len(self._plans) >= PLAN_CACHE:
                    self._plans.clear()
                plan.raw = True
                plan.tails = {}  # its mailbox body tails, kept with the plan
                self._plans[plain] = (items[0][2], specs, plan.offsets, size, plan.tails)
        else:
            fields["device"] = target
        return plan

    def fill(self, plan: WritePlan, reply: dict[str, Any], block: bool) -> int | None:
        """Copy into the memory the broker gave the put (`reply`), then seal it (aborted if
        the copy fails)."""
        items, target, label, key = plan.items, plan.target, plan.label, plan.fields.get("key")
        put_id = reply["put"]
        self.conn.hold(put_id, reply["oid"])  # a broker that restarts keeps the put
        try:
            if target == "cpu":
                for (_, src, dt), wire in zip(items, reply["tensors"], strict=True):
                    assert isinstance(src, np.ndarray)  # placed on the host
                    dst = self._view(TensorDesc.from_wire(wire), dt.typestr)
                    self.copier.copy(dst, src)
            else:
                self._write_device(items, reply)
        except BaseException:
            with contextlib.suppress(BrokerError):
                self.conn.call(Op.ABORT, put=put_id)
            self.conn.forget(put_id)
            raise
        what = f"put {label!r}" if key is not None else f"put to queue {label!r}"
        sealed = self.writes.seal({"op": Op.SEAL, "put": put_id}, key, what, put_id, block)
        return None if sealed is None else int(sealed["version"])

    def write_granted(self, plan: WritePlan, wait: float | None, block: bool) -> int | None:
        """Copy into the block granted ahead and seal it in one trip (a bounded queue's item
        takes a slot credited ahead, asking for one if there is none left)."""
        grant, items, specs, fields = plan.grant, plan.items, plan.specs, plan.fields
        assert grant is not None
        queue = fields.get("queue")
        handing = queue is not None and self.bell is not None
        credited = False
        try:  # earlier errors first (read from the socket unless it may hand the item over)
            self.conn.check_usable(settle=False, poll=not handing)
            if queue is not None:
                credited = self.writes.take_credit(queue, fields.get("timeout"), wait)
            mapping = self.segments.get(grant.segment, populate=True)
            for (_, src, dt), offset in zip(items, plan.offsets, strict=True):
                assert isinstance(src, np.ndarray)  # placed on the host
                if plan.raw and src.flags.c_contiguous:
                    _shm.copy_in(mapping.address + grant.offset + offset, src)
                    continue
                dst = np.frombuffer(
                    mapping.mmap, np.dtype(dt.typestr), src.size, grant.offset + offset
                )
                self.copier.copy(dst.reshape(src.shape), src)
        except BaseException:
            self.writes.give_back(grant)
            if credited and queue is not None:
                self.writes.return_credit(queue)
            raise
        message = {"op": Op.WRITE, "put": grant.put, "tensors": specs, "bundle": plan.bundle}
        for name in ("key", "queue", "name", "evictable"):
            if name in fields:
                message[name] = fields[name]
        key = fields.get("key")
        label = f"put {key!r}" if key is not None else f"put to queue {fields.get('name')!r}"
        hand_over = None
        if handing and queue is not None:
            hand_over = functools.partial(self._hand_over, plan, grant, queue)
        sealed = self.writes.seal(message, key, label, grant.put, block, hand_over)
        return None if sealed is None else int(sealed["version"])

    def _hand_over(
        self, plan: WritePlan, grant: Grant, queue: int, message: dict[str, Any], last: int
    ) -> None:
        """Hand the item just written straight to a consumer waiting for it, if the broker
        offered a grant for `queue` (Note [direct handoff] in common/mailbox.py) once it had
        applied seal `last`, this client's last sent (so the items keep their order), and say
        so in its seal, `message`."""
        bell, mailboxes = self.bell, self.mailboxes
        if bell is None or mailboxes is None or bell.generation != self.conn.generation:
            return
        tail = plan.tail(grant.segment)
        done = hand_over(bell, mailboxes, queue, last, grant.oid, grant.put, grant.offset, tail)
        if done is not None:
            message[done[0]] = done[1]

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
            if self._still_held(reply):
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
        self.conn.hold(reply["lease"], reply["oid"])  # claimed again if the broker restarts
        self._kept.setdefault(line, collections.deque()).append(reply)

    def _still_held(self, reply: dict[str, Any]) -> bool:
        """Whether this client still holds the lease of a kept item: not if the broker
        restarted without the state (every lease lost: ids start again), or lost it."""
        return bool(self.conn.held.get(reply["lease"]) == reply["oid"])

    def forget_kept(self, line: tuple[int, int | None]) -> None:
        """The items kept for `line` (a subscription that ends) are let go."""
        kept = self._kept.pop(line, None)
        while kept:
            reply = kept.popleft()
            if self._still_held(reply):
                self.let_go(reply)

    def let_go(self, reply: dict[str, Any]) -> None:
        """An object answered to a get given up: its lease goes back (a watch told its key
        was deleted holds none)."""
        if "lease" in reply:
            self.conn.releases.put(reply["lease"])

    def _write_device(self, items: list[tuple[str, Source, DType]], reply: dict[str, Any]) -> None:
        """Enqueue the copies into device memory on the sources' streams and record the
        object's write event after them. No host wait, except to keep a failed copy from
        running on after its memory went back to the broker."""
        wires = [TensorDesc.from_wire(w) for w in reply["tensors"]]
        index, link = device_index(wires[0].device), self.devices
        chunk = link.chunk(index, wires[0].segment, reply["handle"])
        write = link.event(index, *reply["event"])
        streams: set[int] = set()
        try:
            for (_, src, dt), desc in zip(items, wires, strict=True):
                stream = STREAM_LEGACY if isinstance(src, np.ndarray) else src.stream
                link.copy(index, chunk.address + desc.offset, src, dt, stream)
                streams.add(stream)
            stream = link.record_after(index, write, streams)
        except BaseException:
            with contextlib.suppress(Exception):  # no copy may land once the memory is reused
                link.runtime("abort").synchronize(index)
            raise
        link.keep_until_done(index, stream, [src for _, src, _ in items])

    def _view(self, desc: TensorDesc, typestr: str) -> np.ndarray[Any, Any]:
        """A writable NumPy view of a tensor being put (the mapping is held by the cache)."""
        mapping = self.segments.get(desc.segment, populate=True)
        count = int(np.prod(desc.shape))
        flat = np.frombuffer(mapping.mmap, np.dtype(typestr), count, desc.offset)
        return flat.reshape(desc.shape)

    @contextlib.contextmanager
    def create(
        self,
        label: str,
        shape: Sequence[int],
        dtype: Any,
        device: Any,
        op: str,
        wait: float | None,
        **fields: Any,
    ) -> Iterator[Tensor]:
        """A writable Tensor over new memory (`op`: a put or a queue put), sealed when the
        block exits, aborted if it raises."""
        device = parse_device(device, f"create {label!r}")
        dt = lookup_dtype(dtype)
        specs = [["", dt.name, [int(d) for d in shape]]]
        if device != "cpu":
            fields["device"] = device
        reply = self.conn.call(op, wait=wait, tensors=specs, **fields)
        desc = TensorDesc.from_wire(reply["tensors"][0])
        self.conn.hold(reply["put"], reply["oid"])
        try:
            lease = self.lease(reply["put"], desc, reply, reader=False)
        except BaseException:
            self.conn.releases.put(reply["put"])  # ends the put: the broker aborts it
            raise
        buffer = Tensor(label, 0, desc, lease, writable=True)
        try:
            yield buffer
            if isinstance(lease, DeviceLease):  # readers wait for the writes enqueued so far
                self.devices.record_after(lease.device, lease.write, lease.streams)
        except BaseException:
            if isinstance(lease, DeviceLease):  # nothing may still write once it is reused
                with contextlib.suppress(Exception):
                    self.devices.runtime("abort").synchronize(lease.device)
            if not self.conn.closed:
                with contextlib.suppress(BrokerError):
                    self.conn.call(Op.ABORT, put=lease.id, keep=True)
            raise
        sealed = self.writes.seal(
            {"op": Op.SEAL, "put": lease.id, "keep": True}, fields.get("key"), label, None, True
        )
        assert sealed is not None
        buffer.version = sealed["version"]

    # -- closing ---------------------------------------------------------------------------

    def finish(self) -> None:
        """Before bye: the copies of this client's puts have run, so the objects hold them;
        read-done events of leases let go of are recorded; items kept for gets that will
        not come are let go."""
        for line in list(self._kept):
            self.forget_kept(line)
        with contextlib.suppress(Exception):
            self.devices.drain()
            self.devices.settle()

    def close(self) -> None:
        """Forget what was mapped and opened (each closes once no array uses it)."""
        self.writes.close()
        if self.directory is not None:
            self.directory.close()
            self.directory = None
        self.slots = None  # unmapped once no SlotLease holds it
        self.segments.clear()
        self.devices.clear()
        self.copier.close()
