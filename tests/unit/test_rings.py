"""A broadcast queue's ring, as the broker keeps it and a subscriber takes from it (Note
[broadcast ring] in common/ring.py), on a real segment in a temporary directory."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tensorbroker.common import _shm
from tensorbroker.common.ring import BITS, CLOSED, R_END, R_MEMBERS, R_WHY, REMOVED, slot_seq
from tensorbroker.server.durability.journal import Journal
from tensorbroker.server.queues.broadcast import QueueRings
from tensorbroker.server.queues.queue_state import BrokerQueue
from tensorbroker.server.queues.rings import Ring
from tensorbroker.server.store.arena import Block

SLOTS = 4


@dataclass(eq=False)
class Item:
    """What the ring reads of a StoredObject."""

    oid: int
    block: Block = field(default_factory=lambda: Block("tb-seg", 4096, 4096))
    key: str = "stream"
    bundle: bool = False
    device: str = "cpu"
    queue: object = None
    version: int = 0
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
    ring.leave(1, session, gone=False)
    assert _shm.load(ring.addr + R_MEMBERS) & 1 << a  # nothing before the journal's commit
    assert ring.flush() == [2]  # a never took v2: v2 is done
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


def unread(ring: Ring, index: int) -> int:
    return _shm.load(slot_seq(ring.addr, index) + 8)


def test_a_leave_is_written_after_the_commit_and_after_the_end_before_it(ring: Ring) -> None:
    """A removed queue's end is staged before its subscriptions leave: a subscriber that
    finds its bit gone (it reads `members` first) finds the end written, so it is told
    "removed", not that its subscription ended. And nothing of a leave is written before
    the journal has it (`flush`)."""
    a, b = ring.join(1, 1), ring.join(2, 1)
    assert a is not None and b is not None
    publish(ring, Item(oid=1), 1)
    ring.end(REMOVED, 1)
    ring.leave(1, object(), gone=False)
    ring.leave(2, object(), gone=True)
    assert ring.join(3, 2) not in (a, b)  # their bits are not given again meanwhile
    assert _shm.load(ring.addr + R_MEMBERS) & (1 << a | 1 << b) == 1 << a | 1 << b
    assert unread(ring, 1) == 1 << a | 1 << b and _shm.load(ring.addr + R_END) == 0
    seen = _shm.bell(ring.addr)
    assert ring.flush() == [1]  # neither takes v1 now
    assert _shm.bell(ring.addr) > seen  # their gets waiting end
    assert not _shm.load(ring.addr + R_MEMBERS) & (1 << a | 1 << b)
    assert _shm.load(ring.addr + R_WHY) == REMOVED


@dataclass
class Registry:
    """What QueueRings asks of the registry at adoption."""

    pinned: list[int] = field(default_factory=list)
    journal: Journal = field(default_factory=Journal)

    def pin(self, obj: Item) -> None:
        self.pinned.append(obj.oid)

    def unpin(self, obj: Item) -> None:
        self.pinned.remove(obj.oid)


def adopt(tmp_path: Path, name: str, subs: dict[int, tuple[int, int]]) -> BrokerQueue:
    """A broker that comes back adopts the ring `name` of queue 1, whose journal row lists
    the subscriptions `subs` (sub -> bit, first version) of clients that came back."""
    session = object()
    q = BrokerQueue("stream", 1, SLOTS // 2, sealed=2, subs={sub: session for sub in subs})  # type: ignore[misc]
    items = {n: Item(oid=n, queue=q, version=n) for n in (1, 2)}  # both written to slots
    rings = QueueRings(Registry(), lambda q: None)  # type: ignore[arg-type]
    rings.make = lambda slots, existing: Ring(
        str(tmp_path), "tb-test-", Journal(), slots, existing=existing
    )
    rings.adopt(q, name)
    assert q.ring is not None
    for sub, (bit, start) in subs.items():
        q.ring.bits[sub], q.ring.starts[sub] = bit, start
    rings.adopted(items)  # type: ignore[arg-type]
    return q


def test_a_broker_killed_between_leaves_and_their_commit_comes_back_with_them_served(
    ring: Ring, tmp_path: Path
) -> None:
    """The journal still has the subscriptions: so does the ring (nothing of the leaves was
    written), and each goes on at its cursor."""
    a, b = ring.join(1, 1), ring.join(2, 1)
    assert a is not None and b is not None
    publish(ring, Item(oid=1), 1)
    publish(ring, Item(oid=2), 2)
    assert isinstance(_shm.ring_take(ring.addr, SLOTS, 1, a), tuple)
    ring.end(REMOVED, 2)
    ring.leave(1, object(), gone=False)
    ring.leave(2, object(), gone=False)  # ... and the broker dies before its commit
    q = adopt(tmp_path, ring.name, {1: (a, 1), 2: (b, 1)})
    adopted = q.ring
    assert adopted is not None and sorted(q.subs or ()) == [1, 2]
    assert _shm.load(adopted.addr + R_MEMBERS) == 1 << a | 1 << b
    assert _shm.load(adopted.addr + R_END) == 0
    for bit, version in ((a, 2), (b, 1), (b, 2)):
        assert isinstance(_shm.ring_take(adopted.addr, SLOTS, version, bit), tuple)
    adopted.close(unlink=False)


def test_an_adopted_subscription_the_ring_does_not_list_ended(ring: Ring, tmp_path: Path) -> None:
    """A broker before leaves waited for the commit wrote a leave (members, and some slots'
    bits) and died before its commit: that subscription comes back ended, its bits gone
    from every slot, and the rest of the ring as the journal has it (a join it never got
    is not listed)."""
    a, b = ring.join(1, 1), ring.join(2, 1)
    assert a is not None and b is not None
    publish(ring, Item(oid=1), 1)
    publish(ring, Item(oid=2), 2)
    _shm.ring_release(ring.addr, 1, 1, 1 << a, 0)  # the old leave of a: v1's bit, not v2's
    _shm.store(ring.addr + R_MEMBERS, 1 << b | 1 << 9)  # and a join the journal never got
    q = adopt(tmp_path, ring.name, {1: (a, 1), 2: (b, 1)})
    adopted = q.ring
    assert adopted is not None and list(q.subs or ()) == [2] and list(adopted.bits) == [2]
    assert _shm.load(adopted.addr + R_MEMBERS) == 1 << b
    assert unread(adopted, 1) == unread(adopted, 2) == 1 << b
    adopted.close(unlink=False)
