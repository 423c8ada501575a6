"""`tensorbroker top`: a live view of a running broker in the terminal.

Three parts, kept apart so that each is easy to test and to reuse:

- `Feed` asks the broker for its figures (a `Sample`) and measures ops/s between samples;
  after the broker goes away it says why, and connects again at the next refresh;
- `render` (tensorbroker/topview.py) turns a `View` (the latest sample, the rates, or the
  reason the broker does not answer) into lines of text that fit a width and a height: a
  pure function;
- `live` draws those lines with curses, once per interval and at once on a key (q or
  Ctrl-C quits); `once` prints one frame as plain text, for scripts and pipes.

This module owns the first and the last: the broker side and the terminal.
"""

from __future__ import annotations

import contextlib
import curses
import locale
import logging
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator

from .client.client import Client, connect
from .common.config import check_address, default_address
from .common.errors import BrokerError
from .topview import Sample, View, render

LARGEST = 10  # objects shown, largest first
CTRL_C = 3  # read as a key: the terminal is in raw mode while top draws (see `_loop`)
QUIT_KEYS = frozenset({ord("q"), ord("Q"), CTRL_C})


# -- the broker side: samples, rates, reconnecting -------------------------------------------


def fetch(client: Client) -> Sample:
    """One sample: the counters, the clients, the largest objects and the queues."""
    return Sample(
        stats=client.stats(),
        clients=client.clients(),
        objects=list(client.list_objects(largest=LARGEST)),
        queues=client.list_queues(),
    )


def op_rates(before: Sample, after: Sample) -> dict[str, float] | None:
    """Requests per second by op between two samples, from the broker's own clock (its
    uptime); None where they are not of the same broker run or no time passed."""
    old, new = before.stats, after.stats
    span = new["uptime_s"] - old["uptime_s"]
    if new["pid"] != old["pid"] or span <= 0:
        return None
    done = old["requests"]
    return {op: (n - done.get(op, 0)) / span for op, n in new["requests"].items()}


class Feed:
    """The Views of one broker, one a refresh. Holds a client while the broker answers;
    after it goes away, each refresh tries to connect again (waiting at most `timeout`)."""

    def __init__(
        self, address: str | None, timeout: float, server_key: str | None, min_span: float
    ) -> None:
        self.address = check_address(address or default_address())
        self._timeout = timeout
        self._server_key = server_key
        self._min_span = min_span  # rates are measured over at least this many seconds
        self._client: Client | None = None
        self._last: Sample | None = None
        self._base: Sample | None = None  # the sample the rates are measured from
        self._rates: dict[str, float] | None = None

    def view(self) -> View:
        """A fresh View: of a new sample, or saying why the broker does not answer."""
        try:
            if self._client is None:
                self._client = connect(
                    self.address, self._timeout, reconnect_timeout=0, server_key=self._server_key
                )
            sample = fetch(self._client)
        except BrokerError as exc:
            self.close()
            return View(self.address, self._last, problem=str(exc), me=os.getpid(), live=True)
        self._measure(sample)
        self._last = sample
        return View(self.address, sample, self._rates, me=os.getpid(), live=True)

    def _measure(self, sample: Sample) -> None:
        """Rates from the base sample once `min_span` has passed (a key pressed just after
        a refresh keeps the last rates), or none if the broker is another one."""
        if self._base is None:
            self._base = sample
            return
        if sample.stats["pid"] != self._base.stats["pid"]:
            self._base, self._rates = sample, None
            return
        if sample.stats["uptime_s"] - self._base.stats["uptime_s"] >= self._min_span:
            self._rates = op_rates(self._base, sample)
            self._base = sample

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(BrokerError):
                client.close()


# -- the terminal ---------------------------------------------------------------------------


def once(address: str | None, timeout: float, server_key: str | None) -> None:
    """Print one frame as plain text (every row: nothing is cut to a height)."""
    with connect(address, timeout, server_key=server_key) as client:
        view = View(client.address, fetch(client), me=os.getpid())
    width = shutil.get_terminal_size((100, 40)).columns
    print("\n".join(render(view, width, sys.maxsize)))


def live(feed: Feed, interval: float) -> None:
    """Draw `feed` until q or Ctrl-C; curses restores the terminal however this ends."""
    locale.setlocale(locale.LC_ALL, "")  # curses draws non-ASCII keys in the user's encoding
    try:
        with _logs_held():
            curses.wrapper(_loop, feed, interval)
    except KeyboardInterrupt:
        pass
    finally:
        feed.close()


class _Held(logging.Handler):
    """Keeps the last log records (see `_logs_held`)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: deque[logging.LogRecord] = deque(maxlen=100)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _logs_held() -> Iterator[None]:
    """While curses owns the terminal, log records (a client's warnings when the broker
    goes away, say) are held instead of written over the frame; the last 100 are handled
    as usual afterwards."""
    root = logging.getLogger()
    handlers, held = root.handlers[:], _Held()
    root.handlers = [held]
    try:
        yield
    finally:
        root.handlers = handlers
        for record in held.records:
            for handler in handlers:
                if record.levelno >= handler.level:
                    handler.handle(record)


def _loop(screen: curses.window, feed: Feed, interval: float) -> None:
    # Raw mode: Ctrl-C is a key like q, read between frames, not a SIGINT whose
    # KeyboardInterrupt can land anywhere, a call to the broker included (the suite saw top
    # still running 5 s after a Ctrl-C, about once in 20 runs).
    curses.raw()
    with contextlib.suppress(curses.error):  # terminals that cannot hide the cursor
        curses.curs_set(0)
    while True:
        view = feed.view()
        _draw(screen, view)
        if _wait(screen, view, interval):
            return


def _wait(screen: curses.window, view: View, interval: float) -> bool:
    """Wait out the interval, redrawing on a resize; True if a quit key came, False at the
    end of the interval or on another key (refresh now)."""
    deadline = time.monotonic() + interval
    while (left := deadline - time.monotonic()) > 0:
        screen.timeout(max(1, int(left * 1000)))
        key = screen.getch()
        if key in QUIT_KEYS:
            return True
        if key == curses.KEY_RESIZE:  # repaint all: terminals keep or reflow the old text
            screen.clear()
            _draw(screen, view)
        elif key != -1:
            return False
    return False


def _draw(screen: curses.window, view: View) -> None:
    """The frame, one line a row, the header in reverse video. Writes past the edge (the
    bottom-right cell, a terminal shrinking meanwhile) are left out, never raised."""
    height, width = screen.getmaxyx()
    screen.erase()
    for y, line in enumerate(render(view, width, height)):
        attr = curses.A_REVERSE if y == 0 else curses.A_NORMAL
        with contextlib.suppress(curses.error):
            screen.addnstr(y, 0, line.ljust(width) if y == 0 else line, width, attr)
    with contextlib.suppress(curses.error):
        screen.refresh()
