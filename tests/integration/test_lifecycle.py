"""The broker's life: a crash leaves nothing that the next start does not clean, and clients
learn at once that their broker is gone."""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import shutil
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

import tensorbroker as tb
from tests.support import segments_of, wait_until


def test_segments_of_a_killed_broker_are_adopted_by_the_next_one_and_then_removed() -> None:
    broker = tb.start_broker(memory="16MiB")
    try:
        with tb.connect(broker.address, reconnect_timeout=0) as c:
            c.put("x", np.ones(1000))
            state = c.stats()["state_dir"]
        left = segments_of(state)
        assert len(left) >= 3, "the broker made no segments"
        assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in left)
        broker.send_signal(signal.SIGKILL)
        broker.wait(10)
        assert all(os.path.exists(p) for p in left)  # SIGKILL: nothing could clean up
        broker.restart()  # the same address, so the same state: adopted
        with tb.connect(broker.address) as c:
            assert c.keys() == ["x"] and c.get("x").numpy().sum() == 1000
        assert broker.stop() == 0
        assert not any(os.path.exists(p) for p in left)  # nor the ones it made since: the dir
        assert not os.path.exists(state)
    finally:
        broker.stop()


def test_a_killed_broker_that_is_not_restarted_leaves_nothing_after_stop() -> None:
    broker = tb.start_broker(memory="16MiB")
    with tb.connect(broker.address, reconnect_timeout=0) as c:
        c.put("x", np.ones(1000))
        state = c.stats()["state_dir"]
    left = segments_of(state)
    broker.send_signal(signal.SIGKILL)
    broker.wait(10)
    broker.stop()  # what a killed broker left, start_broker's stop removes
    assert left and not any(os.path.exists(p) for p in left)


def test_sigterm_unlinks_every_segment_and_the_socket() -> None:
    broker = tb.start_broker(memory="16MiB")
    path = broker.address[len("ipc://") :]
    with tb.connect(broker.address) as c:
        c.put("x", np.ones(1000))
        segments = segments_of(c.stats()["state_dir"])
    assert segments and os.path.exists(path)
    broker.send_signal(signal.SIGTERM)
    assert broker.wait(10) == 0
    assert not any(os.path.exists(p) for p in segments)
    assert not os.path.exists(path)
    broker.stop()


def test_a_parked_get_learns_at_once_that_the_broker_died() -> None:
    broker = tb.start_broker(memory="16MiB")
    try:
        c = tb.connect(broker.address, reconnect_timeout=0)  # a broker that exits is final
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
        broker.stop()  # and what the killed broker left


def test_the_broker_takes_every_descriptor_the_kernel_allows() -> None:
    """Each client's sockets and pidfd are descriptors of the broker (issue 14, item 6)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard limit is {hard}: nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # as systemd starts services
    try:
        broker = tb.start_broker(memory="16MiB")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with broker:
        with open(f"/proc/{broker.pid}/limits") as f:
            line = next(line for line in f if line.startswith("Max open files"))
        broker_soft, broker_hard = line.split()[3:5]
        assert broker_soft == broker_hard != "1024", line


def _start_then_die(conn: Any) -> None:
    """Start a broker, say where, and die without a word (as a SIGKILL would)."""
    broker = tb.start_broker(memory="16MiB")
    with tb.connect(broker.address) as c:
        c.put("x", np.ones(1000))
        conn.send((broker.pid, broker.address, c.stats()["state_dir"]))
    conn.recv()  # until the test has looked
    os._exit(0)


def test_a_broker_from_start_broker_ends_with_the_process_that_started_it() -> None:
    """Its owner killed (no atexit, no stop): the broker stops as on SIGTERM, and removes
    its segments, instead of running on with them."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    owner = ctx.Process(target=_start_then_die, args=(there,))
    owner.start()
    pid, address, state = here.recv()
    try:
        left = segments_of(state)
        assert left and all(os.path.exists(p) for p in left)
        here.send("die")
        owner.join(10)
        assert wait_until(lambda: not _running(pid), 10), (
            f"the broker {pid} outlived the process that started it"
        )
        assert not any(os.path.exists(p) for p in left)
    finally:
        if _running(pid):  # (SIGTERM: it cleans up)
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda: not _running(pid), 10)
        shutil.rmtree(os.path.dirname(address.removeprefix("ipc://")), ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
