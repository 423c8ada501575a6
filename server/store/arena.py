"""Best-fit allocator handing out blocks of broker-owned shared-memory segments.

Segments are created lazily, in chunks, and are never shrunk: freed space goes back to the
free list and is only returned to the system by ``Arena.close()``.

Note [growing]

A new segment's pages are all backed when it is made (posix_fallocate: a lazily-filled
tmpfs would SIGBUS clients later), and backing them costs time: 512 MiB took about 160 ms
on this 2-core VM, during which a broker that made it on its loop answered nothing
(another process's `exists` waited 156-158 ms). A put's allocation asks to `wait`: the
segment it needs is made on a thread of its own (one at a time), `allocate` raises
Growing, the put waits in the parking lot (objects.py), and the loop takes the segment in
(journaled, and registered with NIXL in a cluster, on the loop) once `grown()` says it is
made, then asks again for the puts that waited, in their order. If it could not be made,
they ask again too, and one that still needs a new segment fails with that error
(`after`), not a growth more. A pull of another node's version waits the same way,
holding its loan (pulls.py: a first pull of 512 MiB stalled a reader's loop 161-166 ms
here). Grants ahead (grants.py) take no block that needs a new segment meanwhile (the
client asks again later). Queue items, and items lent from other nodes, still make a
segment they need at once; one that does not fit while a segment is being made waits for
that one on the loop first (as all did before), rather than count it against the
capacity.
"""

from __future__ import annotations

import contextlib
import logging
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ...common.config import round_up
from .segments import Growth, Segment

logger = logging.getLogger(__name__)

_GRAIN = 64  # reserved sizes and the minimum alignment
_HUGE = 2 * 2**20  # new segments are at least this big and a multiple of it


@dataclass(frozen=True, slots=True)
class Block:
    """A reserved byte range of one segment; ``offset`` is a multiple of the requested alignment."""

    segment: str
    offset: int
    size: int


class Growing(Exception):
    """An allocation that asked to `wait` needs a new segment, which is being made on a thread
    (Note [growing]): ask again once `Arena.grown()` took `growth` in (`growth.over`)."""

    def __init__(self, growth: Growth) -> None:
        super().__init__(f"a segment of {growth.size} bytes is being made")
        self.growth = growth


