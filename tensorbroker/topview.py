"""The frame of `tensorbroker top`: figures in, lines of text out.

`render` turns a `View` (the latest `Sample` of the broker's figures, the rates, or the
reason the broker does not answer) into lines of text that fit a width and a height: a pure
function, with neither a broker nor a terminal in it (tensorbroker/top.py has both).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

from .common.config import format_size

KEEP_ROWS = 3  # a table keeps this many rows before the blank lines between sections go


@dataclass(frozen=True)
class Sample:
    """What one refresh fetched from the broker (the dicts of the Client methods)."""

    stats: dict[str, Any]
    clients: list[dict[str, Any]]
    objects: list[dict[str, Any]]  # the largest, largest first
    queues: list[dict[str, Any]]


@dataclass(frozen=True)
class View:
    """Everything one frame shows."""

    address: str
    sample: Sample | None = None  # the latest answer (None: none yet)
    rates: dict[str, float] | None = None  # requests/s by op; None: averages since start
    problem: str | None = None  # why the broker does not answer now
    me: int = 0  # the pid of this view's own client, marked in the clients table
    live: bool = False  # drawn live: the header says how to quit


@dataclass
class _Section:
    """Lines of one part of the frame: `head` always shows; `rows` are cut from the end
    (leaving "... N more") when the screen is short."""

    head: list[str]
    rows: list[str] = field(default_factory=list)


def render(view: View, width: int, height: int) -> list[str]:
    """The frame for `view` as at most `height` lines of at most `width` characters."""
    if width <= 0 or height <= 0:
        return []
    if view.problem is not None or view.sample is None:
        return [line[:width] for line in _unanswered(view, width)][:height]
    s = view.sample
    sections = [
        _header(view, s.stats, width),
        _Section(_memory(s.stats, width)),
        _ops(s.stats, view.rates, width),
        _clients(s.clients, view.me),
        _objects(s.objects, width),
        _queues(s.queues, width),
    ]
    return [line[:width].rstrip() for line in _fit(sections, height)]


def _fit(sections: list[_Section], height: int) -> list[str]:
    """The sections' lines in `height` rows: long tables lose rows first (down to
    KEEP_ROWS), then the blank lines between sections go, then tables shrink to one line;
    what is still too much is cut at the bottom."""
    shown = [len(s.rows) for s in sections]
    gap = 1

    def total() -> int:
        return sum(len(s.head) for s in sections) + sum(shown) + gap * (len(sections) - 1)

    for floor in (KEEP_ROWS, 1):
        while total() > height and max(shown) > floor:
            shown[shown.index(max(shown))] -= 1
        if total() > height:
            gap = 0
    lines: list[str] = []
    for section, n in zip(sections, shown, strict=True):
        if lines and gap:
            lines.append("")
        lines += section.head
        rows = section.rows
        lines += rows if n == len(rows) else rows[: n - 1] + [f"  ... {len(rows) - n + 1} more"]
    return lines[:height]


def _header(view: View, stats: dict[str, Any], width: int) -> _Section:
    """Which broker (pid, address, uptime), then its counts; wrapped to the width."""
    title = ["tensorbroker top", f"pid {stats['pid']}", stats["address"]]
    lines = _wrap("", [*title, f"up {_duration(stats['uptime_s'])}"], width, sep="   ")
    hint = "q: quit" if view.live else ""
    if hint and len(lines[0]) + 3 + len(hint) <= width:
        lines[0] = lines[0].ljust(width - len(hint)) + hint
    counts = [
        f"clients {stats['clients']}",
        f"objects {stats['objects']}",
        f"leases {stats['leases']}",
        f"queues {stats['queues']} ({stats['queued_items']} items, "
        f"{stats['queue_in_flight']} in flight, {stats.get('queue_consumers', 0)} consumers "
        "waiting)",
        f"waiters {stats['waiters']}",
        f"published {stats['published']}",
        f"evicted {stats['evicted']}",
        f"crashed {stats['crashed']}",
    ]
    cluster = stats.get("cluster")
    if cluster is not None:  # a node of a cluster: its peers, and the bytes pulled
        peers = [f"{name} {p['state']}" for name, p in sorted(cluster["peers"].items())]
        counts += [
            f"node {cluster['node']}",
            f"peers: {', '.join(peers) or 'none'}",
            f"sent {format_size(cluster['bytes_sent'])}",
            f"received {format_size(cluster['bytes_received'])}",
        ]
    return _Section(lines + _wrap("", counts, width))


def _memory(stats: dict[str, Any], width: int) -> list[str]:
    """A bar for host memory (# used by objects, + granted ahead for puts) and each GPU."""
    used, granted, capacity = stats["used_bytes"], stats["granted_bytes"], stats["capacity_bytes"]
    lines = [_bar("host", used, granted, capacity, f", {format_size(granted)} granted", width)]
    for device, d in sorted(stats.get("devices", {}).items()):
        waiting = d.get("waiting_bytes", 0)
        note = f", {format_size(waiting)} waiting to be freed" if waiting else ""
        lines.append(_bar(device, d["used_bytes"], 0, d["capacity_bytes"], note, width))
    return lines


def _bar(label: str, used: int, granted: int, capacity: int, note: str, width: int) -> str:
    share = (used + granted) / capacity if capacity else 0.0
    text = f"{format_size(used)} used{note} of {format_size(capacity)} ({share:.0%})"
    cells = min(50, width - 8 - 4 - len(text))
    if cells < 8:
        return f"{label:8}{text}"
    full = round(used / capacity * cells) if capacity else 0
    ahead = min(cells - full, round(granted / capacity * cells) if capacity else 0)
    bar = "#" * full + "+" * ahead + "." * (cells - full - ahead)
    return f"{label:8}[{bar}]  {text}"


def _ops(stats: dict[str, Any], rates: dict[str, float] | None, width: int) -> _Section:
    """Requests per second by op, busiest first (averages since start until measured),
    and the refusals by error code since start."""
    since = ""
    if rates is None:
        uptime = max(stats["uptime_s"], 1e-9)
        rates = {op: n / uptime for op, n in stats["requests"].items()}
        since = " (average since start)"
    busy = sorted(((r, op) for op, r in rates.items() if r > 0), key=lambda x: (-x[0], x[1]))
    items = [f"total {_rate(sum(r for r, _ in busy))}{since}"] if busy else ["idle"]
    items += [f"{op} {_rate(r)}" for r, op in busy]
    lines = _wrap("OPS/S    ", items, width)
    refused = sorted(((n, code) for code, n in stats.get("refused", {}).items() if n), reverse=True)
    if refused:
        items = [f"{c} {n}" for n, c in refused]
        lines += _wrap("REFUSED  ", ["since start:", *items], width)
    return _Section(lines[:1], lines[1:])


def _clients(clients: list[dict[str, Any]], me: int) -> _Section:
    head = (
        f"{'CLIENT PID':>10}  {'UID':>6}  {'LEASES':>6}  {'HELD':>10}  {'PARKED':>6}  {'IDLE':>7}"
    )
    ordered = sorted(clients, key=lambda c: (-c["held_bytes"], -c["leases"], c["pid"]))
    rows = []
    for c in ordered:
        note = "this view" if c["pid"] == me else ("closed" if c["closed"] else "")
        uid = "-" if c["uid"] is None else c["uid"]
        rows.append(
            f"{c['pid']:>10}  {uid:>6}  {c['leases']:>6}  {format_size(c['held_bytes']):>10}  "
            f"{c['parked']:>6}  {_duration(c['idle_s']):>7}  {note}"
        )
    return _Section([head], rows or ["  (none)"])


def _objects(objects: list[dict[str, Any]], width: int) -> _Section:
    """The largest objects, largest first (sorted here: the broker picks them by the size
    of their blocks, which rounds sizes up)."""
    kw = _name_width([o["key"] for o in objects], "OBJECT (largest first)", width)
    title = "OBJECT (largest first)" if kw >= len("OBJECT (largest first)") else "OBJECT"
    head = f"{title:{kw}}  {'SIZE':>10}  {'LEASES':>6}  {'DEVICE':7}  "
    rows = [
        f"{_cell(o['key'], kw)}  {format_size(o['nbytes']):>10}  {o['leases']:>6}  "
        f"{_clean(o['device']):7}  {_layout(o)}"
        for o in sorted(objects, key=lambda o: (-o["nbytes"], o["key"]))
    ]
    return _Section([head + "DTYPE / SHAPE"], rows or ["  (none)"])


def _name_width(names: list[str], title: str, width: int) -> int:
    """The width of a table's name column: its longest name, at most 40 characters and what
    leaves 50 of `width` for the other columns, at least 12."""
    longest = max([len(title), *map(len, names)])
    return max(12, min(longest, 40, width - 50))


def _layout(obj: dict[str, Any]) -> str:
    """'float32 64x3x224x224', or a bundle's 'bundle: w float32 10x4, b int8 3'."""
    parts = [
        f"{name + ' ' if obj['bundle'] else ''}{dtype} {'x'.join(map(str, shape)) or '()'}"
        for name, dtype, shape in obj["tensors"]
    ]
    text = ("bundle: " if obj["bundle"] else "") + ", ".join(parts)
    return _clean(text + (" (evictable)" if obj["evictable"] else ""))


def _queues(queues: list[dict[str, Any]], width: int) -> _Section:
    nw = _name_width([q["name"] for q in queues], "QUEUE", width)
    head = f"{'QUEUE':{nw}}  {'DEPTH':>6}  {'IN FLIGHT':>9}  {'MAXSIZE':>7}  STATE"
    rows = []
    for q in sorted(queues, key=lambda q: (-q["depth"], q["name"])):
        state = "closed" if q["closed"] else "open"
        if q["subscribers"] is not None:
            state += f", broadcast to {q['subscribers']}"
        for who in ("consumers", "producers"):
            if q[who]:
                state += f", {q[who]} {who[:-1] if q[who] == 1 else who} waiting"
        rows.append(
            f"{_cell(q['name'], nw)}  {q['depth']:>6}  {q['in_flight']:>9}  "
            f"{q['maxsize'] or '-':>7}  {state}"
        )
    return _Section([head], rows or ["  (none)"])


def _unanswered(view: View, width: int) -> list[str]:
    """The frame while no broker answers: which address, why, and that it keeps trying."""
    lines = [f"broker at {view.address} not answering: retrying"]
    reason = view.problem or "no answer yet"
    lines += textwrap.wrap(_clean(reason), max(10, width - 2), initial_indent="  ",
                           subsequent_indent="  ")  # fmt: skip
    if view.sample is not None:
        lines.append(f"  (the last broker seen there was pid {view.sample.stats['pid']})")
    if view.live:
        lines += ["", "q: quit"]
    return lines


def _wrap(prefix: str, items: list[str], width: int, sep: str = "  ") -> list[str]:
    """`prefix`, then the items `sep` apart, on as many lines as `width` needs (the later
    lines indented as far as the prefix)."""
    lines = [prefix]
    for item in items:
        line = lines[-1]
        started = len(line) > len(prefix)  # an item is on it already
        if started and len(line) + len(sep) + len(item) > width:
            lines.append(" " * len(prefix) + item)
        else:
            lines[-1] = line + (sep if started else "") + item
    return lines


def _cell(text: str, width: int) -> str:
    """`text` in exactly `width` characters: padded, or cut ending in '~'."""
    text = _clean(text)
    return text.ljust(width) if len(text) <= width else text[: width - 1] + "~"


def _clean(text: str) -> str:
    """`text` with what a terminal would act on (escapes, newlines) shown as '?'."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def _rate(r: float) -> str:
    return f"{r:.1f}" if r < 100 else f"{r:.0f}" if r < 10_000 else f"{r / 1000:.0f}k"


def _duration(seconds: float | None) -> str:
    """1.5 -> '1.5s', 75 -> '1m15s', 4000 -> '1h06m', 200000 -> '2d07h'; None -> '-'."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
