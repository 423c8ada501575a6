"""Direct handoff (Note [direct handoff] in common/mailbox.py): an item put while a consumer
waits goes from its producer straight to that consumer, and every way the wait can end
otherwise (a timeout, a close, either side dying) loses no item and gives none twice."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
from support import CHILDREN, GaveUp, in_thread, interrupt_after, join_all, wait_until
from workers import shm_mapping

import tensorbroker as tb
from tensorbroker.common.mailbox import CLAIMED, MAILBOX, OPEN, word


def offered(c: tb.Client) -> bool:
    return bool(c.stats()["direct_offered"])


def settled(c: tb.Client) -> bool:
    """No item in flight, no memory used by objects: everything handed over was freed."""
    s = c.stats()
    return s["queue_in_flight"] == 0 and s["used_bytes"] == 0 and s["direct_offered"] == 0


@pytest.fixture(autouse=True)
def through_the_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded queues too go through the broker here, as without a ring (a cluster, or
    TENSORBROKER_QUEUE_RINGS=off): the handoff is that path's (Note [queue ring])."""
    monkeypatch.setenv("TENSORBROKER_QUEUE_RINGS", "off")


@pytest.fixture
def c(fresh_broker: tb.BrokerProcess) -> Any:
    with tb.connect(fresh_broker.address) as client:
        yield client


# -- children -------------------------------------------------------------------------------


def consumer(address: str, name: str, count: int, results: Any) -> None:
    """Take `count` items, one at a time, each while parked; report (version, first value,
    whether the data lies in a broker segment) for each."""
    with tb.connect(address) as client:
        q = client.queue(name)
        out = []
        for _ in range(count):
            item = q.get(timeout=30)
            view = np.from_dlpack(item)
            out.append((item.version, int(view[0]), shm_mapping(view.ctypes.data) is not None))
            del view, item
        results.put(out)


def producer(address: str, name: str, tag: int, count: int, pause: float) -> None:
    with tb.connect(address) as client:
        q = client.queue(name)
        for i in range(count):
            time.sleep(pause)
            q.put(np.full(16, tag * 1000 + i, np.int64), wait=False)
        client.flush()


def taker(address: str, name: str, count: int, results: Any) -> None:
    """One of several consumers: take items until the queue closes; report their values."""
    with tb.connect(address) as client:
        got = [int(item.numpy()[0]) for item in client.queue(name)]
        results.put(got)


def dying_producer(address: str, name: str, where: str) -> None:
    """Put once after a first put, and die in the middle of the handoff: right after filling
    the consumer's mailbox (`sealed`: before the seal goes), or between claim and fill."""
    from tensorbroker.client import handoff, writes

    with tb.connect(address) as client:
        q = client.queue(name)
        q.put(np.full(16, 1, np.int64))  # the last producer: the next wait offers it a grant
        while not client.stats()["direct_offered"]:
            time.sleep(0.005)
        if where == "sealed":
            seal = writes.Writes.seal

            def die_at_direct_seal(self: Any, message: dict[str, Any], *args: Any) -> Any:
                *first, hand_over = args

                def then_die(m: dict[str, Any], last: int) -> None:
                    hand_over(m, last)
                    if "direct" in m:
                        os._exit(0)

                return seal(self, message, *first, then_die)

            writes.Writes.seal = die_at_direct_seal  # type: ignore[method-assign]
        else:
            handoff._shm = _Dying(handoff._shm)  # type: ignore[assignment]
        q.put(np.full(16, 2, np.int64))
    os._exit(3)  # the handoff never happened


