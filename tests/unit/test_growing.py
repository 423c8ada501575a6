"""A put that needs a new segment waits for it off the broker's loop (Note [growing] in
server/store/arena.py): the segment is made on a thread, the put parks, and the loop takes
the segment in and grants the puts that waited, in their order. Backing a segment's pages
is held here at a gate (os.posix_fallocate), so the tests see the put wait, not a timing."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest

from tensorbroker.common.errors import CapacityError
from tensorbroker.common.protocol import Request
from tensorbroker.server.broker import Broker
from tensorbroker.server.cluster import lending
from tensorbroker.server.cluster.records import Pull
from tensorbroker.server.durability.journal import JournalFile, read_journal
from tensorbroker.server.store.arena import Arena, Growing
from tensorbroker.server.store.objects import Objects
from tensorbroker.server.store.parking import ParkingLot
from tensorbroker.server.store.records import Session
from tensorbroker.server.store.registry import Registry
from tests.nodes import Node, pair, quad, run

__all__ = ["pair", "quad"]  # the fixtures

MiB = 2**20


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Segments made on the arena's thread while it is closed wait for it (their pages backed
    once it opens); those made at once do not."""
    opened, fallocate = threading.Event(), os.posix_fallocate

    def held(fd: int, offset: int, length: int) -> None:
        if threading.current_thread().name == "arena-growth":
            assert opened.wait(30), "the gate was never opened"
        fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", held)
    yield opened
    opened.set()  # (a test that failed with a segment still waiting lets it end)


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[Arena]:
    made = Arena(16 * MiB, shm_dir=str(tmp_path), prefix="tb-9row-", chunk_size=2 * MiB)
    yield made
    made.close()
    assert list(tmp_path.iterdir()) == []  # also a segment made as it closed


def _grown(arena: Arena) -> Any:
    deadline = time.monotonic() + 30
    while (growth := arena.grown()) is None:
        assert time.monotonic() < deadline, "the segment was never made"
        time.sleep(0.001)
    return growth


