"""The segments a client has mapped: each one once, populated, for as long as anything uses it.

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

    def get(self, name: str) -> Mapping:
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
            raise BrokerUnavailable(
                f"cannot open the broker's segment {path}: {exc.strerror}. Client and broker "
                "must share /dev/shm (same container or pod) and run as the same user"
            ) from None
        try:
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        return Mapping(name, mm)

    def clear(self) -> None:
        """Forget every mapping; each is unmapped once the last array over it is gone."""
        with self._lock:
            self._maps.clear()