def interrupted_producer(address: str, name: str) -> None:
    """Put once after a first put, interrupted (Ctrl-C) right after filling the consumer's
    mailbox, before the seal goes; then carry on with a third put."""
    from tensorbroker.client import writes

    with tb.connect(address) as client:
        q = client.queue(name)
        q.put(np.full(16, 1, np.int64))
        while not client.stats()["direct_offered"]:
            time.sleep(0.005)
        seal = writes.Writes.seal

        def interrupted_at_direct_seal(self: Any, message: dict[str, Any], *args: Any) -> Any:
            *first, hand_over = args

            def then_interrupt(m: dict[str, Any], last: int) -> None:
                hand_over(m, last)
                if "direct" in m:
                    raise KeyboardInterrupt

            return seal(self, message, *first, then_interrupt)

        writes.Writes.seal = interrupted_at_direct_seal  # type: ignore[method-assign]
        try:
            q.put(np.full(16, 2, np.int64))
        except KeyboardInterrupt:
            pass
        else:
            os._exit(3)  # the handoff never happened
        writes.Writes.seal = seal  # type: ignore[method-assign]
        client.flush()
        if client.stats()["direct_handoffs"] != 1:  # the broker knows of it, now (not at bye)
            os._exit(4)
        q.put(np.full(16, 3, np.int64))
        client.flush()


class _Dying:
    """The _shm module, but the process dies between claiming a mailbox and filling it."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        if name != "hand_over":
            return getattr(self._real, name)

        def claim_then_die(bell: int, mailboxes: int, *rest: Any) -> Any:
            offer = self._real.offer_read(bell)  # (queue, token, mailbox index, ...)
            if offer is None:
                return None
            token, address = offer[1], mailboxes + offer[2] * MAILBOX
            self._real.cas(address, word(token, OPEN), word(token, CLAIMED))
            os._exit(0)

        return claim_then_die


def parked_consumer(address: str, name: str) -> None:
    with tb.connect(address) as client:
        client.queue(name).get(timeout=60)


# -- the handoff ----------------------------------------------------------------------------


def test_items_put_while_a_consumer_waits_go_to_it_directly(c: tb.Client) -> None:
    results = CHILDREN.Queue()
    proc = CHILDREN.Process(target=consumer, args=(c.address, "direct", 20, results))
    proc.start()
    q = c.queue("direct")
    for i in range(20):
        if i:  # from the second on: this client is the queue's last producer
            assert wait_until(lambda: offered(c), 10), "no grant was offered to the producer"
        assert q.put(np.full(16, i, np.int64)) == i + 1
        # The put returned once the consumer had the item; this client's next call sees it.
        assert c.stats()["direct_handoffs"] == i
    got = results.get(timeout=30)
    join_all([proc])
    assert [v for v, _, _ in got] == list(range(1, 21))  # each its place in the stream
    assert [x for _, x, _ in got] == list(range(20))
    assert all(in_shm for _, _, in_shm in got), "an item handed over was not zero copy"
    assert c.stats()["direct_handoffs"] == 19
    assert wait_until(lambda: settled(c), 5)


def test_two_producers_and_three_consumers_each_item_once_in_order(c: tb.Client) -> None:
    q = c.queue("mixed", maxsize=4)
    results = CHILDREN.Queue()
    takers = [
        CHILDREN.Process(target=taker, args=(c.address, "mixed", 0, results)) for _ in range(3)
    ]
    makers = [
        CHILDREN.Process(target=producer, args=(c.address, "mixed", tag, 150, 0.002 * tag))
        for tag in (1, 2)
    ]
    for p in takers + makers:
        p.start()
    join_all(makers)
    q.close()
    got = [results.get(timeout=60) for _ in takers]
    join_all(takers)
    every = sorted(x for part in got for x in part)
    assert every == sorted(tag * 1000 + i for tag in (1, 2) for i in range(150))
    for part in got:  # each consumer sees each producer's items in the order they were put
        for tag in (1, 2):
            mine = [x for x in part if x // 1000 == tag]
            assert mine == sorted(mine)
    assert c.stats()["direct_handoffs"] > 0, "no item was handed over directly"
    assert wait_until(lambda: settled(c), 5)


def test_a_direct_items_credit_opens_its_slot_to_a_waiting_producer(
    c: tb.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim counts its item in flight before its seal spends the producer's credit for it:
    the slot that credit held must then go to a producer waiting for one. (Three consumers
    each parked holding their last item, and two producers, once waited forever so.)"""
    from tensorbroker.client import transfer

    handed, go = threading.Event(), threading.Event()

    def hand_over_and_pause(*args: Any) -> Any:
        done = real(*args)
        if done is not None:  # handed over: its seal waits, the broker learns of the claim first
            handed.set()
            go.wait(10)
        return done

    real = transfer.hand_over
    monkeypatch.setattr(transfer, "hand_over", hand_over_and_pause)
    c.queue("four", maxsize=4)
    with tb.connect(c.address) as a, tb.connect(c.address) as b, tb.connect(c.address) as cc:
        a.queue("four").put(np.full(4, 10), wait=True)  # a0; a is the queue's last producer
        first = cc.queue("four").get(timeout=5)  # held to the end: a slot
        taking, took = in_thread(lambda: cc.queue("four").get(timeout=10))
        assert wait_until(lambda: offered(c), 5)
        putting, _ = in_thread(lambda: a.queue("four").put(np.full(4, 11)))  # a1, handed over
        assert handed.wait(5)
        taking.join(10)
        assert int(took[0].numpy()[0]) == 11  # from its mailbox; the broker has not seen a1
        b.queue("four").put(np.full(4, 20))  # b0 takes the grant back: a1's claim counts it
        blocked, out = in_thread(lambda: b.queue("four").put(np.full(4, 21), timeout=10))
        assert wait_until(lambda: c.stats()["waiters"] == 1, 5)  # full: 3 items and a's credit
        go.set()  # a1's seal spends a's credit: 3 of 4 slots are in flight now
        putting.join(10)
        blocked.join(5)
        assert out == [4], "the producer waiting for the slot a1's credit held never got it"
        got = [int(cc.queue("four").get(timeout=5).numpy()[0]) for _ in range(2)]
        assert got == [20, 21]
        del first, took
    assert wait_until(lambda: settled(c), 5)


