"""The segments a client has mapped: each one once, for as long as anything uses it.

Note [populating mappings]
A segment is mapped with MAP_POPULATE by a client that writes into it (a put copies into
fresh pages at about 1.2 ms per 4 MiB when each write faults, 0.15 ms when populated), and
lazily by one that only reads: populating costs about 20-40 ms per 256 MiB chunk, and a
reader of a handful of items paid it all at its first get (four new subscribers of a
broadcast queue stalled its producer some 40 ms). Reads fault 64 KiB around each page, so a
first read costs about 0.6 ms per 4 MiB against 0.2 populated, once per page per process.

A mapping is never closed explicitly. Each lease holds a reference to the mmap of its
segment, so the mapping lives exactly as long as the last Tensor or consumer array over it;
closing it earlier would leave those arrays pointing at unmapped memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

from ..common.config import SEGMENT_NAME, SHM_DIR
from ..common.errors import BrokerUnavailable, ProtocolError


class Mapping:
    """One mapped segment: the mmap object and the address of its first byte."""

    __slots__ = ("name", "mmap", "address", "size", "_anchor")

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self.mmap = mm
        self.size = len(mm)
        self._anchor = ctypes.c_char.from_buffer(mm)  # pins the mmap: it can never be unmapped
        self.address = ctypes.addressof(self._anchor)  # while this object (or a lease) holds it


class SegmentCache:
    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self._dir = shm_dir
        self._maps: dict[str, Mapping] = {}
        self._lock = threading.Lock()

    def get(self, name: str, populate: bool = False) -> Mapping:
        """Segment `name`, mapped once: `populate` for a writer (Note [populating mappings])."""
        found = self._maps.get(name)
        if found is not None:
            return found
        with self._lock:
            found = self._maps.get(name)
            if found is None:
                found = self._maps[name] = self._map(name, populate)
            return found

    def _map(self, name: str, populate: bool) -> Mapping:
        if not SEGMENT_NAME.fullmatch(name):
            raise ProtocolError(f"the broker named an invalid segment {name!r:.80}")
        path = os.path.join(self._dir, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise BrokerUnavailable(
                f"cannot open the broker's segment {path}: {exc.strerror}. Client and broker "
                "must share /dev/shm (same container or pod) and run as the same user"
            ) from None
        try:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            mm = mmap.mmap(fd, 0, flags=flags)
        finally:
            os.close(fd)
        return Mapping(name, mm)

    def clear(self) -> None:
        """Forget every mapping; each is unmapped once the last array over it is gone."""
        with self._lock:
            self._maps.clear()
