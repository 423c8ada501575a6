"""Helpers the integration tests share: child processes (forked from a fork server) whose
exit codes are checked, and waiting for a condition."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import glob
import multiprocessing as mp
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import IO, Any

import pytest

from tensorbroker.server.durability.journal import read_journal
from tensorbroker.server.durability.state import owner_path


class _Child(mp.context.ForkServerProcess):
    """A child process forked from the fork server, run as a spawned one would be: with the
    environment its parent had when it was made (a test's monkeypatched TENSORBROKER_LANES,
    say), not the one the fork server started with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._environ = dict(os.environ)

    def run(self) -> None:
        # What the fork server imported is never garbage: the collector leaves it alone,
        # else each full collection walks it all (171,000 objects with torch: 75 ms, every
        # page of them copied from the fork server's). A broker stalled by those failed the
        # fuzz test once, in a full run (672 of its 5,000 frames answered before it gave up).
        gc.freeze()
        os.environ.clear()
        os.environ.update(self._environ)
        tempfile.tempdir = None  # tempfile's folder from that environment, as in a new process
        super().run()


class _Children(mp.context.ForkServerContext):
    Process = _Child


# The tests' child processes (about 100 a run), forked from a fork server (one per xdist
# worker) that has imported NumPy, tensorbroker and torch once: a spawned child costs 0.2
# CPU-s to start with NumPy (1.7 with torch), most of it those imports, and a forked one a
# few milliseconds. Not JAX: it reads its configuration (JAX_ENABLE_X64, JAX_PLATFORMS) when
# imported, from the environment each child is given.
CHILDREN = _Children()
CHILDREN.set_forkserver_preload(
    ["numpy", "tensorbroker", "torch", "tensorbroker.cli", "tensorbroker.server.broker"]
)


# The suite's brokers (about 320 a run) are forked from the same fork server, which imported
# the broker once: `tensorbroker serve` in a new interpreter costs about 0.19 CPU-s to start,
# most of it imports. They run the CLI's own `main` with the same arguments, their output
# going to the same log, the launcher's two pipes passed to them. Tests of the command
# itself (test_cli.py, ...) still run it as a command.


def _serve(argv: list[str], log_path: str, fds: dict[str, Connection]) -> None:
    """`tensorbroker serve` in this forked child: `fds` are the pipes the launcher passes,
    by the flag that names each (their numbers here are not the launcher's)."""
    for flag, conn in fds.items():
        argv[argv.index(flag) + 1] = str(os.dup(conn.fileno()))  # the broker's to close
        conn.close()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    from tensorbroker.cli import main

    sys.exit(main(argv))


