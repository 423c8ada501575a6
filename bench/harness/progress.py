"""A one-line progress bar on stderr (a line per 5% when stderr is not a terminal)."""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO


def _duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    def __init__(self, total: int, stream: TextIO = sys.stderr) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream
        self.tty = stream.isatty()
        self.started = time.monotonic()
        self._last_step = -1

    def show(self, label: str) -> None:
        """Redraw with what is being measured now."""
        elapsed = time.monotonic() - self.started
        fraction = self.done / self.total
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        eta = f"~{_duration(left)} left" if self.done else "estimating"
        text = (
            f"{self.done}/{self.total} {fraction:4.0%} {_duration(elapsed)} elapsed, {eta}  {label}"
        )
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns
            bar_width = 24
            filled = int(bar_width * fraction)
            line = f"[{'#' * filled}{'.' * (bar_width - filled)}] {text}"
            self.stream.write("\r" + line[: width - 1].ljust(width - 1))
        else:
            step = int(fraction * 20)
            if step == self._last_step:
                return
            self._last_step = step
            self.stream.write(text + "\n")
        self.stream.flush()

    def advance(self, label: str = "") -> None:
        self.done = min(self.total, self.done + 1)
        self.show(label)

    def message(self, text: str) -> None:
        """A line of its own, above the bar."""
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + " " * (width - 1) + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
