"""Store-wide notifications (issue 15): watch_prefix sees every put and delete under its
prefix from the moment it starts, in order, with two writer processes; a watcher that falls
behind is told so."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

import tensorbroker as tb
from tensorbroker.server.store.events import LOG_EVENTS

WRITER = """
import sys, numpy as np, tensorbroker as tb
with tb.connect(sys.argv[1]) as c:
    name, n = sys.argv[2], int(sys.argv[3])
    for i in range(n):
        c.put(f"frames/{name}/{i % 7}", np.full(2, i), wait=i % 2 == 0)
        c.put(f"other/{name}", np.zeros(1))  # not under the prefix
        if i % 5 == 4:
            c.delete(f"frames/{name}/{i % 7}")
"""


def test_no_event_is_lost_with_two_writers(broker: tb.BrokerProcess, client: tb.Client) -> None:
    client.put("frames/before", np.zeros(1))  # before the watch: not seen
    events = client.watch_prefix("frames/", timeout=30)
    n = 300
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, broker.address, name, str(n)])
        for name in ("a", "b")
    ]
    for w in writers:
        assert w.wait(120) == 0
    seen: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
    expected = 2 * (n + n // 5)
    for _ in range(expected):
        event, key, version = next(events)
        assert key is not None and key.startswith("frames/") and version is not None, event
        seen[key.split("/")[1]].append((event, key, version))
    for name in ("a", "b"):  # each writer's events, all there and in its order
        versions: dict[str, int] = {}
        want = []
        for i in range(n):
            key = f"frames/{name}/{i % 7}"
            versions[key] = versions.get(key, 0) + 1
            want.append(("put", key, versions[key]))
            if i % 5 == 4:
                want.append(("delete", key, versions[key]))  # its numbers go on after
        assert seen[name] == want
    client.put("frames/after", np.zeros(1))
    assert next(events) == ("put", "frames/after", 1)


def test_a_watcher_that_falls_behind_is_told_so(client: tb.Client) -> None:
    events = client.watch_prefix("", timeout=5)
    for _ in range(2 * LOG_EVENTS + 10):  # the log keeps LOG_EVENTS to twice that
        client.put("busy", np.zeros(1), wait=False)
    client.flush()
    assert next(events) == ("overflowed", None, None)
    client.put("late", np.zeros(1))
    rest = [next(events)]
    assert rest == [("put", "late", 1)]


def test_a_watch_times_out_and_names_its_prefix(client: tb.Client) -> None:
    with pytest.raises(tb.Timeout, match="'quiet/'"):
        next(client.watch_prefix("quiet/", timeout=0.2))
    with pytest.raises(tb.InvalidRequest, match="prefix"):
        next(client.watch_prefix(7, timeout=0.2))  # type: ignore[arg-type]


def test_a_watcher_of_a_broker_that_restarted_is_told_it_may_have_missed_events() -> None:
    with tb.start_broker("64MiB") as b, tb.connect(b.address) as c:
        events = c.watch_prefix("p/", timeout=30)
        for i in range(3):
            c.put(f"p/old{i}", np.zeros(1))
        assert [next(events).key for _ in range(3)] == ["p/old0", "p/old1", "p/old2"]
        b.send_signal(signal.SIGKILL)
        b.wait(10)
        b.restart()
        for i in range(5):  # the new broker numbers these from 1 again
            c.put(f"p/new{i}", np.zeros(1))
        assert next(events) == ("overflowed", None, None)