# -- the wait ends another way ----------------------------------------------------------------


def test_a_get_that_times_out_takes_its_grant_back(c: tb.Client) -> None:
    q = c.queue("late")
    q.put(np.zeros(4))  # this client is the queue's last producer
    q.get()
    with tb.connect(c.address) as other:
        waiting, out = in_thread(lambda: other.queue("late").get(timeout=0.3))
        assert wait_until(lambda: offered(c), 5)
        waiting.join(10)
        assert isinstance(out[0], tb.Timeout)
        assert not offered(c)
        assert q.put(np.ones(4)) == 2  # the grant was taken back: the item waits in the queue
        assert len(q) == 1
        item = other.queue("late").get(timeout=0)
        assert item.version == 2 and item.numpy().tolist() == [1, 1, 1, 1]
        del item
    assert c.stats()["direct_handoffs"] == 0
    assert wait_until(lambda: settled(c), 5)


def test_close_while_a_grant_is_out_ends_the_wait(c: tb.Client) -> None:
    q = c.queue("closing")
    q.put(np.zeros(4))
    q.get()
    with tb.connect(c.address) as other:
        waiting, out = in_thread(lambda: other.queue("closing").get(timeout=10))
        assert wait_until(lambda: offered(c), 5)
        q.close()
        waiting.join(10)
        assert isinstance(out[0], tb.QueueClosed)
        with pytest.raises(tb.QueueClosed):
            q.put(np.ones(4))
    assert wait_until(lambda: settled(c), 5)


def test_another_producers_item_takes_the_grant_back(c: tb.Client) -> None:
    q = c.queue("two")
    q.put(np.zeros(4))
    q.get()  # `c` is the last producer: the grant goes to it
    with tb.connect(c.address) as other, tb.connect(c.address) as third:
        waiting, out = in_thread(lambda: third.queue("two").get(timeout=10))
        assert wait_until(lambda: offered(c), 5)
        assert other.queue("two").put(np.full(4, 7.0)) == 2
        waiting.join(10)
        assert out[0].numpy().tolist() == [7, 7, 7, 7]
        del out[:]
        assert q.put(np.full(4, 8.0)) == 3  # its grant is gone: the item waits
        assert len(q) == 1
    assert c.stats()["direct_handoffs"] == 0


# -- either side dies -----------------------------------------------------------------------


