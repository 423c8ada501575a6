"""A broker under hostile input: thousands of malformed frames from a raw DEALER socket must
get error replies (or be dropped), never take the broker down, and never disturb a normal
client."""

from __future__ import annotations

import os
import random
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from support import free_tcp_address, wait_until
from zmq.utils.monitor import recv_monitor_message

import tensorbroker as tb
from tensorbroker.common import host
from tensorbroker.common.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, decode, encode

MiB = 2**20
RAW_TIMEOUT_MS = 5000
KNOWN_ERROR_CODES = {"invalid", "protocol", "not_found", "capacity", "timeout"}

RawSocket = zmq.Socket  # type: ignore[type-arg]


@pytest.fixture
def raw() -> Iterator[Callable[..., RawSocket]]:
    """Make raw DEALER sockets to an address; all closed with linger=0 afterwards."""
    ctx = zmq.Context()
    sockets: list[RawSocket] = []

    def make(address: str, connect: bool = True) -> RawSocket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # keep every reply of a flood
        if connect:
            sock.connect(address)
        sockets.append(sock)
        return sock

    try:
        yield make
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def recv(sock: RawSocket, timeout_ms: int = RAW_TIMEOUT_MS) -> dict[str, Any]:
    assert sock.poll(timeout_ms), f"no reply from the broker within {timeout_ms} ms"
    return decode(sock.recv())


def call(sock: RawSocket, message: dict[str, Any]) -> dict[str, Any]:
    """Send a request and return the reply with its id (earlier replies are skipped)."""
    sock.send(encode(message))
    while True:
        reply = recv(sock)
        if reply.get("id") == message["id"]:
            return reply


def hello(sock: RawSocket, *, watched: bool = True, **extra: Any) -> dict[str, Any]:
    """Say hello; a watched session names this process so the broker keeps it without
    heartbeats."""
    message: dict[str, Any] = {
        "op": "hello",
        "id": 1,
        "version": PROTOCOL_VERSION,
        "session": secrets.token_hex(16),
    }
    if watched:
        pid = os.getpid()
        message.update(pid=pid, boot_id=host.boot_id(), start_time=host.start_time(pid))
    message.update(extra)
    return call(sock, message)


def assert_error(reply: dict[str, Any], *codes: str) -> None:
    assert reply["ok"] is False, reply
    assert reply["code"] in codes, reply
    assert isinstance(reply["error"], str) and reply["error"], reply


def assert_serves(broker: tb.BrokerProcess) -> None:
    assert broker.alive, f"the broker died (exit code {broker.returncode})"
    with tb.connect(broker.address) as c:
        value = np.arange(1000, dtype=np.float32)
        key = f"after-{secrets.token_hex(4)}"
        version = c.put(key, value)
        assert version == 1
        got = c.get(key)
        assert np.array_equal(np.asarray(got), value)
        del got
        c.delete(key)


# -- the flood ------------------------------------------------------------------------------


