"""The broker's side of Note [directory and lease slots] (common/directory.py): it writes the
directory, hands out slot regions, and scans them before it frees a retired object.

A table's entries are all of one size (its header says which): the smallest power of two
from MIN_ENTRY that fits its longest key and descriptor, up to ENTRY_SIZE. A key that does
not fit the current size rebuilds the table with bigger entries. Small keys so take 128
bytes an entry, not 2 KiB: the directory was 8 KB of shared memory per key at 200,000 keys
(issue 31). A replaced table's entries are given back to the kernel at once (MADV_REMOVE):
only its header is read after the move, and a client that maps it idly keeps no memory.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import struct
from collections.abc import Sequence
from typing import Any

from ...common import _shm
from ...common.directory import (
    DELETED,
    EMPTY,
    ENTRIES,
    ENTRY_SIZE,
    H_ENTRIES,
    H_ENTRY_SIZE,
    H_MAGIC,
    H_MOVED,
    H_SUCCESSOR,
    HEADER,
    LIVE,
    MAGIC,
    REGIONS,
    SLOTS,
    SUCCESSOR_BYTES,
    encode_desc,
    map_segment,
)
from ..durability.journal import Journal
from .segments import Segment

log = logging.getLogger(__name__)

MIN_ENTRY = 128  # bytes of the smallest entry: a small key and a plain tensor's descriptor
_ENTRY = struct.Struct("<QIIQQQII")  # seq state keylen oid version hash desclen (common/_shm.c)
MADV_REMOVE = 9  # madvise(2): free a shared mapping's pages and their backing store


def entry_size(need: int) -> int:
    """The entry size of a table whose longest entry takes `need` bytes."""
    return max(MIN_ENTRY, 1 << (need - 1).bit_length())


def _give_back_entries(table: Mapped) -> None:
    """Free the pages of a replaced table's entries (all but its header, and the partial page
    at its end): readers of them find nothing there and ask the broker; none can trust an
    entry of a moved table anyway (the check reads `moved`)."""
    start, end = table.addr + HEADER, table.addr + table.size // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= start:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, end - start, MADV_REMOVE) != 0:  # its memory stays: no harm
        log.debug("madvise(MADV_REMOVE) of %s: errno %d", table.name, ctypes.get_errno())


class Mapped:
    """A segment of the broker's (created like the arena's, and journaled as `kind`; or
    one a broker that died made), mapped read-write."""

    def __init__(
        self, shm_dir: str, prefix: str, size: int, journal: Journal, kind: str,
        existing: str | None = None, group: int | None = None, mode: int = 0o660,
        user: int | None = None,
    ) -> None:  # fmt: skip
        self.journal = journal
        if existing is not None:
            self.segment = Segment.existing(shm_dir, existing)
            size = self.segment.size
        else:
            self.segment = Segment.create(shm_dir, prefix, size, group, mode, user)
        self.size = size
        try:
            self.addr = map_segment(self.segment.path, size, writable=True)
            if existing is None:
                journal.segment(self.name, size, kind)
        except BaseException:
            if existing is None:
                self.segment.unlink()
            raise

    @property
    def name(self) -> str:
        return self.segment.name

    def close(self, unlink: bool = True) -> None:
        _shm.unmap(self.addr, self.size)
        if unlink:
            self.segment.unlink()
            self.journal.segment_gone(self.name)


class _Table(Mapped):
    """One directory segment."""

    def __init__(
        self, shm_dir: str, prefix: str, journal: Journal, entries: int, group: int | None,
        size: int = MIN_ENTRY,
    ) -> None:  # fmt: skip
        total = HEADER + entries * size  # clients only read it:
        super().__init__(shm_dir, prefix, total, journal, "directory", None, group, 0o640)
        self.entries, self.entry_size = entries, size
        self.states = bytearray(entries)  # EMPTY / LIVE / DELETED, as written
        self.index: dict[str, int] = {}  # live key -> entry
        self.used = 0  # entries not empty (live or deleted): probes end at empty ones
        self.longest = 0  # bytes of the longest entry written (removed ones too)
        _shm.store(self.addr + H_ENTRIES, entries)
        _shm.store(self.addr + H_ENTRY_SIZE, size)
        _shm.store(self.addr + H_MAGIC, MAGIC)

    def entry(self, i: int) -> int:
        return self.addr + HEADER + i * self.entry_size

    def write(self, key: str, oid: int, version: int, desc: bytes) -> bool:
        """List `key`; False if the table has no room left (a third must stay empty)."""
        raw = key.encode()
        i = self.index.get(key)
        if i is None:
            if 3 * (self.used + 1) > 2 * self.entries:
                return False
            i = _shm.key_hash(raw) % self.entries
            while self.states[i] == LIVE:
                i = (i + 1) % self.entries
            if self.states[i] == EMPTY:
                self.used += 1
            self.index[key] = i
        _shm.entry_write(self.entry(i), self.entry_size, LIVE, oid, version, raw, desc)
        self.longest = max(self.longest, _shm.ENTRY_HEAD + len(raw) + len(desc))
        self.states[i] = LIVE
        return True

    def remove(self, key: str) -> None:
        i = self.index.pop(key, None)
        if i is not None:
            _shm.entry_write(self.entry(i), self.entry_size, DELETED, 0, 0, key.encode(), b"")
            self.states[i] = DELETED

    def copy_to(self, view: memoryview, table: _Table) -> None:
        """Write this table's live entries (read back from `view`, its mapping: only the
        broker writes it, so no seqlock) into `table`."""
        for key, i in self.index.items():
            at = HEADER + i * self.entry_size
            _, _, keylen, oid, version, _, desclen, _ = _ENTRY.unpack_from(view, at)
            start = at + _shm.ENTRY_HEAD + keylen
            table.write(key, oid, version, bytes(view[start : start + desclen]))


class Directory:
    """The directory of sealed host objects under keys (see the Note)."""

    def __init__(
        self, shm_dir: str, prefix: str = "tb-0-", journal: Journal | None = None,
        entries: int = ENTRIES, group: int | None = None,
    ) -> None:  # fmt: skip
        self._dir, self._prefix, self._group = shm_dir, prefix, group
        self._journal = journal if journal is not None else Journal()
        self._table = self._new_table(entries, MIN_ENTRY)
        self._old: list[Mapped] = []  # replaced tables: clients may still map them

    def _new_table(self, entries: int, size: int) -> _Table:
        table = _Table(self._dir, self._prefix, self._journal, entries, self._group, size)
        self._journal.meta("directory", table.name)
        return table

    @property
    def name(self) -> str:
        return self._table.name

    @property
    def size(self) -> int:
        return self._table.size

    def publish(
        self, key: str, oid: int, version: int, bundle: bool, tensors: Sequence[Any]
    ) -> bool:
        """List a newly sealed version of `key` (replacing the one listed). False, and the
        key unlisted, if it does not fit an entry: its gets then ask the broker."""
        desc = encode_desc(bundle, tensors)
        need = _shm.ENTRY_HEAD + len(key.encode()) + len(desc)
        if need > ENTRY_SIZE:
            self.remove(key)
            return False
        table = self._table
        if need > table.entry_size or not table.write(key, oid, version, desc):
            self._rebuild(need)
            self._table.write(key, oid, version, desc)
        return True

    def remove(self, key: str) -> None:
        self._table.remove(key)

    def _rebuild(self, need: int) -> None:
        """A new table (twice as big if half of the old one is live, its entries as big as
        `need` and the longest written to the old one take: one rebuild later, as the longest
        live one), written whole, then announced in the old one's header; the old one stays
        mapped for clients on it, its entries freed."""
        old = self._table
        live = len(old.index) + 1
        entries = old.entries * (2 if 2 * live > old.entries else 1)
        view = memoryview((ctypes.c_char * old.size).from_address(old.addr)).cast("B")
        try:
            table = self._new_table(entries, entry_size(max(need, old.longest)))
            old.copy_to(view, table)
        finally:
            view.release()
        self._table = table
        old.index, old.states = {}, bytearray()  # read no more
        self._replaced(old)
        size = table.entry_size
        log.info("directory rebuilt: %d entries of %d bytes, %d live", entries, size, live)

    def _replaced(self, old: Mapped) -> None:
        """Announce the current table in `old` (and in every table replaced before it)."""
        self._old.append(old)
        name = self._table.name.encode().ljust(SUCCESSOR_BYTES, b"\0")
        for table in self._old:  # each replaced table names the newest
            for i in range(0, SUCCESSOR_BYTES, 8):
                word = int.from_bytes(name[i : i + 8], "little")
                _shm.store(table.addr + H_SUCCESSOR + i, word)
            _shm.store(table.addr + H_MOVED, 1)  # after the table and its name (release)
        _give_back_entries(old)  # after `moved`: a lease checked on it fails from now on
        while len(self._old) > 1:  # clients that still map it keep their mapping; a client
            self._old.pop(0).close()  # that cannot follow its name asks the broker (ping)

    def adopt(self, name: str) -> None:
        """Replace the directory of a broker that died (its live objects are published in
        this one by now): its readers move here (Note [recovery] in state.py)."""
        old = Mapped(self._dir, self._prefix, 0, self._journal, "directory", existing=name)
        if _shm.load(old.addr + H_MAGIC) != MAGIC:
            old.close(unlink=False)
            raise ValueError(f"{name} is not a tensorbroker directory")
        self._replaced(old)

    @property
    def segments(self) -> list[str]:
        return [t.name for t in [self._table, *self._old]]

    def close(self, unlink: bool = True) -> None:
        for table in [self._table, *self._old]:
            table.close(unlink)
        self._old.clear()


class SlotTable(Mapped):
    """The lease-slot regions: one per client that has one, written only by that client.
    `user`: the one user (besides the broker's) who may map it (server/store/members.py)."""

    def __init__(
        self, shm_dir: str, prefix: str = "tb-0-", journal: Journal | None = None,
        regions: int = REGIONS, slots: int = SLOTS, existing: str | None = None,
        group: int | None = None, user: int | None = None,
    ) -> None:  # fmt: skip
        journal = journal if journal is not None else Journal()
        size = regions * slots * 8
        super().__init__(shm_dir, prefix, size, journal, "slots", existing, group, user=user)
        self.regions, self.slots = regions, slots
        self.region_bytes = slots * 8
        if self.size != regions * self.region_bytes:
            self.close(unlink=False)
            raise ValueError(f"{existing} is not a lease-slot segment of {regions} regions")
        self._free = list(range(regions - 1, -1, -1))
        self.assigned: set[int] = set()

    def keep(self, region: int) -> None:
        """An adopted session whose process lives keeps its region (and what it holds)."""
        self._free.remove(region)
        self.assigned.add(region)

    def clear_free(self) -> None:
        """Zero the regions no live client has (after adoption: those of dead clients)."""
        for region in self._free:
            self.used(region)  # empties the slots let go
            if self.held(region):
                self._zero(region)

    def assign(self) -> int | None:
        """A free region (all zero), or None if every one is taken."""
        if not self._free:
            return None
        region = self._free.pop()
        self.assigned.add(region)
        return region

    def release(self, region: int) -> None:
        """Its client is gone: its slots no longer hold anything."""
        self._zero(region)
        self.assigned.discard(region)
        self._free.append(region)

    def _zero(self, region: int) -> None:
        start = self.addr + region * self.region_bytes
        for i in range(self.slots):
            _shm.store(start + 8 * i, 0)

    def used(self, region: int | None = None) -> set[int]:
        """The objects read through a slot let go since the last look, in the assigned
        regions (or one): their slots are emptied."""
        if region is not None:
            return _shm.slots_harvest(self.addr + region * self.region_bytes, self.slots)
        out: set[int] = set()
        for r in self.assigned:
            out |= _shm.slots_harvest(self.addr + r * self.region_bytes, self.slots)
        return out

    def held(self, region: int | None = None) -> dict[int, int]:
        """oid -> slots holding it, in the assigned regions (or one), after a full fence."""
        if region is not None:
            return _shm.slots_scan(self.addr + region * self.region_bytes, self.slots)
        out: dict[int, int] = {}
        for r in self.assigned:
            for oid, n in _shm.slots_scan(self.addr + r * self.region_bytes, self.slots).items():
                out[oid] = out.get(oid, 0) + n
        return out
