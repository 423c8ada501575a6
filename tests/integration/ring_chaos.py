"""Workers of the queue ring chaos test (test_ring_chaos.py): producers and consumers of one
bounded queue that are sent SIGINTs all the time, and consumers that are SIGKILLed.

A SIGINT raises KeyboardInterrupt only where it lands in tensorbroker's code (as a user's
Ctrl-C would in the middle of a put or get); one that lands in the worker's own bookkeeping
is counted and dropped, so that the logs say exactly what each call returned. Each worker
appends what it put (the item's number and version: its put returned, or its
KeyboardInterrupt says the item went in) or took (the number) to a log file, a line each,
with unbuffered writes."""

from __future__ import annotations

import os
import random
import signal
from types import FrameType
from typing import Any

import numpy as np

import tensorbroker as tb

LIBRARY = os.path.dirname(tb.__file__)
QUEUE = "ring-chaos"
MAXSIZE = 4
LARGE = 20_000  # int64s: 160 KB, more than a slot holds, so put through the broker
_quiet = [True]  # outside a put or a get: a SIGINT is dropped


def _interrupt(signum: int, frame: FrameType | None) -> None:
    if not _quiet[0] and frame is not None and frame.f_code.co_filename.startswith(LIBRARY):
        raise KeyboardInterrupt


def _said(exc: BaseException, what: str) -> int:
    """The version a note of `exc` gives after `what` (0: none does)."""
    for note in getattr(exc, "__notes__", ()):
        if what in note:
            return int(note.split(what)[1].rstrip(")"))
    return 0


def _log(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)


def produce(address: str, worker: int, ready: Any, stop: Any, path: str) -> None:
    """Put numbered items (three small ones to one large) until `stop`."""
    rng, fd = random.Random(worker), _log(path)
    with tb.connect(address, reconnect_timeout=60) as c:
        q = c.queue(QUEUE, maxsize=MAXSIZE)
        signal.signal(signal.SIGINT, _interrupt)
        ready.set()
        n = worker * 1_000_000
        while not stop.is_set():
            item = np.full(rng.choice((4, 4, 4, LARGE)), n, np.int64)
            _quiet[0] = False
            try:
                version = q.put(item, timeout=5)
            except KeyboardInterrupt as exc:
                version = _said(exc, "went in first: version ")
            except tb.Timeout:
                version = 0
            finally:
                _quiet[0] = True
            if version:
                os.write(fd, b"%d %d\n" % (n, version))
            n += 1
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def consume(address: str, ready: Any, path: str) -> None:
    """Take items until the queue is closed and drained; each must be whole."""
    fd = _log(path)
    with tb.connect(address, reconnect_timeout=60) as c:
        q = c.queue(QUEUE, maxsize=MAXSIZE)
        signal.signal(signal.SIGINT, _interrupt)
        ready.set()
        while True:
            _quiet[0] = False
            try:
                item = q.get(timeout=5)
            except (KeyboardInterrupt, tb.Timeout):
                continue
            except tb.QueueClosed:
                break
            finally:
                _quiet[0] = True
            values = item.numpy()
            n = int(values[0])
            os.write(fd, b"%d\n" % n if (values == n).all() else b"torn %d\n" % n)
            del item, values
        signal.signal(signal.SIGINT, signal.SIG_IGN)