def _malformed(rng: random.Random, n: int) -> list[tuple[list[bytes], bool]]:
    """n hostile messages as (frames, whether the broker must answer it)."""
    long_key = "k" * 5000
    wrong_types: list[Any] = [
        [], [1, 2, 3], ["op", "put"], 0, -1, 2**64 - 1, 1.5, "put", "", None, True, b"\x00",
        [{"op": "ping", "id": 1}],
    ]  # fmt: skip
    maps: list[dict[str, Any]] = [
        {},
        {"op": "frobnicate", "id": 3},
        {"op": "PING", "id": 3},
        {"op": 7, "id": 3},
        {"op": None},
        {"op": "ping", "id": -1},
        {"op": "ping", "id": "3"},
        {"op": "ping", "id": 2**64 - 1},
        {"op": "ping", "id": 1.5},
        {"op": "ping", "rel": "all"},
        {"op": "ping", "rel": [-1, 2]},
        {"op": "put", "id": 4},
        {"op": "put", "id": 4, "key": 12, "tensors": [["", "float32", [1]]]},
        {"op": "put", "id": 4, "key": "", "tensors": [["", "float32", [1]]]},
        {"op": "put", "id": 4, "key": long_key, "tensors": [["", "float32", [1]]]},
        {"op": "put", "id": 4, "key": "k", "tensors": "float32"},
        {"op": "put", "id": 4, "key": "k", "tensors": []},
        {"op": "put", "id": 4, "key": "k", "tensors": [["", "float32", [-1]]]},
        {"op": "put", "id": 4, "key": "k", "tensors": [["", "float32", [2**48]]]},
        {"op": "put", "id": 4, "key": "k", "tensors": [["", "float32", [2**64 - 1]]]},
        {"op": "put", "id": 4, "key": "k", "tensors": [["", "float32", [True]]]},
        {"op": "put", "id": 4, "key": "k", "tensors": [["", "float32", [1] * 33]]},
        {"op": "put", "id": 4, "key": "k", "tensors": [["", "float32", "3"]]},
        {"op": "put", "id": 4, "key": "k", "tensors": [["", "float99", [1]]]},
        {"op": "put", "id": 4, "key": "k", "tensors": [["a", "int8", [1]], ["a", "int8", [1]]]},
        {"op": "put", "id": 4, "key": "k", "tensors": [["", "int8", [1]]], "bundle": "no"},
        {"op": "put", "id": 4, "key": "k", "tensors": [["w", "int8", [1]]]},  # named, not bundle
        {"op": "put", "id": 4, "key": "k", "tensors": [["", "int8", [2**47, 2**47]]]},
        {"op": "seal", "id": 5, "put": "1"},
        {"op": "seal", "id": 5, "put": 987654321},
        {"op": "abort", "id": 5, "put": 987654321},
        {"op": "abort", "id": 5, "put": -3},
        {"op": "get", "id": 6, "key": long_key},
        {"op": "get", "id": 6, "key": "absent"},
        {"op": "get", "id": 6, "key": "absent", "timeout": -1},
        {"op": "get", "id": 6, "key": "absent", "timeout": "soon"},
        {"op": "get", "id": 6, "key": ["absent"]},
        {"op": "delete", "id": 7, "key": "absent"},
        {"op": "delete", "id": 7, "key": None},
        {"op": "exists", "id": 7, "key": long_key},
        {"op": "hello", "id": 8, "version": "1", "session": "s"},
        {"op": "hello", "id": 8, "version": 1, "session": "s" * 300},
        {"op": "hello", "id": 8, "version": 1},
        {"op": "release", "id": 9, "rel": {"1": 2}},
        {"op": "bye", "id": 9, "keep_leases": "yes"},
    ]
    out: list[tuple[list[bytes], bool]] = []
    for _ in range(n):
        kind = rng.randrange(8)
        if kind == 0:  # random bytes, from empty up
            out.append(([rng.randbytes(rng.randrange(0, 300))], True))
        elif kind == 1:  # valid msgpack, not a map
            out.append(([encode(rng.choice(wrong_types))], True))
        elif kind in (2, 3, 4):  # maps with unknown ops, wrong field types, bad shapes, ...
            message = dict(rng.choice(maps))
            out.append(([encode(message)], True))
        elif kind == 5:  # maps with non-str keys, or truncated msgpack
            if rng.random() < 0.5:
                frame = msgpack.packb({1: "ping", "op": "ping"}, use_bin_type=True)
            else:
                frame = encode(rng.choice(maps))[:-1] or b"\x81"
            out.append(([frame], True))
        elif kind == 6:  # multi-frame messages: dropped without a reply
            frames = [encode({"op": "ping", "id": 99})] * rng.randrange(2, 5)
            out.append((frames, False))
        else:  # releases of leases never held: no reply by design
            out.append(([encode({"op": "release", "rel": [rng.randrange(10**6, 10**9)]})], False))
    return out


