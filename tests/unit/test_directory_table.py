"""The directory as the broker writes it and a client reads it (Note [directory and lease
slots]), on a private directory of segments."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tensorbroker.client.reads import LeaseSlots
from tensorbroker.common import _shm
from tensorbroker.common.directory import (
    ENTRY_SIZE,
    H_MOVED,
    HEADER,
    DirectoryView,
    decode_desc,
)
from tensorbroker.server.store.directory import MIN_ENTRY, Directory, SlotTable


@pytest.fixture
def shm_dir(tmp_path: Path) -> str:
    return str(tmp_path)


@pytest.fixture
def slots(shm_dir: str) -> Iterator[tuple[SlotTable, LeaseSlots]]:
    table = SlotTable(shm_dir, regions=2, slots=1024)
    region = table.assign()
    assert region is not None
    client = LeaseSlots(os.path.join(shm_dir, table.name), region * table.region_bytes, 1024)
    yield table, client
    del client
    table.close()


class Found:
    """What a lease saw; its slot given back at once."""

    def __init__(self, view: DirectoryView, slots: LeaseSlots, key: bytes) -> None:
        leased = view.lease(key, slots)
        self.ok = leased is not None
        if leased is not None:
            self.oid, self.version, self.desc, slot = leased
            slots.give_back(slot)


def _wire(n: int) -> list[object]:
    return [["", "float32", [n], [1], "tb-1-00", 64 * n, "cpu"]]


def test_a_client_finds_what_the_broker_listed(
    shm_dir: str, slots: tuple[SlotTable, LeaseSlots]
) -> None:
    table, client = slots
    d = Directory(shm_dir, entries=64)
    view = DirectoryView(shm_dir, d.name, d.size)
    try:
        assert not Found(view, client, b"x").ok
        assert d.publish("x", 7, 1, False, _wire(3))
        leased = view.lease(b"x", client)
        assert leased is not None
        oid, version, desc, slot = leased
        assert (oid, version) == (7, 1) and decode_desc(desc) == (False, _wire(3))
        assert table.held() == {7: 1} and table.used() == set()  # held until given back
        client.give_back(slot)
        assert table.held() == {}
        assert table.used() == {7} and table.used() == set()  # a use, harvested once
        assert client.take() != slot  # free slots go in turn: this one keeps its mark longest
        assert d.publish("x", 9, 2, True, _wire(4))  # a new version replaces it in place
        found = Found(view, client, b"x")
        assert (found.oid, found.version) == (9, 2)
        d.remove("x")
        assert not Found(view, client, b"x").ok
    finally:
        view.close()
        d.close()


def test_a_full_directory_is_rebuilt_and_readers_follow_it(
    shm_dir: str, slots: tuple[SlotTable, LeaseSlots]
) -> None:
    table, client = slots
    d = Directory(shm_dir, entries=8)
    view = DirectoryView(shm_dir, d.name, d.size)
    first = d.name
    try:
        for i in range(40):  # many times what 8 entries hold, with deletes between
            assert d.publish(f"k{i}", 100 + i, 1, False, _wire(i))
            if i % 3 == 0:
                d.remove(f"k{i}")
        assert d.name != first
        try:  # a view left behind by several rebuilds cannot follow: it asks (the broker)
            Found(view, client, b"k1")
        except OSError:
            view.attach(d.name, d.size)
        for i in range(40):
            found = Found(view, client, f"k{i}".encode())
            assert found.ok == (i % 3 != 0)
            assert not found.ok or found.oid == 100 + i
    finally:
        view.close()
        d.close()
    assert [p.name for p in Path(shm_dir).iterdir()] == [table.name]  # every table unlinked


def test_entries_are_as_small_as_the_keys_allow_and_a_long_key_makes_them_bigger(
    shm_dir: str, slots: tuple[SlotTable, LeaseSlots]
) -> None:
    _, client = slots
    d = Directory(shm_dir, entries=64)
    view = DirectoryView(shm_dir, d.name, d.size)
    try:
        for i in range(5):
            assert d.publish(f"k{i}", 1 + i, 1, False, _wire(i))
        assert d._table.entry_size == MIN_ENTRY
        old = os.path.join(shm_dir, d.name)
        long = "x" * 300
        assert d.publish(long, 99, 1, False, _wire(1))  # 48 + 300 + its descriptor: 512
        assert (d._table.entry_size, d._table.entries) == (512, 64)
        assert os.stat(old).st_blocks * 512 <= HEADER  # the replaced table's entries: freed
        assert [Found(view, client, f"k{i}".encode()).oid for i in range(5)] == [1, 2, 3, 4, 5]
        assert Found(view, client, long.encode()).oid == 99
    finally:
        view.close()
        d.close()


def test_an_entry_too_big_is_not_listed_and_its_older_version_goes(
    shm_dir: str, slots: tuple[SlotTable, LeaseSlots]
) -> None:
    _, client = slots
    d = Directory(shm_dir, entries=16)
    view = DirectoryView(shm_dir, d.name, d.size)
    try:
        assert d.publish("b", 1, 1, False, _wire(1))
        huge = [["t" * 100, "float32", [1], [1], "tb-1-00", 0, "cpu"]] * (ENTRY_SIZE // 100)
        assert not d.publish("b", 2, 2, True, huge)
        assert not Found(view, client, b"b").ok  # its gets ask the broker, never see v1
    finally:
        view.close()
        d.close()


def test_slots_are_scanned_and_a_released_region_is_clear(shm_dir: str) -> None:
    slots = SlotTable(shm_dir, regions=4, slots=1024)
    try:
        r = slots.assign()
        assert r is not None
        base = slots.addr + r * slots.region_bytes
        _shm.slot_publish(base, 42)
        _shm.slot_publish(base + 8, 42)
        _shm.slot_publish(base + 16, 43)
        assert slots.held() == {42: 2, 43: 1}
        _shm.slot_clear(base + 16)
        assert slots.held(r) == {42: 2}
        slots.release(r)
        assert slots.held() == {} and _shm.load(base) == 0
        assert [slots.assign() for _ in range(5)].count(None) == 1
    finally:
        slots.close()


def test_a_reader_follows_a_rebuild_through_the_old_header(
    shm_dir: str, slots: tuple[SlotTable, LeaseSlots]
) -> None:
    _, client = slots
    d = Directory(shm_dir, entries=8)
    view = DirectoryView(shm_dir, d.name, d.size)
    first = d.name
    try:
        for i in range(6):  # the sixth key does not fit a third-empty table of 8
            assert d.publish(f"k{i}", 1 + i, 1, False, _wire(i))
        assert d.name != first
        assert [Found(view, client, f"k{i}".encode()).ok for i in range(6)] == [True] * 6
    finally:
        view.close()
        d.close()


def test_an_entry_of_a_replaced_table_never_passes_the_check(shm_dir: str) -> None:
    """A reader that found its entry in a table the broker then replaced must not trust
    it: the old entry stays live (here, in a table smaller than a page, whose entries are
    not given back), so the check also asks whether the table moved."""
    d = Directory(shm_dir, entries=8)
    try:
        d.publish("k0", 1, 1, False, _wire(0))
        old, size = d._table.addr, d._table.entry_size
        found = _shm.lookup(old + HEADER, 8, size, b"k0")
        assert isinstance(found, tuple)
        entry = old + HEADER + found[0] * size
        for i in range(1, 6):  # a rebuild; then k0 is replaced in the new table only
            d.publish(f"k{i}", 1 + i, 1, False, _wire(i))
        d.publish("k0", 99, 2, False, _wire(0))
        assert _shm.entry_holds(entry, 1)  # the stale entry alone would pass ...
        assert _shm.load(old + H_MOVED) == 1  # ... but its table says it was replaced
    finally:
        d.close()


def test_many_keys_are_leased_at_once(shm_dir: str, slots: tuple[SlotTable, LeaseSlots]) -> None:
    table, client = slots
    d = Directory(shm_dir, entries=64)
    view = DirectoryView(shm_dir, d.name, d.size)
    try:
        for i in range(5):
            assert d.publish(f"k{i}", 10 + i, 1, False, _wire(i))
        leased = view.lease_many([b"k0", b"nope", b"k3"], client)
        assert leased[1] is None  # the broker answers that one
        first, third = leased[0], leased[2]
        assert first is not None and third is not None
        assert (first[0], third[0]) == (10, 13) and decode_desc(third[2]) == (False, _wire(3))
        assert table.held() == {10: 1, 13: 1}
        for got in (first, third):
            client.give_back(got[3])
        assert table.held() == {}
        old, size = d._table.addr, d._table.entry_size
        slot = client.take()
        assert slot is not None
        for i in range(5, 60):  # a rebuild: the old table's entries are given back
            d.publish(f"k{i}", 10 + i, 1, False, _wire(i))
        new = d._table
        assert new.addr != old
        stale = _shm.lease_entries(old + HEADER, 64, size, [b"k0"], [slot], old + H_MOVED)
        assert stale == [None] and _shm.load(slot) == 0  # nothing there: the broker answers
        # Found before the move, checked after it: try again (the slot was cleared).
        found = _shm.lease_entries(
            new.addr + HEADER, new.entries, new.entry_size, [b"k0"], [slot], old + H_MOVED
        )
        assert found == [True] and _shm.load(slot) == 0
        client.give_back(slot)
        assert [got is not None for got in view.lease_many([b"k0", b"k59"], client)] == [True] * 2
    finally:
        view.close()
        d.close()