def test_a_producer_that_dies_after_handing_over_loses_nothing(c: tb.Client) -> None:
    """It died after filling the consumer's mailbox, before its seal went: the consumer has
    the item, and the broker seals it from the mailbox (then frees it when let go)."""
    q = c.queue("dies")
    proc = CHILDREN.Process(target=dying_producer, args=(c.address, "dies", "sealed"))
    proc.start()
    first = q.get(timeout=30)  # its first put: it is the queue's last producer now
    assert first.numpy()[0] == 1
    del first
    item = q.get(timeout=30)
    proc.join(30)
    assert proc.exitcode == 0
    assert item.numpy()[0] == 2 and item.version == 2
    assert wait_until(lambda: c.stats()["direct_handoffs"] == 1, 5)
    assert c.stats()["queue_in_flight"] == 1  # held by this consumer, until it lets go
    del item
    assert wait_until(lambda: settled(c), 5)


def test_a_producer_interrupted_after_handing_over_still_seals(c: tb.Client) -> None:
    """Ctrl-C between filling the consumer's mailbox and sending the seal: the seal goes all
    the same, so the item is counted, freed when let go, and the stream goes on."""
    q = c.queue("interrupted")
    proc = CHILDREN.Process(target=interrupted_producer, args=(c.address, "interrupted"))
    proc.start()
    got = []
    for _ in range(3):
        item = q.get(timeout=30)
        got.append((int(item.numpy()[0]), item.version))
        del item
    join_all([proc])
    assert got == [(1, 1), (2, 2), (3, 3)]
    assert wait_until(lambda: settled(c), 5), c.stats()


def test_a_producer_that_dies_before_filling_leaves_the_consumer_waiting(c: tb.Client) -> None:
    q = c.queue("dies")
    proc = CHILDREN.Process(target=dying_producer, args=(c.address, "dies", "claimed"))
    proc.start()
    first = q.get(timeout=30)
    del first
    waiting, out = in_thread(lambda: q.get(timeout=30))
    proc.join(30)
    assert proc.exitcode == 0
    assert wait_until(lambda: c.stats()["clients"] == 1, 5)
    time.sleep(0.1)
    assert not out, "a get was answered by a producer that died before filling its mailbox"
    with tb.connect(c.address) as other:
        other.queue("dies").put(np.full(16, 5, np.int64))
        waiting.join(10)
    assert out[0].numpy()[0] == 5
    del out[:]
    assert wait_until(lambda: settled(c), 5)


def test_a_consumer_that_dies_waiting_loses_no_item(c: tb.Client) -> None:
    q = c.queue("orphan")
    q.put(np.zeros(4))
    q.get()
    proc = CHILDREN.Process(target=parked_consumer, args=(c.address, "orphan"))
    proc.start()
    assert wait_until(lambda: offered(c), 30)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert wait_until(lambda: not offered(c), 5), "the dead consumer's grant was not taken back"
    assert q.put(np.full(4, 3.0)) == 2
    item = q.get(timeout=5)
    assert item.numpy().tolist() == [3, 3, 3, 3]
    del item
    assert wait_until(lambda: settled(c), 5)


# -- the broker dies mid-handoff ----------------------------------------------------------------


def test_an_item_handed_over_as_the_broker_dies_is_neither_lost_nor_queued_again() -> None:
    """The producer filled the consumer's mailbox, and the broker died before its seal: the
    consumer has the item; the seal, sent again to the broker that comes back, binds it to
    that consumer (its lease claimed at its hello) instead of queueing it a second time."""
    from tensorbroker.client import writes

    with tb.start_broker(memory="64MiB") as broker:
        with tb.connect(broker.address) as p, tb.connect(broker.address) as c:
            q = p.queue("restart")
            q.put(np.full(16, 1, np.int64))
            first = c.queue("restart").get(timeout=5)
            del first
            waiting, out = in_thread(lambda: c.queue("restart").get(timeout=30))
            assert wait_until(lambda: offered(p), 10)
            seal = writes.Writes.seal
            restarted = threading.Thread(target=broker.restart)

            def crash_then_seal(self: Any, message: dict[str, Any], *args: Any) -> Any:
                *first, hand_over = args

                def then_crash(m: dict[str, Any], last: int) -> None:
                    hand_over(m, last)
                    if "direct" in m:  # handed over: the broker dies before the seal
                        broker.send_signal(signal.SIGKILL)
                        broker.wait(10)
                        restarted.start()

                return seal(self, message, *first, then_crash if hand_over else None)

            writes.Writes.seal = crash_then_seal  # type: ignore[method-assign]
            try:
                assert q.put(np.full(16, 2, np.int64)) == 2
            finally:
                writes.Writes.seal = seal  # type: ignore[method-assign]
            restarted.join(30)
            waiting.join(30)
            item = out[0]
            assert item.version == 2 and item.numpy()[0] == 2
            assert len(q) == 0, "the item handed over was queued again"
            assert q.put(np.full(16, 3, np.int64)) == 3
            assert c.queue("restart").get(timeout=5).numpy()[0] == 3
            del item, out[:]
            assert wait_until(lambda: settled(p), 5)


