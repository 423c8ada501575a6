"""The object directory and the lease slots: the state readers need, in shared memory.

Note [directory and lease slots]

    directory segment (the broker's; clients map it read-only)
    ┌──────────────── header (4096 B) ────────────────┬─ entry 0 ─┬─ entry 1 ─┬ ...
    │ magic │ entries │ entry_size │ moved │ successor │ seq state keylen oid version hash
    └─────────────────────────────────────────────────┴ desclen key desc (common/_shm.c)

    slots segment (the broker's): one region of SLOTS u64 per client, written only by it
    ┌ client 0: oid oid 0 0 oid ... ┬ client 1: ... ┬ ...

Only the broker writes the directory: an open-addressed hash table (linear probing from
key_hash(key) % entries; a deleted entry keeps probes going, an empty one ends them). Each
entry has a seqlock: the broker makes seq odd, writes, makes it even (release); a reader
loads seq (acquire), copies, fences (acquire), and retries while seq was odd or changed. So a
reader sees an entry whole, before or after a write, never half of each. Entries never move;
a directory that fills up is replaced by a new one, written whole, then announced in the
old one's header (`successor`, then `moved` = 1 with release); readers look at `moved` on
every get and switch.

A get without the broker (client/reads.py, Reads.read_directly):
    1. look the key up: (entry, oid, version, descriptor); absent or torn: ask the broker
    2. publish oid in a free slot of its own region, then a full fence   (slot_publish)
    3. read the entry again: still live with that oid? else clear the slot, go to 1
    4. the object is safe to read until the slot is cleared (the Tensor and its arrays gone)
A retired object (deleted or replaced, so no longer in the directory) is freed by the broker
only when no lease holds it and, after a full fence (its directory write before it), no
slot of a live client holds its oid (`slots_scan`). If a reader published its slot after
that scan, its step 3 sees the entry changed and it retries: the fences make the two orders
the only ones possible (this is the hazard-pointer protocol). Object ids are never reused.

All of the ordering is in common/_shm.c; nothing here orders memory.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any

import msgpack

from . import _shm

MAGIC = 0x31524944_42540000  # "TBDIR1"
HEADER = 4096
ENTRY_SIZE = 2048  # a bigger key and descriptor is not listed: its gets ask the broker
# (the largest entry: a table's header says its own entry size, a power of two from 128
# that fits its longest key and descriptor; server/store/directory.py)
ENTRIES = 4096  # of the first directory; it is rebuilt (twice the size if need be) when full
SLOTS = 1024  # per client region (8 KiB)
REGIONS = 256  # client regions in the slots segment: more clients get theirs from the broker

# header words
H_MAGIC, H_ENTRIES, H_ENTRY_SIZE, H_MOVED, H_SUCCESSOR = 0, 8, 16, 24, 32
SUCCESSOR_BYTES = 64

EMPTY, LIVE, DELETED = 0, 1, 2
DIRECT_TRIES = 8  # an entry replaced under a lease this often in a row: ask the broker


def encode_desc(bundle: bool, tensors: Sequence[Any]) -> bytes:
    """A directory entry's descriptor: the object's bundle flag and tensors (wire form)."""
    data: bytes = msgpack.packb([bundle, tensors], use_bin_type=True)
    return data


def decode_desc(data: bytes) -> tuple[bool, list[Any]]:
    bundle, tensors = msgpack.unpackb(data, raw=False, strict_map_key=True)
    return bool(bundle), tensors


def map_segment(path: str, size: int, writable: bool, offset: int = 0) -> int:
    """Map `size` bytes of the file at `path` from `offset` (a multiple of the page size);
    the address. The mapping outlives the file's name."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        return _shm.map_fd(fd, size, writable, offset)
    finally:
        os.close(fd)