def test_flood_of_malformed_frames(broker: tb.BrokerProcess, raw: Callable[..., Any]) -> None:
    rng = random.Random(20240611)

    # Before hello: everything but ping and hello is refused, by id.
    early = raw(broker.address)
    early.send(b"")  # an empty frame
    assert_error(recv(early), "protocol")
    for i, op in enumerate(["put", "get", "keys", "stats", "delete", "seal"], start=100):
        reply = call(early, {"op": op, "id": i, "key": "k", "put": 1})
        assert_error(reply, "hello_first", "invalid")
    reply = call(early, {"op": "keys", "id": 200})
    assert_error(reply, "hello_first")  # a client that knows it says hello (again)
    assert "does not know the client" in reply["error"]
    assert call(early, {"op": "ping", "id": 201})["ok"] is True  # ping needs no hello

    sock = raw(broker.address)
    assert hello(sock)["ok"] is True
    messages = _malformed(rng, 3000)
    expected = sum(answered for _, answered in messages)
    replies: list[dict[str, Any]] = []
    for i, (frames, _) in enumerate(messages):
        sock.send_multipart(frames)
        if i % 200 == 199:  # read as we go so that no queue fills up
            while sock.poll(0):
                replies.append(decode(sock.recv()))
    deadline = time.monotonic() + 20
    while len(replies) < expected and time.monotonic() < deadline:
        if sock.poll(100):
            replies.append(decode(sock.recv()))
    assert len(replies) == expected, f"{len(replies)} replies to {expected} answerable messages"
    internal = [r for r in replies if r.get("code") not in KNOWN_ERROR_CODES]
    assert not internal, f"{len(internal)} replies that are not plain errors: {internal[:3]}"
    assert all(r["ok"] is False for r in replies)

    # A frame over the size limit: the broker drops that peer, nothing more.
    big = raw(broker.address, connect=False)
    monitor = big.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    try:
        big.connect(broker.address)
        assert monitor.poll(RAW_TIMEOUT_MS), "could not connect"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
        big.send(b"\x00" * (MAX_MESSAGE_BYTES + 1))
        assert monitor.poll(RAW_TIMEOUT_MS), "the broker kept a peer that sent an oversized frame"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert not big.poll(0)  # and sent it no reply
    finally:
        big.disable_monitor()
        monitor.close(linger=0)

    # The same raw session still gets precise error replies, by id.
    samples: list[tuple[dict[str, Any], str, str]] = [
        ({"op": "frobnicate", "id": 5001}, "protocol", "frobnicate"),
        ({"op": "get", "id": 5002}, "invalid", "key"),
        ({"op": "get", "id": 5003, "key": "k" * 5000}, "invalid", "5000 bytes"),
        ({"op": "put", "id": 5004, "key": "k", "tensors": [["", "f32", [1]]]}, "invalid", "f32"),
        (
            {"op": "put", "id": 5005, "key": "k", "tensors": [["", "int8", [-2]]]},
            "invalid",
            "shape",
        ),
        ({"op": "seal", "id": 5006, "put": 424242}, "invalid", "424242"),
        ({"op": "get", "id": 5007, "key": "nothing-here"}, "not_found", "nothing-here"),
        ({"op": "delete", "id": 5008, "key": "nothing-here"}, "not_found", "nothing-here"),
        ({"op": "ping", "id": 5009, "rel": "x"}, "invalid", "rel"),
    ]
    for message, code, mentions in samples:
        reply = call(sock, message)
        assert_error(reply, code)
        assert mentions in reply["error"], reply
    assert call(sock, {"op": "ping", "id": 6000})["ok"] is True

    assert_serves(broker)
    with tb.connect(broker.address) as c:
        stats = c.stats()
        assert stats["pending"] == 0  # no malformed put left anything half-made
        assert stats["used_bytes"] == 0
    sock.send(encode({"op": "bye"}))


def test_hello_with_a_wrong_protocol_version(
    broker: tb.BrokerProcess, raw: Callable[..., Any]
) -> None:
    sock = raw(broker.address)
    wrong = PROTOCOL_VERSION + 6
    reply = hello(sock, version=wrong)
    assert_error(reply, "protocol")
    assert re.search(rf"\b{wrong}\b", reply["error"]), reply
    assert re.search(rf"\b{PROTOCOL_VERSION}\b", reply["error"].replace(str(wrong), "")), reply
    # no session was made: the socket is still refused
    assert_error(call(sock, {"op": "keys", "id": 2}), "hello_first")
    assert_serves(broker)


