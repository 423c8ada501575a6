"""The two patterns a pipeline's small handoffs have (issue 34; bench rows "pingpong" and
"stream"): every item arrives once, in order, zero copy, whichever path it took.

- ping-pong: the consumer takes an item, tells the producer, and asks for the next at once;
  the producer puts the next item as soon as it hears back;
- streaming: the producer puts as fast as it can into a bounded queue, the consumer takes
  each item and drops it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from support import CHILDREN
from workers import shm_mapping

import tensorbroker as tb

ITEMS = 300


def pingpong_consumer(address: str, name: str, count: int, told: Any) -> None:
    """Take `count` items; after each, tell (its value, whether it lies in a broker
    segment) and ask for the next at once."""
    with tb.connect(address) as client:
        q = client.queue(name)
        for _ in range(count):
            item = q.get(timeout=30)
            view = np.from_dlpack(item)
            told.send((int(view[0]), shm_mapping(view.ctypes.data) is not None))
            del view, item


def streaming_producer(address: str, name: str, count: int) -> None:
    with tb.connect(address) as client:
        q = client.queue(name, maxsize=8)
        for i in range(count):
            q.put(np.full(1024, i, np.int32))  # 4 KiB
        q.close()


def test_ping_pong_hands_each_item_once_in_order_zero_copy(fresh_broker: tb.BrokerProcess) -> None:
    mine, theirs = CHILDREN.Pipe()
    proc = CHILDREN.Process(
        target=pingpong_consumer, args=(fresh_broker.address, "pingpong", ITEMS, theirs)
    )
    proc.start()
    theirs.close()
    with tb.connect(fresh_broker.address) as c:
        q = c.queue("pingpong")
        got = []
        for i in range(ITEMS):
            q.put(np.full(1024, i, np.int32))
            assert mine.poll(30), f"item {i} did not reach the consumer"
            got.append(mine.recv())  # the consumer is asking for the next one already
        proc.join(30)
        assert proc.exitcode == 0
        assert [v for v, _ in got] == list(range(ITEMS))
        assert all(shared for _, shared in got), "an item was copied out of the broker"
        assert c.stats()["queue_in_flight"] == 0


def test_streaming_into_a_bounded_queue_hands_each_item_once_in_order(
    fresh_broker: tb.BrokerProcess,
) -> None:
    proc = CHILDREN.Process(
        target=streaming_producer, args=(fresh_broker.address, "stream", ITEMS * 3)
    )
    proc.start()
    with tb.connect(fresh_broker.address) as c:
        got, peak = [], 0
        for item in c.queue("stream", maxsize=8):
            got.append(int(np.from_dlpack(item)[0]))
            del item
            if len(got) % 100 == 0:
                peak = max(peak, c.queue("stream").in_flight())
        proc.join(30)
        assert proc.exitcode == 0
        assert got == list(range(ITEMS * 3))
        assert peak <= 8, f"{peak} items in flight in a queue of maxsize 8"
