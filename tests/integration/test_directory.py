"""Gets without the broker (Note [directory and lease slots] in common/directory.py): an
existing key is read from the shared-memory directory and leased through a slot."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import numpy as np
import readers
from support import CHILDREN, join_all, seconds_until

import tensorbroker as tb

MiB = 1 << 20


def test_a_get_needs_no_broker(fresh_broker: tb.BrokerProcess) -> None:
    with tb.connect(fresh_broker.address) as c:
        c.put("x", np.arange(1000, dtype=np.float32))
        c.put("b", {"w": np.ones(4), "v": np.zeros(2)})
        fresh_broker.send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            x = c.get("x")
            b = c.get("b")
            took = time.monotonic() - start
            assert isinstance(x, tb.Tensor) and isinstance(b, dict)
            assert x.numpy().sum() == 499500.0 and b["w"].numpy().sum() == 4.0
        finally:
            fresh_broker.send_signal(signal.SIGCONT)
        assert took < 0.05, f"the gets took {took:.3f}s with the broker stopped"
        del x, b
        gc.collect()
        c.delete("x")  # and all is well afterwards
        assert c.keys() == ["b"]
        assert seconds_until(lambda: c.stats()["leases"] == 0, 2.0) < 2.0


def test_no_torn_reads_while_a_key_is_replaced_20000_times(
    fresh_broker: tb.BrokerProcess,
) -> None:
    out, stop = CHILDREN.Queue(), CHILDREN.Event()
    writer = CHILDREN.Process(target=readers.replace_many, args=(fresh_broker.address, 20_000, out))
    procs = [
        CHILDREN.Process(target=readers.read_uniform, args=(fresh_broker.address, stop, out))
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    writer.start()
    try:
        assert out.get(timeout=240) == ("writer", 20_000)
    finally:
        stop.set()
    reports = [out.get(timeout=60) for _ in procs]
    join_all([writer, *procs])
    assert all(who == "reader" and reads > 100 for who, reads in reports), reports


def test_memory_is_never_reused_under_a_reader() -> None:
    with tb.start_broker(memory="8MiB") as b:
        out, stop = CHILDREN.Queue(), CHILDREN.Event()
        writer = CHILDREN.Process(target=readers.churn, args=(b.address, 4.0, out))
        holders = [
            CHILDREN.Process(target=readers.hold_and_check, args=(b.address, stop, seed, out))
            for seed in range(3)
        ]
        for p in [writer, *holders]:
            p.start()
        try:
            who, puts = out.get(timeout=120)
        finally:
            stop.set()
        reports = [out.get(timeout=60) for _ in holders]
        join_all([writer, *holders])
        assert who == "churn" and puts > 200, puts  # the 8 MiB were reused many times over
        assert all(checked > 50 for _, checked in reports), reports


def test_a_reader_killed_holding_1000_leases_gives_them_back_within_a_second(
    fresh_broker: tb.BrokerProcess,
) -> None:
    with tb.connect(fresh_broker.address) as c:
        c.put("k", np.ones(MiB // 4, np.float32))
        out = CHILDREN.Queue()
        p = CHILDREN.Process(target=readers.hold_many, args=(fresh_broker.address, "k", 1000, out))
        p.start()
        try:
            assert out.get(timeout=60) == 1000
            c.delete("k")
            assert c.stats()["leases"] == 1000 and c.stats()["used_bytes"] >= MiB
            os.kill(p.pid, signal.SIGKILL)
            took = seconds_until(lambda: c.stats()["used_bytes"] == 0, timeout=1.0)
        finally:
            p.kill()
            p.join(10)
        assert took < 1.0 and c.stats()["leases"] == 0


def test_a_client_with_every_slot_taken_still_gets_through_the_broker(
    fresh_broker: tb.BrokerProcess,
) -> None:
    with tb.connect(fresh_broker.address) as c:
        c.put("k", np.arange(10.0))
        held = [c.get("k") for _ in range(1100)]  # 1024 slots, then leases of the broker
        assert all(isinstance(t, tb.Tensor) and t.numpy()[9] == 9.0 for t in held)
        assert c.stats()["leases"] == 1100
        c.delete("k")
        assert c.stats()["used_bytes"] > 0
        del held
        gc.collect()
        seconds_until(lambda: c.stats()["used_bytes"] == 0, timeout=2.0)
        assert c.stats()["leases"] == 0


def test_a_new_version_is_read_at_once_and_the_old_one_kept_for_its_reader(
    fresh_broker: tb.BrokerProcess,
) -> None:
    with tb.connect(fresh_broker.address) as w, tb.connect(fresh_broker.address) as r:
        w.put("k", np.full(4, 1.0))
        old = r.get("k")
        w.put("k", np.full(4, 2.0))
        new = r.get("k")
        assert isinstance(old, tb.Tensor) and isinstance(new, tb.Tensor)
        assert (old.version, new.version) == (1, 2)
        assert old.numpy().tolist() == [1.0] * 4 and new.numpy().tolist() == [2.0] * 4
        w.delete("k")
        try:
            r.get("k")
        except tb.NotFound:
            pass
        else:
            raise AssertionError("a deleted key was still found")
        assert old.numpy()[0] == 1.0  # snapshot: still readable after delete


FORK_SCRIPT = """
import gc, os, sys
import numpy as np
import tensorbroker as tb
with tb.connect(sys.argv[1]) as c:
    c.put("k", np.full(8, 1.0))
    a = c.get("k").numpy()
    pid = os.fork()
    if pid == 0:  # the child drops its copy of the lease: the parent's slot must stay
        del a
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    c.delete("k")
    c.put("other", np.full(8, 7.0))  # would land in k's memory if it had been freed
    print(c.stats()["leases"], a.tolist() == [1.0] * 8)
"""


def test_a_forked_child_letting_go_does_not_end_its_parents_lease(
    fresh_broker: tb.BrokerProcess,
) -> None:
    # In a fresh interpreter: this one has imported JAX, which objects to fork().
    out = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, fresh_broker.address],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["1", "True"], out
