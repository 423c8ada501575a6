"""The broker's life: a crash leaves nothing that the next start does not clean, and clients
learn at once that their broker is gone."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

import tensorbroker as tb


def test_segments_of_a_killed_broker_are_removed_by_the_next_one() -> None:
    first = tb.start_broker(memory="16MiB")
    try:
        with tb.connect(first.address) as c:
            c.put("x", np.ones(1000))
        left = glob.glob(f"/dev/shm/tb-{first.pid}-*")
        assert left, "the broker made no segment"
        assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in left)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert all(os.path.exists(p) for p in left)  # SIGKILL: nothing could clean up
        with tb.start_broker(memory="16MiB") as second:
            assert not any(os.path.exists(p) for p in left)
            with tb.connect(second.address) as c:
                assert c.keys() == []
    finally:
        first.stop()


def test_sigterm_unlinks_every_segment_and_the_socket() -> None:
    broker = tb.start_broker(memory="16MiB")
    path = broker.address[len("ipc://") :]
    with tb.connect(broker.address) as c:
        c.put("x", np.ones(1000))
    segments = glob.glob(f"/dev/shm/tb-{broker.pid}-*")
    assert segments and os.path.exists(path)
    broker.send_signal(signal.SIGTERM)
    assert broker.wait(10) == 0
    assert not any(os.path.exists(p) for p in segments)
    assert not os.path.exists(path)
    broker.stop()


def test_a_parked_get_learns_at_once_that_the_broker_died() -> None:
    broker = tb.start_broker(memory="16MiB")
    try:
        c = tb.connect(broker.address)
        outcome: list[Any] = []

        def wait() -> None:
            try:
                c.get("never", timeout=None)
            except tb.BrokerError as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.2)
        broker.send_signal(signal.SIGKILL)
        waiter.join(5)
        assert not waiter.is_alive()
        assert isinstance(outcome[0], tb.BrokerUnavailable) and "exited" in str(outcome[0])
        with pytest.raises(tb.BrokerUnavailable):
            c.keys()
        c.close()
    finally:
        broker.stop()
        for p in glob.glob(f"/dev/shm/tb-{broker.pid}-*"):
            os.unlink(p)  # SIGKILL left them; a next broker would remove them
