"""Best-fit allocator handing out blocks of broker-owned shared-memory segments.

Segments are created lazily, in chunks, and are never shrunk: freed space goes back to the
free list and is only returned to the system by ``Arena.close()``.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from bisect import bisect_left, insort
from dataclasses import dataclass

from ..common.config import SEGMENT_NAME, round_up, segment_prefix

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
    """/dev/shm (the tmpfs) could not back a new segment (ENOSPC from posix_fallocate)."""


class Segment:
    """One shared-memory file owned by the broker (the broker never maps it).

    Class-level defaults let a half-built object still be unlinked, as in
    ``multiprocessing.shared_memory``.
    """

    name: str = ""
    path: str = ""
    size: int = 0

    @classmethod
    def create(cls, shm_dir: str, prefix: str, size: int) -> Segment:
        """Create ``shm_dir/<prefix><16 hex>`` (mode 0600) with every page backed now."""
        if size < 1:
            raise ValueError(f"segment size must be >= 1 byte, got {size}")
        segment = cls()
        while True:
            name = prefix + secrets.token_hex(8)
            path = os.path.join(shm_dir, name)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                continue
            break
        segment.name, segment.path = name, path
        try:
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
        prefix: str | None = None,
        chunk_size: int = 256 * 2**20,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 byte, got {capacity}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 byte, got {chunk_size}")
        self._capacity = capacity
        self._shm_dir = shm_dir
        self._prefix = segment_prefix(os.getpid()) if prefix is None else prefix
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
        self._seg_index[segment.name] = len(self._segments)
        self._segments.append(segment)
        self._reserved += size
        self._add_free(len(self._segments) - 1, 0, size)
        return True

    def _new_segment(self, size: int) -> Segment:
        """Back `size` more bytes (a subclass may back them elsewhere: see DeviceArena)."""
        return Segment.create(self._shm_dir, self._prefix, size)

    # -- public API --------------------------------------------------------------------------

    def allocate(self, size: int, align: int = 64) -> Block | None:
        """Reserve ``size`` bytes at an ``align``-aligned offset; None if capacity is exceeded.

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

    def close(self) -> None:
        """Unlink every segment; idempotent. Outstanding blocks become invalid."""
        if self._closed:
            return
        self._closed = True
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

    @staticmethod
    def remove_stale(shm_dir: str = "/dev/shm") -> list[str]:
        """Unlink this uid's ``tb-<pid>-<hex>`` files whose pid is not a live process.

        Pids are checked in this process's pid namespace: do not share ``shm_dir`` with brokers
        in other pid namespaces.
        """
        uid = os.getuid()
        removed: list[str] = []
        try:
            with os.scandir(shm_dir) as it:
                entries = list(it)
        except FileNotFoundError:
            return removed
        for entry in entries:
            match = SEGMENT_NAME.fullmatch(entry.name)
            if match is None:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue
            if _pid_alive(int(match.group(1))):
                continue
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            logger.warning("removed stale shm segment %s", entry.path)
            removed.append(entry.name)
        return sorted(removed)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False  # 0 and negatives address process groups, never a broker
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True