def test_put_larger_than_capacity(broker: tb.BrokerProcess, raw: Callable[..., Any]) -> None:
    sock = raw(broker.address)
    assert hello(sock)["ok"]
    size = broker.memory + MiB
    reply = call(sock, {"op": "put", "id": 2, "key": "too-big", "tensors": [["", "uint8", [size]]]})
    assert_error(reply, "capacity")
    assert "too-big" in reply["error"] and "memory" in reply["error"]
    with tb.connect(broker.address) as c:
        with pytest.raises(tb.CapacityError, match="too-big"):
            with c.create("too-big", (size,), "uint8"):
                pytest.fail("create must not yield a buffer the broker cannot hold")
        assert not c.exists("too-big")
        assert c.stats()["pending"] == 0
    sock.send(encode({"op": "bye"}))
    assert_serves(broker)


@pytest.fixture
def tcp_broker() -> Iterator[tb.BrokerProcess]:
    """A broker on 127.0.0.1, where the kernel cannot name a client's process."""
    with tb.start_broker("64MiB", free_tcp_address(), options=["--insecure-tcp"]) as b:
        yield b


@pytest.fixture
def tcp_client(tcp_broker: tb.BrokerProcess) -> Iterator[tb.Client]:
    with tb.connect(tcp_broker.address) as c:
        yield c


def test_silent_session_without_pid_is_dropped(
    tcp_broker: tb.BrokerProcess, tcp_client: tb.Client, raw: Callable[..., Any]
) -> None:
    client = tcp_client
    before = client.stats()["clients"]
    sock = raw(tcp_broker.address)
    reply = hello(sock, watched=False)
    said_hello = time.monotonic()
    assert reply["ok"] and reply["heartbeat"] > 0  # the broker asks for heartbeats
    assert client.stats()["clients"] == before + 1
    assert wait_until(lambda: client.stats()["clients"] == before, 3.0), "never dropped"
    assert time.monotonic() - said_hello > 0.5  # not at once: it had time to send heartbeats
    # its socket is no longer a session
    assert_error(call(sock, {"op": "keys", "id": 3}), "hello_first")


def test_heartbeats_keep_a_session_without_pid(
    tcp_broker: tb.BrokerProcess, tcp_client: tb.Client, raw: Callable[..., Any]
) -> None:
    client = tcp_client
    before = client.stats()["clients"]
    sock = raw(tcp_broker.address)
    reply = hello(sock, watched=False)
    interval = reply["heartbeat"]
    end = time.monotonic() + 1.4
    while time.monotonic() < end:  # a client's heartbeat cadence, for longer than the timeout
        sock.send(encode({"op": "hb"}))
        time.sleep(interval)
    assert client.stats()["clients"] == before + 1
    assert call(sock, {"op": "keys", "id": 2})["ok"] is True
    sock.send(encode({"op": "bye"}))
    assert wait_until(lambda: client.stats()["clients"] == before, 3.0)


# -- known bugs -----------------------------------------------------------------------------


def test_unhashable_dtype_is_an_invalid_request(
    broker: tb.BrokerProcess, raw: Callable[..., Any]
) -> None:
    sock = raw(broker.address)
    assert hello(sock)["ok"]
    reply = call(sock, {"op": "put", "id": 2, "key": "k", "tensors": [["", {"x": 1}, [1]]]})
    sock.send(encode({"op": "bye"}))
    assert_error(reply, "invalid")


@pytest.mark.parametrize("op", [{"a": 1}, [1, 2], None, 3.5, "no-such-op"])
def test_an_op_of_any_shape_is_refused_and_the_broker_goes_on(
    broker: tb.BrokerProcess, raw: Callable[..., Any], op: Any
) -> None:
    sock = raw(broker.address)
    assert hello(sock)["ok"]
    reply = call(sock, {"op": op, "id": 2})
    sock.send(encode({"op": "bye"}))
    assert_error(reply, "protocol")
    assert_serves(broker)


def test_hello_with_an_out_of_range_pid(broker: tb.BrokerProcess, raw: Callable[..., Any]) -> None:
    sock = raw(broker.address)
    reply = hello(sock, watched=False, pid=2**62, boot_id=host.boot_id(), start_time=1)
    if reply["ok"]:
        sock.send(encode({"op": "bye"}))
    assert reply["ok"] or reply["code"] in ("invalid", "protocol"), reply


