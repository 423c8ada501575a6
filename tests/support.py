"""Helpers the integration tests share: spawned children whose exit codes are checked, and
waiting for a condition."""

from __future__ import annotations

import contextlib
import glob
import multiprocessing as mp
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from tensorbroker.server.state import read_journal

SPAWN = mp.get_context("spawn")


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


def free_tcp_address() -> str:
    """tcp://127.0.0.1:PORT with a port no one listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


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
