"""A broadcast queue's ring, as the broker keeps it and a subscriber takes from it (Note
[broadcast ring] in common/ring.py), on a real segment in a temporary directory."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tensorbroker.common import _shm
from tensorbroker.common.ring import BITS, CLOSED, R_END, R_MEMBERS, R_WHY
from tensorbroker.server.arena import Block
from tensorbroker.server.rings import Ring
from tensorbroker.server.state import Journal

SLOTS = 4


@dataclass(eq=False)
class Item:
    """What the ring reads of a StoredObject."""

    oid: int
    block: Block = field(default_factory=lambda: Block("tb-seg", 4096, 4096))
    key: str = "stream"
    bundle: bool = False
    device: str = "cpu"
    wire: list[list[object]] = field(
        default_factory=lambda: [["", "float32", [4], [1], "tb-seg", 4096, "cpu"]]
    )


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[Ring]:
    r = Ring(str(tmp_path), "tb-test-", Journal(), SLOTS)
    yield r
    r.close()


def publish(ring: Ring, item: Item, version: int) -> None:
    tail = ring.tail(item)
    assert tail is not None
    ring.post(version, ring.mask_for(version), item, tail)
    ring.flush()


def test_each_subscription_takes_each_item_once_and_the_last_to_let_go_says_so(
    ring: Ring,
) -> None:
    a, b = ring.join(1, 1), ring.join(2, 1)
    assert (a, b) == (0, 1)
    seen = _shm.bell(ring.addr)
    publish(ring, Item(oid=7), 1)
    assert _shm.bell(ring.addr) == seen + 1  # every sleeper woken
    assert _shm.ring_take(ring.addr, SLOTS, 2, a) is None  # not published yet
    flags, index, oid, _, base, tail, _ = _shm.ring_take(ring.addr, SLOTS, 1, a)  # type: ignore[misc]
    assert (flags, index, oid, base) == (0, 1, 7, 4096) and tail == ring.tail(Item(oid=7))
    assert _shm.ring_take(ring.addr, SLOTS, 1, a) is False  # taken already
    assert ring.done(1) is None  # b has not taken it, a holds it
    assert _shm.ring_take(ring.addr, SLOTS, 1, b) is not None
    assert not _shm.ring_release(ring.addr, 1, 1, 0, 1 << a)
    assert _shm.ring_release(ring.addr, 1, 1, 0, 1 << b)  # the last: it tells the broker
    posted = ring.done(1)
    assert posted is not None and posted.item.oid == 7
    assert _shm.ring_release(ring.addr, 1, 1, 0, 1 << b) is False  # emptied: nothing to do


def test_items_wait_in_order_for_a_free_slot_and_a_kept_one_does_not_stop_the_stream(
    ring: Ring,
) -> None:
    bit = ring.join(1, 1)
    assert bit is not None
    for v in range(1, SLOTS + 3):
        publish(ring, Item(oid=v), v)
    assert [p.version for p in ring.waiting] == [SLOTS + 1, SLOTS + 2]
    assert _shm.ring_take(ring.addr, SLOTS, SLOTS + 1, bit) is None  # no slot free for it
    for v in range(1, SLOTS + 1):  # v1 is kept; the others are let go
        taken = _shm.ring_take(ring.addr, SLOTS, v, bit)
        assert isinstance(taken, tuple)
        if v > 1:
            assert _shm.ring_release(ring.addr, taken[1], v, 0, 1 << bit)
            ring.done(v)
    ring.flush()
    assert not ring.waiting
    for v in (SLOTS + 1, SLOTS + 2):  # in the slots the others left, v1 still held
        taken = _shm.ring_take(ring.addr, SLOTS, v, bit)
        assert isinstance(taken, tuple) and taken[1] != 1


def test_a_subscription_that_ends_keeps_what_it_took_until_its_process_is_gone(
    ring: Ring,
) -> None:
    session = object()
    a, b = ring.join(1, 1), ring.join(2, 1)
    assert a is not None and b is not None
    publish(ring, Item(oid=1), 1)
    publish(ring, Item(oid=2), 2)
    _shm.ring_take(ring.addr, SLOTS, 1, a)
    _shm.ring_take(ring.addr, SLOTS, 1, b)
    _shm.ring_take(ring.addr, SLOTS, 2, b)
    _shm.ring_release(ring.addr, 2, 2, 0, 1 << b)
    assert ring.leave(1, session, gone=False) == [2]  # a never took v2: v2 is done
    assert ring.done(2) is not None
    assert not _shm.load(ring.addr + R_MEMBERS) & 1 << a  # its waiting get ends
    assert ring.join(3, 3) not in (a, None)  # a's bit is still held in slot 1
    _shm.ring_release(ring.addr, 1, 1, 0, 1 << b)
    assert ring.idle() == []  # a's hold on v1 stays while its process lives
    assert ring.session_gone(session) == [1]


def test_bits_run_out_then_subscriptions_read_through_messages(ring: Ring) -> None:
    assert [ring.join(sub, 1) for sub in range(BITS)] == list(range(BITS))
    assert ring.join(BITS, 1) is None


def test_a_late_subscription_is_not_given_earlier_items(ring: Ring) -> None:
    a = ring.join(1, 1)
    late = ring.join(2, 3)
    assert a is not None and late is not None
    assert ring.mask_for(2) == 1 << a
    assert ring.mask_for(3) == 1 << a | 1 << late


def test_an_item_a_slot_cannot_describe_is_asked_for(ring: Ring) -> None:
    bit = ring.join(1, 1)
    assert bit is not None
    wide = Item(oid=3, bundle=True)
    wide.wire = [[f"tensor-{i:03d}-with-a-long-name", "float32", [4], [1], "tb-seg", 4096, "cpu"]
                 for i in range(40)]  # fmt: skip
    assert ring.tail(wide) is None
    assert ring.tail(Item(oid=4, device="cuda:0")) is None
    ring.post(1, ring.mask_for(1), None, b"")
    ring.flush()
    flags, *_, idle = _shm.ring_take(ring.addr, SLOTS, 1, bit)  # type: ignore[misc]
    assert flags & 1 and idle  # the only subscription took it: the broker is told


def test_the_end_of_the_stream_is_written_after_its_items(ring: Ring) -> None:
    ring.join(1, 1)
    ring.post(1, ring.mask_for(1), Item(oid=1), ring.tail(Item(oid=1)) or b"")
    ring.end(CLOSED, 1)
    assert _shm.load(ring.addr + R_END) == 0  # nothing before the journal's commit
    ring.flush()
    assert (_shm.load(ring.addr + R_END), _shm.load(ring.addr + R_WHY)) == (2, CLOSED)
