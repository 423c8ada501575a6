"""Counters of the requests a broker answered: how many of each op, how long the broker spent
on them, and the errors it refused them with. They cost two clock reads and a few additions
per request, so they are always on; `stats()` carries them, and `serve --metrics` exports them
(server/metrics.py).

The time is the broker's own work on a request, from its decoded message to its answer or
its parking: a get that waits in the broker for its key counts its two visits, not the wait.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

# Upper bounds of the latency buckets, in seconds (a last one, +Inf, takes the rest).
BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0)


class OpStats:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.buckets: dict[str, list[int]] = {}  # per op: counts per bucket, +Inf last
        self.refused: dict[str, int] = {}  # error code -> requests refused with it

    def record(self, op: str, seconds: float) -> None:
        counts = self.buckets.get(op)
        if counts is None:
            counts = self.buckets[op] = [0] * (len(BUCKETS) + 1)
            self.counts[op], self.seconds[op] = 0, 0.0
        counts[bisect_left(BUCKETS, seconds)] += 1
        self.counts[op] += 1
        self.seconds[op] += seconds

    def refuse(self, code: str) -> None:
        self.refused[code] = self.refused.get(code, 0) + 1

    def wire(self) -> dict[str, Any]:
        """The counters for `stats()`: requests by op, refusals by error code, and per op
        the latency buckets (counts, not cumulative, +Inf last) and the seconds in all."""
        return {
            "requests": dict(self.counts),
            "refused": dict(self.refused),
            "latency": {
                op: {"buckets": list(b), "seconds": self.seconds[op]}
                for op, b in self.buckets.items()
            },
            "latency_bounds": list(BUCKETS),
        }