@pytest.mark.parametrize("timeout", [float("inf"), 3e6], ids=["inf", "35-days"])
def test_get_with_a_very_long_timeout_does_not_kill_the_broker(
    fresh_broker: tb.BrokerProcess, raw: Callable[..., Any], timeout: float
) -> None:
    sock = raw(fresh_broker.address)
    assert hello(sock)["ok"]
    sock.send(encode({"op": "get", "id": 2, "key": "later", "timeout": timeout}))
    sock.send(encode({"op": "ping", "id": 3}))
    answered = sock.poll(1000)
    died = wait_until(lambda: not fresh_broker.alive, 1.0)
    assert not died, f"the broker exited with code {fresh_broker.returncode}"
    assert answered and decode(sock.recv())["id"] == 3
    assert_serves(fresh_broker)


# -- issue 14: every input bounded ------------------------------------------------------------


def _nested(depth: int) -> Any:
    value: Any = "k"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("op", ["get", "exists", "delete", "put", "qopen"])
def test_a_value_nested_a_thousand_deep_is_refused_not_an_internal_error(
    broker: tb.BrokerProcess, raw: Callable[..., Any], op: str
) -> None:
    sock = raw(broker.address)
    assert hello(sock)["ok"]
    deep = _nested(1000)
    fields = {"name": deep} if op == "qopen" else {"key": deep}
    if op == "put":
        fields["tensors"] = [["", "float32", [1]]]
    reply = call(sock, {"op": op, "id": 3, **fields})
    sock.send(encode({"op": "bye"}))
    assert_error(reply, "invalid")
    assert "internal error" not in reply["error"] and len(reply["error"]) < 300, reply


def test_releasing_many_leases_never_held_writes_one_log_line(
    fresh_broker: tb.BrokerProcess, raw: Callable[..., Any]
) -> None:
    sock = raw(fresh_broker.address)
    assert hello(sock)["ok"]
    before = os.path.getsize(fresh_broker.log_path)
    reply = call(sock, {"op": "stats", "id": 4, "rel": list(range(10**9, 10**9 + 65536))})
    sock.send(encode({"op": "bye"}))
    assert reply["ok"]
    grew = os.path.getsize(fresh_broker.log_path) - before
    assert grew < 1000, f"the broker's log grew by {grew} bytes for one request"


# -- bounds on what one client can make the broker do -------------------------------------


@pytest.mark.parametrize(
    "tensors",
    [[[]] * 1_000_000, [[[]] * 65_535] * 15],  # one long array; many shorter ones
    ids=["one-array", "fifteen-arrays"],
)
def test_a_frame_of_a_million_arrays_is_refused_before_it_is_built(
    broker: tb.BrokerProcess, raw: Callable[..., Any], tensors: list[Any]
) -> None:
    """Issue 14, item 2: a 1 MiB frame of a million empty arrays kept the broker busy 400 ms
    building them, then was refused for holding too many tensors. Now msgpack stops at the
    request's limits, before building it, and says so."""
    sock = raw(broker.address)
    assert hello(sock)["ok"]
    frame = encode({"op": "put", "id": 2, "key": "k", "tensors": tensors})
    assert len(frame) <= MAX_MESSAGE_BYTES
    sock.send(frame)
    reply = recv(sock)
    assert_error(reply, "protocol")
    assert re.search(r"max_array_len|maps and arrays", reply["error"]), reply
    assert_serves(broker)
    sock.send(encode({"op": "bye"}))