class ForkedBroker:
    """A broker forked from the fork server, driven as BrokerProcess drives a Popen."""

    def __init__(self, argv: list[str], pass_fds: tuple[int, ...], log: IO[bytes]) -> None:
        given = {argv[argv.index(flag) + 1]: flag for flag in ("--ready-fd", "--parent-fd")}
        fds = {given[str(fd)]: Connection(os.dup(fd)) for fd in pass_fds}  # (closed here)
        args = argv[argv.index("serve") :]
        self._proc = CHILDREN.Process(target=_serve, args=(args, log.name, fds))
        try:
            self._proc.start()
        finally:
            for conn in fds.values():
                conn.close()
        self.pid = int(self._proc.pid or 0)

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired("tensorbroker serve", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def low_priority() -> None:
    """For a child whose loop works as fast as it can until the test stops it: the test's
    clock sets how long it runs, not how much it does. At nice 10 it takes about a tenth of a
    core that the brokers, the other children or the suite's other tests want, not an equal
    share, and all of one they leave."""
    os.nice(10)


def join_all(procs: list[Any], timeout: float = 120) -> None:
    """Join every child (killing those still alive after `timeout`); all must exit 0."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = {p.name: p.exitcode for p in procs}
    assert all(code == 0 for code in codes.values()), f"child exit codes: {codes}"


def crash(broker: Any) -> None:
    """SIGKILL a broker (a tb.BrokerProcess) and wait for it to be gone."""
    broker.send_signal(signal.SIGKILL)
    broker.wait(10)


async def keep_a_cancelled_get(c: Any, q: Any) -> None:
    """An asyncio get of queue `q` (of client `c`) cancelled as the broker answered it: its
    item is kept for the next get (aio_queue's turn)."""
    getter = asyncio.create_task(q.get())
    await asyncio.sleep(0)  # its request is sent, its answer not read
    getter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await getter
    for _ in range(100):
        if any(turn.kept for turn in c._turns.values()):
            break
        await asyncio.sleep(0.01)
    assert any(turn.kept for turn in c._turns.values())  # the answer came anyway


def wait_until(cond: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    """Poll `cond` until it is true or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def seconds_until(cond: Callable[[], bool], timeout: float) -> float:
    """Seconds it took `cond` to hold; fails the test after `timeout`."""
    start = time.monotonic()
    assert wait_until(cond, timeout), f"condition not met within {timeout}s"
    return time.monotonic() - start


def segments_of(state_dir: str) -> list[str]:
    """The /dev/shm files of the broker state in `state_dir` (stats()["state_dir"])."""
    found = read_journal(state_dir)
    assert found is not None, f"no broker state in {state_dir}"
    return sorted(glob.glob(f"/dev/shm/tb-{found.meta['id']}-*"))


def run_segments(run_dir: str) -> set[str]:
    """The files in /dev/shm (segments and owner files) of the broker states kept in
    `run_dir` (the folder of this test run: tests/conftest.py), or of states whose journal
    is there: a state's owner file names its state dir (Note [recovery] in
    server/durability/state.py). Those of other runs on this machine, at the same time, are not
    counted; nor is a segment left with neither (its state cannot be told)."""
    root = os.path.join(os.path.realpath(run_dir), "")
    ours: set[str] = set()
    for top, _, files in os.walk(run_dir):
        if "journal" in files:
            with contextlib.suppress(OSError, ValueError):
                found = read_journal(top)
                if found is not None and "id" in found.meta:
                    ours.add(str(found.meta["id"]))
    left = set()
    for path in glob.glob("/dev/shm/tb-*"):
        match = re.match(r"tb-([0-9a-f]+)[-.]", os.path.basename(path))
        if match is None:
            continue
        sid = match.group(1)
        if sid not in ours:
            try:
                with open(owner_path("/dev/shm", sid)) as f:
                    state_dir = f.read().strip()
            except OSError:
                continue
            if not os.path.realpath(state_dir).startswith(root):
                continue
        if os.path.exists(path):  # not removed as we looked
            left.add(path)
    return left


def free_port() -> int:
    """A port of 127.0.0.1 no one listens on now, below the kernel's ephemeral range: a port
    picked from that range (bind to port 0) can be taken before the broker binds it by any
    socket given a port by the kernel, such as those of the UCX agents of a cluster's other
    brokers (seen: a three-node cluster whose third broker found its port in use).

    Each pytest-xdist worker picks from its own slice of that range, in turn from a random
    start, so no two workers (and no two picks of one worker) hand out the same port while a
    test holds it unbound (seen: a node of one worker finding its port taken by another's)."""
    global _next_port
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    low = max(1024, ephemeral - 12000)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0) % workers
    span = (ephemeral - low) // workers
    start = low + worker * span
    for _ in range(200):
        if _next_port is None:
            _next_port = random.randrange(span)
        port, _next_port = start + _next_port % span, (_next_port + 1) % span
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port of 127.0.0.1 in {start}-{start + span - 1}")


_next_port: int | None = None


def free_tcp_address() -> str:
    """tcp://127.0.0.1:PORT with a port no one listens on now."""
    return f"tcp://127.0.0.1:{free_port()}"


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run `fn` in a thread; the list gets its result, or the exception it raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


class GaveUp(Exception):
    """Raised by `interrupt_after`'s default handler: a caller that stops waiting."""


def _give_up() -> None:
    raise GaveUp


@contextlib.contextmanager
def interrupt_after(seconds: float, then: Callable[[], None] = _give_up) -> Iterator[None]:
    """Run `then` from a SIGALRM handler `seconds` after entering (its exception interrupts
    what the main thread is doing, as Ctrl-C's does); the old handler is restored."""
    old = signal.signal(signal.SIGALRM, lambda signum, frame: then())
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