def test_a_get_given_up_leaves_its_line_and_loses_no_item(c: tb.Client) -> None:
    """A get interrupted while it waits (Ctrl-C, say) is cancelled in the broker: its grant
    is taken back, and the next item goes to the next get, never to the get given up or to
    a get of another queue."""
    a, b = c.queue("given-up"), c.queue("other")
    with tb.connect(c.address) as p:
        pa = p.queue("given-up")
        pa.put(np.zeros(4))  # `p` is the last producer of "given-up"
        a.get()
        with interrupt_after(0.3), pytest.raises(GaveUp):
            a.get(timeout=10)
        assert not offered(p)
        pa.put(np.full(4, 9.0))
        with pytest.raises(tb.Timeout):
            b.get(timeout=0.3)
        assert a.get(timeout=5).numpy().tolist() == [9.0] * 4


@pytest.mark.parametrize("then", ["its next get", "its client closes"])
def test_an_item_handed_to_a_get_as_it_is_given_up_is_not_lost(c: tb.Client, then: str) -> None:
    """The item handed straight into the mailbox of a get as it is given up goes to that
    client's next get; if the client closes first, back to the queue, for the next consumer
    (as an item answered through the broker)."""
    with tb.connect(c.address) as p:
        consumer = tb.connect(c.address)
        q, pq = consumer.queue("crossed"), p.queue("crossed")
        pq.put(np.zeros(4))  # `p` is the last producer
        assert q.get().numpy()[0] == 0

        def hand_then_give_up() -> None:
            pq.put(np.full(4, 7.0))  # handed to the waiting get, which gives up before it looks
            raise GaveUp

        before = c.stats()["direct_handoffs"]
        with interrupt_after(0.3, hand_then_give_up), pytest.raises(GaveUp):
            q.get(timeout=10)
        assert c.stats()["direct_handoffs"] == before + 1
        if then == "its next get":
            assert q.get(timeout=0).numpy().tolist() == [7.0] * 4
            consumer.close()
        else:
            consumer.close()
            assert c.queue("crossed").get(timeout=5).numpy().tolist() == [7.0] * 4
    assert wait_until(lambda: settled(c), 5)


