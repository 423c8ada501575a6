"""Unit tests for the broker's lanes (server/sessions/lanes.py), with a real listener in a temporary
directory and the poller replaced by a record of what is watched."""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tensorbroker.server.sessions import lanes as lanes_module
from tensorbroker.server.sessions.lanes import Lanes


class Watched:
    """What the lanes ask the broker's poller to watch: fd -> writable too."""

    def __init__(self) -> None:
        self.fds: dict[int, bool] = {}
        self.gone: list[bytes] = []
        self.delivered: list[bytes] = []

    def watch(self, fd: int, writable: bool) -> None:
        self.fds[fd] = writable

    def unwatch(self, fd: int) -> None:
        self.fds.pop(fd, None)


@pytest.fixture
def lanes(tmp_path: Path) -> Iterator[tuple[Lanes, Watched]]:
    w = Watched()
    lanes = Lanes(
        str(tmp_path / "b.sock.lane"), w.watch, w.unwatch, w.gone.append, w.delivered.append
    )  # fmt: skip
    lanes.listen()
    yield lanes, w
    lanes.close()
    assert not (tmp_path / "b.sock.lane").exists()


def _connect(lanes: Lanes) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(lanes.path)
    lanes.accept()
    return client


def test_messages_split_and_joined_across_reads_are_dispatched_whole(
    lanes: tuple[Lanes, Watched],
) -> None:
    lanes_, _ = lanes
    client = _connect(lanes_)
    (fd,) = lanes_.by_fd
    got: list[Any] = []
    data = b"".join(msgpack.packb({"op": "ping", "id": i}) for i in range(3))
    client.sendall(data[:5])
    time.sleep(0.05)
    lanes_.read(fd, lambda route, m: got.append(m))
    assert got == []  # half a message waits for the rest
    client.sendall(data[5:])
    time.sleep(0.05)
    lanes_.read(fd, lambda route, m: got.append(m))
    assert [m["id"] for m in got] == [0, 1, 2]
    client.close()


def test_a_failed_accept_rests_the_listener_instead_of_spinning(
    lanes: tuple[Lanes, Watched], monkeypatch: pytest.MonkeyPatch
) -> None:
    lanes_, watched = lanes
    listener = lanes_._listener
    assert listener is not None and listener.fileno() in watched.fds

    class OutOfFds:  # the listener, as accept finds it when the process has no fd left
        def fileno(self) -> int:
            return listener.fileno()

        def accept(self) -> Any:
            raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(lanes_, "_listener", OutOfFds())
    lanes_.accept()
    assert listener.fileno() not in watched.fds and lanes_.paused_until is not None
    lanes_.resume(time.monotonic())  # too early
    assert listener.fileno() not in watched.fds
    lanes_.resume(time.monotonic() + lanes_module.ACCEPT_PAUSE)
    assert listener.fileno() in watched.fds and lanes_.paused_until is None


def test_a_client_that_reads_nothing_is_cut_off_at_the_backlog(
    lanes: tuple[Lanes, Watched], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lanes_module, "LANE_BACKLOG", 1 << 20)
    lanes_, watched = lanes
    client = _connect(lanes_)
    (route,) = lanes_.by_route
    reply = b"x" * (64 << 10)
    sent = 0
    while route in lanes_.by_route:
        assert lanes_.send(route, reply)
        sent += 1
        assert sent < 1000, "never cut off"
    assert watched.gone == [route] and not watched.fds.keys() - {lanes_._listener.fileno()}
    assert lanes_.send(route, reply)  # a closed lane's reply is dropped, not sent by ZeroMQ
    client.close()


def test_a_reply_is_delivered_only_once_nothing_of_it_waits_in_the_buffer(
    lanes: tuple[Lanes, Watched],
) -> None:
    """A bell rings on `delivered` (Note [direct handoff]): a consumer woken while part of its
    reply still waits in the broker's buffer would find nothing and sleep again."""
    lanes_, watched = lanes
    client = _connect(lanes_)
    (route,) = lanes_.by_route
    (fd,) = lanes_.by_fd
    assert lanes_.send(route, b"small")
    assert watched.delivered == [route]
    big = b"x" * (8 << 20)  # more than the kernel takes at once
    assert lanes_.send(route, big)
    assert watched.delivered == [route] and watched.fds[fd]  # the rest waits for writable
    received = 0
    while received < len(big) + len(b"small"):
        received += len(client.recv(1 << 20))
        lanes_.write(fd)
    assert watched.delivered == [route, route] and not watched.fds[fd]
    client.close()
