"""The transfer of bytes into the broker, for keys and queues alike: the copy of a put into
the broker's memory, and in-place writes (`create`). The Tensors of a get, with their leases,
are reads.py's.

It owns what a client has opened: the segment cache (host shared memory), the `DeviceLink`
(CUDA handles, events and streams) and the copier of large host puts, and the two sides that
use them, the seals of its puts (`Writes`) and its reads (`Reads`). It talks to the broker
only through its `Connection`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..common import _shm
from ..common.cudart import STREAM_LEGACY, device_index, parse_device
from ..common.descriptors import DEVICE_ALIGN, TensorDesc, layout
from ..common.dtypes import DType
from ..common.dtypes import dtype as lookup_dtype
from ..common.errors import BrokerError, BrokerUnavailable, CapacityError
from ..common.protocol import Op
from . import placement
from .ahead import Grant
from .connection import Connection
from .copy import Copier
from .cuda import DeviceLink
from .handoff import hand_over
from .plans import PLAN_CACHE, WritePlan
from .reads import Reads
from .shm import SegmentCache
from .sources import Source, entries
from .tensor import DeviceLease, Tensor
from .writes import Writes


class PutNotKept(BrokerUnavailable):
    """The memory a put was given came from a broker that died, and the one after it does
    not keep it (Leases.hold_put): nothing was written; the put asks again."""


class Transfer:
    """A client's puts, and the owner of what its puts and reads use (see above)."""

    def __init__(self, conn: Connection, devices: DeviceLink) -> None:
        self.conn = conn
        self.devices = devices
        self.segments = SegmentCache()
        self.writes = Writes(conn)
        self.copier = Copier()
        # Plans of plain NumPy puts: (dtype, shape) -> its DType, specs, offsets, block size.
        self._plans: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.reads = Reads(conn, devices, self.segments)

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
        granted ahead and seals it in one trip (Note [grants] in server/store/grants.py)."""
        plan = self.plan_write(label, value, device, copy, fields)
        if plan.grant is not None:
            return self.write_granted(plan, wait, block)
        while True:
            epoch = self.conn.leases.epoch
            try:
                return self.fill(plan, self.ask_memory(op, wait, **plan.request), block, epoch)
            except PutNotKept:  # asked of a broker that died: now of the one after it
                continue

    def ask_memory(
        self, op: str, wait: float | None, late: Callable[[dict[str, Any]], None] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:  # fmt: skip
        """The broker's answer to `op`, a put that asks it for memory. Refused for room while
        this client holds blocks granted ahead there, it lets them go and asks once more
        (their releases go first, with the request: Note [grants] in server/store/grants.py)."""
        try:
            return self.conn.call(op, wait=wait, late=late, **fields)
        except CapacityError:
            if not self.writes.ahead.drop_grants(fields.get("device", "cpu")):
                raise
        return self.conn.call(op, wait=wait, late=late, **fields)

    def plan_write(
        self, label: str, value: Any, device: Any, copy: bool, fields: dict[str, Any],
        grant: bool = True,
    ) -> WritePlan:  # fmt: skip
        """What a put of `value` writes where, with a block granted ahead taken if it fits
        one and `grant` (then `write_granted`; else the broker is asked with `plan.request`,
        and `fill` writes into what it answers). A plain NumPy array's plan is made once for
        its dtype and shape (`_plans`)."""
        plain = (value.dtype, value.shape) if type(value) is np.ndarray and device is None else None
        if plain is not None:
            known = self._plans.get(plain)
            if known is not None:
                dt, specs, offsets, size, tails = known
                plan = WritePlan(label, [("", value, dt)], "cpu", specs, False, fields)
                plan.offsets, plan.size = offsets, size
                plan.grant = self.writes.ahead.take_grant(size) if grant else None
                plan.raw, plan.tails = True, tails
                return plan
        items, bundle = entries(label, value)
        target, items = placement.place(self.devices, label, items, device, copy)
        specs = [[name, dt.name, list(src.shape)] for name, src, dt in items]
        plan = WritePlan(label, items, target, specs, bundle, fields)
        if target == "cpu":
            plan.offsets, size, _ = layout([(n, dt.name, tuple(src.shape)) for n, src, dt in items])
            plan.size = size
            plan.grant = self.writes.ahead.take_grant(size) if grant else None
            if plain is not None and items[0][1] is value:  # stored as it is (no view, no swap)
                if len(self._plans) >= PLAN_CACHE:
                    self._plans.clear()
                plan.raw = True
                plan.tails = {}  # its mailbox body tails, kept with the plan
                self._plans[plain] = (items[0][2], specs, plan.offsets, size, plan.tails)
        else:
            fields["device"] = target
            if grant and "queue" not in fields:  # (a queue's device items ask, Note [grants])
                shapes = [(n, dt.name, tuple(src.shape)) for n, src, dt in items]
                plan.offsets, plan.size, _ = layout(shapes, DEVICE_ALIGN)
                plan.grant = self.writes.ahead.take_grant(plan.size, target)
        return plan

    def fill(self, plan: WritePlan, reply: dict[str, Any], block: bool, epoch: int) -> int | None:
        """Copy into the memory the broker gave the put (`reply`, to a request sent at
        `epoch`: Leases.hold_put), then seal it (aborted if the copy fails)."""
        items, target, label, key = plan.items, plan.target, plan.label, plan.fields.get("key")
        put_id = reply["put"]
        self._hold_put(put_id, reply["oid"], label, epoch)  # a broker that restarts keeps it
        try:
            if target == "cpu":
                pairs = []
                for (_, src, dt), wire in zip(items, reply["tensors"], strict=True):
                    assert isinstance(src, np.ndarray)  # placed on the host
                    pairs.append((self._view(TensorDesc.from_wire(wire), dt.typestr), src))
                self.copier.copy_all(pairs)
            else:
                self._write_device(items, reply)
        except BaseException:
            with contextlib.suppress(BrokerError):
                self.conn.call(Op.ABORT, put=put_id)
            self.conn.leases.forget(put_id)
            raise
        what = f"put {label!r}" if key is not None else f"put to queue {label!r}"
        seal = {"op": Op.SEAL, "put": put_id, **({} if key is not None else {"item": True})}
        sealed = self.writes.seal(seal, key, what, put_id, block)
        return None if sealed is None else int(sealed["version"])

    def _hold_put(self, put: int, oid: int, label: str, epoch: int) -> None:
        if not self.conn.leases.hold_put(put, oid, epoch):
            raise PutNotKept(
                f"the broker at {self.conn.address} restarted while {label!r} was being "
                "put, and does not keep the memory the one before gave it: nothing was "
                "stored; put it again"
            )

    def write_granted(self, plan: WritePlan, wait: float | None, block: bool) -> int | None:
        """Copy into the block granted ahead and seal it in one trip (a bounded queue's item
        takes a slot credited ahead, asking for one if there is none left)."""
        grant, items, fields = plan.grant, plan.items, plan.fields
        assert grant is not None
        if grant.device != "cpu":
            return self._write_granted_device(plan, grant, block)
        queue = fields.get("queue")
        handing = queue is not None and self.reads.bell is not None
        credited = False
        try:  # earlier errors first (read from the socket unless it may hand the item over)
            self.conn.check_usable(settle=False, poll=not handing)
            if queue is not None:
                credited = self.writes.ahead.take_credit(queue, fields.get("timeout"), wait)
            mapping = self.segments.get(grant.segment)
            mapping.writing(grant.size)
            pairs = []
            for (_, src, dt), offset in zip(items, plan.offsets, strict=True):
                assert isinstance(src, np.ndarray)  # placed on the host
                if plan.raw and src.flags.c_contiguous:
                    _shm.copy_in(mapping.address + grant.offset + offset, src)
                    continue
                dst = np.frombuffer(
                    mapping.mmap, np.dtype(dt.typestr), src.size, grant.offset + offset
                )
                pairs.append((dst.reshape(src.shape), src))
            self.copier.copy_all(pairs)
        except BaseException:
            self.writes.ahead.give_back(grant)
            if credited and queue is not None:
                self.writes.ahead.return_credit(queue)
            raise
        message, key, label = self._write_message(plan, grant)
        hand_over = None
        if handing and queue is not None:
            hand_over = functools.partial(self._hand_over, plan, grant, queue)
        sealed = self.writes.seal(message, key, label, grant.put, block, hand_over)
        return None if sealed is None else int(sealed["version"])

    def _write_granted_device(self, plan: WritePlan, grant: Grant, block: bool) -> int | None:
        """Copy into a device's block granted ahead and seal it in one message: one copy
        and no trip before it (Note [grants] in server/store/grants.py)."""
        try:
            self.conn.check_usable(settle=False)
            offsets = [grant.offset + o for o in plan.offsets]
            self._copy_to_device(plan.items, grant.device, grant.segment, grant.handle,
                                 grant.event, offsets)  # fmt: skip
        except BaseException:  # (no copy of it runs on: _copy_to_device waited for that)
            self.writes.ahead.give_back(grant)
            raise
        message, key, label = self._write_message(plan, grant)
        sealed = self.writes.seal(message, key, label, grant.put, block)
        return None if sealed is None else int(sealed["version"])

    def _write_message(self, plan: WritePlan, grant: Grant) -> tuple[dict[str, Any], Any, str]:
        """The `write` of a block granted ahead, its key (None: a queue item's) and label."""
        fields = plan.fields
        message = {"op": Op.WRITE, "put": grant.put, "tensors": plan.specs, "bundle": plan.bundle}
        for name in ("key", "queue", "name", "evictable"):
            if name in fields:
                message[name] = fields[name]
        key = fields.get("key")
        label = f"put {key!r}" if key is not None else f"put to queue {fields.get('name')!r}"
        return message, key, label

    def _hand_over(
        self, plan: WritePlan, grant: Grant, queue: int, message: dict[str, Any], last: int
    ) -> None:
        """Hand the item just written straight to a consumer waiting for it, if the broker
        offered a grant for `queue` (Note [direct handoff] in common/mailbox.py) once it had
        applied seal `last`, this client's last sent (so the items keep their order), and say
        so in its seal, `message`."""
        bell, mailboxes = self.reads.bell, self.reads.mailboxes
        if bell is None or mailboxes is None or bell.generation != self.conn.generation:
            return
        tail = plan.tail(grant.segment)
        done = hand_over(bell, mailboxes, queue, last, grant.oid, grant.put, grant.offset, tail)
        if done is not None:
            message[done[0]] = done[1]

    def _write_device(self, items: list[tuple[str, Source, DType]], reply: dict[str, Any]) -> None:
        """Enqueue the copies into device memory on the sources' streams and record the
        object's write event after them. No host wait, except to keep a failed copy from
        running on after its memory went back to the broker."""
        wires = [TensorDesc.from_wire(w) for w in reply["tensors"]]
        offsets = [desc.offset for desc in wires]
        self._copy_to_device(items, wires[0].device, wires[0].segment, reply["handle"],
                             reply["event"], offsets)  # fmt: skip

    def _copy_to_device(
        self, items: list[tuple[str, Source, DType]], device: str, segment: str, handle: bytes,
        event: Any, offsets: list[int],
    ) -> None:  # fmt: skip
        """Copy `items` to `offsets` in a chunk of `device` (opened once from `handle`) on
        their streams, then record write `event` after them."""
        index, link = device_index(device), self.devices
        chunk = link.chunk(index, segment, handle)
        write = link.event(index, *event)
        copies = [
            (chunk.address + offset, src, dt,
             STREAM_LEGACY if isinstance(src, np.ndarray) else src.stream)
            for (_, src, dt), offset in zip(items, offsets, strict=True)
        ]  # fmt: skip
        try:
            link.copy(index, copies)
            stream = link.record_after(index, write, {c[3] for c in copies})
        except BaseException:
            with contextlib.suppress(Exception):  # no copy may land once the memory is reused
                link.runtime("abort").synchronize(index)
            raise
        link.keep_until_done(index, stream, [src for _, src, _ in items])

    def _view(self, desc: TensorDesc, typestr: str) -> np.ndarray[Any, Any]:
        """A writable NumPy view of a tensor being put (the mapping is held by the cache)."""
        mapping = self.segments.get(desc.segment)
        count = int(np.prod(desc.shape))
        flat = np.frombuffer(mapping.mmap, np.dtype(typestr), count, desc.offset)
        mapping.writing(flat.nbytes)
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
        late: Callable[[dict[str, Any]], None] | None = None,
        **fields: Any,
    ) -> Iterator[Tensor]:
        """A writable Tensor over new memory (`op`: a put or a queue put), sealed when the
        block exits, aborted if it raises; `late`: as `Connection.call`'s."""
        device = parse_device(device, f"create {label!r}")
        dt = lookup_dtype(dtype)
        specs = [["", dt.name, [int(d) for d in shape]]]
        if device != "cpu":
            fields["device"] = device
        epoch = self.conn.leases.epoch
        reply = self.ask_memory(op, wait, late, tensors=specs, **fields)
        desc = TensorDesc.from_wire(reply["tensors"][0])
        self._hold_put(reply["put"], reply["oid"], label, epoch)
        try:
            lease = self.reads.lease(reply["put"], desc, reply, reader=False)
        except BaseException:
            self.conn.leases.releases.put(reply["put"])  # ends the put: the broker aborts it
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
        seal = {"op": Op.SEAL, "put": lease.id, "keep": True}
        if fields.get("key") is None:
            seal["item"] = True  # (a queue item: Adoption.sealed_before)
        sealed = self.writes.seal(seal, fields.get("key"), label, None, True)
        assert sealed is not None
        buffer.version = sealed["version"]

    # -- closing ---------------------------------------------------------------------------

    def finish(self) -> None:
        """Before bye: the copies of this client's puts have run, so the objects hold them;
        read-done events of leases let go of are recorded; items kept for gets that will
        not come are let go."""
        self.reads.finish()
        with contextlib.suppress(Exception):
            self.devices.drain()
            self.devices.settle()

    def close(self) -> None:
        """Forget what was mapped and opened (each closes once no array uses it)."""
        self.writes.close()
        self.reads.close()
        self.segments.clear()
        self.devices.clear()
        self.copier.close()