@pytest.fixture
def slow_seal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Producers of this process pause 0.5 s between handing an item over and its seal."""
    from tensorbroker.client import transfer

    real = transfer.hand_over

    def hand_over_then_pause(*args: Any) -> Any:
        done = real(*args)
        time.sleep(0.5)
        return done

    monkeypatch.setattr(transfer, "hand_over", hand_over_then_pause)


@pytest.mark.usefixtures("slow_seal")
def test_an_item_given_back_while_a_handoff_is_unsealed_answers_one_get_once(
    c: tb.Client,
) -> None:
    """A client closes with an item kept (qback) while a producer has handed the waiting
    get of another consumer its item, unsealed: that get keeps its one answer, and the item
    given back goes to the next get."""
    with tb.connect(c.address) as p, tb.connect(c.address) as waiting:
        pq, wq = p.queue("race"), waiting.queue("race")
        closing = tb.connect(c.address)
        cq = closing.queue("race")

        def answer_then_give_up() -> None:
            pq.put(np.full(4, 7.0), wait=False)  # answered to the get about to be given up
            assert wait_until(lambda: pq.in_flight() == 1 and len(pq) == 0, 5)
            raise GaveUp

        with interrupt_after(0.3, answer_then_give_up), pytest.raises(GaveUp):
            cq.get(timeout=10)
        thread, got = in_thread(lambda: wq.get(timeout=10))
        assert wait_until(lambda: offered(p), 5)  # `p` may hand the waiting get its item
        putter, _ = in_thread(lambda: pq.put(np.full(4, 8.0)))  # handed over, sealed 0.5 s on
        time.sleep(0.2)
        closing.close()  # gives the 7.0 back
        putter.join(10)
        thread.join(10)
        assert got[0].numpy().tolist() == [8.0] * 4
        assert c.queue("race").get(timeout=5).numpy().tolist() == [7.0] * 4
        del got
        assert wait_until(lambda: pq.in_flight() == 0, 5)


@pytest.mark.usefixtures("slow_seal")
def test_an_item_handed_over_given_back_before_its_seal_goes_back_to_the_queue(
    c: tb.Client,
) -> None:
    """A get given up after a producer handed it an item but before that item's seal, and
    its client closed at once: when the seal comes, the item goes back to the queue."""
    with tb.connect(c.address) as p:
        consumer = tb.connect(c.address)
        q, pq = consumer.queue("early"), p.queue("early")
        pq.put(np.zeros(4))  # `p` is the last producer
        assert q.get().numpy()[0] == 0
        putter: list[Any] = []

        def hand_then_give_up() -> None:  # handed over; its seal goes 0.5 s later
            putter.append(in_thread(lambda: pq.put(np.full(4, 7.0)))[0])
            assert wait_until(lambda: consumer._transfer.reads.bell is not None, 1)
            time.sleep(0.1)
            raise GaveUp

        with interrupt_after(0.3, hand_then_give_up), pytest.raises(GaveUp):
            q.get(timeout=10)
        consumer.close()  # before the seal: the item goes back once it comes
        putter[0].join(10)
        assert c.queue("early").get(timeout=5).numpy().tolist() == [7.0] * 4
        with pytest.raises(tb.Timeout):
            c.queue("early").get(timeout=0.2)
    assert wait_until(lambda: settled(c), 5)


def test_producer_threads_of_one_client_keep_their_order(c: tb.Client) -> None:
    results = CHILDREN.Queue()
    proc = CHILDREN.Process(target=consumer_of, args=(c.address, "threads", 200, results))
    proc.start()
    q = c.queue("threads", maxsize=4)

    def put(tag: int) -> None:
        for i in range(100):
            time.sleep(0.001)
            q.put(np.full(16, tag * 1000 + i, np.int64), wait=i % 2 == 0)

    threads = [threading.Thread(target=put, args=(tag,)) for tag in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    got = results.get(timeout=60)
    join_all([proc])
    assert sorted(got) == sorted(tag * 1000 + i for tag in (1, 2) for i in range(100))
    for tag in (1, 2):
        mine = [x for x in got if x // 1000 == tag]
        assert mine == sorted(mine)
    assert c.stats()["direct_handoffs"] > 0
    assert wait_until(lambda: settled(c), 5)


def consumer_of(address: str, name: str, count: int, results: Any) -> None:
    with tb.connect(address) as client:
        q = client.queue(name)
        results.put([int(q.get(timeout=30).numpy()[0]) for _ in range(count)])


def test_a_seal_naming_a_grant_never_given_is_refused(c: tb.Client) -> None:
    q = c.queue("forged")
    fields = {"queue": q._id, "name": "forged", "tensors": [["", "float32", [4]]]}
    for direct in ([0, "x" * 32, 1, 1], [10**9, "x" * 32, 1, 1], [1, "x" * 32, 0, 1]):
        with pytest.raises(tb.InvalidRequest, match="no direct grant"):
            c._conn.call("write", put=123, direct=direct, **fields)
    assert c.stats()["queue_in_flight"] == 0 and len(q) == 0
