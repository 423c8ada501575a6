"""Pipelines of real processes (tests/support.py CHILDREN) through queues and watched keys:
every item once, in order, zero copy; backpressure; weight sync; a consumer killed in the
middle; closing."""

from __future__ import annotations

import signal
import threading
from collections import Counter
from typing import Any

import pytest
import stages
from support import CHILDREN, join_all, wait_until

import tensorbroker as tb

MiB = 2**20


def start(target: Any, *args: Any, name: str) -> Any:
    proc = CHILDREN.Process(target=target, args=args, name=name)
    proc.start()
    return proc


def reports(report: Any, count: int, timeout: float = 120) -> dict[str, Any]:
    """`count` reports, by the name each child gave."""
    out = {}
    for _ in range(count):
        name, *rest = report.get(timeout=timeout)
        out[name] = rest
    return out


def test_torch_jax_numpy_through_two_queues(fresh_broker: tb.BrokerProcess) -> None:
    items, n, address = 300, 4096, fresh_broker.address
    report = CHILDREN.Queue()
    procs = [
        start(stages.torch_source, address, "batches", items, n, 8, name="torch"),
        start(stages.jax_transform, address, "batches", "outputs", 8, report, name="jax"),
        start(stages.numpy_sink, address, "outputs", n, report, name="numpy"),
    ]
    try:
        got = reports(report, 2, timeout=240)
    finally:
        join_all(procs)
    jax_count, jax_zero_copy = got["jax"]
    indices, bad, numpy_zero_copy = got["numpy"]
    assert jax_count == items
    assert indices == list(range(items))  # every item once, in order
    assert bad == 0  # every checksum right
    assert jax_zero_copy and numpy_zero_copy  # every hop read the broker's memory
    with tb.connect(address) as c:
        assert wait_until(lambda: c.stats()["used_bytes"] == 0, 5.0)
        assert c.stats()["queues"] == 0  # both streams ended


def test_two_producers_three_consumers_deliver_each_item_once(
    fresh_broker: tb.BrokerProcess,
) -> None:
    count, address = 150, fresh_broker.address
    report = CHILDREN.Queue()
    with tb.connect(address) as c:
        q = c.queue("work", maxsize=16)
        producers = [
            start(stages.numbered_producer, address, "work", p, count, name=f"producer{p}")
            for p in (1, 2)
        ]
        consumers = [
            start(stages.collecting_consumer, address, "work", f"c{i}", report, name=f"c{i}")
            for i in range(3)
        ]
        join_all(producers)
        q.close()  # both producers are done: end the stream
        try:
            got = reports(report, 3)
        finally:
            join_all(consumers)
    delivered = [item for seen in got.values() for item in seen[0]]
    expected = [(p, s) for p in (1, 2) for s in range(count)]
    assert Counter(delivered) == Counter(expected)  # exactly once
    for seen in got.values():  # FIFO: each producer's items in order, as any consumer sees them
        for p in (1, 2):
            mine = [s for q_p, s in seen[0] if q_p == p]
            assert mine == sorted(mine)


@pytest.mark.parametrize("wait", [True, False], ids=["put-waits", "put-does-not-wait"])
def test_backpressure_bounds_memory_and_blocks_the_producer(
    fresh_broker: tb.BrokerProcess, wait: bool
) -> None:
    maxsize, count, address = 4, 24, fresh_broker.address
    report = CHILDREN.Queue()
    with tb.connect(address) as c:
        c.queue("frames", maxsize=maxsize)
        peak, stop = [0], threading.Event()

        def watch_memory() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], c.stats()["used_bytes"])

        watcher = threading.Thread(target=watch_memory)
        watcher.start()
        procs = [
            start(
                stages.timed_producer,
                address,
                "frames",
                maxsize,
                count,
                MiB,
                report,
                wait,
                name="producer",
            ),  # fmt: skip
            start(stages.slow_consumer, address, "frames", 0.05, report, name="consumer"),
        ]
        try:
            got = reports(report, 2)
        finally:
            stop.set()
            watcher.join()
            join_all(procs)
    (returned,), (let_go, good) = got["producer"], got["consumer"]
    assert good and len(returned) == len(let_go) == count
    assert peak[0] <= maxsize * MiB, f"{peak[0] / MiB:.1f} MiB in use with maxsize={maxsize}"
    # Item k could only be given memory once item k - maxsize was let go: the producer waited.
    for k in range(maxsize, count):
        assert returned[k] > let_go[k - maxsize], f"put {k} returned before a slot was free"


