"""What an operator sees and removes: `Client.list`, `list_queues`, `clients`, `delete_queue`
and the request counters in `stats()` (the CLI over them: test_cli.py)."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest

import tensorbroker as tb
from tests.support import wait_until

MiB = 2**20


def test_list_pages_through_every_key_in_order(client: tb.Client) -> None:
    keys = [f"inv/{i:03d}" for i in range(25)]
    for i, key in enumerate(reversed(keys)):
        client.put(key, np.full(i + 1, i, dtype=np.int16))
    client.put("elsewhere", np.ones(2))
    listed = list(client.list_objects("inv/", page_size=7))  # 4 pages
    assert [o["key"] for o in listed] == keys
    assert all(o["version"] == 1 and o["device"] == "cpu" for o in listed)
    assert listed[0]["tensors"] == [["", "int16", [25]]] and listed[0]["nbytes"] == 50
    assert len(list(client.list_objects())) == 26


def test_list_largest_first(client: tb.Client) -> None:
    for n in (1, 64, 8, 32):
        client.put(f"big/{n}", np.zeros(n * 1024, np.uint8))
    assert [o["key"] for o in client.list_objects(largest=2)] == ["big/64", "big/32"]
    for n in (5000, 7000, 6000):  # one size class of blocks: their own bytes decide
        client.put(f"near/{n}", np.zeros(n, np.uint8))
    largest = client.list_objects("near/", largest=2)
    assert [(o["key"], o["nbytes"]) for o in largest] == [("near/7000", 7000), ("near/6000", 6000)]


def test_leases_count_every_reader(client: tb.Client, broker: tb.BrokerProcess) -> None:
    client.put("held", np.ones(100))
    with tb.connect(broker.address) as other:
        a, b = other.get("held"), client.get("held")  # read through the directory
        (row,) = client.list_objects("held")
        assert row["leases"] == 2
        del a, b
        assert wait_until(lambda: next(client.list_objects("held"))["leases"] == 0, 5.0)


def test_clients_shows_each_process_and_what_it_reads(
    client: tb.Client, broker: tb.BrokerProcess
) -> None:
    client.put("c/x", np.ones(MiB // 8))
    with tb.connect(broker.address) as other:
        held = other.get("c/x")
        rows = client.clients()
        assert len(rows) == 2 and {r["pid"] for r in rows} == {os.getpid()}
        assert sorted(r["leases"] for r in rows) == [0, 1]
        assert all(r["uid"] == os.getuid() and not r["closed"] for r in rows)
        del held


@pytest.mark.parametrize("maxsize", [0, 2], ids=["through-the-broker", "ring"])
def test_the_handles_of_a_removed_queue_say_it_was_removed(client: tb.Client, maxsize: int) -> None:
    """Issue 48: once the broker forgot a removed queue, its handles were told it was
    "closed and drained", which it never was."""
    q = client.queue(f"removed-{maxsize}", maxsize=maxsize)
    q.put(np.ones(4))
    client.delete_queue(f"removed-{maxsize}")
    for call in (lambda: q.get(timeout=0), lambda: q.put(np.ones(4), timeout=0)):
        with pytest.raises(tb.QueueClosed, match=f"queue 'removed-{maxsize}' was removed"):
            call()


def test_delete_queue_ends_consumers_and_producers_and_frees_its_items(
    client: tb.Client, broker: tb.BrokerProcess
) -> None:
    used = client.stats()["used_bytes"]
    q = client.queue("doomed", maxsize=3)
    for i in range(3):
        q.put(np.full(MiB // 8, i, np.float64))
    held = np.from_dlpack(q.get())
    outcomes: list[Any] = []

    def produce() -> None:  # waits for a slot of the full queue
        with tb.connect(broker.address) as c:
            try:
                c.queue("doomed").put(np.ones(8), timeout=30)
            except tb.QueueClosed as exc:
                outcomes.append(("put", str(exc)))

    producer = threading.Thread(target=produce)
    producer.start()
    assert wait_until(lambda: client.list_queues()[0]["producers"] == 1, 10.0)
    client.delete_queue("doomed")
    producer.join(10.0)
    assert outcomes == [("put", "queue 'doomed' was removed")]
    assert "doomed" not in [r["name"] for r in client.list_queues()]
    # The two waiting items are freed; the one a consumer holds stays readable until let go.
    assert client.stats()["used_bytes"] == used + MiB
    assert float(held[0]) == 0.0 and float(held[-1]) == 0.0
    with pytest.raises(tb.QueueClosed, match="queue 'doomed' was removed"):
        q.get(timeout=0)
    del held
    assert wait_until(lambda: client.stats()["used_bytes"] == used, 5.0)
    fresh = client.queue("doomed")  # the name starts a new queue
    fresh.put(np.ones(2))
    assert len(fresh) == 1
    client.delete_queue("doomed")
    with pytest.raises(tb.NotFound, match="no queue 'doomed'"):
        client.delete_queue("doomed")


def test_delete_queue_wakes_a_waiting_consumer(client: tb.Client, broker: tb.BrokerProcess) -> None:
    q = client.queue("empty")
    errors: list[BaseException] = []

    def consume() -> None:
        with tb.connect(broker.address) as c:
            try:
                c.queue("empty").get(timeout=30)
            except BaseException as exc:
                errors.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert wait_until(lambda: client.stats()["waiters"] == 1, 10.0)
    client.delete_queue("empty")
    consumer.join(10.0)
    assert not consumer.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], tb.QueueClosed)
    del q


def test_stats_count_requests_by_op_and_refusals_by_code(client: tb.Client) -> None:
    before = client.stats()
    client.put("counted", np.ones(3))
    for _ in range(3):
        client.exists("counted")
    with pytest.raises(tb.NotFound):
        client.delete("not-there")
    after = client.stats()
    assert after["requests"]["exists"] - before["requests"].get("exists", 0) == 3
    assert after["refused"]["not_found"] - before["refused"].get("not_found", 0) == 1
    latency = after["latency"]["exists"]
    assert sum(latency["buckets"]) == after["requests"]["exists"]
    assert len(latency["buckets"]) == len(after["latency_bounds"]) + 1
    assert after["published"] - before["published"] == 1