def test_a_zeromq_client_that_never_reads_its_replies_is_cut_off(
    fresh_broker: tb.BrokerProcess, raw: Callable[..., Any]
) -> None:
    """Issue 14, item 5: 2,000 `keys` requests (200 long keys each) whose replies are never
    read took the broker from 39 to 188 MiB. Now it holds at most 64 MiB of replies for one
    client, then cuts that client off, and serves the others."""
    with tb.connect(fresh_broker.address) as c:
        for i in range(200):
            c.put(f"{i:04d}-" + "k" * 900, np.zeros(1, np.uint8))
        before = _status_mib(fresh_broker.pid, "VmRSS")
        sock = raw(fresh_broker.address)
        sock.setsockopt(zmq.RCVHWM, 1)  # this end holds almost nothing either
        assert hello(sock)["ok"]
        for i in range(2000):  # 360 MiB of replies asked for, none read
            sock.send(encode({"op": "keys", "id": 10 + i}))
        assert _until_idle(fresh_broker.pid, 60), "the broker was still busy after 60 s"
        peak = _status_mib(fresh_broker.pid, "VmHWM")
        assert peak - before < 128, f"the broker grew by {peak - before} MiB for one client"
        assert len(c.keys()) == 200  # the others are served
        replies = []
        while sock.poll(1000):
            replies.append(decode(sock.recv()))
        assert len(replies) < 2000  # the rest were dropped
        assert_error(call(sock, {"op": "keys", "id": 10_000}), "hello_first")  # route ended


def test_a_zeromq_client_that_floods_the_broker_waits_in_its_own_socket(
    fresh_broker: tb.BrokerProcess, raw: Callable[..., Any]
) -> None:
    """A client that sends 1 MiB requests faster than the broker handles them (each names
    4,096 tensors, the last of a dtype that does not exist): ZeroMQ reads ahead at most
    RCVHWM of them per client; the rest wait on the client's side."""
    before = _status_mib(fresh_broker.pid, "VmRSS")
    sock = raw(fresh_broker.address)
    sock.setsockopt(zmq.SNDHWM, 8)
    assert hello(sock)["ok"]
    specs = [[f"{i:0200d}", "uint8", [1]] for i in range(4096)]
    specs[-1][1] = "uint9"
    frame = encode({"op": "put", "id": 7, "key": "k", "bundle": True, "tensors": specs})
    assert MAX_MESSAGE_BYTES // 2 < len(frame) <= MAX_MESSAGE_BYTES
    sent = 0
    deadline = time.monotonic() + 10
    while sent < 600 and time.monotonic() < deadline:
        try:
            sock.send(frame, zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            time.sleep(0.001)
    assert _until_idle(fresh_broker.pid, 60)
    peak = _status_mib(fresh_broker.pid, "VmHWM")
    assert peak - before < 256, f"the broker grew by {peak - before} MiB reading ahead"
    assert_serves(fresh_broker)


def _until_idle(pid: int, timeout: float) -> bool:
    """Wait until process `pid` used no CPU for half a second."""

    def cpu() -> int:
        with open(f"/proc/{pid}/stat") as f:
            utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
        return int(utime) + int(stime)

    deadline, last = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        now = cpu()
        if now == last:
            return True
        last = now
        time.sleep(0.5)
    return False


def _status_mib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) >> 10 for line in f if line.startswith(field + ":"))


