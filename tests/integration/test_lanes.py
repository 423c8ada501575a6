"""Lanes (Note [lanes] in server/sessions/lanes.py): clients on an ipc:// address talk to the broker
over a Unix stream socket beside it, ZeroMQ clients share the same objects, and a lane that
misbehaves or closes costs no one else anything."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

import tensorbroker as tb
from tensorbroker.common import host
from tensorbroker.common.protocol import PROTOCOL_VERSION
from tests.support import wait_until

MiB = 1 << 20


class RawLane:
    """A lane spoken by hand: msgpack maps out, msgpack maps back."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(address[len("ipc://") :] + ".lane")
        self.unpacker = msgpack.Unpacker(raw=False)

    def send(self, message: Any) -> None:
        self.sock.sendall(msgpack.packb(message))

    def recv(self) -> dict[str, Any]:
        for reply in self.unpacker:
            return dict(reply)
        while True:
            data = self.sock.recv(1 << 20)
            assert data, "the broker closed the lane"
            self.unpacker.feed(data)
            for reply in self.unpacker:
                return dict(reply)

    def hello(self) -> None:
        pid = os.getpid()
        self.send({"op": "hello", "id": 1, "version": PROTOCOL_VERSION,
                   "session": secrets.token_hex(16), "pid": pid, "boot_id": host.boot_id(),
                   "start_time": host.start_time(pid)})  # fmt: skip
        assert self.recv()["ok"]

    def closed_by_broker(self) -> bool:
        """Read what is left until the broker's end closes; False if it stays open."""
        self.sock.settimeout(5)
        try:
            while self.sock.recv(1 << 20):
                pass
        except TimeoutError:
            return False
        except ConnectionResetError:  # closed with requests of ours unread
            pass
        return True


@pytest.fixture(autouse=True)
def _lanes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about lanes, also in a run with TENSORBROKER_LANES=off."""
    monkeypatch.delenv("TENSORBROKER_LANES", raising=False)


@pytest.fixture
def lanes(fresh_broker: tb.BrokerProcess) -> Iterator[list[RawLane]]:
    made: list[RawLane] = []
    yield made
    for lane in made:
        lane.sock.close()


def test_lane_and_zeromq_clients_share_objects(
    fresh_broker: tb.BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORBROKER_LANES", "off")
    with tb.connect(fresh_broker.address) as zeromq:
        assert zeromq.stats()["lanes"] == 0
        monkeypatch.delenv("TENSORBROKER_LANES")
        with tb.connect(fresh_broker.address) as lane:
            assert lane.stats()["lanes"] >= 1
            zeromq.put("a", np.arange(1000, dtype=np.int64))
            lane.put("b", np.arange(10, dtype=np.float32), wait=False)
            assert (lane.get("a").numpy() == np.arange(1000)).all()
            lane.flush()
            assert (zeromq.get("b").numpy() == np.arange(10)).all()
            q_lane, q_zeromq = lane.queue("q", maxsize=2), zeromq.queue("q")
            q_zeromq.put(np.ones(4))
            q_lane.put(np.zeros(4), wait=False)
            assert q_lane.get().numpy().sum() == 4 and q_zeromq.get().numpy().sum() == 0
        # the lane client closed: its lanes with it
        assert wait_until(lambda: zeromq.stats()["lanes"] == 0, 5)


def test_garbage_on_a_lane_is_refused_and_others_are_served(
    fresh_broker: tb.BrokerProcess, lanes: list[RawLane]
) -> None:
    lane = RawLane(fresh_broker.address)
    lanes.append(lane)
    lane.send([1, 2, 3])  # msgpack, not a map: an error reply
    reply = lane.recv()
    assert not reply["ok"] and reply["code"] == "protocol" and "map" in reply["error"]
    lane.send({"op": "keys", "id": 5})  # before hello
    reply = lane.recv()
    assert not reply["ok"] and reply["id"] == 5
    lane.sock.sendall(b"\xc1")  # never valid msgpack: the lane is closed
    assert lane.closed_by_broker()
    with tb.connect(fresh_broker.address) as c:
        c.put("x", np.arange(5))
        assert (c.get("x").numpy() == np.arange(5)).all()
        assert wait_until(lambda: c.stats()["lanes"] >= 1, 5)


def test_a_lane_that_sends_a_million_arrays_is_closed_before_they_are_built(
    fresh_broker: tb.BrokerProcess, lanes: list[RawLane]
) -> None:
    """Issue 14, item 2, over a lane: msgpack stops at a request's limits (15 arrays of
    65,535 empty arrays each, in 1 MiB) and the lane is closed."""
    lane = RawLane(fresh_broker.address)
    lanes.append(lane)
    lane.hello()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed mid-send
        lane.send({"op": "put", "id": 2, "key": "k", "tensors": [[[]] * 65_535] * 15})
    assert lane.closed_by_broker()
    with tb.connect(fresh_broker.address) as c:
        c.put("x", np.arange(5))
        assert (c.get("x").numpy() == np.arange(5)).all()


def test_a_lane_that_closes_while_its_get_waits_takes_no_item(
    fresh_broker: tb.BrokerProcess, lanes: list[RawLane]
) -> None:
    lane = RawLane(fresh_broker.address)
    lanes.append(lane)
    lane.hello()
    lane.send({"op": "qopen", "id": 2, "name": "q", "maxsize": 0})
    queue_id = lane.recv()["queue"]
    with tb.connect(fresh_broker.address) as c:
        lane.send({"op": "qget", "id": 3, "queue": queue_id, "timeout": None})
        assert wait_until(lambda: c.stats()["waiters"] == 1, 5)
        lane.sock.close()  # its process lives on, so its session does
        assert wait_until(lambda: c.stats()["waiters"] == 0, 5)
        q = c.queue("q")
        q.put(np.full(8, 3.0))
        assert q.get(timeout=5).numpy().sum() == 24  # not handed to the closed lane


def test_a_client_that_leaves_its_replies_unread_is_cut_off(
    fresh_broker: tb.BrokerProcess, lanes: list[RawLane]
) -> None:
    with tb.connect(fresh_broker.address) as c:
        x = np.zeros(1, np.uint8)
        for i in range(1000):  # each `keys` reply is then about 1 MiB
            c.put(f"{i:04d}" + "k" * 1000, x, wait=False)
        c.flush()
        lane = RawLane(fresh_broker.address)
        lanes.append(lane)
        lane.hello()
        for i in range(100):  # 100 MiB asked for, never read while asking
            lane.send({"op": "keys", "id": 10 + i})
        assert lane.closed_by_broker()
        assert c.stats()["lanes"] >= 1  # this client's lanes were not touched
        assert len(c.keys()) == 1000