def test_an_allocation_that_waits_has_its_segment_made_on_a_thread(
    arena: Arena, gate: threading.Event
) -> None:
    with pytest.raises(Growing):
        arena.allocate(3 * MiB, wait=True)
    assert arena.growing and arena.segments == [] and arena.grown() is None
    with pytest.raises(Growing):  # (the segment under way may hold it too)
        arena.allocate(MiB, wait=True)
    gate.set()
    growth = _grown(arena)
    assert growth.error is None and not arena.growing
    assert arena.reserved_bytes == 4 * MiB  # (3 MiB and its alignment, in 2 MiB pages)
    first, second = arena.allocate(3 * MiB, wait=True), arena.allocate(MiB // 2, wait=True)
    assert first is not None and second is not None and first.segment == second.segment


def test_an_allocation_made_at_once_that_does_not_fit_waits_for_the_segment_under_way(
    arena: Arena, gate: threading.Event
) -> None:
    """(A queue item, say: made at once, a segment would pass the capacity with the one
    under way, and it would fail although that one holds it.)"""
    with pytest.raises(Growing):
        arena.allocate(12 * MiB, wait=True)  # a 14 MiB segment, of 16
    threading.Timer(0.05, gate.set).start()
    block = arena.allocate(3 * MiB)
    assert block is not None and not arena.growing and arena.reserved_bytes == 14 * MiB
    growth = arena.grown()  # (still said: the puts that waited for it try again)
    assert growth is not None and growth.error is None and growth.over
    assert arena.grown() is None


def test_a_segment_made_as_the_arena_closes_is_removed(
    tmp_path: Path, gate: threading.Event
) -> None:
    arena = Arena(16 * MiB, shm_dir=str(tmp_path), prefix="tb-9row-", chunk_size=2 * MiB)
    with pytest.raises(Growing):
        arena.allocate(MiB, wait=True)
    threading.Timer(0.05, gate.set).start()
    arena.close()  # (waits for the thread: its file goes too)
    assert list(tmp_path.iterdir()) == []


# -- puts ------------------------------------------------------------------------------------


def _put(i: int, key: str, nbytes: int) -> Request:
    tensors = [["", "uint8", [nbytes]]]
    return Request("put", i, {"key": key, "tensors": tensors}, [])


@pytest.fixture
def objects(arena: Arena) -> Iterator[tuple[Objects, list[tuple[bytes, dict[str, Any]]]]]:
    sent: list[tuple[bytes, dict[str, Any]]] = []

    def send(route: bytes, payload: bytes, last: bool = False) -> None:
        sent.append((route, msgpack.unpackb(payload)))

    yield Objects(Registry(arena), ParkingLot(), send), sent


def _answers(objects: Objects, sent: list[Any], n: int) -> list[tuple[bytes, dict[str, Any]]]:
    deadline = time.monotonic() + 30
    while len(sent) < n:  # (the broker's loop calls it each turn)
        assert time.monotonic() < deadline, f"{len(sent)} of {n} puts answered"
        objects.retry_growing_puts()
        time.sleep(0.001)
    return sent


def test_puts_that_need_a_new_segment_wait_for_it_and_are_granted_in_their_order(
    objects: tuple[Objects, list[Any]], gate: threading.Event
) -> None:
    store, sent = objects
    s = Session("a" * 8, None)
    assert store.put(s, b"one", _put(1, "big", 3 * MiB)) is None  # parked, not made here
    assert store.put(s, b"two", _put(2, "small", MiB // 4)) is None  # behind it
    assert sent == [] and store.registry.arena.growing
    gate.set()
    answers = _answers(store, sent, 2)
    assert [(route, m["id"]) for route, m in answers] == [(b"one", 1), (b"two", 2)]
    assert all("put" in m and "error" not in m for _, m in answers), answers
    assert store.put(s, b"three", _put(3, "more", 64)) is not None  # room now: at once


def test_puts_that_waited_for_a_segment_that_could_not_be_made_fail_saying_why(
    objects: tuple[Objects, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """...unless room came back meanwhile: those that fit now are granted, and none of them
    makes another segment (which would fail as that one did)."""
    store, sent = objects
    arena = store.registry.arena
    held = arena.allocate(2 * MiB - 4096)  # (a 2 MiB segment, made at once: nearly full)
    assert held is not None
    made, fallocates = threading.Event(), []

    def full(fd: int, offset: int, length: int) -> None:
        fallocates.append(length)
        made.wait(30)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    s = Session("a" * 8, None)
    assert store.put(s, b"one", _put(1, "big", 3 * MiB)) is None
    assert store.put(s, b"two", _put(2, "other", 3 * MiB // 2)) is None
    assert store.put(s, b"three", _put(3, "third", 3 * MiB // 2)) is None
    arena.free(held)  # (a delete, say: room for one of the two)
    made.set()
    answers = _answers(store, sent, 3)
    assert [m["id"] for _, m in answers] == [1, 2, 3]
    (_, big), (_, other), (_, third) = answers
    for m, key in ((big, "big"), (third, "third")):
        assert m["code"] == CapacityError.code, m
        assert repr(key) in m["error"] and "tmpfs is full" in m["error"], m
    assert "put" in other and "error" not in other, other
    assert len(fallocates) == 1 and not arena.growing and len(arena.segments) == 1


# -- pulls of other nodes' versions (cluster objects stepped by hand: tests/nodes.py) --------


def _pulls(node: Node, key: str) -> list[Pull]:
    return [p for p in node.cluster.replicas.pulls.pulls.values() if p.key == key]


def _has(node: Node, key: str) -> bool:
    return key in node.registry.objects and not _pulls(node, key)


def _made(*nodes: Node) -> None:
    for n in nodes:  # (their first chunk made, as a broker's at start: only the others grow)
        n.arena.free(n.arena.allocate(1))  # type: ignore[arg-type]


def _waiting(node: Node, key: str) -> Pull:
    """`node`'s pull of `key`, lent and waiting for `node`'s memory to grow."""
    (pull,) = _pulls(node, key)
    assert pull.room is not None and pull.handle is None and node.arena.growing
    assert key not in node.reads.started
    return pull


def test_a_pull_that_needs_a_new_segment_reads_its_loan_once_it_is_made(
    pair: Callable[[str], Node], gate: threading.Event
) -> None:
    a, b = nodes = [pair("a"), pair("b")]
    assert run(nodes, 5, lambda: a.up("b") and b.up("a"))
    _made(a)
    a.put("w", 3 * MiB)
    assert run(nodes, 5, lambda: b.knows("w")) and b.get("w")
    assert run(nodes, 5, lambda: bool(_pulls(b, "w")) and _pulls(b, "w")[0].room is not None)
    run(nodes, 0.2)  # (b's loop goes on, its loan held)
    _waiting(b, "w")
    gate.set()
    b.reads.over = True
    assert run(nodes, 5, lambda: _has(b, "w"))
    assert a.cluster.replicas.lending.bytes_sent == 3 * MiB  # (lent once)


def _d_waits_for_memory(quad: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch) -> list[Node]:
    """a puts w (1 MiB: a large version here); b and c read it from a; d is sent to one of
    them, a relay, which lends it at once, and d waits for its memory to grow."""
    monkeypatch.setattr(lending, "CHUNK", 64 * 1024)
    a, b, c, d = nodes = [quad(name) for name in "abcd"]
    assert run(nodes, 5, lambda: all(n.up(m.name) for n in nodes for m in nodes if m is not n))
    _made(a, b, c)
    a.put("w", MiB)
    assert run(nodes, 5, lambda: all(n.knows("w") for n in (b, c, d)))
    assert b.get("w") and c.get("w")
    assert run(nodes, 5, lambda: b.reads.started == ["w"] and c.reads.started == ["w"])
    assert d.get("w")
    assert run(nodes, 5, lambda: any(p.room is not None for p in _pulls(d, "w")))
    assert _waiting(d, "w").source in ("b", "c")
    return nodes


def test_a_borrower_waiting_for_memory_reads_what_its_relay_said_it_has_meanwhile(
    quad: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch, gate: threading.Event
) -> None:
    a, b, c, d = nodes = _d_waits_for_memory(quad, monkeypatch)
    pull = _waiting(d, "w")
    for n in (b, c):
        n.reads.over = True
    assert run(nodes, 5, lambda: _has(b, "w") and _has(c, "w"))
    assert run(nodes, 2, lambda: pull.room is not None and pull.room[0].get("ready") == MiB)
    gate.set()
    d.reads.over = True  # (a read ends once all it reads is there: the relay said it is)
    assert run(nodes, 5, lambda: _has(d, "w"))
    assert a.cluster.replicas.lending.bytes_sent == 2 * MiB  # (d's from its relay)


def test_a_borrower_whose_relay_forgot_it_while_its_memory_grew_reads_from_the_owner(
    quad: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch, gate: threading.Event
) -> None:
    """What a node that forgot this one lent it may be let go already: never read."""
    a, b, c, d = nodes = _d_waits_for_memory(quad, monkeypatch)
    relay = _waiting(d, "w").source
    d.cluster.replicas.pulls.forget(relay)
    (pull,) = _pulls(d, "w")
    assert pull.room is None and pull.source == "a"  # (asked of the owner, directly)
    gate.set()
    for n in (b, c, d):
        n.reads.over = True
    assert run(nodes, 5, lambda: all(_has(n, "w") for n in (b, c, d)))
    assert a.cluster.replicas.lending.bytes_sent == 3 * MiB


def test_a_borrower_whose_relay_went_down_while_its_memory_grew_reads_from_the_owner(
    quad: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch, gate: threading.Event
) -> None:
    """Its loan is gone with the relay, and the owner's answer to its lend again is read
    (it was dropped, as an answer to no lend of a pull that had a version, every PULL_WAIT
    for as long as the get waited)."""
    a, b, c, d = nodes = _d_waits_for_memory(quad, monkeypatch)
    relay = _waiting(d, "w").source
    d.cluster.replicas.pulls.node_down(relay)  # (as the cluster calls it: taken for down)
    (pull,) = _pulls(d, "w")
    assert pull.room is None and pull.version == 0 and pull.source == "a"
    gate.set()
    for n in (b, c, d):
        n.reads.over = True
    assert run(nodes, 5, lambda: all(_has(n, "w") for n in (b, c, d)))


def test_a_segment_its_cluster_could_not_register_is_not_left_in_the_journal(
    tmp_path: Path, gate: threading.Event
) -> None:
    """The arena removes a segment it could not take in; a state whose journal still named
    it could not be adopted (an arena segment missing: start again with --reset)."""
    (tmp_path / "state").mkdir()
    journal = JournalFile(str(tmp_path / "state"), "9row", None)

    class Refusing:
        def segment(self, name: str) -> None:
            raise OSError("NIXL could not register it")

    broker = SimpleNamespace(state=SimpleNamespace(journal=journal), cluster=Refusing())
    made = Arena(
        16 * MiB, shm_dir=str(tmp_path), prefix="tb-9row-", chunk_size=2 * MiB,
        on_segment=lambda segment: Broker._segment_made(broker, segment),  # type: ignore[arg-type]
    )  # fmt: skip
    with pytest.raises(Growing):
        made.allocate(MiB, wait=True)
    gate.set()
    growth = _grown(made)
    assert isinstance(growth.error, OSError) and "register" in str(growth.error)
    journal.close()
    found = read_journal(str(tmp_path / "state"))
    assert found is not None and found.segments == {}
    assert [p.name for p in tmp_path.iterdir()] == ["state"]  # (the segment's file is gone)
    made.close()
