"""Broadcast queues (issue 15): every subscriber gets every item put after it subscribed,
exactly once and in order, all from one copy in shared memory; the producer waits for the
slowest; a subscriber that dies is dropped and the others go on; close ends every loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from support import wait_until

import tensorbroker as tb

SUBSCRIBER = """
import sys, time, numpy as np, tensorbroker as tb
address, name, slow = sys.argv[1], sys.argv[2], float(sys.argv[3])
with tb.connect(address) as c:
    sub = c.subscribe(name)
    print("subscribed", flush=True)
    seen = []
    for item in sub:
        a = np.from_dlpack(item)
        seen.append(int(a[0]))
        time.sleep(slow)
        del a, item
    print(",".join(map(str, seen)), flush=True)
"""


def subscriber(broker: tb.BrokerProcess, name: str, slow: float = 0.0) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", SUBSCRIBER, broker.address, name, str(slow)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout is not None and p.stdout.readline() == "subscribed\n"
    return p


def test_every_subscriber_gets_every_item_once_and_in_order(broker: tb.BrokerProcess) -> None:
    n = 1000
    with tb.connect(broker.address) as c:
        q = c.broadcast("bcast-order", maxsize=8)
        subs = [subscriber(broker, "bcast-order") for _ in range(4)]
        for i in range(n):
            q.put(np.full(256, i, np.int32), wait=i % 3 != 0)
        q.close()
        for p in subs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0
            assert out.strip() == ",".join(map(str, range(n)))
        assert wait_until(lambda: c.stats()["used_bytes"] == 0, 5)


def test_one_copy_per_item_and_the_producer_waits_for_the_slowest(
    broker: tb.BrokerProcess,
) -> None:
    MiB = 1 << 20
    with tb.connect(broker.address) as c:
        q = c.broadcast("bcast-slow", maxsize=2)
        fast = [subscriber(broker, "bcast-slow") for _ in range(3)]
        slow = subscriber(broker, "bcast-slow", slow=0.2)
        peak, start = 0, time.monotonic()
        for i in range(8):
            q.put(np.full(MiB // 4, i, np.int32))  # 1 MiB
            peak = max(peak, c.stats()["used_bytes"])
        took = time.monotonic() - start
        q.close()
        for p in [*fast, slow]:
            out, _ = p.communicate(timeout=120)
            assert out.strip() == ",".join(map(str, range(8)))
        assert peak <= 2 * MiB + 4096, peak  # maxsize items, each once, not once per reader
        assert took >= 1.0, took  # 6 puts waited for a slot the slow one held 0.2 s


def test_a_subscriber_that_dies_is_dropped_and_the_others_go_on(
    broker: tb.BrokerProcess,
) -> None:
    with tb.connect(broker.address) as c:
        q = c.broadcast("bcast-kill", maxsize=2)
        alive = subscriber(broker, "bcast-kill")
        doomed = subscriber(broker, "bcast-kill", slow=60)  # holds its first item
        q.put(np.full(4, 0, np.int32))
        q.put(np.full(4, 1, np.int32))
        time.sleep(0.3)
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.communicate()
        for i in range(2, 20):  # would wait for ever on the dead one's slots
            q.put(np.full(4, i, np.int32), timeout=10)
        q.close()
        out, _ = alive.communicate(timeout=60)
        assert out.strip() == ",".join(map(str, range(20)))
        assert wait_until(lambda: c.stats()["used_bytes"] == 0, 5)


def test_subscriptions_start_now_and_can_end(client: tb.Client) -> None:
    q = client.broadcast("bcast-local", maxsize=4)
    q.put(np.zeros(2))  # no subscriber yet: no one gets it, and it takes no slot
    assert q.in_flight() == 0
    first, second = client.subscribe("bcast-local"), client.subscribe("bcast-local")
    q.put(np.ones(2))
    assert first.get(timeout=5).numpy()[0] == 1
    second.close()  # the item it did not take is no longer kept for it
    assert wait_until(lambda: q.in_flight() == 0, 5)
    with pytest.raises(tb.InvalidRequest, match="broadcast queue"):
        client.queue("bcast-local")
    with pytest.raises(tb.InvalidRequest, match="subscription"):
        q.get(timeout=0)
    q.close()
    with pytest.raises(tb.QueueClosed):
        first.get(timeout=5)


def test_closing_a_subscription_ends_a_loop_waiting_in_another_thread(client: tb.Client) -> None:
    client.broadcast("bcast-end")
    sub = client.subscribe("bcast-end")
    ended = threading.Event()

    def loop() -> None:
        for _ in sub:
            pass
        ended.set()

    reader = threading.Thread(target=loop)
    reader.start()
    time.sleep(0.3)  # parked in its get
    sub.close()
    reader.join(10)
    assert ended.is_set()


def _gets(c: tb.Client) -> int:
    return int(c.stats()["requests"].get("qget", 0))


def test_subscribers_take_items_from_the_ring_without_a_message_each(
    broker: tb.BrokerProcess,
) -> None:
    """Subscribers of a bounded broadcast queue take each item from its ring (Note
    [broadcast ring]): no get per item reaches the broker, and all of them read the
    producer's one copy in the broker's shared memory (a write through one subscriber's
    view, in its own mapping, is seen through another's)."""
    import torch

    with (
        tb.connect(broker.address) as p,
        tb.connect(broker.address) as a,
        tb.connect(broker.address) as b,
    ):
        q = p.broadcast("bcast-ring", maxsize=4)
        sa, sb = a.subscribe("bcast-ring"), b.subscribe("bcast-ring")
        before, posted = _gets(p), p.stats()["ring_items"]
        for i in range(50):
            q.put(np.full(1024, i, np.int32))
            ta, tb_ = sa.get(timeout=5), sb.get(timeout=5)
            assert ta.version == tb_.version
            assert int(np.from_dlpack(ta)[0]) == int(np.from_dlpack(tb_)[-1]) == i
        assert _gets(p) == before
        assert p.stats()["ring_items"] - posted == 50
        writable, seen = torch.from_dlpack(ta), np.from_dlpack(tb_)
        for t in (ta, tb_):  # inside the broker's segment, as each client mapped it
            start, size = t.lease.mapping.address, t.lease.mapping.size
            assert start <= np.from_dlpack(t).ctypes.data < start + size
        assert ta.lease.mapping.address != tb_.lease.mapping.address  # two mappings
        writable[0] = -7
        assert seen[0] == -7
        del ta, tb_, t, writable, seen
        q.close()
        with pytest.raises(tb.QueueClosed):
            sa.get(timeout=5)
        assert wait_until(lambda: p.stats()["queue_in_flight"] == 0, 5)


def test_an_item_the_ring_cannot_describe_is_asked_for_in_its_place(
    broker: tb.BrokerProcess,
) -> None:
    """A bundle too wide for a ring slot goes to ring subscribers through the broker, in its
    place in the stream; a subscription made before the queue was bounded reads through
    messages beside them."""
    with tb.connect(broker.address) as p, tb.connect(broker.address) as c:
        early = c.subscribe("bcast-wide")  # the queue is unbounded yet: no ring
        q = p.broadcast("bcast-wide", maxsize=8)
        ringed = c.subscribe("bcast-wide")
        wide = {f"tensor-{i:03d}-with-a-long-name": np.full(2, i) for i in range(40)}
        before = _gets(p)
        for i in range(6):
            q.put(wide if i % 3 == 1 else np.full(4, i))
        for sub in (early, ringed):
            got = [sub.get(timeout=5) for _ in range(6)]
            for i, g in enumerate(got):
                if i % 3 == 1:
                    assert isinstance(g, dict) and len(g) == 40
                    g = g["tensor-039-with-a-long-name"]
                    assert g.numpy().tolist() == [39, 39]
                else:
                    assert isinstance(g, tb.Tensor) and g.numpy()[0] == i
                assert g.version == i + 1
            del got, g
        assert _gets(p) - before == 6 + 2  # every item for `early`, the 2 wide ones for `ringed`
        q.close()
        assert wait_until(lambda: p.stats()["queue_in_flight"] == 0, 5)


def test_an_item_a_subscriber_keeps_holds_its_slot_not_the_stream(client: tb.Client) -> None:
    """As through messages, an item kept for good takes one of the `maxsize` slots, and the
    stream goes on through the others."""
    q = client.broadcast("bcast-keep", maxsize=2)
    sub = client.subscribe("bcast-keep")
    q.put(np.full(4, 0))
    kept = sub.get(timeout=5)
    for i in range(1, 13):  # 3 times round the ring's slots
        q.put(np.full(4, i), timeout=5)
        assert sub.get(timeout=5).numpy()[0] == i
    assert kept.numpy()[0] == 0
    assert wait_until(lambda: q.in_flight() == 1, 5)  # the last one's "done" comes soon
    del kept
    q.close()


def test_subscribers_of_a_removed_queue_are_told_it_was_removed(broker: tb.BrokerProcess) -> None:
    """Each subscriber waiting on the ring, or between gets, is told the queue was removed,
    never that its subscription ended: the ring's end is written before the bits of the
    subscriptions it ends (a subscriber saw its bit gone before the end, 1 in 7 here)."""
    told: list[str] = []
    for n in range(10):
        name = f"bcast-removed-{n}"
        clients = [tb.connect(broker.address) for _ in range(4)]
        try:
            q = clients[0].broadcast(name, maxsize=4)
            subs = [c.subscribe(name) for c in clients]
            assert all(s._ring is not None for s in subs)  # from the ring, not a get

            def take(sub: tb.Subscription) -> None:
                try:
                    while True:
                        sub.get(timeout=10)  # let go at once
                except tb.QueueClosed as exc:
                    told.append(str(exc))

            readers = [threading.Thread(target=take, args=(s,)) for s in subs]
            for t in readers:
                t.start()
            q.put(np.ones(4))
            time.sleep(0.1)  # each took it and waits for the next
            clients[0].delete_queue(name)
            for t in readers:
                t.join(10)
            assert not any(t.is_alive() for t in readers)
        finally:
            for c in clients:
                c.close()
    assert told == [f"queue 'bcast-removed-{r}' was removed" for r in range(10) for _ in range(4)]
