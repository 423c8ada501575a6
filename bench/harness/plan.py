"""The measurements of a run (cells), and where their numbers are kept (rows)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from .config import Settings

SMALL = 4096
LATENCY = ("put", "put_nowait", "get", "handoff")
THROUGHPUT = ("throughput_get", "throughput_putget")
MANY_KEYS = 100  # get_many: of this many 4 KiB objects
PATTERNS = ("pingpong", "stream")  # small handoffs as pipelines have them (base.py says how)
FANOUT_SIZE = 4 << 20  # fanout: items of this size, to 1 reader (a queue) or 4 (a broadcast)
FANOUT_READERS = (1, 4)
MEMORY_METRICS = (
    "shm_idle", "shm_per_object", "rss_idle", "rss_per_object", "rss_per_key", "shm_rss_per_key"
)  # fmt: skip


@dataclass(frozen=True)
class Cell:
    """One measurement, asked of every system that runs its scenario."""

    scenario: str
    size: int = SMALL
    clients: int = 1

    def message(self, settings: Settings) -> dict[str, Any]:
        return {
            "cmd": "measure",
            "scenario": self.scenario,
            "size": self.size,
            "clients": self.clients,
            "budget": settings.budget,
            "duration": settings.duration,
            "count": settings.count,
            "keys": settings.keys,
        }

    def row(self, metric: str) -> Row:
        if self.scenario in THROUGHPUT or self.scenario == "fanout":
            return Row(self.scenario, self.clients, metric)
        if self.scenario == "memory":
            return Row(self.scenario, 0, metric)
        return Row(self.scenario, self.size, metric)

    def label(self) -> str:
        if self.scenario in THROUGHPUT:
            return f"{self.scenario} x{self.clients}"
        if self.scenario == "memory":
            return "memory"
        if self.scenario == "fanout":
            return f"fanout {format_size(self.size)} to {self.clients}"
        return f"{self.scenario} {format_size(self.size)}"


@dataclass(frozen=True, order=True)
class Row:
    """A line of a results table: scenario, its parameter (size or clients), metric."""

    scenario: str
    param: int
    metric: str = "value"

    def key(self) -> str:
        return f"{self.scenario}/{self.param}/{self.metric}"


def cells(settings: Settings, rep: int) -> list[Cell]:
    """The cells of repetition `rep`, in order. Memory is measured once, first, while every
    store is fresh (page counts of a store only grow). Sizes are the outer loop so that a
    worker makes each source array once per repetition."""
    out = [Cell("memory")] if rep == 0 else []
    for size in settings.sizes:
        out.extend(Cell(scenario, size) for scenario in LATENCY)
    for scenario in THROUGHPUT:
        out.extend(Cell(scenario, clients=n) for n in settings.clients)
    out.append(Cell("get_many", SMALL))
    out.extend(Cell(scenario, SMALL) for scenario in PATTERNS)
    out.extend(Cell("fanout", FANOUT_SIZE, clients=n) for n in FANOUT_READERS)
    return out


def interleaved(systems: list[str], rep: int, index: int) -> list[str]:
    """The systems in a rotated order: each system goes first as often as the others."""
    if not systems:
        return systems
    shift = (rep + index) % len(systems)
    return systems[shift:] + systems[:shift]


class Results:
    """Per row and system: the value of each repetition."""

    def __init__(self) -> None:
        self.values: dict[Row, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.errors: dict[str, list[str]] = defaultdict(list)

    def add(self, cell: Cell, system: str, metrics: dict[str, float]) -> None:
        for metric, value in metrics.items():
            self.values[cell.row(metric)][system].append(float(value))

    def median(self, row: Row, system: str) -> float | None:
        values = self.values.get(row, {}).get(system)
        return statistics.median(values) if values else None

    def rows(self, scenario: str) -> list[Row]:
        return sorted(row for row in self.values if row.scenario == scenario)

    def systems(self, scenario: str) -> set[str]:
        return {s for row in self.rows(scenario) for s in self.values[row]}

    @classmethod
    def from_json(cls, rows: list[dict[str, Any]]) -> Results:
        results = cls()
        for item in rows:
            row = Row(item["scenario"], int(item["param"]), item["metric"])
            results.values[row][item["system"]] = [float(v) for v in item["values"]]
        return results

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {
                "scenario": row.scenario,
                "param": row.param,
                "metric": row.metric,
                "system": system,
                "values": values,
                "median": statistics.median(values),
            }
            for row in sorted(self.values)
            for system, values in sorted(self.values[row].items())
        ]


def format_size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes:.0f} B"
