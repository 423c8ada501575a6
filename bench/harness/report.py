"""results.md and results.json."""

from __future__ import annotations

import json
import os
from typing import Any

from .config import BASELINE, BY_NAME, SYSTEMS, Settings
from .plan import LATENCY, MEMORY_METRICS, PATTERNS, THROUGHPUT, Results, Row, format_size
from .targets import SCENARIO_TITLES, Target

TITLES = {
    "put": "put latency: `put(key, array)` returns (lower is better)",
    "put_nowait": "put latency, not waiting: `put(key, array, wait=False)` returns (lower is "
    "better)",
    "get": "get latency: an existing object, as a NumPy array (lower is better)",
    "handoff": "handoff latency: producer has the array, until a consumer process holds it "
    "(tensorbroker: through a queue; lower is better)",
    "throughput_get": "4 KiB get ops/s by client processes (higher is better)",
    "throughput_putget": "4 KiB put+get cycles/s by client processes (higher is better)",
    "memory": "memory: 1000 stored 4 KiB objects, and many 4-byte objects under keys of their "
    "own (lower is better)",
    "get_many": "get_many: 100 existing 4 KiB objects in one call, as NumPy arrays (lower is "
    "better)",
    "pingpong": "ping-pong handoff of 4 KiB: the consumer tells the producer it has an item and "
    "asks for the next at once, the producer puts it as soon as it hears; from the put until "
    "the consumer holds it as a NumPy array (queues of maxsize 8; lower is better)",
    "stream": "streaming 4 KiB items: the producer puts 3000 as fast as a queue of maxsize 8 "
    "takes them, the consumer drops each; items a second (higher is better)",
    "fanout": "fanout: 100 items of 4 MiB to 1 reader process (a queue) or 4 (a broadcast "
    "queue), per item, and the peak shared memory in use (maxsize 8; lower is better)",
}
RATIO_NOTE = {
    "latency": "ratio = system / tensorbroker: above 1, slower than tensorbroker.",
    "throughput": "ratio = system / tensorbroker: above 1, more ops/s than tensorbroker.",
    "memory": "ratio = system / tensorbroker: above 1, more memory than tensorbroker.",
}
MEMORY_LABELS = {
    "shm_idle": "shared memory backed, idle",
    "shm_per_object": "shared memory per object",
    "rss_idle": "store process private RSS, idle",
    "rss_per_object": "store process private RSS per object",
    "rss_per_key": "store process private RSS per small key",
    "shm_rss_per_key": "store process resident shared memory per small key",
}


def format_value(row: Row, value: float) -> str:
    if row.scenario in (*THROUGHPUT, "stream"):
        return f"{value / 1000:.1f} k/s"
    if row.scenario == "memory" or row.metric == "peak_bytes":
        return format_size(value)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value * 1e9:.3g} ns"


