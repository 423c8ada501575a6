"""A pull's reads (Transfers' half that reads): a version's bytes asked for in pieces, a window
of them under way, each read by this broker's mover, or pushed by its lender (Note [pushes]
in pushes.py), and looked at by the loop (`done`)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...common.cudart import device_index
from .mover import Mover, Read

CHUNK = 16 * 2**20  # a version's bytes are read in reads of this size at most (Reading)
WINDOW = 4  # reads of one Reading under way at most (Reading)
POPULATED = 2 * 2**20  # the granule of host memory known to be populated (`_unpopulated`)
# Lent host objects of at least this many bytes are pushed (Note [pushes] in pushes.py). A
# lone get here took as long either way from 96 MiB on; 40 MiB pushed took 15.0 ms against
# 14.1, 16 MiB 8.0 against 6.7 and 1 MiB 1.9 against 1.4 (medians of 12): a push's pieces
# go through both brokers' loops.
PUSH_MIN = 2 * CHUNK
INLINE = 64 * 2**10  # host objects of at most this many bytes lent with them (Note [inline])


@dataclass(slots=True)
class Reading:
    """A pull's reads of `size` bytes at `remote` in `node`'s memory into `local` in this
    broker's (`far`, `near`: their NIXL memory types and device ids), asked for in CHUNK
    reads, WINDOW of them under way at most: a relay lends a version it is still pulling,
    its first bytes read as it has them (Note [relays] in lending.py), and UCX moves the
    reads under way side by side, so that with all 32 reads of a 512 MiB version asked for
    at once, the first ended with 352 MiB of the others, 283 ms after it began, and the
    relay's borrower waited that long for its first bytes."""

    node: str
    remote: int
    local: int
    size: int
    far: tuple[str, int]
    near: tuple[str, int]
    asked: int = 0  # bytes asked for so far, from the first
    limit: int = 0  # bytes its source has (all, but for a relay's): asked for up to there
    reads: list[Read] = field(default_factory=list)
    failed: str | None = None  # why a read could not be asked for (no more are)
    push: bool = False  # its reads are pieces its source writes (Note [pushes] in pushes.py)
    inc: int | None = None  # the incarnation of its source's broker that lent it (pushes)

    def ended(self) -> bool:
        """Whether none of the reads asked for is under way."""
        return all(r.finished or r.error is not None for r in self.reads)

    def ready(self) -> int:
        """The bytes read, from the first to the first read not finished."""
        n = 0
        for r in self.reads:
            if not r.finished:
                break
            n += r.size
        return n


