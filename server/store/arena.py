"""Best-fit allocator handing out blocks of broker-owned shared-memory segments.

Segments are created lazily, in chunks, and are never shrunk: freed space goes back to the
free list and is only returned to the system by ``Arena.close()``.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...common.config import round_up

logger = logging.getLogger(__name__)

_GRAIN = 64  # reserved sizes and the minimum alignment
_HUGE = 2 * 2**20  # new segments are at least this big and a multiple of it


@dataclass(frozen=True, slots=True)
class Block:
    """A reserved byte range of one segment; ``offset`` is a multiple of the requested alignment."""

    segment: str
    offset: int
    size: int


class ShmExhausted(OSError):
    """/dev/shm (the tmpfs) could not back a new segment (ENOSPC from posix_fallocate); or
    the GPU a new device chunk (a failed cudaMalloc, devices.py)."""


_ACL = "system.posix_acl_access"
_ACL_ENTRY = struct.Struct("<HHI")  # tag, permissions, id: linux/posix_acl_xattr.h
_ACL_ANY = 0xFFFFFFFF  # the id of an entry that names no one
# tags: the owner, a named user, the owning group, the mask, everyone else
_USER_OBJ, _USER, _GROUP_OBJ, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x10, 0x20


def share_with_user(fd: int, uid: int) -> None:
    """Let user `uid` open the file `fd` read-write too, and no one else but its owner: a
    POSIX ACL (owner rw, that user rw, owning group and others nothing), which the owner of a
    file may set without privilege. OSError if the file system has no ACLs (EOPNOTSUPP)."""
    entries = [
        (_USER_OBJ, 6, _ACL_ANY), (_USER, 6, uid), (_GROUP_OBJ, 0, _ACL_ANY),
        (_MASK, 6, _ACL_ANY), (_OTHER, 0, _ACL_ANY),
    ]  # fmt: skip
    value = struct.pack("<I", 2) + b"".join(_ACL_ENTRY.pack(*e) for e in entries)
    os.setxattr(fd, _ACL, value)


class Segment:
    """One shared-memory file owned by the broker (the broker never maps it).

    Class-level defaults let a half-built object still be unlinked, as in
    ``multiprocessing.shared_memory``.
    """

    name: str = ""
    path: str = ""
    size: int = 0

    @classmethod
    def create(
        cls, shm_dir: str, prefix: str, size: int, group: int | None = None, mode: int = 0o660,
        user: int | None = None,
    ) -> Segment:  # fmt: skip
        """Create ``shm_dir/<prefix><16 hex>`` (mode 0600) with every page backed now; with
        `group`, that group's members may map it too (`mode`: 0660, or 0640 read-only); with
        `user` (and no group), that one user too, read-write (`share_with_user`)."""
        if size < 1:
            raise ValueError(f"segment size must be >= 1 byte, got {size}")
        segment = cls()
        while True:
            name = prefix + os.urandom(8).hex()
            path = os.path.join(shm_dir, name)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                continue
            break
        segment.name, segment.path = name, path
        try:
            if group is not None:
                os.fchown(fd, -1, group)
                os.fchmod(fd, mode)
            elif user is not None and user != os.geteuid():
                share_with_user(fd, user)
            os.ftruncate(fd, size)
            try:
                # Back every page now: a lazily-filled tmpfs would SIGBUS clients later.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise ShmExhausted(
                    errno.ENOSPC,
                    f"cannot back a {size}-byte ({size / 2**20:.1f} MiB) shared-memory segment "
                    f"in {shm_dir}: the tmpfs is full. Enlarge it (docker run --shm-size=..., or "
                    f"in Kubernetes mount an emptyDir {{medium: Memory, sizeLimit: ...}} at "
                    f"{shm_dir}) or lower the broker capacity",
                ) from exc
            segment.size = size
        except BaseException:
            segment.unlink()
            raise
        finally:
            os.close(fd)
        logger.info("created shm segment %s (%s bytes)", path, size)
        return segment

    @classmethod
    def existing(cls, shm_dir: str, name: str) -> Segment:
        """A segment a broker that died made (adopted: Note [recovery] in state.py)."""
        segment = cls()
        segment.name, segment.path = name, os.path.join(shm_dir, name)
        segment.size = os.stat(segment.path).st_size
        return segment

    def unlink(self) -> None:
        """Remove the file; idempotent."""
        if not self.path:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        return f"Segment(name={self.name!r}, size={self.size})"


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

    def _grow(self, need: int, align: int) -> bool:
        room = (self._capacity - self._reserved) // _GRAIN * _GRAIN
        size = min(max(self._chunk_size, round_up(need + align, _HUGE)), room)
        if size < need:
            return False
        segment = self._new_segment(size)
        self._on_segment(segment)
        self._add_segment(segment, [])
        return True

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

    def allocate(self, size: int, align: int = 64, high: bool = False) -> Block | None:
        """Reserve ``size`` bytes at an ``align``-aligned offset; None if capacity is exceeded.
        ``high``: at the top of the free block it is cut from, not the bottom (blocks granted
        ahead: freed when a large put needs their room, they leave no hole in the middle).

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
        if found is None:
            if not self._grow(need, align):
                return None
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
