"""Blocks granted ahead, so that a small put takes one trip: how many each client holds of
each size class, and how many are out.

Note [grants]

A small put would take two round trips, one for its memory and one for its seal. So the
broker grants each writing client blocks ahead, per size class (a page to 1 MiB by powers
of two, `grant_class`): a pending put with no key yet (`StoredObject.granted`), held by the
client as a put lease, journaled like any put. The client lays its tensors out in a block
of the class that fits (`layout`, which both ends compute alike), copies, and sends one
`write` naming the block; the broker checks that the block is that client's grant and
that the layout fits, then seals it as any put. Once the batch's replies are out, the
broker tops the client's grants of that class back up to `grant_depth` and sends them in a
message of their own (id 0, on the socket of the write), which the client reads with its
next reply: refills cost no trip, and are not on the writer's path. Grants are real allocations
(they count in `stats()["granted_bytes"]` and never let the arena go past its capacity),
and are made only while a quarter of the arena stays free: a put that finds no grant asks
for its block as before. A client that dies, closes, or loses its broker lets them go
like any unsealed put. A put the broker has no room for is asked again once its client let
go of the grants it holds there (client/transfer.py, `ask_memory`: the releases go first,
with the request), and grants are cut from the top of a free block (`Arena.allocate`,
high), so that the room they leave joins the rest: a client that made small puts then
fills the arena with 4 MiB objects fits 128 in 512 MiB, not 126 (issue 48). Another
client's grants are not taken back: it may be copying into one (at most GRANT_AHEAD_BYTES
a class, and none made once three quarters of the arena is used).

A GPU put is granted blocks of its device the same way (issue 36: a trip before the copy
cost a 1 GiB device put a fifth of a device-to-device copy's bandwidth). A device grant
carries its chunk's IPC handle and the write event the client records after its copy
(Note [device handoff] in client/cuda.py); its classes reach 4 GiB, finer above 1 MiB
(`grant_class`), and a client holds about DEVICE_AHEAD_BYTES of a class, at least one
block, and never more than an eighth of the device's arena in all (grants are memory no one
else may use, and the broker cannot take one back: its client may be copying into it). A
chunk that cannot be made (cudaMalloc failed) ends the grants, never the request or the
loop. A GPU object is lent to another node only once its write event completed (lending.py).
Device grants are not journaled (device memory does not outlive its broker), and a
queue's device items still ask for their block (a direct handoff of one is refused).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...common.descriptors import DEVICE_ALIGN, MIN_ALIGN, PAGE, Shapes, laid_out, layout
from ...common.errors import InvalidRequest
from .arena import Arena, Block, Growing
from .devices import DeviceMemory
from .records import Session, StoredObject
from .segments import ShmExhausted

log = logging.getLogger(__name__)

GRANT_AHEAD_BYTES = 1 << 20  # a client is granted about this much of one size class ahead,
GRANT_DEPTH = (2, 8)  # and at least 2 blocks of it, at most 8
DEVICE_AHEAD_BYTES = 256 << 20  # on a device: this much, at least 1 block and at most 8,
DEVICE_GRANT_SHARE = 8  # and no client holds more than 1/8 of a device's arena in grants
GRANT_FREE_SHARE = 4  # grants ahead only while more than 1/4 of the arena stays free


def grant_depth(size_class: int, device: bool = False) -> int:
    """Blocks of `size_class` a client is granted ahead, on the host or a device."""
    if device:
        return max(1, min(GRANT_DEPTH[1], DEVICE_AHEAD_BYTES // size_class))
    return max(GRANT_DEPTH[0], min(GRANT_DEPTH[1], GRANT_AHEAD_BYTES // size_class))


class Grants:
    """The blocks of `arena` (the host's, or `device`'s) granted ahead: `bytes` and `blocks`
    out, and each session's count per size class (`Session.grants`, by `class_key`). The
    registry holds each block as a pending put."""

    def __init__(self, arena: Arena, device: str = "cpu", align: int = MIN_ALIGN) -> None:
        self.arena, self.device, self.align = arena, device, align
        self.bytes = self.blocks = 0

    def class_key(self, size_class: int) -> Any:
        """A size class's key in `Session.grants`: the class, or (device, class)."""
        return size_class if self.device == "cpu" else (self.device, size_class)

    def take(self, session: Session, size_class: int) -> list[Block]:
        """Blocks of `size_class` bytes for `session`, up to its depth: fewer, or none, once
        the arena is three quarters full, once a device's would hold more than an eighth of
        it for `session`, or once a new segment cannot be made (ShmExhausted, a failed
        cudaMalloc: grants are a shortcut, never an error)."""
        key = self.class_key(size_class)
        have = session.grants.get(key, 0)
        out: list[Block] = []
        arena, device = self.arena, self.device != "cpu"
        held = self.held(session) if device else 0
        for _ in range(grant_depth(size_class, device) - have):
            if arena.free_bytes - size_class < arena.capacity // GRANT_FREE_SHARE:
                break
            if device and held + size_class > arena.capacity // DEVICE_GRANT_SHARE:
                break
            try:  # (host memory grows on a thread: Note [growing] in arena.py)
                block = arena.allocate(size_class, PAGE, high=True, wait=not device)
            except Growing:  # (granted once it has grown: the next top-up)
                break
            except Exception as exc:  # (the blocks taken so far stay granted)
                log.info("no more grants of %d bytes on %s: %s", size_class, self.device, exc)
                break
            if block is None:
                break
            out.append(block)
            held += size_class
        if out:
            session.grants[key] = have + len(out)
            self.bytes += size_class * len(out)
            self.blocks += len(out)
        return out

    def held(self, session: Session) -> int:
        """The bytes of this device's blocks granted to `session`, not yet written."""
        grants = session.grants.items()
        return sum(k[1] * n for k, n in grants if isinstance(k, tuple) and k[0] == self.device)

    def give_back(self, session: Session, block: Block) -> None:
        """A block `take` gave that could not be made a pending put: freed, ungranted."""
        session.grants[self.class_key(block.size)] -= 1
        self.bytes -= block.size
        self.blocks -= 1
        self.arena.free(block)

    def carry(self, session: Session, obj: StoredObject) -> None:
        """A block a broker that died granted `session`, granted again (adoption.py)."""
        obj.granted = True
        size, key = obj.block.size, self.class_key(obj.block.size)
        session.grants[key] = session.grants.get(key, 0) + 1
        self.bytes += size
        self.blocks += 1

    def fill(
        self,
        session: Session,
        put_id: int,
        obj: StoredObject,
        key: str,
        specs: list[tuple[str, str, tuple[int, ...]]],
        bundle: bool,
        shapes: Shapes,
    ) -> None:
        """`obj`, the pending put `put_id` of `session`, written: no longer a grant but a put
        of `key` laid out as `specs`. InvalidRequest if it was no grant or they do not fit."""
        if not obj.granted:
            raise InvalidRequest(f"write {key!r}: put {put_id} is not a block granted ahead")
        if not bundle and (len(specs) != 1 or specs[0][0] != ""):
            raise InvalidRequest(f"write {key!r}: a plain object holds one unnamed tensor")
        offsets, size, _ = layout(specs, self.align)
        if size > obj.block.size:
            raise InvalidRequest(
                f"write {key!r}: its tensors take {size} bytes, and block {put_id} has "
                f"{obj.block.size}"
            )
        self.ungrant(session, obj)
        obj.key, obj.bundle = key, bundle
        block = obj.block
        obj.wire = laid_out(specs, offsets, block.segment, block.offset, self.device, shapes)

    def ungrant(self, session: Session, obj: StoredObject) -> None:
        """`obj` is no longer a grant (written, aborted, or let go)."""
        if obj.granted:
            obj.granted = False
            session.grants[self.class_key(obj.block.size)] -= 1
            self.bytes -= obj.block.size
            self.blocks -= 1


