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
