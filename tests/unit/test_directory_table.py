"""The directory as the broker writes it and a client reads it (Note [directory and lease
slots]), on a private directory of segments."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorbroker.common import _shm
from tensorbroker.common.directory import ENTRY_SIZE, DirectoryView, decode_desc
from tensorbroker.server.directory import Directory, SlotTable


@pytest.fixture
def shm_dir(tmp_path: Path) -> str:
    return str(tmp_path)


def _wire(n: int) -> list[object]:
    return [["", "float32", [n], [1], "tb-1-00", 64 * n, "cpu"]]


def test_a_client_finds_what_the_broker_listed(shm_dir: str) -> None:
    d = Directory(shm_dir, entries=64)
    view = DirectoryView(shm_dir, d.name, d.size)
    try:
        assert view.find(b"x") is None
        assert d.publish("x", 7, 1, False, _wire(3))
        found = view.find(b"x")
        assert found is not None
        _, oid, version, desc = found
        assert (oid, version) == (7, 1) and decode_desc(desc) == (False, _wire(3))
        assert d.publish("x", 9, 2, True, _wire(4))  # a new version replaces it in place
        found = view.find(b"x")
        assert found is not None and found[1:3] == (9, 2)
        assert not _shm.entry_holds(found[0], 7) and _shm.entry_holds(found[0], 9)
        d.remove("x")
        assert view.find(b"x") is None and not _shm.entry_holds(found[0], 9)
    finally:
        view.close()
        d.close()


def test_a_full_directory_is_rebuilt_and_readers_follow_it(shm_dir: str) -> None:
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
            view.find(b"k1")
        except OSError:
            view.attach(d.name, d.size)
        for i in range(40):
            found = view.find(f"k{i}".encode())
            if i % 3 == 0:
                assert found is None
            else:
                assert found is not None and found[1] == 100 + i
    finally:
        view.close()
        d.close()
    assert not list(Path(shm_dir).iterdir())  # every table unlinked


def test_an_entry_too_big_is_not_listed_and_its_older_version_goes(shm_dir: str) -> None:
    d = Directory(shm_dir, entries=16)
    view = DirectoryView(shm_dir, d.name, d.size)
    try:
        assert d.publish("b", 1, 1, False, _wire(1))
        huge = [["t" * 100, "float32", [1], [1], "tb-1-00", 0, "cpu"]] * (ENTRY_SIZE // 100)
        assert not d.publish("b", 2, 2, True, huge)
        assert view.find(b"b") is None  # its gets ask the broker, never see version 1
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


def test_a_reader_follows_a_rebuild_through_the_old_header(shm_dir: str) -> None:
    d = Directory(shm_dir, entries=8)
    view = DirectoryView(shm_dir, d.name, d.size)
    first = d.name
    try:
        for i in range(6):  # the sixth key does not fit a third-empty table of 8
            assert d.publish(f"k{i}", 1 + i, 1, False, _wire(i))
        assert d.name != first
        assert [view.find(f"k{i}".encode()) is not None for i in range(6)] == [True] * 6
    finally:
        view.close()
        d.close()
