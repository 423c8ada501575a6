"""Queue rings (Note [queue ring] in common/qring.py): a bounded queue's items go between
processes through shared memory, the broker off the path, keeping every queue guarantee:
each item once, in order per producer, `maxsize` in flight, and a producer or consumer that
dies at any step loses nothing else and holds nothing up."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
from support import CHILDREN, GaveUp, interrupt_after, join_all, wait_until
from workers import shm_mapping

import tensorbroker as tb
from tensorbroker.client import qring_asks
from tensorbroker.client.shm import SegmentGone
from tensorbroker.common import _shm
from tensorbroker.common.qring import (
    FREE,
    INLINE,
    Q_TAIL,
    QUEUED,
    SKIP,
    WRITING,
    QueueRingView,
    state,
)  # fmt: skip


@pytest.fixture
def c(fresh_broker: tb.BrokerProcess) -> Any:
    with tb.connect(fresh_broker.address) as client:
        yield client


# -- children -------------------------------------------------------------------------------


def streamer(address: str, name: str, tag: int, count: int) -> None:
    with tb.connect(address) as client:
        q = client.queue(name)
        for i in range(count):
            q.put(np.full(1024, tag * 100_000 + i, np.float32))


def taker(address: str, name: str, keep: int, results: Any) -> None:
    """Take items until the queue closes, keeping the last `keep` alive while it takes the
    next; report (value, version, whether the data lay in the queue's ring) of each."""
    with tb.connect(address) as client:
        q = client.queue(name)
        ring = q._ring
        assert ring is not None
        got, kept = [], []
        for item in q:
            where = shm_mapping(item.data_ptr)
            got.append((int(item.numpy()[0]), item.version, where == f"/dev/shm/{ring.segment}"))
            kept.append(item)
            del item
            if len(kept) > keep:
                kept.pop(0)
        results.put(got)


def pinger(address: str, name: str, count: int, conn: Any) -> None:
    """Ping-pong's consumer: say each item's value as soon as it has it, then ask again."""
    with tb.connect(address) as client:
        q = client.queue(name)
        conn.send("ready")
        for _ in range(count):
            item = q.get(timeout=30)
            conn.send(int(item.numpy()[0]))
            del item


def dies_writing(address: str, name: str) -> None:
    """Take a slot and a position, then die before the item is published."""
    with tb.connect(address) as client:
        ring = client.queue(name)._ring
        assert ring is not None
        qring_asks.reserve(ring, None, [])
        os._exit(0)


def dies_holding(address: str, name: str, count: int) -> None:
    """Take `count` items and die holding them (and in the middle of taking one more)."""
    with tb.connect(address) as client:
        q = client.queue(name)
        held = [q.get(timeout=10) for _ in range(count)]
        assert len(held) == count
        QueueRingView._taken = lambda self, entry, pos: os._exit(0)  # type: ignore[method-assign]
        q.get(timeout=10)
    os._exit(3)  # it never took the next one


def dies_claiming(address: str, name: str) -> None:
    """Take a slot, claim the position at the tail's entry, and die before the tail moves."""
    with tb.connect(address) as client:
        ring = client.queue(name)._ring
        assert ring is not None
        view = ring.view
        view.alloc(ring.owner)
        pos = _shm.load(view.addr + Q_TAIL) >> 2
        assert _shm.cas(view.entry(pos), state(pos, 0, FREE), state(pos, ring.owner, WRITING))
        os._exit(0)


def dies_publishing(address: str, name: str) -> None:
    """Write an item whole, and die before its entry says so."""
    with tb.connect(address) as client:
        ring = client.queue(name)._ring
        assert ring is not None
        planned = ring.plan(np.full(2, 9.0), None, None, False)
        claimed: list[int] = []
        qring_asks.reserve(ring, None, claimed)
        slot, pos = claimed
        ring._copy(planned[0], slot)
        ring.view.name(pos, slot, INLINE, planned[1])
        _shm.store(ring.view.meta(slot), ring.owner << 2 | QUEUED)
        os._exit(0)


def dies_passing_over(address: str, name: str) -> None:
    """Take the item at the head, then die taking the entry passed over after it."""
    with tb.connect(address) as client:
        q = client.queue(name)
        first = q.get(timeout=10)
        passed_over = QueueRingView._taken

        def die_there(self: QueueRingView, entry: int, pos: int) -> None:
            if _shm.load(entry + 8) & SKIP:
                os._exit(0)
            passed_over(self, entry, pos)

        QueueRingView._taken = die_there  # type: ignore[method-assign]
        del first
        q.get(timeout=10)
    os._exit(3)


# -- the patterns ---------------------------------------------------------------------------


def test_a_stream_goes_through_shared_memory_each_item_once_in_order(c: tb.Client) -> None:
    q = c.queue("stream", maxsize=8)
    assert q._ring is not None
    results = CHILDREN.Queue()
    consumer = CHILDREN.Process(target=taker, args=(c.address, "stream", 0, results))
    consumer.start()
    for i in range(2000):
        assert q.put(np.full(1024, i, np.float32)) == i + 1  # its place in the stream
    q.close()
    got = results.get(timeout=60)
    join_all([consumer])
    assert [v for v, _, _ in got] == list(range(2000))
    assert [version for _, version, _ in got] == list(range(1, 2001))
    assert all(in_ring for _, _, in_ring in got), "an item was not read where it was written"
    assert wait_until(lambda: q.in_flight() == 0, 5)
    assert c.stats()["queues"] == 0  # closed and drained: ended


def test_ping_pong_each_item_once_in_order(c: tb.Client) -> None:
    q = c.queue("pingpong", maxsize=8)
    here, there = CHILDREN.Pipe()
    consumer = CHILDREN.Process(target=pinger, args=(c.address, "pingpong", 300, there))
    consumer.start()
    assert here.recv() == "ready"
    for i in range(300):
        q.put(np.full(1024, i, np.float32))
        assert here.poll(30) and here.recv() == i
    join_all([consumer])
    assert wait_until(lambda: q.in_flight() == 0, 5)


def test_producers_and_consumers_that_keep_items_each_item_once_in_order(c: tb.Client) -> None:
    """Consumers that keep an item while they take the next hold up nothing but those items'
    share of maxsize (a ring that gave positions the slots of held items would stall)."""
    q = c.queue("mixed", maxsize=4)
    results = CHILDREN.Queue()
    takers = [CHILDREN.Process(target=taker, args=(c.address, "mixed", 1, results))
              for _ in range(3)]  # fmt: skip
    makers = [CHILDREN.Process(target=streamer, args=(c.address, "mixed", tag, 300))
              for tag in (1, 2)]  # fmt: skip
    for p in takers + makers:
        p.start()
    join_all(makers)
    q.close()
    got = [results.get(timeout=60) for _ in takers]
    join_all(takers)
    values = [v for g in got for v, _, _ in g]
    assert sorted(values) == sorted([t * 100_000 + i for t in (1, 2) for i in range(300)])
    for g in got:  # each consumer saw each producer's items in order, and versions go up
        for tag in (1, 2):
            mine = [v for v, _, _ in g if v // 100_000 == tag]
            assert mine == sorted(mine)
        assert [version for _, version, _ in g] == sorted(version for _, version, _ in g)


def test_maxsize_bounds_items_in_flight_and_a_put_waits_for_a_let_go(c: tb.Client) -> None:
    q = c.queue("bounded", maxsize=2)
    q.put(np.zeros(4))
    q.put(np.zeros(4))
    with pytest.raises(tb.Timeout, match=r"2 of 2 in flight\) stayed full for 0.1s"):
        q.put(np.zeros(4), timeout=0.1)
    first = q.get(timeout=0)
    assert q.in_flight() == 2 and len(q) == 1  # a held item keeps its slot
    del first
    assert q.put(np.zeros(4), timeout=1) == 3


# -- what the ring cannot hold, and the broker's part ----------------------------------------


def test_items_the_ring_cannot_hold_keep_their_place(c: tb.Client) -> None:
    """An item larger than a slot, a bundle and one written in place go through the broker,
    at the position their producer claimed: consumers get every item in put order."""
    q = c.queue("sizes", maxsize=8)
    ring = q._ring
    assert ring is not None
    big = np.arange(ring.view.data // 4 + 1024, dtype=np.float32)
    q.put(np.full(4, 0.0))
    assert q.put(big, wait=False) is None and q.put(np.zeros(1), wait=False) is None
    assert q.get(timeout=5).version == 1 and q.get(timeout=5).numpy().size == big.size
    assert q.get(timeout=5).version == 3
    q.put(np.full(4, 0.0))
    q.put(big, wait=False)
    q.put({"a": np.full(3, 2.0), "b": np.full(2, 2.0)})
    with q.create((5,), "float32") as buf:
        buf.numpy()[:] = 3.0
    del buf  # (its writer's hold)
    q.put(np.full(4, 4.0))
    got = [q.get(timeout=5) for _ in range(5)]
    versions = [g["a"].version if isinstance(g, dict) else g.version for g in got]
    assert versions == [4, 5, 6, 7, 8]
    assert got[0].numpy().tolist() == [0.0] * 4
    assert np.array_equal(got[1].numpy(), big)
    assert got[2]["a"].numpy().tolist() == [2.0] * 3 and got[2]["b"].numpy().tolist() == [2.0] * 2
    assert got[3].numpy().tolist() == [3.0] * 5
    assert got[4].numpy().tolist() == [4.0] * 4
    del got
    assert wait_until(lambda: q.in_flight() == 0 and c.stats()["used_bytes"] == 0, 5)


def test_a_client_without_rings_is_told_so(
    c: tb.Client, fresh_broker: tb.BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    c.queue("ringed", maxsize=2)
    monkeypatch.setenv("TENSORBROKER_QUEUE_RINGS", "off")
    with tb.connect(fresh_broker.address) as other:
        assert other.queue("unringed", maxsize=2)._ring is None  # made without one: fine
        with pytest.raises(tb.InvalidRequest, match="served through shared memory"):
            other.queue("ringed")


# -- ends ----------------------------------------------------------------------------------


def test_close_ends_waiting_consumers_after_the_items_and_refuses_puts(c: tb.Client) -> None:
    q = c.queue("closing", maxsize=2)
    q.put(np.ones(2))
    q.close()
    with pytest.raises(tb.QueueClosed, match="takes no more puts"):
        q.put(np.ones(2))
    assert q.get(timeout=1).numpy().tolist() == [1.0, 1.0]
    with pytest.raises(tb.QueueClosed, match="closed and drained"):
        q.get(timeout=5)
    assert list(c.queue("closing")) == []


def test_a_queue_whose_ring_ends_as_it_is_opened_reads_as_closed(
    c: tb.Client, fresh_broker: tb.BrokerProcess
) -> None:
    """The queue is drained and ends between the broker's answer to an open, which names its
    ring, and the mapping of that ring: the broker unlinked it. The open does not fail
    (it raised "cannot open the broker's segment"): the queue reads as closed."""
    q = c.queue("ending", maxsize=2)
    q.put(np.ones(2))
    q.close()
    got: list[Any] = []
    with tb.connect(fresh_broker.address) as late:
        segments = late._transfer.segments
        get = segments.get

        def drained_first(name: str) -> Any:
            if name not in segments._maps and not got:  # (the ring: not mapped yet)
                got.append(q.get(timeout=5).numpy().tolist())  # (let go: the queue ends)
                path = os.path.join(segments._dir, name)  # (seen ended, by stats say)
                assert wait_until(lambda: c.stats() and not os.path.exists(path), 5)
            return get(name)

        segments.get = drained_first  # type: ignore[method-assign]
        ending = late.queue("ending")
        with pytest.raises(tb.QueueClosed, match="closed and drained"):
            ending.get(timeout=5)
    assert got == [[1.0, 1.0]]


def test_a_ring_whose_segment_is_gone_while_its_queue_lives_is_an_error(
    c: tb.Client, fresh_broker: tb.BrokerProcess
) -> None:
    """A ring's segment gone for another reason (a cleaner of /dev/shm, say) while its queue
    lives: the open asks again and says so, rather than use the queue without its ring (its
    items would not be seen)."""
    c.queue("live", maxsize=2).put(np.ones(2))
    with tb.connect(fresh_broker.address) as late:
        segments, tried = late._transfer.segments, []
        get = segments.get

        def gone(name: str) -> Any:
            if name not in segments._maps:  # (the ring: not mapped yet)
                tried.append(name)
                raise SegmentGone(f"cannot open the broker's segment {name}")
            return get(name)

        segments.get = gone  # type: ignore[method-assign]
        with pytest.raises(tb.BrokerUnavailable, match="cannot open the broker's segment"):
            late.queue("live")
    assert len(tried) == 2  # (asked again: the ring named again)


def test_a_removed_queue_ends_its_waiters(c: tb.Client) -> None:
    q = c.queue("doomed", maxsize=1)
    q.put(np.ones(2))
    errors: list[BaseException] = []

    def put() -> None:
        try:
            q.put(np.ones(2), timeout=30)
        except BaseException as exc:
            errors.append(exc)

    import threading

    t = threading.Thread(target=put)
    t.start()
    time.sleep(0.2)
    c.delete_queue("doomed")
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], tb.QueueClosed), errors
    with pytest.raises(tb.QueueClosed, match="removed"):
        q.get(timeout=1)


def test_a_get_given_up_while_it_waits_takes_nothing(c: tb.Client, fresh_broker: Any) -> None:
    """An interrupted get of a ring takes no item: the next get has it."""
    q = c.queue("patient", maxsize=4)
    with tb.connect(fresh_broker.address) as producer:
        pq = producer.queue("patient")
        with (
            interrupt_after(0.2, lambda: (pq.put(np.full(3, 5.0)), _raise())),
            pytest.raises(GaveUp),
        ):
            q.get(timeout=10)
        assert q.get(timeout=1).numpy().tolist() == [5.0] * 3


def _raise() -> None:
    raise GaveUp


# -- clients that die ----------------------------------------------------------------------


def test_a_producer_that_dies_writing_holds_nothing_up(c: tb.Client) -> None:
    q = c.queue("fragile", maxsize=2)
    q.put(np.full(2, 1.0))
    dying = CHILDREN.Process(target=dies_writing, args=(c.address, "fragile"))
    dying.start()
    join_all([dying])
    q.put(np.full(2, 3.0), timeout=10)  # its slot came back
    assert q.get(timeout=5).numpy()[0] == 1.0
    assert q.get(timeout=5).numpy()[0] == 3.0  # its position was passed over
    assert wait_until(lambda: q.in_flight() == 0, 5)


def test_a_consumer_that_dies_holding_items_gives_their_slots_back(c: tb.Client) -> None:
    """What it held is let go; the item it died taking (its get never returned) goes back
    to the queue, first (issue 48, defect 7: it was lost)."""
    q = c.queue("held", maxsize=3)
    for i in range(3):
        q.put(np.full(2, float(i)))
    dying = CHILDREN.Process(target=dies_holding, args=(c.address, "held", 2))
    dying.start()
    join_all([dying])
    assert wait_until(lambda: q.in_flight() == 1, 10)  # the two it held: let go
    for i in range(2):
        q.put(np.full(2, float(10 + i)), timeout=5)
    assert [q.get(timeout=5).numpy()[0] for _ in range(3)] == [2.0, 10.0, 11.0]


# -- asyncio -------------------------------------------------------------------------------


def test_asyncio_clients_use_the_ring_without_blocking_the_loop(
    c: tb.Client, fresh_broker: Any
) -> None:
    import asyncio

    from tensorbroker import aio

    q = c.queue("async", maxsize=3)

    async def main() -> list[float]:
        async with aio.connect(fresh_broker.address) as ac:
            aq = await ac.queue("async")
            assert aq._ring is not None
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            getter = asyncio.create_task(aq.get(timeout=10))
            await asyncio.sleep(0.2)  # it waits, and the loop runs on
            q.put(np.full(2, 7.0))
            item = await getter
            await aq.put(np.full(2, 8.0))
            await aq.put(np.full(2, 9.0))
            put3 = asyncio.create_task(aq.put(np.full(2, 10.0), timeout=10))  # full: waits
            await asyncio.sleep(0.2)
            assert not put3.done()
            del item, getter  # (the task holds its result)
            assert await put3 == 4
            ticker.cancel()
            assert ticks >= 20
            return [(await aq.get(timeout=1)).numpy()[0] for _ in range(3)]

    assert asyncio.run(main()) == [8.0, 9.0, 10.0]


def test_a_producer_that_dies_claiming_or_publishing_holds_nothing_up(c: tb.Client) -> None:
    """Between its claim of a position and moving the tail on: the position is passed over
    (the tail too). Between writing an item whole and publishing it: it is published."""
    q = c.queue("claims", maxsize=2)
    for child in (dies_claiming, dies_publishing):
        dying = CHILDREN.Process(target=child, args=(c.address, "claims"))
        dying.start()
        join_all([dying])
    assert q.get(timeout=5).numpy().tolist() == [9.0, 9.0]  # the one written whole
    q.put(np.full(2, 1.0), timeout=5)
    q.put(np.full(2, 2.0), timeout=5)
    assert [q.get(timeout=5).numpy()[0] for _ in range(2)] == [1.0, 2.0]
    assert wait_until(lambda: q.in_flight() == 0, 5)


def test_a_consumer_that_dies_passing_over_a_position_holds_nothing_up(c: tb.Client) -> None:
    q = c.queue("passing", maxsize=2)
    ring = q._ring
    assert ring is not None
    q.put(np.full(2, 1.0))
    claimed: list[int] = []
    qring_asks.reserve(
        ring, None, claimed
    )  # a position given up behind the first: passed over later
    slot, pos = claimed
    assert ring.view.skip(pos, ring.owner)
    ring.view.unalloc(slot, ring.owner)
    dying = CHILDREN.Process(target=dies_passing_over, args=(c.address, "passing"))
    dying.start()
    join_all([dying])
    q.put(np.full(2, 3.0), timeout=5)
    assert q.get(timeout=5).numpy()[0] == 3.0
    assert wait_until(lambda: q.in_flight() == 0, 5)


@pytest.mark.parametrize(
    "answered", [False, True, None], ids=["cancelled", "answered-anyway", "granted-unanswered"]
)
def test_a_put_through_the_broker_given_up_holds_nothing_up(
    c: tb.Client, monkeypatch: pytest.MonkeyPatch, answered: bool | None
) -> None:
    """A put of an item larger than a slot, given up (Ctrl-C) while the broker was asked:
    cancelled there, its position is passed over; answered anyway, it is aborted and the
    broker passes it over; granted but its answer lost (a cancel not confirmed: issue 48),
    the broker aborts it when asked. Either way the items after it flow, and nothing is
    held while this client lives."""
    q = c.queue("given-up", maxsize=2)
    ring = q._ring
    assert ring is not None
    conn = c._transfer.conn
    real = type(conn).call

    def give_up(self: Any, op: str, *args: Any, **fields: Any) -> Any:
        if op != "qput" or "ring" not in fields:
            return real(self, op, *args, **fields)
        if answered is not False:
            reply = real(self, op, *args, **{**fields, "late": None})
            if answered:
                fields["late"](reply)
        raise GaveUp

    monkeypatch.setattr(type(conn), "call", give_up)
    with pytest.raises(GaveUp):
        q.put(np.zeros(ring.view.data // 4 + 1024, np.float32))
    monkeypatch.undo()
    q.put(np.full(2, 1.0), timeout=5)
    q.put(np.full(2, 2.0), timeout=5)
    assert [q.get(timeout=5).numpy()[0] for _ in range(2)] == [1.0, 2.0]
    assert wait_until(lambda: q.in_flight() == 0 and c.stats()["used_bytes"] == 0, 5)


def test_a_position_whose_put_was_given_up_unanswered_is_granted_no_put(c: tb.Client) -> None:
    """The broker told of a put given up that it never had (its request still on the way)
    grants none for that position later: the producer passes it over and frees its slot,
    and no late grant holds that slot meanwhile (issue 48: the ABA case)."""
    q = c.queue("unclaimed", maxsize=2)
    ring = q._ring
    assert ring is not None
    conn = c._transfer.conn
    claimed: list[int] = []
    qring_asks.reserve(ring, None, claimed)
    slot, pos = claimed
    assert conn.call("qunclaim", queue=ring.queue_id, ring=pos)["aborted"] is False
    with pytest.raises(tb.InvalidRequest, match=f"position {pos} is not this client's"):
        conn.call("qput", queue=ring.queue_id, name="unclaimed", ring=pos,
                  tensors=[["", "float32", [4]]])  # fmt: skip
    ring.view.skip(pos, ring.owner)
    ring.view.unalloc(slot, ring.owner)
    q.put(np.full(2, 1.0), timeout=5)
    assert q.get(timeout=5).numpy().tolist() == [1.0, 1.0]


def test_a_ring_queue_removed_with_only_items_through_the_broker_in_it(c: tb.Client) -> None:
    """The broker unmapped the ring as it freed the last item, then read it: it died
    (SIGSEGV) on `delete_queue` of a ring queue holding only items larger than a slot."""
    q = c.queue("removed-big", maxsize=2)
    ring = q._ring
    assert ring is not None
    q.put(np.zeros(ring.view.data // 4 + 1024, np.float32))
    c.delete_queue("removed-big")
    assert c.ping()["pid"] and c.stats()["used_bytes"] == 0
    with pytest.raises(tb.QueueClosed, match="was removed"):
        q.get(timeout=1)