class GrantBook:
    """The blocks granted ahead on the host (`host`) and on each device (`of`); `open_put`
    makes each a pending put of its session (Registry._open_put)."""

    def __init__(
        self, arena: Arena, devices: DeviceMemory, open_put: Callable[[Session, StoredObject], int]
    ) -> None:
        self.host, self.devices, self._open_put = Grants(arena), devices, open_put
        self._devices: dict[str, Grants] = {}  # device -> its blocks granted ahead

    def of(self, device: str) -> Grants:
        """The blocks granted ahead on `device` ('cpu': the host's)."""
        if device == "cpu":
            return self.host
        grants = self._devices.get(device)
        if grants is None:
            arena = self.devices.arena(device)  # (InvalidRequest if it is not served)
            grants = self._devices[device] = Grants(arena, device, DEVICE_ALIGN)
        return grants

    @property
    def blocks(self) -> int:
        return self.host.blocks + sum(g.blocks for g in self._devices.values())

    def grant(self, session: Session, size_class: int, device: str = "cpu") -> list[list[Any]]:
        """Blocks of `size_class` bytes on `device` granted ahead to `session`: [[put id,
        object id, segment, offset, size], ...], and for a device's [..., device, its chunk's
        IPC handle, [write event, its IPC handle]]."""
        out, grants = [], self.of(device)
        blocks = grants.take(session, size_class)
        for i, block in enumerate(blocks):
            obj = StoredObject("", False, block, (), granted=True, device=device)
            try:
                put_id = self._open_put(session, obj)
            except ShmExhausted as exc:  # no event for it: nothing of it registered yet
                log.warning("no grant of %d bytes on %s: %s", block.size, device, exc)
                for left in blocks[i:]:
                    grants.give_back(session, left)
                break
            entry = [put_id, obj.oid, block.segment, block.offset, block.size]
            if obj.events is not None:
                write, arena = obj.events[0], self.devices.arena(device)
                entry += [device, arena.handle(block.segment), [write, self.devices.handle(write)]]
            out.append(entry)
        return out

    def device_stats(self) -> dict[str, dict[str, Any]]:
        """Each device's figures (DeviceMemory.stats), its blocks granted ahead apart."""
        out = self.devices.stats()
        for device, grants in self._devices.items():
            if device in out:
                out[device]["used_bytes"] -= grants.bytes
                out[device]["granted_bytes"] = grants.bytes
        return out