def test_sessions_share_one_pidfd_per_process_and_are_bounded(
    fresh_broker: tb.BrokerProcess, raw: Callable[..., Any]
) -> None:
    """Issue 14, item 6: one process said hello 1,100 times and the broker, with a pidfd per
    session, ran out of file descriptors and aborted. Now a process's sessions share one
    pidfd, and past MAX_SESSIONS_PER_PROCESS a hello is refused, saying what to do."""
    from tensorbroker.server.sessions.sessions import MAX_SESSIONS_PER_PROCESS

    fds_before = len(os.listdir(f"/proc/{fresh_broker.pid}/fd"))
    sock = raw(fresh_broker.address)
    for i in range(MAX_SESSIONS_PER_PROCESS):
        assert hello(sock)["ok"], f"hello {i} refused"
    assert len(os.listdir(f"/proc/{fresh_broker.pid}/fd")) <= fds_before + 2
    reply = hello(sock)
    assert_error(reply, "capacity")
    assert f"process {os.getpid()}" in reply["error"] and "close" in reply["error"], reply
    other = subprocess.run(  # another process is served
        [sys.executable, "-c", OTHER_CLIENT, fresh_broker.address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert other.returncode == 0, other.stderr
    assert other.stdout == f"served, clients: {MAX_SESSIONS_PER_PROCESS + 1}\n"


OTHER_CLIENT = """
import sys, numpy as np, tensorbroker as tb
with tb.connect(sys.argv[1]) as c:
    c.put("k", np.arange(10))
    assert (np.asarray(c.get("k")) == np.arange(10)).all()
    print("served, clients:", c.stats()["clients"])
"""


# -- whose process a session is: the kernel's word, never the client's ----------------------

CLAIMER = """
import secrets, socket, sys, time, msgpack, zmq
from tensorbroker.common import host
from tensorbroker.common.protocol import PROTOCOL_VERSION
transport, address, claimed = sys.argv[1], sys.argv[2], int(sys.argv[3])
if transport == "lane":
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(address)
    send, u = lambda m: s.sendall(msgpack.packb(m)), msgpack.Unpacker(raw=False)
    def receive():
        while True:
            for r in u:
                return r
            u.feed(s.recv(1 << 16))
else:
    z = zmq.Context().socket(zmq.DEALER)
    z.connect(address)
    send, receive = lambda m: z.send(msgpack.packb(m)), lambda: msgpack.unpackb(z.recv())
send({"op": "hello", "id": 1, "version": PROTOCOL_VERSION, "session": secrets.token_hex(16),
      "pid": claimed, "boot_id": host.boot_id(), "start_time": host.start_time(claimed)})
heartbeat = receive()["heartbeat"]
send({"op": "put", "id": 2, "key": "k", "tensors": [["", "uint8", [1 << 20]]]})
assert receive()["ok"]
print("holding", flush=True)
while heartbeat:  # if the broker asked for them, until killed
    send({"op": "hb"})
    time.sleep(heartbeat)
sys.stdin.read()
"""


@pytest.mark.parametrize("transport", ["lane", "zeromq", "tcp"])
def test_a_client_cannot_tie_its_memory_to_another_process(
    transport: str, fresh_broker: tb.BrokerProcess, tcp_broker: tb.BrokerProcess
) -> None:
    """Issue 14, item 4: a client claims a live bystander's pid at hello and holds an unsealed
    put. The bystander exits: the claimer's put is kept (it still lives). The claimer is
    SIGKILLed: its memory comes back (over tcp, where the kernel cannot say who it is, by its
    missing heartbeats)."""
    broker = tcp_broker if transport == "tcp" else fresh_broker
    address = broker.address
    if transport == "lane":
        address = address[len("ipc://") :] + ".lane"
    with (
        subprocess.Popen(["sleep", "60"]) as bystander,
        subprocess.Popen(
            [sys.executable, "-c", CLAIMER, transport, address, str(bystander.pid)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        ) as claimer,
        tb.connect(broker.address) as c,
    ):  # fmt: skip
        try:
            assert claimer.stdout is not None
            assert claimer.stdout.readline() == "holding\n"
            assert c.stats()["pending"] == 1
            bystander.kill()
            bystander.wait()
            time.sleep(1.5)  # over tcp, longer than a silent session is kept
            assert c.stats()["pending"] == 1, "dropped when the process it named exited"
            claimer.kill()
            claimer.wait()
            assert wait_until(lambda: c.stats()["pending"] == 0, 3), "held for the bystander"
            assert c.stats()["used_bytes"] == 0
        finally:
            claimer.kill()
            bystander.kill()


@pytest.mark.parametrize(
    "tensors",
    [[["", "float99", [3]]], [["", "float64", [1 << 20]]], [["", "float64", [-1]]]],
    ids=["unknown dtype", "larger than its block", "bad shape"],
)
def test_a_refused_write_gives_its_block_back_at_once(
    broker: tb.BrokerProcess, raw: Callable[..., Any], tensors: list[Any]
) -> None:
    """A write into a block granted ahead that the broker refuses ends the put there and
    then: the block is free again, not held until the client's process exits."""
    sock = raw(broker.address)
    assert hello(sock)["ok"]
    grants = call(sock, {"op": "grant", "id": 2, "size": 4096})["grants"]
    put = grants[0][0]
    reply = call(sock, {"op": "write", "id": 3, "put": put, "key": "w", "tensors": tensors})
    assert_error(reply, "invalid")
    again = call(sock, {"op": "abort", "id": 4, "put": put})
    assert_error(again, "invalid")
    assert f"no unsealed put {put}" in again["error"]
    sock.send(encode({"op": "bye"}))
    assert_serves(broker)
