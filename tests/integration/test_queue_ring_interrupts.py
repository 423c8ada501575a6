"""Queue rings and interrupted calls (issue 48; Note [shielded steps] in client/shield.py):
an interrupted put went in whole or not at all, and says which; an interrupted get leaves
its item first in the queue; a client killed while it waits or takes leaves nothing
counted and loses no item."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from support import CHILDREN, wait_until

import tensorbroker as tb
from tensorbroker.client import qring_asks
from tensorbroker.client.qring import QueueRing
from tensorbroker.common import _shm


@pytest.fixture
def c(fresh_broker: tb.BrokerProcess) -> Any:
    with tb.connect(fresh_broker.address) as client:
        yield client


def _sigint_after_swap(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Ctrl-C (a real SIGINT to this process) right after the `n`-th successful
    compare-and-swap on a ring, where the undo code used to be escaped."""
    real, count = _shm.cas, [0]

    def cas(addr: int, old: int, new: int) -> bool:
        done = real(addr, old, new)
        if done:
            count[0] += 1
            if count[0] == n:
                os.kill(os.getpid(), signal.SIGINT)
        return done

    monkeypatch.setattr(_shm, "cas", cas)


@pytest.mark.parametrize("n", [1, 2, 3])  # the slot, the entry, the tail
def test_a_put_interrupted_after_any_swap_went_in_whole_or_not_at_all(
    c: tb.Client, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """The interrupt's exception says whether the item went in; either way the queue
    (maxsize 1: one slot held would wedge it) takes the next put."""
    q = c.queue("interrupted-put", maxsize=1)
    _sigint_after_swap(monkeypatch, n)
    with pytest.raises(KeyboardInterrupt) as raised:
        q.put(np.full(4, 1.0), timeout=2)
    monkeypatch.undo()
    notes = getattr(raised.value, "__notes__", [])
    assert notes == ["(the put into queue 'interrupted-put' went in first: version 1)"]
    assert q.get(timeout=2).numpy().tolist() == [1.0] * 4
    q.put(np.full(4, 2.0), timeout=2)
    assert q.get(timeout=2).numpy().tolist() == [2.0] * 4
    assert wait_until(lambda: q.in_flight() == 0, 5)


def test_a_get_interrupted_after_it_took_the_item_leaves_it_first_in_the_queue(
    c: tb.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 48, defect 2: Ctrl-C right after the take's swap lost the item. (After its
    commit, the head's swap, the item is the caller's: as after the get returned.)"""
    q = c.queue("interrupted-get", maxsize=1)
    q.put(np.full(4, 1.0))
    _sigint_after_swap(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        q.get(timeout=2)
    monkeypatch.undo()
    assert q.get(timeout=2).numpy().tolist() == [1.0] * 4  # not lost, and its slot let go
    q.put(np.full(4, 2.0), timeout=2)
    assert q.get(timeout=2).numpy().tolist() == [2.0] * 4


def test_a_get_interrupted_while_it_builds_the_item_leaves_it_in_the_queue(
    c: tb.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 48, defect 5: the slot was let go and the item lost."""
    q = c.queue("interrupted-build", maxsize=2)
    q.put(np.full(4, 1.0))
    q.put(np.full(4, 2.0))
    real = QueueRing.item

    def interrupted(self: QueueRing, *args: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)
        return real(self, *args)

    monkeypatch.setattr(QueueRing, "item", interrupted)
    with pytest.raises(KeyboardInterrupt):
        q.get(timeout=2)
    monkeypatch.undo()
    assert [q.get(timeout=2).numpy()[0] for _ in range(2)] == [1.0, 2.0]
    assert wait_until(lambda: q.in_flight() == 0, 5)


def test_a_create_interrupted_while_the_broker_is_asked_holds_nothing_up(
    c: tb.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 48, defect 3: only BrokerError was cleaned up, and the claimed position was
    never published (consumers stopped there). Answered anyway: the grant is aborted."""
    q = c.queue("interrupted-create", maxsize=2)
    conn = c._transfer.conn
    real = type(conn).call

    def interrupted(self: Any, op: str, *args: Any, **fields: Any) -> Any:
        if op == "qput" and "ring" in fields:
            fields["late"](real(self, op, *args, **{**fields, "late": None}))
            raise KeyboardInterrupt
        return real(self, op, *args, **fields)

    monkeypatch.setattr(type(conn), "call", interrupted)
    with pytest.raises(KeyboardInterrupt), q.create((4,), "float32"):
        pass
    monkeypatch.undo()
    q.put(np.full(2, 1.0), timeout=5)
    assert q.get(timeout=5).numpy().tolist() == [1.0, 1.0]
    assert wait_until(lambda: q.in_flight() == 0 and c.stats()["used_bytes"] == 0, 5)


def waits_for_an_item(address: str, name: str) -> None:
    with tb.connect(address) as client:
        client.queue(name).get(timeout=60)


def test_consumers_killed_while_they_wait_are_counted_out(c: tb.Client) -> None:
    """Issue 48, defect 6: after kills the queue reported consumers waiting with none
    alive, and every later put made a needless wake-up call. stats() counts them too."""
    q = c.queue("watched", maxsize=2)

    def waiting() -> int:
        return next(r["consumers"] for r in c.list_queues() if r["name"] == "watched")

    sleepers = [
        CHILDREN.Process(target=waits_for_an_item, args=(c.address, "watched")) for _ in range(3)
    ]
    for p in sleepers:
        p.start()
    assert wait_until(lambda: waiting() == 3, 20), c.list_queues()
    assert c.stats()["queue_consumers"] == 3  # (asleep on the ring: no request parked)
    for p in sleepers:
        p.kill()
        p.join()
    assert wait_until(lambda: waiting() == 0, 10), c.list_queues()
    assert c.stats()["queue_consumers"] == 0
    q.put(np.ones(2))
    assert q.get(timeout=5).numpy().tolist() == [1.0, 1.0]


def _big(q: Any, value: float) -> np.ndarray:
    """An item larger than a slot of `q`'s ring: it goes through the broker."""
    ring = q._ring
    assert ring is not None
    return np.full(ring.view.data // 4 + 1024, value, np.float32)


def _the_big_item_first_then_the_rest(c: tb.Client, q: Any, timeout: float) -> None:
    """Version 1 (`_big(q, 1.0)`) comes first, then an item of 2.0s; then nothing is held."""
    first = q.get(timeout=timeout)
    assert first.version == 1 and np.array_equal(first.numpy(), _big(q, 1.0))
    assert q.get(timeout=2).numpy().tolist() == [2.0] * 4
    del first
    assert wait_until(lambda: q.in_flight() == 0 and c.stats()["used_bytes"] == 0, 5)


def _sigint_after_commit(monkeypatch: pytest.MonkeyPatch, view: Any) -> None:
    """A real SIGINT right after a take is committed (the item is the get's from then on)."""
    real = type(view).commit

    def interrupted(self: Any, pos: int) -> None:
        real(self, pos)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(type(view), "commit", interrupted)


@pytest.mark.parametrize("when", ["before-the-ask", "answered-then-interrupted"])
def test_a_get_of_an_item_through_the_broker_interrupted_leaves_it_first(
    c: tb.Client, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Issue 48, defect 4: Ctrl-C in the get of an item larger than a slot lost it, and its
    slot was held until the client ended. Now it stays first, before the item put after it."""
    q = c.queue("interrupted-ask", maxsize=2)
    q.put(_big(q, 1.0))
    q.put(np.full(4, 2.0))
    conn = c._transfer.conn
    real = type(conn).call

    def interrupted(self: Any, op: str, *args: Any, **fields: Any) -> Any:
        if op == "qget" and "ring" in fields:
            if when == "answered-then-interrupted":
                fields["late"](real(self, op, *args, **{**fields, "late": None}))
            raise KeyboardInterrupt
        return real(self, op, *args, **fields)

    monkeypatch.setattr(type(conn), "call", interrupted)
    with pytest.raises(KeyboardInterrupt):
        q.get(timeout=2)
    monkeypatch.undo()
    _the_big_item_first_then_the_rest(c, q, timeout=2)


def test_a_get_of_an_item_through_the_broker_interrupted_while_built_leaves_it_first(
    c: tb.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SIGINT once the broker answered, while the item's Tensors are built: the
    lease is given back to the broker (not released: that would free the item)."""
    q = c.queue("interrupted-ask-build", maxsize=2)
    q.put(_big(q, 1.0))
    reads = c._transfer.reads
    real = type(reads).build

    def interrupted(self: Any, reply: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)
        return real(self, reply)

    monkeypatch.setattr(type(reads), "build", interrupted)
    with pytest.raises(KeyboardInterrupt):
        q.get(timeout=2)
    monkeypatch.undo()
    again = q.get(timeout=2)
    assert again.version == 1 and np.array_equal(again.numpy(), _big(q, 1.0))
    del again
    assert wait_until(lambda: q.in_flight() == 0 and c.stats()["used_bytes"] == 0, 5)


def dies_once_answered(address: str, name: str) -> None:
    """Take an item put through the broker, ask for it, and die (SIGKILL) once the broker
    answered, before the take is committed."""
    from tensorbroker.client import reads

    def killed(wire: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    reads.TensorDesc.from_wire = killed  # type: ignore[method-assign]
    with tb.connect(address) as client:
        client.queue(name).get(timeout=30)


def test_an_item_through_the_broker_whose_taker_died_keeps_its_place(c: tb.Client) -> None:
    """The broker had handed the item over on the dead consumer's lease: it takes it back
    from the lease and the item stays first."""
    q = c.queue("died-asking", maxsize=2)
    q.put(_big(q, 1.0))
    q.put(np.full(4, 2.0))
    p = CHILDREN.Process(target=dies_once_answered, args=(c.address, "died-asking"))
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    _the_big_item_first_then_the_rest(c, q, timeout=10)


def test_an_item_taken_as_its_queue_is_removed_says_so(
    c: tb.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race of a consumer's take with the queue's removal: the item through the broker
    it took is gone with the queue, and its get says the queue was removed."""
    q = c.queue("removed-while-taken", maxsize=2)
    q.put(_big(q, 1.0))
    real = qring_asks.ask

    def removed_first(ring: Any, pos: int, slot: int) -> Any:
        with tb.connect(c.address) as other:
            other.delete_queue("removed-while-taken")
        return real(ring, pos, slot)

    monkeypatch.setattr(qring_asks, "ask", removed_first)
    with pytest.raises(tb.QueueClosed, match="queue 'removed-while-taken' was removed"):
        q.get(timeout=2)
    monkeypatch.undo()
    assert wait_until(lambda: c.stats()["used_bytes"] == 0, 5)


def test_a_put_through_the_broker_that_does_not_fit_holds_up_no_later_item(
    c: tb.Client,
) -> None:
    """A put through the broker claims its position before the broker has its memory: one
    refused for room passes it over at once (a host put never waits for memory), so the
    items after it flow to consumers that hold the arena meanwhile (issue 48)."""
    q = c.queue("no-room", maxsize=4)
    capacity = c.stats()["capacity_bytes"]
    q.put(np.zeros(capacity // 2 + 4096, np.uint8))  # through the broker
    held = q.get(timeout=2)
    with pytest.raises(tb.CapacityError):
        q.put(np.zeros(capacity // 2 + 4096, np.uint8), timeout=5)
    q.put(np.full(4, 2.0), timeout=2)  # in a slot, after the position given up
    assert q.get(timeout=2).numpy().tolist() == [2.0] * 4
    del held


def test_positions_given_up_with_no_consumer_wait_for_one(c: tb.Client) -> None:
    """Positions given up behind an item use entries until a consumer passes them (2 per
    slot): with none taking, a put may wait as on a full queue though a slot is free. It
    goes on once a consumer takes, and nothing is lost (a Note in client/qring_asks.py)."""
    q = c.queue("passed-over", maxsize=2)
    q.put(np.full(4, 1.0))
    for _ in range(3):  # refused: each position is passed over behind the first item
        with pytest.raises(tb.CapacityError):
            q.put(np.zeros(c.stats()["capacity_bytes"] + 4096, np.uint8), timeout=1)
    with pytest.raises(tb.Timeout):
        q.put(np.full(4, 2.0), timeout=0.2)  # 1 of 2 slots used, but no entry free
    assert q.get(timeout=2).numpy().tolist() == [1.0] * 4
    q.put(np.full(4, 2.0), timeout=2)
    assert q.get(timeout=2).numpy().tolist() == [2.0] * 4


def test_a_signal_after_a_get_took_its_item_comes_once_it_returned(
    c: tb.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a get has taken (committed) its item, a Ctrl-C waits until the get returned and
    comes about a millisecond later, in the caller's code: the item is the caller's, not
    dropped between the take and the return (found by the chaos test: ~100 a run)."""
    q = c.queue("deferred", maxsize=2)
    q.put(np.full(4, 1.0))
    q.put(np.full(4, 2.0))
    _sigint_after_commit(monkeypatch, q._ring.view)  # type: ignore[union-attr]
    got: list[Any] = []
    with pytest.raises(KeyboardInterrupt):
        got.append(q.get(timeout=2))
        time.sleep(5)  # (it comes here)
    monkeypatch.undo()
    assert [g.numpy()[0] for g in got] == [1.0]
    assert q.get(timeout=2).numpy()[0] == 2.0


def test_an_asyncio_get_that_took_its_item_is_not_dropped_by_a_signal(
    fresh_broker: tb.BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through the asyncio client, whose ring gets run on the event loop."""
    got: list[Any] = []

    async def consume() -> None:
        async with tb.aio.connect(fresh_broker.address) as c:
            q = await c.queue("adeferred", maxsize=2)
            await q.put(np.full(4, 1.0))
            _sigint_after_commit(monkeypatch, q._ring.view)  # type: ignore[union-attr]
            got.append(await q.get(timeout=2))
            time.sleep(5)  # (it comes here, in this coroutine)

    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(consume())
    finally:
        monkeypatch.undo()
        loop.close()
    assert [g.numpy()[0] for g in got] == [1.0]