class Arena:
    """Best-fit allocator over up to ``capacity`` bytes of shared-memory segments.

    Free blocks live in a list sorted by (size, segment index, offset), searched with bisect,
    plus dicts keyed by (segment index, start) and (segment index, end) for O(1) coalescing.
    Segments are never shrunk or unlinked before ``close()``.
    """

    def __init__(
        self,
        capacity: int,
        *,
        shm_dir: str = "/dev/shm",
        prefix: str = "tb-0-",
        chunk_size: int = 256 * 2**20,
        on_segment: Callable[[Segment], None] = lambda segment: None,
        group: int | None = None,
    ) -> None:
        """`group`: a group whose members may map the segments too (serve --group)."""
        self._group = group
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 byte, got {capacity}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 byte, got {chunk_size}")
        self._capacity = capacity
        self._shm_dir = shm_dir
        self._prefix = prefix
        self._on_segment = on_segment  # told of each new segment (the journal)
        self._chunk_size = round_up(chunk_size, _GRAIN)
        self._segments: list[Segment] = []
        self._seg_index: dict[str, int] = {}
        self._free: list[tuple[int, int, int]] = []  # (size, segment index, start), sorted
        self._free_by_start: dict[tuple[int, int], int] = {}  # (segment, start) -> size
        self._free_by_end: dict[tuple[int, int], int] = {}  # (segment, end) -> start
        self._allocated: set[Block] = set()
        self._reserved = 0
        self._used = 0
        self._closed = False
        self._growth: Growth | None = None  # a segment being made on a thread (`wait`)
        self._ended: Growth | None = None  # one that ended since `grown` last said
        self._failed: Exception | None = None  # (`after`)

    # -- free list ---------------------------------------------------------------------------

    def _add_free(self, seg: int, start: int, size: int) -> None:
        insort(self._free, (size, seg, start))
        self._free_by_start[seg, start] = size
        self._free_by_end[seg, start + size] = start

    def _remove_free(self, seg: int, start: int, size: int) -> None:
        i = bisect_left(self._free, (size, seg, start))
        del self._free[i]
        del self._free_by_start[seg, start]
        del self._free_by_end[seg, start + size]

    def _best_fit(self, need: int, align: int) -> tuple[int, int, int] | None:
        # At align 64 the first candidate always fits (all free starts are multiples of 64).
        for i in range(bisect_left(self._free, (need, -1, -1)), len(self._free)):
            size, seg, start = self._free[i]
            if round_up(start, align) - start + need <= size:
                return size, seg, start
        return None

    def _growth_size(self, need: int, align: int) -> int:
        """The size of the segment to add for `need` bytes at `align`; 0 if it cannot fit
        (none is being made: `allocate` waits for it, or raises Growing, first)."""
        room = (self._capacity - self._reserved) // _GRAIN * _GRAIN
        size = min(max(self._chunk_size, round_up(need + align, _HUGE)), room)
        return size if size >= need else 0

    def _take(self, segment: Segment) -> None:
        """A new segment of this arena's, all of it free."""
        self._on_segment(segment)
        self._add_segment(segment, [])

    def _add_segment(self, segment: Segment, blocks: Iterable[Block]) -> None:
        """Take `segment` in, `blocks` of it allocated and the rest free."""
        seg = self._seg_index[segment.name] = len(self._segments)
        self._segments.append(segment)
        self._reserved += segment.size
        end = 0
        for block in sorted(blocks, key=lambda b: b.offset):
            if block.offset < end or block.offset + block.size > segment.size:
                raise ValueError(f"{block} overlaps another or lies outside {segment}")
            if block.offset > end:
                self._add_free(seg, end, block.offset - end)
            self._allocated.add(block)
            self._used += block.size
            end = block.offset + block.size
        if segment.size > end:
            self._add_free(seg, end, segment.size - end)

    def adopt(self, segments: list[Segment], blocks: Iterable[Block]) -> None:
        """Take over the segments of a broker that died, with the blocks its objects hold
        (Note [recovery] in state.py); the rest of them is free."""
        by_segment: dict[str, list[Block]] = {s.name: [] for s in segments}
        for block in blocks:
            by_segment[block.segment].append(block)
        for segment in segments:
            self._add_segment(segment, by_segment[segment.name])

    def _new_segment(self, size: int) -> Segment:
        """Back `size` more bytes (a subclass may back them elsewhere: see DeviceArena)."""
        return Segment.create(self._shm_dir, self._prefix, size, self._group)

    # -- public API --------------------------------------------------------------------------

    def allocate(
        self, size: int, align: int = 64, high: bool = False, wait: bool = False
    ) -> Block | None:
        """Reserve ``size`` bytes at an ``align``-aligned offset; None if capacity is exceeded.
        ``high``: at the top of the free block it is cut from, not the bottom (blocks granted
        ahead: freed when a large put needs their room, they leave no hole in the middle).
        ``wait``: a new segment it needs is made on a thread, not here, and Growing raised
        (Note [growing]); also while another is being made. Without it, one that does not
        fit while a segment is being made waits for that one first.

        Raises ShmExhausted when the tmpfs cannot back a needed new segment.
        """
        if self._closed:
            raise ValueError("arena is closed")
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if align < _GRAIN or align & (align - 1):
            raise ValueError(f"align must be a power of two >= {_GRAIN}, got {align}")
        need = round_up(max(size, 1), _GRAIN)
        if need > self._capacity - self._used:
            return None
        found = self._best_fit(need, align)
        if found is None and not wait and self._growth is not None:
            # (one made now would count that one against the capacity: it may hold this)
            self._growth.join()
            self._settle()
            found = self._best_fit(need, align)
        if found is None:
            if wait and self._growth is not None:  # (it may hold this one too)
                raise Growing(self._growth)
            grow = self._growth_size(need, align)
            if not grow:
                return None
            if wait and self._failed is not None:
                raise self._failed
            if wait:
                self._growth = Growth(self._new_segment, grow)
                raise Growing(self._growth)
            self._take(self._new_segment(grow))
            found = self._best_fit(need, align)
            if found is None:  # pragma: no cover - a fresh segment always fits
                raise RuntimeError("new segment cannot hold the request")
        free_size, seg, free_start = found
        self._remove_free(seg, free_start, free_size)
        start = round_up(free_start, align)
        if high:
            start = (free_start + free_size - need) // align * align  # (>= the bottom's)
        if start > free_start:
            self._add_free(seg, free_start, start - free_start)
        tail = free_start + free_size - (start + need)
        if tail > 0:
            self._add_free(seg, start + need, tail)
        block = Block(self._segments[seg].name, start, need)
        self._allocated.add(block)
        self._used += need
        return block

    @property
    def growing(self) -> bool:
        """A segment is being made on a thread (`allocate`'s `wait`)."""
        return self._growth is not None

    @contextlib.contextmanager
    def after(self, growth: Growth) -> Iterator[None]:
        """While the allocations that waited for `growth` try again: if it failed, one that
        would grow raises its error instead (not a growth more, failing as that one did)."""
        self._failed = growth.error
        try:
            yield
        finally:
            self._failed = None

    def grown(self) -> Growth | None:
        """The growth that ended since the last call, its segment taken in, or its `error`
        (also if taking it in failed: journaling it, registering it with NIXL); None if
        none did."""
        if self._growth is not None and self._growth.done:
            self._settle()
        growth, self._ended = self._ended, None
        return growth

    def _settle(self) -> None:
        """Take in the segment made on the thread, which ended (`grown` says so next)."""
        growth = self._growth
        assert growth is not None and growth.done
        self._growth, self._ended, growth.over = None, growth, True
        if growth.segment is not None:
            try:
                self._take(growth.segment)
            except Exception as exc:
                logger.exception("could not take in new segment %s", growth.segment.path)
                growth.segment.unlink()
                growth.segment, growth.error = None, exc

    def free(self, block: Block) -> None:
        """Return ``block`` and merge it with free neighbours in the same segment."""
        if block not in self._allocated:
            raise ValueError(f"{block} is not allocated here (double free or foreign block)")
        self._allocated.remove(block)
        self._used -= block.size
        seg = self._seg_index[block.segment]
        start, end = block.offset, block.offset + block.size
        prev_start = self._free_by_end.get((seg, start))
        if prev_start is not None:
            self._remove_free(seg, prev_start, start - prev_start)
            start = prev_start
        next_size = self._free_by_start.get((seg, end))
        if next_size is not None:
            self._remove_free(seg, end, next_size)
            end += next_size
        self._add_free(seg, start, end - start)

    def close(self, unlink: bool = True) -> None:
        """Unlink every segment (unless the state is kept for the next broker); idempotent.
        Outstanding blocks become invalid."""
        if self._closed:
            return
        self._closed = True
        if self._growth is not None:  # (its segment is not journaled: it goes either way)
            self._growth.join()
            if self._growth.segment is not None:
                self._growth.segment.unlink()
            self._growth = None
        if unlink:
            for segment in self._segments:
                segment.unlink()
            logger.debug("arena closed, %s segments unlinked", len(self._segments))
        self._segments.clear()
        self._seg_index.clear()
        self._free.clear()
        self._free_by_start.clear()
        self._free_by_end.clear()
        self._allocated.clear()
        self._reserved = self._used = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    def stats(self) -> dict[str, int]:
        """The counters `stats()` reports, for the host arena and each device's."""
        return {
            "capacity_bytes": self.capacity,
            "used_bytes": self.used_bytes,
            "reserved_bytes": self.reserved_bytes,
            "free_bytes": self.free_bytes,
            "largest_free_bytes": self.largest_free,
            "segments": len(self.segments),
        }

    @property
    def largest_free(self) -> int:
        """Largest block allocate(align=64) could still return, counting unreserved capacity."""
        in_segments = self._free[-1][0] // _GRAIN * _GRAIN if self._free else 0
        unreserved = 0 if self._closed else (self._capacity - self._reserved) // _GRAIN * _GRAIN
        return max(in_segments, unreserved)

    @property
    def segments(self) -> list[str]:
        return [segment.name for segment in self._segments]

    @property
    def blocks(self) -> int:
        return len(self._allocated)
