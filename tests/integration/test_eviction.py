"""Eviction (issue 15): a store at its limit keeps working by freeing evictable objects no
one holds, oldest first; never one someone holds, never one not evictable."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
from support import in_thread

import tensorbroker as tb

MiB = 1 << 20


def block(i: int) -> np.ndarray:
    return np.full(MiB // 8, i, np.int64)  # 1 MiB


@pytest.fixture
def small_broker() -> Iterator[tb.BrokerProcess]:
    with tb.start_broker("16MiB") as b:
        yield b


def test_a_full_store_frees_the_oldest_evictable_objects(small_broker: tb.BrokerProcess) -> None:
    with tb.connect(small_broker.address) as c:
        events = c.watch_prefix("e-", timeout=5)
        for i in range(40):  # 40 MiB through a 16 MiB store
            c.put(f"e-{i}", block(i), evictable=True)
        assert (c.get("e-39").numpy() == 39).all()
        with pytest.raises(tb.NotFound):
            c.get("e-0")  # evicted behaves as deleted
        alive = [i for i in range(40) if c.exists(f"e-{i}")]
        assert alive == list(range(40 - len(alive), 40))  # the oldest went first
        stats = c.stats()
        assert stats["evicted"] == 40 - len(alive) and stats["objects"] == len(alive)
        seen = [next(events) for _ in range(40 + stats["evicted"])]
        assert ("delete", "e-0", 1) in seen and ("put", "e-39", 1) in seen


def test_a_read_from_the_directory_counts_as_a_use(small_broker: tb.BrokerProcess) -> None:
    """Gets served from shared memory never reach the broker; the object they read, and let
    go, still outlives objects put before the read and not read since (Note [eviction])."""
    with tb.connect(small_broker.address) as c, tb.connect(small_broker.address) as reader:
        for i in range(10):
            c.put(f"e-{i}", block(i), evictable=True)
        for i in (0, 3):
            got = reader.get(f"e-{i}")
            assert (got.numpy() == i).all()
            del got  # let go: only the use is left
        for i in range(10, 20):  # 10 MiB more through a 16 MiB store
            c.put(f"e-{i}", block(i), evictable=True)
        alive = {i for i in range(20) if c.exists(f"e-{i}")}
        assert {0, 3} <= alive and not alive & {1, 2, 4}
        assert c.stats()["evicted"] == 20 - len(alive)


def test_objects_stay_evictable_across_a_broker_kill(small_broker: tb.BrokerProcess) -> None:
    with tb.connect(small_broker.address) as c:
        c.put("keep", block(-1))  # not evictable, and older than every evictable one
        for i in range(10):
            c.put(f"e-{i}", block(i), evictable=True)
        small_broker.send_signal(signal.SIGKILL)
        small_broker.wait(10)
        small_broker.restart()
        flags = {o["key"]: o["evictable"] for o in c.list_objects()}
        assert flags == {"keep": False, **{f"e-{i}": True for i in range(10)}}
        for i in range(10, 20):  # the store is full: the adopted objects make room
            c.put(f"e-{i}", block(i), evictable=True)
        assert not c.exists("e-0") and c.exists("e-19")
        assert (c.get("keep").numpy() == -1).all()  # still pinned
        assert c.stats()["evicted"] >= 5


def test_a_watch_of_an_evicted_key_is_told(small_broker: tb.BrokerProcess) -> None:
    """An eviction is a delete to watchers: `watch` yields None, as `watch_prefix` a
    "delete"."""
    with tb.connect(small_broker.address) as c:
        c.put("e-0", block(0), evictable=True)
        watch = c.watch("e-0", timeout=10)
        first = next(watch)
        assert first is not None and first.version == 1
        del first  # a held object is never evicted
        thread, out = in_thread(lambda: next(watch))  # waits in the broker for version 2
        time.sleep(0.3)
        for i in range(1, 20):
            c.put(f"e-{i}", block(i), evictable=True)
        thread.join(10)
        assert out == [None] and not c.exists("e-0")


def test_an_object_held_or_not_evictable_is_never_evicted(small_broker: tb.BrokerProcess) -> None:
    with tb.connect(small_broker.address) as c:
        c.put("keep", block(-1))  # not evictable
        c.put("held", block(-2), evictable=True)
        held = c.get("held")  # a reader holds it (a lease slot, or a lease)
        for i in range(30):
            c.put(f"e-{i}", block(i), evictable=True)
        assert c.exists("keep") and c.exists("held")
        assert (held.numpy() == -2).all() and (c.get("keep").numpy() == -1).all()
        for i in range(14):  # only what no one may evict, and nothing left to evict
            c.put(f"fixed-{i}", block(i))
        with pytest.raises(tb.CapacityError, match="fixed-99"):
            c.put("fixed-99", block(99))
        assert c.exists("held") and (held.numpy() == -2).all()
        del held


def test_serve_evict_lru_makes_every_put_evictable() -> None:
    with tb.start_broker("16MiB", options=["--evict", "lru"]) as b, tb.connect(b.address) as c:
        for i in range(40):
            c.put(f"p-{i}", block(i))
        assert c.exists("p-39") and not c.exists("p-0")
        assert c.stats()["evicted"] > 0


def test_a_put_that_cannot_fit_evicts_nothing(small_broker: tb.BrokerProcess) -> None:
    with tb.connect(small_broker.address) as c:
        for i in range(4):
            c.put(f"e-{i}", block(i), evictable=True)
        with pytest.raises(tb.CapacityError):
            c.put("huge", np.zeros(20 * MiB // 8, np.int64), evictable=True)  # > the store
        c.put("fixed", np.zeros(6 * MiB // 8, np.int64))  # not evictable
        with pytest.raises(tb.CapacityError):  # 6 MiB free at most, and 4 evictable: not 12
            c.put("big", np.zeros(12 * MiB // 8, np.int64))
        assert c.stats()["evicted"] == 0
        assert all(c.exists(f"e-{i}") for i in range(4))
