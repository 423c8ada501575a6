"""`tensorbroker top`, run as users run it: on a pseudo-terminal of a set size, its screen
read back by a terminal emulator (pyte); and `--once`, its plain-text frame."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyte
import pytest

import tensorbroker as tb
from tensorbroker.common.config import ADDRESS_ENV, format_size
from tensorbroker.topview import Sample, View, render
from tests.support import wait_until

MiB = 2**20
ENTER_ALT, LEAVE_ALT = b"\x1b[?1049h", b"\x1b[?1049l"  # xterm's smcup / rmcup: curses' screen

# The child takes the pseudo-terminal as its controlling terminal (it leads a session of its
# own), so a resize reaches it as SIGWINCH and Ctrl-C as SIGINT, as in a real terminal.
TAKE_TTY = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, '-P', '-m', 'tensorbroker', *sys.argv[1:]])"
)


def _set_size(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Terminal:
    """`tensorbroker ARGS` on a `cols` x `rows` pseudo-terminal; `text()` is its screen."""

    def __init__(self, args: list[str], cols: int, rows: int) -> None:
        self.master, slave = os.openpty()
        _set_size(slave, cols, rows)
        self.screen = pyte.Screen(cols, rows)
        self.stream = pyte.ByteStream(self.screen)
        self.raw = bytearray()  # every byte it wrote
        env = {k: v for k, v in os.environ.items() if k not in (ADDRESS_ENV, "LINES", "COLUMNS")}
        env["TERM"] = "xterm-256color"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", TAKE_TTY, *args],
                stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(slave)

    def pump(self) -> None:
        """Feed the emulator what the child wrote so far."""
        while select.select([self.master], [], [], 0)[0]:
            try:
                data = os.read(self.master, 1 << 16)
            except OSError:  # EIO: the child is gone and the terminal hung up
                return
            if not data:
                return
            self.raw += data
            self.stream.feed(data)

    def text(self) -> str:
        self.pump()
        return "\n".join(line.rstrip() for line in self.screen.display)

    def shows(self, pattern: str, timeout: float = 20.0) -> bool:
        """Whether the screen comes to match the regular expression within `timeout`."""
        return wait_until(lambda: re.search(pattern, self.text()) is not None, timeout, 0.05)

    def resize(self, cols: int, rows: int) -> None:
        self.pump()
        self.screen.resize(rows, cols)
        _set_size(self.master, cols, rows)  # the kernel sends the child SIGWINCH

    def press(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def exit_code(self, timeout: float) -> int | None:
        """The child's exit status once it exits (reading its output meanwhile), else None."""
        wait_until(lambda: (self.pump(), self.proc.poll())[1] is not None, timeout, 0.02)
        self.pump()
        return self.proc.poll()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.master)


@pytest.fixture
def top() -> Iterator[Callable[..., Terminal]]:
    """Starts `tensorbroker top ARGS` on a terminal; every one is killed at the end."""
    started: list[Terminal] = []

    def start(*args: str, cols: int = 120, rows: int = 40) -> Terminal:
        started.append(Terminal(["top", *args], cols, rows))
        return started[-1]

    yield start
    for term in started:
        term.close()


def _quits_cleanly(term: Terminal, key: bytes = b"q") -> None:
    """`key` ends it within a few seconds, status 0, the terminal given back, no traceback."""
    term.press(key)
    code = term.exit_code(timeout=5.0)
    assert code == 0, f"top did not exit 0 on {key!r} (status {code}):\n{term.text()}"
    raw = bytes(term.raw)
    assert ENTER_ALT in raw, "top never took the screen"
    assert raw.rfind(LEAVE_ALT) > raw.rfind(ENTER_ALT), "top left the terminal unrestored"
    assert b"Traceback" not in raw, raw.decode(errors="replace")[-2000:]


def _ops_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.startswith("OPS/S")), "")


def test_live_view(
    broker: tb.BrokerProcess, client: tb.Client, top: Callable[..., Terminal]
) -> None:
    client.put("top/frames", np.zeros((3, MiB), dtype=np.uint8))
    q = client.queue("top-jobs", maxsize=5)
    q.put(np.ones(4, dtype=np.float32))
    q.put(np.ones(4, dtype=np.float32))
    term = top("--address", broker.address, "--interval", "0.5")
    assert term.shows(rf"pid {broker.pid}\b"), term.text()
    text = term.text()
    assert re.search(rf"top/frames +{re.escape(format_size(3 * MiB))} .*uint8 3x{MiB}", text), text
    assert re.search(r"top-jobs +2 +\d+ +5 +open", text), text
    assert re.search(rf"^ +{os.getpid()} ", text, re.M), text  # this test's client
    assert "q: quit" in text

    def live_and_quiet() -> bool:  # rates between refreshes: this client puts nothing yet
        line = _ops_line(term.text())
        return bool(line) and "since start" not in line and not re.search(r"\b(put|write) ", line)

    assert wait_until(live_and_quiet, 20.0, 0.05), term.text()

    def putting() -> bool:  # puts while it watches, until a put rate shows
        client.put("top/busy", np.ones(256, dtype=np.float32))
        return re.search(r"\b(put|write) \d", _ops_line(term.text())) is not None  # only > 0

    assert wait_until(putting, 20.0, 0.02), term.text()
    _quits_cleanly(term)


def test_ctrl_c_quits_cleanly(broker: tb.BrokerProcess, top: Callable[..., Terminal]) -> None:
    term = top("--address", broker.address)
    assert term.shows(rf"pid {broker.pid}\b"), term.text()
    _quits_cleanly(term, b"\x03")


