"""Many keys at once (issue 15): get_many and wait, as a user sees them; the keys come from
another process, put while the call waits."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tensorbroker as tb

PUT_LATER = """
import sys, time, numpy as np, tensorbroker as tb
with tb.connect(sys.argv[1]) as c:
    for key in sys.argv[3:]:
        time.sleep(float(sys.argv[2]))
        c.put(key, np.full(4, int(key.rsplit("-", 1)[1]), np.int32))
"""


def put_later(broker: tb.BrokerProcess, delay: float, *keys: str) -> subprocess.Popen[bytes]:
    """Another process that puts each of `keys` (ending in -N: four Ns), `delay` s apart."""
    return subprocess.Popen([sys.executable, "-c", PUT_LATER, broker.address, str(delay), *keys])


def test_get_many_gives_every_key_in_order(client: tb.Client) -> None:
    for i in range(100):
        client.put(f"m-{i}", np.full(16, i, np.int64))
    client.put("bundle", {"a": np.arange(3), "b": np.ones(2)})
    keys = [f"m-{i}" for i in reversed(range(100))] + ["bundle"]
    got = client.get_many(keys)
    assert list(got) == keys
    assert all((got[f"m-{i}"].numpy() == i).all() for i in range(100))
    assert set(got["bundle"]) == {"a", "b"}  # type: ignore[arg-type]


def test_get_many_names_the_keys_missing(client: tb.Client) -> None:
    client.put("here", np.arange(2))
    with pytest.raises(tb.NotFound, match=r"'gone-1', 'gone-2' \(2 of 3\)"):
        client.get_many(["here", "gone-1", "gone-2"])
    with pytest.raises(tb.Timeout, match=r"'gone-1' \(1 of 2\) not put within 0.2s"):
        client.get_many(["here", "gone-1"], timeout=0.2)
    with pytest.raises(tb.InvalidRequest, match="distinct"):
        client.get_many(["here", "here"])


def test_get_many_waits_for_keys_another_process_puts(
    broker: tb.BrokerProcess, client: tb.Client
) -> None:
    client.put("later-0", np.zeros(4, np.int32))
    with put_later(broker, 0.1, "later-1", "later-2", "later-3") as writer:
        got = client.get_many([f"later-{i}" for i in range(4)], timeout=30)
    assert writer.returncode == 0
    assert [int(got[f"later-{i}"].numpy()[0]) for i in range(4)] == [0, 1, 2, 3]


def test_wait_returns_once_num_of_the_keys_exist(
    broker: tb.BrokerProcess, client: tb.Client
) -> None:
    keys = [f"w-{i}" for i in range(5)]
    assert client.wait(keys, num=1, timeout=0) == []  # none yet, and no error
    with put_later(broker, 0.3, "w-3", "w-1", "w-4") as writer:
        got = client.wait(keys, num=2, timeout=30)
        assert got in (["w-1", "w-3"], ["w-1", "w-3", "w-4"])  # in the order given
        writer.wait()
    assert client.wait(keys, num=3) == ["w-1", "w-3", "w-4"]  # already so: at once
    start = time.monotonic()
    assert client.wait(keys, timeout=0.3) == ["w-1", "w-3", "w-4"]  # all: never
    assert time.monotonic() - start >= 0.3
    with pytest.raises(tb.InvalidRequest, match="num must be 1 to the 5 keys"):
        client.wait(keys, num=6)
    assert client.stats()["waiters"] == 0


def test_a_client_that_goes_while_it_waits_leaves_nothing_waiting(
    broker: tb.BrokerProcess, client: tb.Client
) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", WAIT_FOREVER, broker.address], stdout=subprocess.PIPE
    ) as waiter:
        try:
            assert waiter.stdout is not None and waiter.stdout.readline() == b"waiting\n"
            time.sleep(0.2)
            assert client.stats()["waiters"] == 1
        finally:
            waiter.kill()
    deadline = time.monotonic() + 5
    while client.stats()["waiters"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.stats()["waiters"] == 0
    client.put("never-0", np.zeros(1))  # a seal of a key it named finds nothing to answer
    assert client.get("never-0").numpy()[0] == 0


WAIT_FOREVER = """
import sys, tensorbroker as tb
c = tb.connect(sys.argv[1])
print("waiting", flush=True)
c.wait(["never-0", "never-1"])
"""


def test_wait_wakes_for_a_key_that_went_and_came_back(client: tb.Client) -> None:
    client.put("back-a", np.zeros(1))
    result: list[list[str]] = []
    waiter = threading.Thread(
        target=lambda: result.append(client.wait(["back-a", "back-b"], num=2, timeout=20))
    )
    start = time.monotonic()
    waiter.start()
    time.sleep(0.2)
    client.delete("back-a")
    client.put("back-b", np.zeros(1))  # one of two: not yet
    client.put("back-a", np.zeros(1))  # the key that was there when it parked, back
    waiter.join(30)
    assert result == [["back-a", "back-b"]]
    assert time.monotonic() - start < 10, "answered only at its timeout"
