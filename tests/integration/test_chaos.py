"""The chaos tests: clients put, read and use queues while the broker is SIGKILLed and
restarted at random moments; nothing is lost, nothing is delivered twice (the workers are
chaos.py's; test_recovery.py has each kind of recovery on its own)."""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import pytest

import tensorbroker as tb
from tests.integration import chaos
from tests.support import CHILDREN, crash, join_all, wait_until

pytestmark = pytest.mark.usefixtures("transport")  # lanes and ZeroMQ both


def _kill_and_restart(broker: tb.BrokerProcess, times: int, rng: random.Random) -> None:
    """SIGKILL the broker and restart it, `times` times at random moments."""
    for _ in range(times):
        time.sleep(rng.uniform(0.05, 0.4))
        crash(broker)
        broker.restart()
    time.sleep(0.5)


def _reports(out: Any, count: int) -> dict[Any, dict[str, Any]]:
    """The next `count` reports of chaos workers, by worker."""
    reports = {}
    for _ in range(count):
        r = out.get(timeout=120)
        reports[r["worker"]] = r
    return reports


def _subscribers(address: str, workers: list[int], out: Any) -> list[Any]:
    """Subscriber processes of the broadcast queue "cast", subscribed (chaos.subscribe)."""
    ready = {w: CHILDREN.Event() for w in workers}
    subs = [
        CHILDREN.Process(target=chaos.subscribe, args=(address, w, ready[w], out), name=f"sub{w}")
        for w in workers
    ]
    for p in subs:
        p.start()
    assert all(r.wait(60) for r in ready.values())
    return subs


def _check_broadcast(reports: dict[Any, dict[str, Any]], workers: list[int]) -> None:
    """Each subscriber got every item of "cast" whose put returned, once, in order."""
    sent = reports["cast"]["sent"]
    assert len(sent) > 20
    for w in workers:
        taken = reports[w]["taken"]
        assert taken == sorted(set(taken)), f"subscriber {w}: twice or out of order"
        assert set(sent) <= set(taken), (
            f"subscriber {w} missed {sorted(set(sent) - set(taken))[:10]}"
        )


def test_clients_and_the_broker_survive_twenty_kills() -> None:
    """The chaos test: four clients put, replace, delete, read and use a queue, and a
    producer and two subscribers a broadcast queue, while the broker is SIGKILLed and
    restarted 20 times at random moments."""
    rng = random.Random(12)
    with tb.start_broker(memory="128MiB") as broker:
        stop, out = CHILDREN.Event(), CHILDREN.Queue()
        address = broker.address
        subs = _subscribers(address, [4, 5], out)
        procs = [
            CHILDREN.Process(target=chaos.keyed, args=(address, 0, stop, out), name="keyed0"),
            CHILDREN.Process(target=chaos.keyed, args=(address, 1, stop, out), name="keyed1"),
            CHILDREN.Process(target=chaos.produce, args=(address, 2, stop, out), name="producer"),
            CHILDREN.Process(target=chaos.consume, args=(address, 3, out), name="consumer"),
            CHILDREN.Process(target=chaos.cast, args=(address, stop, out), name="cast"),
        ]
        for p in procs:
            p.start()
        with tb.connect(address) as c:
            assert wait_until(lambda: len(c.keys()) >= 6, 60)
        _kill_and_restart(broker, 20, rng)
        stop.set()
        reports = _reports(out, 6)  # the subscribers end once "cast" closes its queue
        with tb.connect(address) as c:
            c.queue("chaos").close()  # the consumer drains what is left, then ends
            reports[3] = out.get(timeout=120)
            join_all([*procs, *subs])
            errors = {w: r["errors"] for w, r in reports.items() if r["errors"]}
            assert all(not r["errors"] for r in reports.values()), errors
            assert all(reports[w]["puts"] > 20 and reports[w]["verified"] > 20 for w in (0, 1))
            sent, taken = reports[2]["sent"], Counter(reports[3]["taken"])
            assert len(sent) > 20
            assert not [t for t, n in taken.items() if n > 1], "an item was delivered twice"
            assert not [t for t in sent if t not in taken], "an item that was put was lost"
            _check_broadcast(reports, [4, 5])
            for key in c.keys():
                c.delete(key)
            assert wait_until(lambda: c.stats()["used_bytes"] == 0, 10), c.stats()


def test_broadcast_subscribers_get_every_item_once_in_order_through_kills() -> None:
    """A producer and two subscriber processes on a broadcast queue while the broker is
    SIGKILLed and restarted 8 times: each subscriber gets every item whose put returned,
    once, in order."""
    rng = random.Random(15)
    with tb.start_broker(memory="64MiB") as broker:
        stop, out = CHILDREN.Event(), CHILDREN.Queue()
        subs = _subscribers(broker.address, [0, 1], out)
        producer = CHILDREN.Process(target=chaos.cast, args=(broker.address, stop, out))
        producer.start()
        _kill_and_restart(broker, 8, rng)
        stop.set()
        reports = _reports(out, 3)
        join_all([producer, *subs])
        errors = {w: r["errors"] for w, r in reports.items() if r["errors"]}
        assert not errors, errors
        _check_broadcast(reports, [0, 1])
        with tb.connect(broker.address) as c:
            assert wait_until(lambda: c.stats()["used_bytes"] == 0, 10), c.stats()
