"""The segments a client has mapped: each one once, for as long as anything uses it.

Note [populating mappings]
A put that copies into pages its process has not touched yet faults each one (about 1.2 ms
per 4 MiB, against 0.15 ms populated). So the first write of at least PREFAULT_BYTES into a
segment populates all of its pages in one call (madvise MADV_POPULATE_WRITE, Linux 5.14+;
elsewhere the copies fault them): about 20-40 ms per 256 MiB chunk, once per process. A
writer of small items never pays that: segments were once mapped with MAP_POPULATE by every
writer, and a new client's first put of 4 KiB took 17-20 ms (1.1 ms since). Readers do not
populate (four new subscribers of a broadcast queue stalled its producer some 40 ms so):
reads fault 64 KiB around each page, so a first read costs about 0.6 ms per 4 MiB against
0.2 populated, once per page per process.

A mapping is never closed explicitly. Each lease holds a reference to the mmap of its
segment, so the mapping lives exactly as long as the last Tensor or consumer array over it;
closing it earlier would leave those arrays pointing at unmapped memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading

from ..common.config import SEGMENT_NAME, SHM_DIR
from ..common.errors import BrokerUnavailable, ProtocolError

MADV_POPULATE_WRITE = 23  # linux/mman.h (Python's mmap module does not name it)
PREFAULT_BYTES = 1 << 20  # a write this large populates its segment (Note [populating mappings])


class SegmentGone(BrokerUnavailable):
    """A segment the broker named was unlinked before this process could map it."""


class Mapping:
    """One mapped segment: the mmap object and the address of its first byte."""

    __slots__ = ("name", "mmap", "address", "size", "populated", "_anchor")

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self.mmap = mm
        self.size = len(mm)
        self.populated = False  # writing()
        self._anchor = ctypes.c_char.from_buffer(mm)  # pins the mmap: it can never be unmapped
        self.address = ctypes.addressof(self._anchor)  # while this object (or a lease) holds it

    def writing(self, nbytes: int) -> None:
        """A copy of `nbytes` into this segment is about to start (Note [populating mappings])."""
        if nbytes >= PREFAULT_BYTES and not self.populated:
            self.populated = True
            with contextlib.suppress(OSError):  # a kernel without it: the copies fault them
                self.mmap.madvise(MADV_POPULATE_WRITE)


class SegmentCache:
    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self._dir = shm_dir
        self._maps: dict[str, Mapping] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Mapping:
        """Segment `name`, mapped once (not populated: Note [populating mappings])."""
        found = self._maps.get(name)
        if found is not None:
            return found
        with self._lock:
            found = self._maps.get(name)
            if found is None:
                found = self._maps[name] = self._map(name)
            return found

    def _map(self, name: str) -> Mapping:
        if not SEGMENT_NAME.fullmatch(name):
            raise ProtocolError(f"the broker named an invalid segment {name!r:.80}")
        path = os.path.join(self._dir, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            gone = SegmentGone if isinstance(exc, FileNotFoundError) else BrokerUnavailable
            raise gone(
                f"cannot open the broker's segment {path}: {exc.strerror}. Client and broker "
                "must share /dev/shm (same container or pod) and run as the same user"
            ) from None
        try:
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return Mapping(name, mm)

    def clear(self) -> None:
        """Forget every mapping; each is unmapped once the last array over it is gone."""
        with self._lock:
            self._maps.clear()