class Reads:
    """Reads into this broker's memory (Transfers: its agent, its memory and its peers; the
    pieces pushed, Pushes)."""

    agent: Any
    mover: Mover
    send: Callable[[str, dict[str, Any]], bool] | None
    _populated: set[int]

    def _place(self, obj: Any) -> tuple[int, str, int]:
        raise NotImplementedError

    def unknown(self, node: str) -> None:
        raise NotImplementedError

    def push(
        self, node: str, remote: int, local: int, size: int, inc: int | None = None
    ) -> Read | None:
        raise NotImplementedError

    def take(
        self, node: str, offer: dict[str, Any], obj: Any, lent: bool = False
    ) -> tuple[Reading, int]:
        """Start reading the bytes of `node`'s `offer` into StoredObject `obj`'s block: the
        reads, and their size. An offer of a relay still pulling its version says how many
        of its first bytes it has (`ready`): the others are read as it says (`extend`).
        `lent`: it was (Lending.lend): host memory is pushed (Note [pushes])."""
        size = min(int(offer["size"]), int(obj.nbytes))
        local, mine, index = self._place(obj)
        theirs = ("VRAM", device_index(offer["device"])) if "device" in offer else ("DRAM", 0)
        data = offer.get("data")
        if isinstance(data, bytes) and mine == "DRAM" and len(data) >= size:
            ctypes.memmove(local, data, size)  # (Note [inline]: no read)
            copied = [Read(node, None, None, size, finished=True)]
            reading = Reading(
                node, int(offer["address"]), local, size, theirs, (mine, index),
                asked=size, limit=size, reads=copied,
            )  # fmt: skip
            return reading, size
        ready = int(offer.get("ready", size))
        reading = Reading(node, int(offer["address"]), local, size, theirs, (mine, index))
        version = offer.get("agent_v")
        if isinstance(version, list) and version and isinstance(version[0], int):
            reading.inc = version[0]  # (none: not pushed, as no process could be named)
        reading.push = (
            lent and size >= PUSH_MIN and self.send is not None and theirs[0] == mine == "DRAM"
            and reading.inc is not None
        )  # fmt: skip
        self.extend(reading, ready)
        return reading, size

    def read(
        self, node: str, remote: int, local: int, size: int,
        far: tuple[str, int] = ("DRAM", 0), near: tuple[str, int] = ("DRAM", 0),
        ready: int | None = None,
    ) -> Reading:  # fmt: skip
        """Start reading `size` bytes at `remote` in `node`'s memory into `local` in ours
        (`far`, `near`: their NIXL memory types and device ids), the first `ready` of them
        (all if None) now."""
        reading = Reading(node, remote, local, size, far, near)
        self.extend(reading, size if ready is None else ready)
        return reading

    def extend(self, reading: Reading, ready: int) -> None:
        """Read the bytes of `reading` up to `ready` (its source has them) not asked for yet,
        in CHUNK reads, as the window lets (`done` asks for more as reads end)."""
        reading.limit = max(reading.limit, min(ready, reading.size))
        self._ask(reading)

    def _ask(self, reading: Reading) -> None:
        """Ask for the next reads, as the window lets; none once one failed. OSError only if
        not one read was asked for (else `failed` says why, for `done` to raise once the
        reads under way ended: NIXL may write into the block until then)."""
        if reading.failed is not None or any(r.error is not None for r in reading.reads):
            return
        under_way = sum(1 for r in reading.reads if not r.finished)
        while reading.asked < reading.limit and under_way < WINDOW:
            size = min(CHUNK, reading.limit - reading.asked)
            try:
                read = self._piece(reading, reading.asked, size)
            except OSError as exc:
                if not reading.reads:
                    raise
                reading.failed = str(exc)
                return
            if read is None:  # (a piece to push whose request could not go: asked again)
                return
            reading.reads.append(read)
            reading.asked += size
            under_way += 1

    def _piece(self, reading: Reading, start: int, size: int) -> Read | None:
        """Ask for `size` bytes of `reading` from `start`: pushed by its source (None if the
        request could not go now), or read by the mover (NIXL's descriptors made here, its
        transfer the mover's). OSError if it cannot be asked for."""
        if reading.push:  # (its pages not populated first: the first get of 512 MiB into new
            # memory took 421-491 ms populated on the loop, 471-478 not, 3 runs each)
            local = reading.local + start
            return self.push(reading.node, reading.remote + start, local, size, reading.inc)
        agent, near, far = self.agent, reading.near, reading.far
        try:
            mine = agent.get_xfer_descs([(reading.local + start, size, near[1])], near[0])
            theirs = agent.get_xfer_descs([(reading.remote + start, size, far[1])], far[0])
        except Exception as exc:  # NIXL's own errors
            why = f"NIXL could not describe a read from {reading.node!r}: {exc!r}"
            raise OSError(why) from None
        fill = self._unpopulated(reading.local + start, size) if near[0] == "DRAM" else 0
        return self.mover.start(reading.node, mine, theirs, size, fill)

    def _unpopulated(self, address: int, size: int) -> int:
        """`address`, if a read of `size` bytes there should populate its pages first (mover.py:
        `populate`), else 0: the POPULATED granules wholly inside it were populated before,
        in this broker's mapping, which keeps them (it never unmaps a segment before it
        stops, nor frees a segment's pages). On this VM, populating 512 MiB of a segment
        took 112 ms the first time in a mapping, and 22 ms of CPU each time again, for
        nothing: a 512 MiB weight-sync version costs each reader one such read."""
        first, end = -(-address // POPULATED), (address + size) // POPULATED
        granules = range(first, end)
        if granules and all(g in self._populated for g in granules):
            return 0
        self._populated.update(granules)
        return address

    def done(self, reading: Reading) -> bool:
        """Whether all of `reading` was read; OSError if a read of it failed (once none of its
        reads is under way: NIXL may write into the block until then). Reads that ended make
        room for the next ones (`extend`; NIXL's descriptors made here, its transfers the
        mover's)."""
        self._ask(reading)
        if not reading.ended():
            return False
        errors = [r.error for r in reading.reads if r.error is not None]  # (once ended: the
        if errors or reading.failed is not None:  # mover may fail the last one until then)
            if any(r.nixl_error for r in reading.reads):
                self.unknown(reading.node)
            raise OSError(errors[0] if errors else reading.failed)
        return reading.asked == reading.size