def test_small_and_resized_terminal(
    broker: tb.BrokerProcess, client: tb.Client, top: Callable[..., Terminal]
) -> None:
    for i in range(30):  # more rows than fit
        client.put(f"top/many-{i:02d}", np.ones(64 * (i + 1), dtype=np.uint8))
    term = top("--address", broker.address, "--interval", "0.3", cols=40, rows=10)
    assert term.shows(r"tensorbroker top"), term.text()
    for cols, rows, shown in ((20, 4, "tensorbroker top"), (1, 1, "t"), (100, 30, "QUEUE"),
                              (40, 18, "tensorbroker top")):  # fmt: skip
        term.resize(cols, rows)
        term.screen.reset()  # what shows next is drawn anew
        assert term.shows(re.escape(shown)), f"{cols}x{rows}:\n{term.text()}"
        assert term.proc.poll() is None, term.raw.decode(errors="replace")[-2000:]
    # The tables were cut to fit (18 rows: the header takes up to 11, with a queue and the
    # ops of the last interval; at 10 rows it once took them all, and no table showed).
    assert term.shows(r"\.\.\. \d+ more"), term.text()
    _quits_cleanly(term)


def test_broker_going_away(top: Callable[..., Terminal]) -> None:
    with tb.start_broker(memory="64MiB") as b:
        term = top("--address", b.address, "--interval", "0.3")
        assert term.shows(rf"pid {b.pid}\b"), term.text()
        b.send_signal(signal.SIGKILL)
        b.wait(10)
        assert term.shows(rf"broker at {re.escape(b.address)} not answering: retrying")
        assert "release thread" not in term.text()  # the client's warnings wait for the end
        b.restart()  # adopts what the killed one left
        assert term.shows(rf"pid {b.pid}\b"), term.text()  # back, without a keypress
        _quits_cleanly(term)


@pytest.mark.parametrize("once", [["--once"], []], ids=["once", "piped"])
def test_once_prints_plain_text(
    broker: tb.BrokerProcess, client: tb.Client, once: list[str]
) -> None:
    client.put("top/plain", np.zeros(1000, dtype=np.float64))
    queue = f"top-plain-{len(once)}"  # a queue of this run's own
    client.queue(queue).put(np.ones(2))
    env = {k: v for k, v in os.environ.items() if k != ADDRESS_ENV}
    done = subprocess.run(
        [sys.executable, "-P", "-m", "tensorbroker", "top", "--address", broker.address, *once],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "\x1b" not in out, "escape sequences in plain text"
    assert f"pid {broker.pid}" in out
    assert re.search(r"top/plain +7\.8 KiB +0 +cpu +float64 1000", out), out
    assert re.search(rf"{queue} +1 +1 +- +open", out), out
    assert "OPS/S" in out and "since start" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_once_without_broker(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-P", "-m", "tensorbroker", "top", "--once", "--timeout", "0.5",
         "--address", f"ipc://{tmp_path}/none.sock"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 1
    assert "no broker answers" in done.stderr and "Traceback" not in done.stderr


def test_render_fits_any_size() -> None:
    """The frame never has more lines than the height nor longer lines than the width."""
    stats = {
        "pid": 7, "address": "ipc:///run/tb.sock", "uptime_s": 4000.0, "clients": 9,
        "objects": 40, "leases": 3, "queues": 2, "queued_items": 5, "queue_in_flight": 1,
        "waiters": 0, "published": 90, "evicted": 2, "crashed": 1, "used_bytes": 3 * MiB,
        "granted_bytes": MiB, "capacity_bytes": 64 * MiB, "requests": {"put": 40, "get": 9},
        "refused": {"capacity": 2}, "devices": {"cuda:0": {"used_bytes": MiB,
        "capacity_bytes": 8 * MiB, "waiting_bytes": 4096}},
    }  # fmt: skip
    clients = [
        {"pid": 100 + i, "uid": 0, "leases": i, "held_bytes": i * MiB, "parked": 0,
         "closed": False, "idle_s": None}
        for i in range(9)
    ]  # fmt: skip
    objects = [
        {"key": f"k\x1b[2J{i}" * 5, "nbytes": MiB, "leases": 0, "device": "cpu", "bundle": True,
         "evictable": False, "tensors": [["w", "float32", [1024, 256]], ["b", "int8", []]]}
        for i in range(10)
    ]  # fmt: skip
    queues = [
        {"name": "q", "depth": 5, "maxsize": 0, "in_flight": 1, "closed": True,
         "consumers": 1, "producers": 0, "subscribers": 3}
    ]  # fmt: skip
    sample = Sample(stats, clients, objects, queues)
    for view in (View("ipc:///x", sample, {"put": 2.5}, live=True), View("ipc:///x", sample)):
        for width in (0, 1, 5, 20, 40, 80, 100, 200):
            for height in (0, 1, 2, 5, 10, 24, 60):
                lines = render(view, width, height)
                assert len(lines) <= height
                assert all(len(line) <= width and "\x1b" not in line for line in lines)
    full = render(View("ipc:///x", sample), 100, 200)
    assert any(line.startswith("REFUSED") and "capacity 2" in line for line in full)
    assert any(line.startswith("cuda:0") and "waiting to be freed" in line for line in full)
    gone = render(View("ipc:///x", sample, problem="the broker exited", live=True), 80, 24)
    assert gone[0] == "broker at ipc:///x not answering: retrying"