class DirectoryView:
    """A client's read-only view of the broker's directory, following it when it moves.

    Threads share it. Tables left behind are unmapped once no lease taken through them is
    still being checked, and at close once no thread is inside `lease`.
    """

    def __init__(self, shm_dir: str, name: str, size: int) -> None:
        self._dir = shm_dir
        self._lock = threading.Lock()
        # Threads in `lease`: a list, as append and pop are atomic under the GIL. A thread
        # appends before it reads the current table, so a table left behind when the list
        # was seen empty (under the lock) is read by nobody.
        self._inside: list[None] = []
        self._stale: list[tuple[int, int]] = []  # tables left behind, unmapped when idle
        self._closed = False
        self._table = self._map(name, size)

    def _map(self, name: str, size: int) -> tuple[int, int, int, int]:
        """(header address, entries, entry size, mapping size) of the directory `name`."""
        addr = map_segment(os.path.join(self._dir, name), size, writable=False)
        if _shm.load(addr + H_MAGIC) != MAGIC:
            _shm.unmap(addr, size)
            raise ValueError(f"{name} is not a tensorbroker directory")
        return addr, _shm.load(addr + H_ENTRIES), _shm.load(addr + H_ENTRY_SIZE), size

    def attach(self, name: str, size: int) -> None:
        """Read the directory `name` from now on (the broker says it is the current one)."""
        table = self._map(name, size)
        with self._lock:
            self._stale.append(self._table[0::3])
            self._table = table

    def _follow(self, table: tuple[int, int, int, int]) -> None:
        """`table` was replaced: map the successor its header names. OSError if that one is
        gone too (then the broker says which is current: attach)."""
        raw = ctypes.string_at(table[0] + H_SUCCESSOR, SUCCESSOR_BYTES)
        name = raw.rstrip(b"\0").decode(errors="replace")  # written before `moved` (release)
        new = self._map(name, os.stat(os.path.join(self._dir, name)).st_size)
        with self._lock:
            if self._table is table:
                self._stale.append(table[0::3])
                self._table = new
                return
        _shm.unmap(new[0], new[3])  # another thread followed first

    def lease(self, key: bytes, slots: Any) -> tuple[int, int, bytes, int] | None:
        """Lease the live object under `key` through a slot of `slots` (Note [directory and
        lease slots], steps 1 to 3): (oid, version, descriptor, slot), or None when the
        broker must answer (not listed, torn, no free slot, replaced under this lease too
        often). OSError or ValueError if the directory moved where this view cannot follow."""
        self._inside.append(None)
        try:
            if self._closed:
                return None
            for _ in range(DIRECT_TRIES):
                table = self._table
                header, entries, entry_size, _ = table
                if _shm.load(header + H_MOVED):
                    self._follow(table)
                    continue
                found = _shm.lookup(header + HEADER, entries, entry_size, key)
                if not isinstance(found, tuple):
                    return None
                index, oid, version, desc = found
                slot = slots.take()
                if slot is None:
                    return None
                try:
                    _shm.slot_publish(slot, oid)
                    # Still listed, in a table still current: the broker writes `moved`
                    # before it fences and scans, so a lease checked here is seen by its scan.
                    entry = header + HEADER + index * entry_size
                    held = _shm.entry_holds(entry, oid) and not _shm.load(header + H_MOVED)
                except BaseException:
                    slots.give_back(slot)
                    raise
                if held:
                    return oid, version, desc, slot
                slots.give_back(slot)
            return None
        finally:
            self._leave()

    def lease_many(self, keys: list[bytes], slots: Any) -> list[tuple[int, int, bytes, int] | None]:
        """`lease` of each of `keys` at once (one fence for all): (oid, version, descriptor,
        slot) of each, or None where the broker must answer. OSError or ValueError if the
        directory moved where this view cannot follow."""
        out: list[tuple[int, int, bytes, int] | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        self._inside.append(None)
        try:
            for _ in range(DIRECT_TRIES):
                if self._closed or not todo:
                    break
                table = self._table
                header, entries, entry_size, _ = table
                if _shm.load(header + H_MOVED):
                    self._follow(table)
                    continue
                taken = [slots.take() for _ in todo]
                if None in taken:  # too few free slots: the broker leases the rest
                    for slot in taken:
                        if slot is not None:
                            slots.give_back(slot)
                    break
                try:
                    found = _shm.lease_entries(
                        header + HEADER, entries, entry_size, [keys[i] for i in todo], taken,
                        header + H_MOVED,
                    )  # fmt: skip
                except BaseException:
                    for slot in taken:
                        slots.give_back(slot)
                    raise
                again = []
                for i, slot, result in zip(todo, taken, found, strict=True):
                    if isinstance(result, tuple):
                        out[i] = (*result, slot)
                        continue
                    slots.give_back(slot)
                    if result is True:  # replaced under the lease: once more
                        again.append(i)
                todo = again
            return out
        except BaseException:
            for leased in out:
                if leased is not None:
                    slots.give_back(leased[3])
            raise
        finally:
            self._leave()

    def _leave(self) -> None:
        """A lease is done with the tables: those left behind are unmapped once no thread
        is inside one."""
        self._inside.pop()
        if self._stale or self._closed:
            with self._lock:
                stale = self._release_stale()
            for addr, size in stale:
                _shm.unmap(addr, size)

    def _release_stale(self) -> list[tuple[int, int]]:
        """With the lock held: the mappings nobody can be reading any more."""
        if self._inside:
            return []
        stale, self._stale = self._stale, []
        if self._closed and self._table[0]:
            stale.append(self._table[0::3])
            self._table = (0, 0, 0, 0)
        return stale

    def close(self) -> None:
        """Unmap every table, now or when the last thread inside `lease` leaves."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stale = self._release_stale()
        for addr, size in stale:
            _shm.unmap(addr, size)
