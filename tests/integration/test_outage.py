"""A broker down for longer than a client's reconnect window: the calls made meanwhile raise
BrokerUnavailable, and once a broker is back on the same state, the same Client (sync or
asyncio, busy or idle) carries on with its session and its leases, without being rebuilt.
Calls in flight when the broker died are sent again, and keep their deadlines."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import tensorbroker as tb
from tests.support import wait_until

WINDOW = 1.0  # the clients' reconnect_timeout: shorter than the outages below


@pytest.fixture
def broker() -> Iterator[tb.BrokerProcess]:
    with tb.start_broker(memory="64MiB") as b:
        yield b


def _kill(broker: tb.BrokerProcess) -> None:
    broker.send_signal(signal.SIGKILL)
    broker.wait(10)


def test_a_client_that_gave_up_carries_on_with_its_leases(broker: tb.BrokerProcess) -> None:
    with tb.connect(broker.address, reconnect_timeout=WINDOW) as c:
        c.put("x", np.arange(1000.0))
        held = c.get("x").numpy()  # a lease of this process, on version 1
        _kill(broker)
        with pytest.raises(tb.BrokerUnavailable, match=f"within {WINDOW:g}s"):
            c.put("y", np.ones(3))
        began = time.monotonic()
        with pytest.raises(tb.BrokerUnavailable, match="next call looks for it again"):
            c.keys()  # a later call looks again, with a window of its own
        assert time.monotonic() - began >= WINDOW * 0.9
        broker.restart()
        assert c.keys() == ["x"]  # the same Client, back
        c.put("x", np.zeros(1000))  # version 1 is retired: only the lease carried over holds it
        with tb.connect(broker.address) as other:  # memory that version 1 must not be given
            for i in range(20):
                other.put(f"fill-{i}", np.full(1000, -1.0))
        np.testing.assert_array_equal(held, np.arange(1000.0))
        assert c.get("x").numpy().sum() == 0


def test_an_idle_client_comes_back_by_itself(broker: tb.BrokerProcess) -> None:
    """The release thread looks for the broker again now and then: a client that makes no
    call still comes back, so the broker that adopted its state is not kept waiting."""
    with tb.connect(broker.address, reconnect_timeout=WINDOW) as c:
        c.put("x", np.arange(10.0))
        held = c.get("x").numpy()
        _kill(broker)
        time.sleep(WINDOW + 1.0)  # the release thread's own wait is over by now
        broker.restart()
        assert wait_until(lambda: c._conn.generation == 1, timeout=10.0), "never came back"
        assert not c._conn.broken
        np.testing.assert_array_equal(held, np.arange(10.0))


def test_a_get_sent_again_after_a_restart_keeps_its_deadline(broker: tb.BrokerProcess) -> None:
    timeout = 4.0
    with tb.connect(broker.address) as c:
        outcome: list[Any] = []

        def get() -> None:
            try:
                c.get("never", timeout=timeout)
            except tb.BrokerError as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=get)
        began = time.monotonic()
        waiter.start()
        time.sleep(1.0)
        _kill(broker)
        broker.restart()
        back = time.monotonic() - began
        waiter.join(30)
        took = time.monotonic() - began
        assert outcome and isinstance(outcome[0], tb.Timeout), outcome
        # sent again with what was left of its 4 s: not 4 s more after the restart
        assert took < max(timeout, back) + 1.5, (took, back)


def test_the_asyncio_client_carries_on_after_an_outage(broker: tb.BrokerProcess) -> None:
    async def main() -> None:
        async with tb.aio.connect(broker.address, reconnect_timeout=WINDOW) as c:
            await c.put("x", np.arange(10.0))
            _kill(broker)
            with pytest.raises(tb.BrokerUnavailable, match=f"within {WINDOW:g}s"):
                await c.keys()  # waits out its window (in a thread: the loop goes on)
            await asyncio.to_thread(broker.restart)
            assert await c.keys() == ["x"]
            assert (await c.get("x")).numpy().sum() == 45

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_asyncio_client_sends_its_waiting_calls_again(broker: tb.BrokerProcess) -> None:
    """A get waiting in the broker when it dies is sent again to the one that comes back,
    and answered by a put made there, as the synchronous client's are."""

    async def main() -> None:
        async with tb.aio.connect(broker.address) as c:
            waiting = asyncio.create_task(c.get("later", timeout=30.0))
            await asyncio.sleep(0.5)
            _kill(broker)
            await asyncio.to_thread(broker.restart)
            with tb.connect(broker.address) as producer:
                producer.put("later", np.arange(5.0))
            got = await asyncio.wait_for(waiting, 20)
            assert got.numpy().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]

    asyncio.run(asyncio.wait_for(main(), 60))


def test_closing_a_client_whose_broker_is_gone_does_not_wait_for_it(
    broker: tb.BrokerProcess,
) -> None:
    c = tb.connect(broker.address, reconnect_timeout=5.0)
    c.put("x", np.ones(3))
    _kill(broker)
    with pytest.raises(tb.BrokerUnavailable):
        c.put("y", np.ones(3))  # waits out its 5 s window
    began = time.monotonic()
    c.close()  # nothing to flush to a broker that is gone: no window of its own
    assert time.monotonic() - began < 2.5


def test_closing_ends_a_wait_for_the_broker_that_the_release_thread_is_in(
    broker: tb.BrokerProcess,
) -> None:
    """The release thread waits out a reconnect window (it saw the broker exit) when the
    client closes: close does not wait for that window to run out."""
    c = tb.connect(broker.address, reconnect_timeout=8.0)
    c.put("x", np.ones(3))
    _kill(broker)
    time.sleep(1.5)  # the release thread's next turn sees the broker gone, and waits for one
    began = time.monotonic()
    c.close()
    assert time.monotonic() - began < 2.5