def _ratio(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio >= 0.01 else f"{ratio:.1g}x"


def _param_label(row: Row) -> str:
    if row.scenario in (*LATENCY, "get_many", *PATTERNS):
        return format_size(row.param)
    if row.scenario == "fanout":
        what = "peak memory" if row.metric == "peak_bytes" else "per item"
        return f"{row.param} reader{'s' if row.param > 1 else ''}, {what}"
    if row.scenario in THROUGHPUT:
        return f"{row.param} client{'s' if row.param > 1 else ''}"
    return MEMORY_LABELS.get(row.metric, row.metric)


def _table(results: Results, scenario: str) -> list[str]:
    rows = results.rows(scenario)
    if scenario == "memory":
        order = {metric: i for i, metric in enumerate(MEMORY_METRICS)}
        rows.sort(key=lambda row: order.get(row.metric, len(order)))
    present = results.systems(scenario)
    columns = [spec.name for spec in SYSTEMS if spec.name in present]
    if not rows or not columns:
        return []
    timed = (*LATENCY, "get_many", "fanout", "pingpong")
    rates = (*THROUGHPUT, "stream")
    kind = "latency" if scenario in timed else "throughput" if scenario in rates else "memory"
    heading = {"fanout": "readers", "stream": "size"}.get(
        scenario,
        "size" if scenario in timed else "clients" if scenario in THROUGHPUT else "metric",
    )
    lines = [
        f"### {TITLES[scenario]}",
        "",
        RATIO_NOTE[kind],
        "",
        "| " + " | ".join([heading, *(BY_NAME[c].label for c in columns)]) + " |",
        "|" + "---|" * (len(columns) + 1),
    ]
    for row in rows:
        ours = results.median(row, BASELINE)
        cells = [_param_label(row)]
        for system in columns:
            value = results.median(row, system)
            if value is None:
                cells.append("–")
                continue
            cell = format_value(row, value)
            if system != BASELINE and ours:
                cell += f" ({_ratio(value / ours)})"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _targets(targets: list[Target]) -> list[str]:
    lines = [
        "## Targets",
        "",
        "| target | goal | measured | met |",
        "|---|---|---|---|",
    ]
    for t in targets:
        met = "n/a" if t.met is None else "**met**" if t.met else "not met"
        name = f"{t.name}, {t.detail}" if t.detail and not t.detail.startswith("behind") else t.name
        lines.append(f"| {name} | {t.goal} | {t.measured} | {met} |")
    behind = [t for t in targets if t.detail.startswith("behind")]
    if behind:
        lines += [
            "",
            "Rows where tensorbroker is behind, as its advantage (the peer's time over "
            "tensorbroker's, or tensorbroker's ops/s over the peer's; below 1 is behind):",
        ]
    lines.append("")
    for t in behind:
        lines.extend([f"- {t.name}, {t.detail}", ""])
    return lines


def _machine(machine: dict[str, Any], infos: dict[str, dict[str, Any]]) -> list[str]:
    versions = {
        "numpy": machine["numpy"],
        "torch": machine["torch"],
        "pyzmq": machine["pyzmq"],
        "tensorbroker": machine["tensorbroker"],
    }
    for info in infos.values():
        for key in ("pyarrow", "ray"):
            if key in info:
                versions[key] = info[key]
        if "pyarrow" in info or "ray" in info:
            versions["numpy (peers)"] = info.get("numpy", "?")
    load = ", ".join(f"{x:.2f}" for x in machine["loadavg_start"])
    return [
        f"- CPU: {machine['cpu']}, {machine['cores']} cores ({machine['cores_usable']} usable)",
        f"- RAM {format_size(machine['ram_bytes'])}, "
        f"/dev/shm {format_size(machine['dev_shm_bytes'])}",
        f"- {machine['kernel']}, Python {machine['python']}",
        "- " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- load average at start: {load}",
    ]


def emit(path: str, lines: list[str]) -> None:
    """A section's markdown (bench/cluster.py, scaling.py, ...): written to `path`, printed."""
    text = "\n".join(lines)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(text)


def write(
    results: Results,
    targets: list[Target],
    settings: Settings,
    machine: dict[str, Any],
    infos: dict[str, dict[str, Any]],
    notes: list[str],
    out_dir: str,
    command: str,
    elapsed: float,
) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    lines = [
        "# tensorbroker benchmarks",
        "",
        f"`{command}`: {settings.reps} repetitions (medians shown), sizes "
        + ", ".join(format_size(s) for s in settings.sizes)
        + f"; systems run interleaved; {elapsed / 60:.1f} min. "
        "See bench/README.md for what each row measures.",
        "",
        *_machine(machine, infos),
        "",
    ]
    if notes:
        lines += [*(f"- {note}" for note in notes), ""]
    lines += _targets(targets)
    lines += ["## Results", ""]
    for scenario in SCENARIO_TITLES:
        lines += _table(results, scenario)
    if results.errors:
        lines += ["## Errors", ""]
        for system, errors in sorted(results.errors.items()):
            lines += [f"- {BY_NAME[system].label}: {error}" for error in errors]
        lines.append("")
    md_path = os.path.join(out_dir, "results.md")
    with open(md_path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w") as f:
        json.dump(
            {
                "command": command,
                "settings": {**settings.__dict__},
                "machine": machine,
                "systems": infos,
                "notes": notes,
                "errors": dict(results.errors),
                "targets": [t.to_json() for t in targets],
                "rows": results.to_json(),
            },
            f,
            indent=1,
        )
    return md_path, json_path
