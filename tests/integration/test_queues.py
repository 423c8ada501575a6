"""Queues and watches, seen from one process: order, bounds, closing, errors, memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
from support import GaveUp, in_thread, interrupt_after, wait_until

import tensorbroker as tb
from tensorbroker.common.protocol import Op

MiB = 2**20


@pytest.fixture
def c(fresh_broker: tb.BrokerProcess) -> Any:
    with tb.connect(fresh_broker.address) as client:
        yield client


# -- queues ----------------------------------------------------------------------------------


def test_items_come_out_in_order_numbered_and_zero_copy(c: tb.Client) -> None:
    q = c.queue("frames")
    assert [q.put(np.full(8, i, np.int32)) for i in range(5)] == [1, 2, 3, 4, 5]
    assert len(q) == 5
    got = [q.get(timeout=0) for _ in range(5)]
    assert [t.version for t in got] == [1, 2, 3, 4, 5]
    assert [int(t.numpy()[0]) for t in got] == [0, 1, 2, 3, 4]
    assert all(t.key == "frames" for t in got)
    assert len(q) == 0


def test_a_bundle_item_comes_whole(c: tb.Client) -> None:
    q = c.queue("bundles")
    q.put({"image": np.ones((2, 3), np.uint8), "label": np.array([7])})
    item = q.get()
    assert isinstance(item, dict) and set(item) == {"image", "label"}
    assert item["label"].numpy().tolist() == [7]


def test_create_writes_an_item_in_place(c: tb.Client) -> None:
    q = c.queue("frames")
    with q.create((4, 4), "float32") as buf:
        buf.numpy()[:] = 3.0
        assert len(q) == 0  # not queued before the block exits
    item = q.get(timeout=0)
    assert item.numpy().tolist() == [[3.0] * 4] * 4
    assert item.data_ptr == buf.data_ptr  # the very bytes written


def test_an_aborted_create_queues_nothing_and_frees_its_slot(c: tb.Client) -> None:
    q = c.queue("frames", maxsize=1)
    with pytest.raises(RuntimeError), q.create((1024,), "float32"):
        raise RuntimeError("the writer failed")
    assert len(q) == 0
    assert wait_until(lambda: q.in_flight() == 0, 2.0)
    q.put(np.zeros(3), timeout=1.0)  # the slot is free again


def test_get_waits_for_a_put_and_times_out_on_an_empty_queue(c: tb.Client) -> None:
    q = c.queue("frames")
    with pytest.raises(tb.Timeout, match="'frames' is empty"):
        q.get(timeout=0)
    start = time.monotonic()
    with pytest.raises(tb.Timeout, match="'frames' stayed empty"):
        q.get(timeout=0.2)
    assert time.monotonic() - start >= 0.2
    thread, out = in_thread(lambda: q.get(timeout=10).numpy().tolist())
    time.sleep(0.1)
    q.put(np.arange(3))
    thread.join(10)
    assert out == [[0, 1, 2]]


@pytest.mark.usefixtures("transport")
def test_an_item_answered_to_a_get_given_up_goes_to_the_next_get(
    fresh_broker: tb.BrokerProcess,
) -> None:
    """A get interrupted while it waits (Ctrl-C, a signal handler's exception) is cancelled
    in the broker; an item answered to it meanwhile is not lost: the next get takes it. The
    same for a subscription of a broadcast queue."""
    with tb.connect(fresh_broker.address) as c, tb.connect(fresh_broker.address) as p:
        q, pq = c.queue("crossed"), p.queue("crossed")
        caster = p.broadcast("cast")
        sub = c.subscribe("cast")

        def answer_then_give_up(put: Callable[[], Any], taken: Callable[[], bool]) -> None:
            put()
            assert wait_until(taken, 5)  # the broker answered the waiting get
            raise GaveUp

        with interrupt_after(0.3), pytest.raises(GaveUp):  # nothing came: it leaves its line
            q.get(timeout=10)
        crossing = partial(
            answer_then_give_up, lambda: pq.put(np.full(4, 7.0)),
            lambda: pq.in_flight() == 1 and len(pq) == 0,
        )  # fmt: skip
        with interrupt_after(0.3, crossing), pytest.raises(GaveUp):
            q.get(timeout=10)
        pq.put(np.full(4, 8.0))
        assert [q.get(timeout=0).numpy()[0] for _ in range(2)] == [7.0, 8.0]

        crossing = partial(
            answer_then_give_up, lambda: caster.put(np.full(4, 5.0)),
            lambda: c.stats()["queue_in_flight"] == 1,
        )  # fmt: skip
        with interrupt_after(0.3, crossing), pytest.raises(GaveUp):
            sub.get(timeout=10)
        assert sub.get(timeout=0).numpy().tolist() == [5.0] * 4
        assert wait_until(lambda: c.stats()["queue_in_flight"] == 0, 5)
        with interrupt_after(0.3, crossing), pytest.raises(GaveUp):
            sub.get(timeout=10)
        sub.close()  # what was kept for it is let go
        assert c.exists("nothing") is False  # a call sends the releases due
        assert wait_until(lambda: c.stats()["queue_in_flight"] == 0, 5)


@pytest.mark.usefixtures("transport")
def test_an_item_answered_to_a_get_given_up_goes_back_to_the_queue_when_its_client_closes(
    fresh_broker: tb.BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer interrupted (Ctrl-C) while a get waited, then closed, never took the item
    answered to that get: it goes back to the front of the queue for another consumer, once,
    and its slot stays counted until that one lets go. (Through the broker: a get from a
    queue ring takes nothing until it returns, test_queue_rings.py.)"""
    monkeypatch.setenv("TENSORBROKER_QUEUE_RINGS", "off")
    with tb.connect(fresh_broker.address) as p, tb.connect(fresh_broker.address) as other:
        pq = p.queue("handed-back", maxsize=4)
        interrupted = tb.connect(fresh_broker.address)
        q = interrupted.queue("handed-back")

        def answer_then_give_up() -> None:
            pq.put(np.full(4, 7.0))
            assert wait_until(lambda: pq.in_flight() == 1 and len(pq) == 0, 5)  # answered
            raise GaveUp

        with interrupt_after(0.3, answer_then_give_up), pytest.raises(GaveUp):
            q.get(timeout=10)
        pq.put(np.full(4, 8.0))
        interrupted.close()  # never took the 7.0: it goes back, in front of the 8.0
        oq = other.queue("handed-back")
        assert [oq.get(timeout=5).numpy()[0] for _ in range(2)] == [7.0, 8.0]
        assert pq.in_flight() == 0 or wait_until(lambda: pq.in_flight() == 0, 5)
        with pytest.raises(tb.Timeout):
            oq.get(timeout=0.2)  # and only once


def test_only_an_item_handed_to_a_get_can_be_given_back(c: tb.Client) -> None:
    """qback refuses a lease that is not an item handed over: a producer's put not yet
    sealed stays its put (no consumer gets its block before the seal, or twice)."""
    q = c.queue("not-handed")
    conn = c._transfer.conn
    put = conn.call(Op.QPUT, queue=q._id, name=q.name, tensors=[["", "float32", [4]]])["put"]
    assert conn.call(Op.QBACK, queue=q._id, leases=[put, 999_999])["back"] == []
    assert len(q) == 0
    conn.call(Op.SEAL, put=put)
    assert q.get(timeout=5).numpy().shape == (4,)
    with pytest.raises(tb.Timeout):
        q.get(timeout=0.1)


def test_a_full_queue_blocks_put_until_a_consumer_lets_go(c: tb.Client) -> None:
    q = c.queue("frames", maxsize=2)
    q.put(np.zeros(1024))
    q.put(np.zeros(1024))
    with pytest.raises(tb.Timeout, match=r"2 of 2 in flight\) stayed full"):
        q.put(np.zeros(1024), timeout=0.1)
    first = q.get()  # taken, but still held: its slot is not free yet
    thread, out = in_thread(lambda: q.put(np.ones(1024), timeout=10))
    time.sleep(0.2)
    assert thread.is_alive() and q.in_flight() == 2
    del first  # the consumer lets go: the waiting put goes through
    thread.join(10)
    assert out == [3]
    assert q.in_flight() == 2


@pytest.mark.parametrize("wait", [True, False], ids=["put-waits", "put-does-not-wait"])
def test_many_items_through_a_small_queue_keep_memory_bounded(c: tb.Client, wait: bool) -> None:
    q = c.queue("frames", maxsize=3)
    item_bytes = MiB  # granted ahead, on credited slots, when the put does not wait
    peak = 0

    def produce() -> None:
        for i in range(30):
            q.put(np.full(item_bytes // 4, i, np.float32), wait=wait)
        c.flush()
        q.close()

    thread, out = in_thread(produce)
    seen = []
    for item in q:
        seen.append(int(item.numpy()[0]))
        peak = max(peak, c.stats()["used_bytes"])
    del item
    thread.join(10)
    assert out == [None]
    assert seen == list(range(30))
    assert peak <= 3 * item_bytes


def test_close_drains_then_raises_and_ends_iteration(c: tb.Client) -> None:
    q = c.queue("frames")
    for i in range(3):
        q.put(np.array([i]))
    q.close()
    q.close()  # closing a closed queue succeeds
    with pytest.raises(tb.QueueClosed, match="'frames' is closed"):
        q.put(np.array([9]))
    assert [int(t.numpy()[0]) for t in q] == [0, 1, 2]
    with pytest.raises(tb.QueueClosed, match="'frames' is closed and drained"):
        q.get()
    assert q.closed and len(q) == 0
    assert list(q) == []


def test_close_wakes_waiting_consumers_and_producers(c: tb.Client) -> None:
    empty, full = c.queue("empty"), c.queue("full", maxsize=1)
    full.put(np.zeros(1))
    getter, got = in_thread(lambda: empty.get(timeout=30))
    putter, put = in_thread(lambda: full.put(np.zeros(1), timeout=30))
    time.sleep(0.2)
    empty.close()
    full.close()
    getter.join(10)
    putter.join(10)
    assert isinstance(got[0], tb.QueueClosed) and isinstance(put[0], tb.QueueClosed)


def test_an_item_sealed_after_close_is_refused_and_freed(c: tb.Client) -> None:
    q = c.queue("frames")
    with pytest.raises(tb.QueueClosed, match="closed before this item was sealed"):
        with q.create((1024,), "float32") as buf:
            buf.numpy()[:] = 1
            c.queue("frames").close()  # another handle (another producer) ends the stream
    del buf
    assert wait_until(lambda: c.stats()["used_bytes"] == 0, 2.0)
    assert list(q) == []


def test_a_closed_queue_stays_closed_for_late_comers(c: tb.Client) -> None:
    old = c.queue("frames", maxsize=2)
    old.put(np.zeros(1))
    old.close()
    assert len(list(old)) == 1
    late = c.queue("frames")  # a consumer that comes after the stream ended
    assert late.closed and late.maxsize == 2
    with pytest.raises(tb.QueueClosed, match="closed and drained"):
        late.get(timeout=10)  # at once: no waiting for a stream that is over
    with pytest.raises(tb.QueueClosed, match="give a new stream a new name"):
        late.put(np.ones(1))
    assert c.stats()["queues"] == 0  # ended queues are not counted


def test_maxsize_is_set_once_and_zero_takes_the_queue_as_it_is(c: tb.Client) -> None:
    assert c.queue("frames").maxsize == 0
    assert c.queue("frames", maxsize=4).maxsize == 4  # the first bound holds
    assert c.queue("frames").maxsize == 4
    with pytest.raises(tb.InvalidRequest, match="maxsize=4, not 8"):
        c.queue("frames", maxsize=8)
    for bad in (-1, 1.5, True):
        with pytest.raises(tb.InvalidRequest, match="maxsize"):
            c.queue("frames", maxsize=bad)  # type: ignore[arg-type]


def test_an_item_larger_than_the_broker_leaves_no_slot_taken(c: tb.Client) -> None:
    q = c.queue("frames", maxsize=1)
    with pytest.raises(tb.CapacityError, match="'frames'"):
        q.put(np.zeros(128 * MiB, np.uint8))
    assert q.in_flight() == 0
    q.put(np.zeros(1), timeout=1.0)


def test_stats_count_queues_and_their_items(c: tb.Client) -> None:
    q = c.queue("frames")
    q.put(np.zeros(1))
    stats = c.stats()
    assert stats["queues"] == 1 and stats["queued_items"] == 1 and stats["objects"] == 0
    assert "frames" not in c.keys()  # queues are not keys


def test_two_consumers_share_items_without_duplicates(c: tb.Client) -> None:
    q = c.queue("work")
    for i in range(200):
        q.put(np.array([i]))
    q.close()
    results: list[list[int]] = [[], []]

    def consume(out: list[int]) -> None:
        for item in q:
            out.append(int(item.numpy()[0]))

    threads = [threading.Thread(target=consume, args=(out,)) for out in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results[0] + results[1]) == list(range(200))
    assert all(r == sorted(r) for r in results)  # FIFO as each consumer sees it


# -- watch -----------------------------------------------------------------------------------


def test_watch_starts_with_the_current_version_and_follows(c: tb.Client) -> None:
    c.put("weights", np.zeros(4))
    watch = c.watch("weights", timeout=10)
    first = next(watch)
    assert first.version == 1
    thread, _ = in_thread(lambda: [c.put("weights", np.full(4, v)) for v in (2.0, 3.0)])
    thread.join(10)
    latest = next(watch)  # both were sealed while we were not looking: the newest only
    assert latest.version == 3 and latest.numpy().tolist() == [3.0] * 4
    short = c.watch("weights", timeout=0.1)
    assert next(short).version == 3
    with pytest.raises(tb.Timeout, match="newer than 3"):
        next(short)


def test_watch_waits_for_a_key_that_does_not_exist_yet(c: tb.Client) -> None:
    thread, out = in_thread(lambda: next(c.watch("later", timeout=10)).version)
    time.sleep(0.1)
    c.put("later", np.zeros(1))
    thread.join(10)
    assert out == [1]


def test_watch_goes_on_across_delete_and_put(c: tb.Client) -> None:
    c.put("w", np.zeros(1))
    watch = c.watch("w", timeout=5)
    assert next(watch).version == 1
    c.delete("w")
    c.put("w", np.ones(1))
    assert next(watch).version == 2


def test_watch_sees_a_delete_then_goes_on(c: tb.Client) -> None:
    """A delete (as watch_prefix's "delete") yields None, once; then the next version."""
    c.put("w", np.zeros(1))
    watch = c.watch("w", timeout=5)
    assert next(watch).version == 1
    thread, out = in_thread(lambda: next(watch))  # waits in the broker for version 2
    time.sleep(0.3)
    c.delete("w")
    thread.join(10)
    assert out == [None]
    thread, out = in_thread(lambda: next(watch))  # told once: now it waits for a put
    time.sleep(0.3)
    c.put("w", np.ones(1))
    thread.join(10)
    assert [t.version for t in out] == [2]
    c.delete("w")  # deleted before the watcher asks again: told all the same
    assert next(watch) is None
    short = c.watch("w", timeout=0.2)  # a watch that saw no version sees no delete
    with pytest.raises(tb.Timeout):
        next(short)


def test_a_bundle_is_seen_whole_by_watchers(c: tb.Client) -> None:
    for step in range(5):
        c.put("state", {"a": np.full(1000, step), "b": np.full(10, step)})
    item = next(c.watch("state"))
    assert item["a"].numpy()[0] == item["b"].numpy()[0] == 4
