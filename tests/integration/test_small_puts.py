"""Small puts in one trip (Note [grants] in server/store/grants.py) and puts that do not wait
(Note [writes] in client/writes.py): read your writes, errors raised later with their key,
a writer killed with grants and seals on their way, and queues with credits."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

import tensorbroker as tb
from tests.support import CHILDREN, join_all, seconds_until

pytestmark = pytest.mark.usefixtures("transport")  # lanes and ZeroMQ both

MiB = 1 << 20


def test_a_put_that_waits_takes_one_trip_once_granted(fresh_broker: tb.BrokerProcess) -> None:
    with tb.connect(fresh_broker.address) as c:
        c.put("x", np.zeros(1024, np.float32))  # asks for grants of 4 KiB
        granted = c.stats()["granted_bytes"]
        assert granted > 0 and c.stats()["used_bytes"] == 4096
        for i in range(1, 50):
            assert c.put("x", np.full(1024, i, np.float32)) == i + 1
        assert c.stats()["granted_bytes"] == granted  # each write's reply refilled
        assert (c.get("x").numpy() == 49).all()
    with tb.connect(fresh_broker.address) as c:  # a client that closed gave them back
        assert c.stats()["granted_bytes"] == 0 and c.stats()["pending"] == 0


@pytest.mark.parametrize("how", ["put", "queue", "create"])
def test_a_put_that_does_not_fit_first_takes_back_the_blocks_granted_ahead(
    fresh_broker: tb.BrokerProcess, how: str
) -> None:
    """Issue 48: a client that had made small puts (so it held blocks granted ahead) filled
    a broker with 4 MiB objects, deleted them and filled it again: 127, 127, then 128 of
    512 MiB. Now its grants go back before a put is refused: every fill is whole."""
    with tb.connect(fresh_broker.address) as c:
        capacity = c.stats()["capacity_bytes"]
        for size in (64, 1024, 8192, 65536):  # grants ahead of four size classes
            c.put("small", np.zeros(size, np.float32))
        c.delete("small")
        assert c.stats()["granted_bytes"] > 0
        q = c.queue("fill") if how == "queue" else None
        for round_ in range(2):
            kept: list[Any] = []
            with pytest.raises(tb.CapacityError, match="it needs 4.0 MiB"):
                for i in range(capacity // (4 * MiB) + 1):
                    if how == "put":
                        c.put(f"big{i}", np.zeros(4 * MiB, np.uint8))
                    elif how == "queue":
                        assert q is not None
                        q.put(np.zeros(4 * MiB, np.uint8))
                    else:
                        with c.create(f"big{i}", (4 * MiB,), "uint8"):
                            pass
                    kept.append(i)
            assert len(kept) == capacity // (4 * MiB), (round_, len(kept))
            if how == "queue":
                assert q is not None
                for _ in kept:
                    q.get(timeout=5)
            else:
                [c.delete(f"big{i}") for i in kept]


def test_puts_of_the_same_shape_and_another_dtype_or_byte_order_keep_theirs(
    fresh_broker: tb.BrokerProcess,
) -> None:
    """A plain array's put plan is made once per dtype and shape: arrays that share the
    shape and not the dtype (or byte order) must not share it, and arrays that share it and
    are not contiguous are copied element by element, not byte for byte."""
    values = [
        np.arange(4, dtype=np.float32),
        np.arange(4, dtype=np.int64) * 3,
        np.arange(4, dtype=">f4") + 0.5,  # stored in native order
        np.arange(8, dtype=np.float32).reshape(4, 2),
        np.arange(4, dtype=np.float32) * 2,
        np.arange(8, dtype=np.float32)[::2],  # strided, the shape and dtype of the first
        np.asfortranarray(np.arange(8, dtype=np.float32).reshape(4, 2) + 1),
    ]
    with tb.connect(fresh_broker.address) as c:
        for i, v in enumerate(values):
            c.put(f"k{i}", v, wait=i % 2 == 0)
        for i, v in enumerate(values):
            got = c.get(f"k{i}").numpy()
            assert got.dtype == v.dtype.newbyteorder("=") and got.shape == v.shape
            assert (got == v).all()


def test_read_your_writes_from_several_threads(fresh_broker: tb.BrokerProcess) -> None:
    errors: list[BaseException] = []
    with tb.connect(fresh_broker.address) as c:

        def writer(t: int) -> None:
            try:
                for i in range(200):
                    shape = (1 + i % 7, 64)  # several size classes and shapes
                    assert c.put(f"k{t}", np.full(shape, i, np.int32), wait=False) is None
                    got = c.get(f"k{t}").numpy()
                    assert got.shape == shape and (got == i).all(), (t, i)
                    assert c.exists(f"k{t}")
                c.put(f"k{t}", np.zeros(1), wait=False)
                c.delete(f"k{t}")  # after the put before it
                assert not c.exists(f"k{t}")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]
        c.flush()
        assert c.keys() == []


def test_errors_of_puts_that_did_not_wait_come_with_their_key(
    fresh_broker: tb.BrokerProcess,
) -> None:
    with tb.connect(fresh_broker.address) as c, tb.connect(fresh_broker.address) as other:
        q = c.queue("frames")
        q.put(np.ones(16), wait=False)
        c.flush()  # sealed before the close, which another socket sends (it could overtake it)
        other.queue("frames").close()
        q.put(np.full(16, 2.0), wait=False)  # refused by the broker, after this returned
        time.sleep(0.2)  # the broker has answered by now
        with pytest.raises(tb.QueueClosed, match="put to queue 'frames'.*did not wait"):
            c.exists("anything")  # the next call
        c.exists("anything")  # raised once
        q.put(np.full(16, 3.0), wait=False)
        with pytest.raises(tb.QueueClosed, match="'frames'"):
            c.flush()
        assert [float(item.numpy()[0]) for item in other.queue("frames")] == [1.0]  # not half
        with pytest.raises(tb.CapacityError, match="'huge'"):  # asked before the copy
            c.put("huge", np.zeros(64 * MiB, np.uint8), wait=False)
        assert c.keys() == [] and c.stats()["pending"] == 0


def test_an_earlier_error_raised_by_a_put_costs_that_put_nothing(
    fresh_broker: tb.BrokerProcess,
) -> None:
    """The put that raises an earlier put's error raises it before it writes: its block
    granted ahead goes back to the client's stock (every block the broker granted is in
    it), and nothing of it is published."""
    with tb.connect(fresh_broker.address) as c, tb.connect(fresh_broker.address) as other:
        q = c.queue("frames")
        q.put(np.ones(16), wait=False)  # credits, and grants of this size class, in stock
        other.queue("frames").close()
        q.put(np.full(16, 2.0), wait=False)  # refused by the broker, after this returned
        time.sleep(0.2)  # the broker has answered by now
        with pytest.raises(tb.QueueClosed, match="put to queue 'frames'"):
            c.put("next", np.ones(16))
        time.sleep(0.2)  # the grants topped up since have come
        assert not c.exists("next")  # (and are read)
        stock = sum(len(blocks) for blocks in c._transfer.writes.ahead.grants.values())
        assert c.stats()["granted_bytes"] == stock * 4096
        c.put("next", np.ones(16))  # and the one after goes through
        assert c.get("next").numpy().tolist() == [1.0] * 16


def test_a_producer_that_found_a_queue_unbounded_heeds_a_bound_set_later(
    fresh_broker: tb.BrokerProcess,
) -> None:
    with tb.connect(fresh_broker.address) as c, tb.connect(fresh_broker.address) as other:
        q = c.queue("late")
        q.put(np.ones(4))  # unbounded: no credit needed, and none asked for again
        bounded = other.queue("late", maxsize=2)
        q.put(np.ones(4))  # written without a credit; its reply says the queue is bounded
        with pytest.raises(tb.Timeout, match="'late'"):
            q.put(np.ones(4), timeout=0.3)  # 2 of 2 in flight: waits for a slot
        assert len(bounded) == 2
        bounded.get().numpy()  # dropped at once: a slot is free again
        q.put(np.ones(4), timeout=5)


def test_a_writer_killed_with_grants_and_seals_on_their_way(
    fresh_broker: tb.BrokerProcess,
) -> None:
    ready = CHILDREN.Event()
    writer = CHILDREN.Process(target=_write_forever, args=(fresh_broker.address, ready))
    writer.start()
    try:
        assert ready.wait(60)
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)
        with tb.connect(fresh_broker.address) as c:

            def back() -> bool:
                s = c.stats()
                return s["granted_bytes"] == 0 and s["pending"] == 0 and s["clients"] == 1

            assert seconds_until(back, 1.0) < 1.0
            keys = c.keys()
            assert keys, "the writer put nothing before it was killed"
            for key in keys:  # no half object: each holds one value throughout
                a = c.get(key).numpy()
                assert a.shape == (512,) and (a == a[0]).all(), key
            del a
            for key in keys:
                c.delete(key)
            assert seconds_until(lambda: c.stats()["used_bytes"] == 0, 5.0) < 5.0
    finally:
        if writer.is_alive():
            writer.kill()
            writer.join()


def test_exactly_once_in_order_with_two_producers_and_three_consumers_not_waiting(
    fresh_broker: tb.BrokerProcess,
) -> None:
    address, count = fresh_broker.address, 400
    out = CHILDREN.Queue()
    with tb.connect(address) as c:
        q = c.queue("work", maxsize=8)
        consumers = [CHILDREN.Process(target=_consume, args=(address, out)) for _ in range(3)]
        producers = [CHILDREN.Process(target=_produce, args=(address, p, count)) for p in range(2)]
        for p in [*consumers, *producers]:
            p.start()
        join_all(producers)
        q.close()
        seen = [out.get(timeout=60) for _ in consumers]
        join_all(consumers)
    items = [item for got in seen for item in got]
    assert sorted(items) == [(p, i) for p in range(2) for i in range(count)]  # exactly once
    for got in seen:  # each consumer saw each producer's items in the order they were put
        for p in range(2):
            mine = [i for q_, i in got if q_ == p]
            assert mine == sorted(mine)


def _write_forever(address: str, ready: Any) -> None:
    with tb.connect(address) as c:
        i = 0
        while True:
            c.put(f"k{i % 40}", np.full(512, i, np.float64), wait=False)
            i += 1
            if i == 200:
                ready.set()


def _produce(address: str, producer: int, count: int) -> None:
    with tb.connect(address) as c:
        q = c.queue("work")
        for i in range(count):
            q.put(np.array([producer, i], np.int64), wait=False)
        c.flush()


def _consume(address: str, out: Any) -> None:
    got = []
    with tb.connect(address) as c:
        for item in c.queue("work"):
            p, i = item.numpy()
            got.append((int(p), int(i)))
            del item
    out.put(got)