def test_weight_sync_watchers_see_only_whole_versions_and_end_on_the_last(
    fresh_broker: tb.BrokerProcess,
) -> None:
    versions, address = 50, fresh_broker.address
    names = sorted(stages.model_state(0))
    report = CHILDREN.Queue()
    watchers = [
        start(stages.weight_watcher, fw, address, "weights", names, versions - 1, report, name=fw)
        for fw in ("jax", "torch")
    ]
    trainer = start(stages.trainer, address, "weights", versions, name="trainer")
    try:
        got = reports(report, 2, timeout=240)
    finally:
        join_all([trainer, *watchers])
    for fw, (seen,) in got.items():
        assert seen, fw
        assert all(whole for _, _, whole in seen), f"{fw} saw a torn or wrong version"
        assert all(step == version - 1 for version, step, _ in seen), fw
        assert [v for v, _, _ in seen] == sorted({v for v, _, _ in seen}), f"{fw}: not increasing"
        assert seen[-1][0] == versions, f"{fw} did not end on the last version"


def test_a_consumer_killed_in_the_middle_neither_hangs_nor_leaks(
    fresh_broker: tb.BrokerProcess,
) -> None:
    maxsize, count, address = 4, 40, fresh_broker.address
    report, holding = CHILDREN.Queue(), CHILDREN.Queue()
    with tb.connect(address) as c:
        q = c.queue("frames", maxsize=maxsize)
        producer = start(stages.numbered_producer, address, "frames", 0, count, name="producer")
        holder = start(stages.holding_consumer, address, "frames", maxsize, holding, name="holder")
        held = holding.get(timeout=120)
        assert held == list(range(maxsize))
        collector = start(stages.collecting_consumer, address, "frames", "collector", report,
                          name="collector")  # fmt: skip
        # Every slot is held by the holder: the producer waits, the collector gets nothing.
        assert wait_until(lambda: q.in_flight() == maxsize and len(q) == 0, 5.0)
        assert producer.is_alive()
        holder.kill()  # SIGKILL
        holder.join(10)
        assert holder.exitcode == -signal.SIGKILL
        join_all([producer])  # it got its slots back
        q.close()
        try:
            got = reports(report, 1)
        finally:
            join_all([collector])
        assert got["collector"][0] == [(0, s) for s in range(maxsize, count)]
        assert wait_until(lambda: c.stats()["used_bytes"] == 0, 5.0)
        assert c.stats()["leases"] == 0 and c.stats()["queues"] == 0


def test_closing_lets_consumers_drain_and_refuses_more_puts(
    fresh_broker: tb.BrokerProcess,
) -> None:
    count, address = 60, fresh_broker.address
    report = CHILDREN.Queue()
    with tb.connect(address) as c:
        c.queue("work")  # exists before anyone puts, so no consumer opens a new stream
        consumers = [
            start(stages.collecting_consumer, address, "work", f"c{i}", report, name=f"c{i}")
            for i in range(3)
        ]
        producer = start(stages.closing_producer, address, "work", count, report, name="producer")
        try:
            got = reports(report, 4)
        finally:
            join_all([producer, *consumers])
    assert got["producer"][0].startswith("refused: queue 'work' is closed")
    delivered = sorted(s for name, seen in got.items() if name != "producer" for _, s in seen[0])
    assert delivered == list(range(count))
