"""Leases: memory comes back when the last reader lets go, or dies."""

from __future__ import annotations

import gc
import os
import signal
import time

import numpy as np
import pytest
import workers
from support import CHILDREN, GaveUp, interrupt_after, seconds_until, wait_until

import tensorbroker as tb

MiB = 2**20


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
def test_memory_returns_only_when_the_last_consumer_array_is_gone(
    fresh_broker: tb.BrokerProcess, framework: str
) -> None:
    with tb.connect(fresh_broker.address) as writer, tb.connect(fresh_broker.address) as reader:
        writer.put("k", np.ones(MiB, np.float32))
        t = reader.get("k")
        array = workers.consume(framework, t)
        # A view of the consumer's array keeps the memory too (JAX slices are copies).
        view = array if framework == "jax" else array[10:20]
        expected = float(view.sum())
        del t, array
        gc.collect()
        writer.delete("k")
        time.sleep(0.2)  # time enough for any release to arrive
        stats = writer.stats()
        assert stats["used_bytes"] >= 4 * MiB and stats["leases"] == 1
        assert float(view.sum()) == expected  # still readable: nothing was freed under it

        del view
        gc.collect()
        seconds_until(lambda: writer.stats()["used_bytes"] == 0, timeout=2.0)
        assert writer.stats()["leases"] == 0


def test_release_travels_with_the_next_request(fresh_broker: tb.BrokerProcess) -> None:
    with tb.connect(fresh_broker.address) as c:
        c.put("k", np.ones(1000))
        t = c.get("k")
        c.delete("k")
        del t
        gc.collect()
        # The release is queued when the Tensor dies; the next call carries it if the
        # background flusher has not sent it already. Either way stats sees it.
        assert c.stats()["used_bytes"] == 0


def test_a_get_given_up_as_it_is_answered_holds_nothing(fresh_broker: tb.BrokerProcess) -> None:
    """A get waiting for a key, interrupted (Ctrl-C) just as the broker answers it: the
    lease of that answer goes back; the object is not held until the client closes."""
    with tb.connect(fresh_broker.address) as c, tb.connect(fresh_broker.address) as p:

        def put_then_give_up() -> None:
            p.put("late", np.ones(4))
            assert wait_until(lambda: p.stats()["leases"] == 1, 5)  # answered: c's lease
            raise GaveUp

        with interrupt_after(0.3, put_then_give_up), pytest.raises(GaveUp):
            c.get("late", timeout=10)
        assert c.exists("late")  # a call sends the releases due
        assert wait_until(lambda: p.stats()["leases"] == 0, 5)


def test_readers_sigkilled_give_their_leases_back_within_a_second(
    fresh_broker: tb.BrokerProcess,
) -> None:
    import torch

    with tb.connect(fresh_broker.address) as c:
        c.put("held", torch.ones(2 * MiB))
        holding = CHILDREN.Queue()
        readers = [
            CHILDREN.Process(
                target=workers.hold_then_wait, args=(fresh_broker.address, "held", holding)
            )
            for _ in range(2)
        ]
        for p in readers:
            p.start()
        try:
            assert [holding.get(timeout=60) for _ in readers] == [2.0 * MiB] * 2
            c.delete("held")
            assert c.stats()["leases"] == 2 and c.stats()["used_bytes"] >= 8 * MiB
            for p in readers:
                os.kill(p.pid, signal.SIGKILL)
            took = seconds_until(lambda: c.stats()["used_bytes"] == 0, timeout=1.0)
        finally:
            for p in readers:
                p.kill()
                p.join(10)
        assert [p.exitcode for p in readers] == [-signal.SIGKILL] * 2
        assert took < 1.0
        stats = c.stats()
        assert stats["leases"] == 0 and stats["clients"] == 1


def test_producer_sigkilled_while_writing_loses_its_allocation(
    fresh_broker: tb.BrokerProcess,
) -> None:
    with tb.connect(fresh_broker.address) as c:
        holding = CHILDREN.Queue()
        p = CHILDREN.Process(
            target=workers.create_then_wait, args=(fresh_broker.address, "w", holding)
        )
        p.start()
        try:
            assert holding.get(timeout=60) == "writing"
            assert c.stats()["pending"] == 1 and not c.exists("w")
            os.kill(p.pid, signal.SIGKILL)
            seconds_until(lambda: c.stats()["used_bytes"] == 0, timeout=1.0)
        finally:
            p.kill()
            p.join(10)
        assert p.exitcode == -signal.SIGKILL
        assert c.stats()["pending"] == 0 and not c.exists("w")


def test_arrays_outliving_their_client_keep_their_memory(fresh_broker: tb.BrokerProcess) -> None:
    with tb.connect(fresh_broker.address) as watcher:
        with tb.connect(fresh_broker.address) as c:
            c.put("k", np.arange(100.0))
            array = c.get("k").numpy()
            c.delete("k")
        assert watcher.stats()["used_bytes"] > 0
        assert array[99] == 99.0  # closing the client did not unmap or free it
        del array
        gc.collect()
