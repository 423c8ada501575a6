"""The queue ring chaos test (issue 48): producers and consumers of a bounded queue are sent
SIGINTs every few milliseconds and consumers are SIGKILLed; every item whose put went in is
taken once, whole, and none that did not go in is taken (workers: ring_chaos.py)."""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import tensorbroker as tb
from tests.integration import ring_chaos
from tests.support import CHILDREN, join_all, wait_until

pytestmark = pytest.mark.slow


def _lines(paths: list[Path]) -> list[list[str]]:
    return [line.split() for p in paths if p.exists() for line in p.read_text().splitlines()]


def test_interrupted_and_killed_clients_lose_no_item_of_a_queue_ring(tmp_path: Path) -> None:
    rng = random.Random(48)
    with tb.start_broker(memory="256MiB") as broker:
        address, stop = broker.address, CHILDREN.Event()
        consumers: list[Any] = []

        def consumer() -> Any:
            ready = CHILDREN.Event()
            path = str(tmp_path / f"took{len(consumers)}")
            p = CHILDREN.Process(target=ring_chaos.consume, args=(address, ready, path))
            p.start()
            assert ready.wait(60)
            consumers.append(p)
            return p

        for _ in range(3):
            consumer()
        producers = []
        for w in (1, 2):
            ready = CHILDREN.Event()
            path = str(tmp_path / f"put{w}")
            p = CHILDREN.Process(target=ring_chaos.produce, args=(address, w, ready, stop, path))
            p.start()
            assert ready.wait(60)
            producers.append(p)
        interrupts, kills, end = 0, 0, time.monotonic() + 8
        kill_at = [time.monotonic() + 2.5, time.monotonic() + 5]
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.0005, 0.003))
            live = [p for p in [*producers, *consumers] if p.is_alive()]
            os.kill(rng.choice(live).pid, signal.SIGINT)
            interrupts += 1
            if kill_at and time.monotonic() > kill_at[0]:
                kill_at.pop(0)
                victim = rng.choice([p for p in consumers if p.is_alive()])
                victim.kill()
                victim.join()
                kills += 1
                consumer()
        stop.set()
        join_all(producers)
        with tb.connect(address) as c:
            c.queue(ring_chaos.QUEUE).close()
            join_all([p for p in consumers if p.exitcode != -signal.SIGKILL])
            assert wait_until(lambda: c.stats()["used_bytes"] == 0, 10), c.stats()

    put = dict(_lines([tmp_path / f"put{w}" for w in (1, 2)]))  # number -> version
    logs = _lines(sorted(p for p in tmp_path.glob("took*") if not p.suffix))
    took = [line[0] for line in logs if line[0] != "torn"]
    assert not [line for line in logs if line[0] == "torn"], "an item came back torn"
    twice = [n for n, k in Counter(took).items() if k > 1]
    assert not twice, f"taken twice: {twice[:10]}"
    assert not set(took) - set(put), f"taken but never put: {sorted(set(took) - set(put))[:10]}"
    lost = set(put) - set(took)  # (a consumer killed may lose the item its get returned)
    assert len(lost) <= kills, f"{len(lost)} items lost ({sorted(lost)[:10]}), {kills} kills"
    assert len(put) > 200 and interrupts > 1000, (len(put), interrupts)
