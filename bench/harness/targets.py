"""The issue's targets, checked against the medians of one run."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .config import BASELINE, BY_NAME, GiB
from .plan import LATENCY, THROUGHPUT, Results, Row, format_size

GET_OVER_RTT = 0.2  # get <= 0.2x the raw ZeroMQ round trip, at every size (no broker on it)
GET_OVER_PLASMA = 0.5  # get of 4 KiB <= 0.5x Plasma's
OPS_OVER_PLASMA = 2.0  # get ops/s with 1, 2 and 4 clients >= 2x Plasma's
GET_FLAT = 1.3  # "the same time at 1 GiB as at 4 KiB", within this factor (noise)
PUT_OVER_COPY = 1.2  # put of 1 GiB <= 1.2x one numpy.copyto into touched memory
OVER_TORCH_QUEUE = 8.0  # handoff of 1 GiB at least 8x faster than torch.mp.Queue
OVER_MP_QUEUE = 50.0  # ... and 50x faster than multiprocessing.Queue
OVER_ECHO = 0.5  # 4-client get ops/s at least half of the raw ZeroMQ echo broker's
PUT_OVER_RTT = 1.15  # put of 4 KiB that waits <= 1.15x the raw ZeroMQ round trip
PUT_NOWAIT_OVER_RTT = 0.2  # ... that does not wait <= 0.2x
HANDOFF_OVER_MP_QUEUE = 0.8  # handoff of 4 KiB through a queue <= 0.8x multiprocessing.Queue's
PUTGET_OVER_PLASMA = 1.0  # 4 KiB put+get cycles/s with 1, 2 and 4 clients ahead of Plasma's
MANY_OVER_GETS = 0.4  # get_many of 100 existing 4 KiB objects <= 0.4x 100 single gets
PINGPONG_OVER_MP_QUEUE = 0.8  # ping-pong handoff of 4 KiB <= 0.8x multiprocessing.Queue's
STREAM_OVER_MP_QUEUE = 1.25  # streaming 4 KiB items/s >= 1.25x multiprocessing.Queue's
BROADCAST_OVER_QUEUE = 1.5  # a 4 MiB item to 4 subscribers <= 1.5x one queue to one reader


@dataclass
class Target:
    name: str
    goal: str
    measured: str
    met: bool | None  # None: not measured in this run
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def lower_is_better(row: Row) -> bool:
    return row.scenario not in (*THROUGHPUT, "stream")


def advantage(results: Results, row: Row, peer: str) -> float | None:
    """How many times better tensorbroker is than `peer` on `row` (above 1: ahead)."""
    ours, theirs = results.median(row, BASELINE), results.median(row, peer)
    if ours is None or theirs is None:
        return None
    better, worse = (theirs, ours) if lower_is_better(row) else (ours, theirs)
    if worse == 0:
        return 1.0 if better == 0 else float("inf")
    return better / worse


def _ratio(results: Results, row: Row, top: str, bottom: str) -> float | None:
    a, b = results.median(row, top), results.median(row, bottom)
    if a is None or b is None or b == 0:
        return None
    return a / b


def _at(size: int) -> str:
    return "at 1 GiB" if size == GiB else f"at {format_size(size)}: 1 GiB not in this run"


def check(results: Results, sizes: tuple[int, ...]) -> list[Target]:
    big, small = max(sizes), min(sizes)
    out: list[Target] = []

    worst: tuple[float, int] | None = None
    for size in sizes:
        r = _ratio(results, Row("get", size), BASELINE, "zmq_floor")
        if r is not None and (worst is None or r > worst[0]):
            worst = (r, size)
    out.append(
        Target(
            "get, any size, vs raw ZeroMQ msgpack round trip",
            f"<= {GET_OVER_RTT}x",
            f"{worst[0]:.2f}x (worst: {format_size(worst[1])})" if worst else "n/a",
            None if worst is None else worst[0] <= GET_OVER_RTT,
        )
    )
    get_big = results.median(Row("get", big), BASELINE)
    get_small = results.median(Row("get", small), BASELINE)
    flat = get_big / get_small if get_big is not None and get_small else None
    out.append(
        Target(
            f"get {format_size(big)} vs get {format_size(small)}",
            f"<= {GET_FLAT}x (the same time)",
            f"{flat:.2f}x" if flat is not None else "n/a",
            None if flat is None else flat <= GET_FLAT,
            _at(big),
        )
    )
    put = _ratio(results, Row("put", big), BASELINE, "copyto_floor")
    out.append(
        Target(
            f"put {format_size(big)} vs one numpy.copyto into touched memory",
            f"<= {PUT_OVER_COPY}x",
            f"{put:.2f}x" if put is not None else "n/a",
            None if put is None else put <= PUT_OVER_COPY,
            _at(big),
        )
    )
    for peer, goal in (("torch_queue", OVER_TORCH_QUEUE), ("mp_queue", OVER_MP_QUEUE)):
        r = _ratio(results, Row("handoff", big), peer, BASELINE)
        out.append(
            Target(
                f"handoff {format_size(big)}: faster than {BY_NAME[peer].label}",
                f">= {goal:.0f}x",
                f"{r:.1f}x" if r is not None else "n/a",
                None if r is None else r >= goal,
                _at(big),
            )
        )
    for peer in ("plasma", "ray"):
        out.append(_ahead_everywhere(results, peer))
    r = _ratio(results, Row("get", small), BASELINE, "plasma")
    out.append(
        Target(
            f"get {format_size(small)} vs Plasma's get",
            f"<= {GET_OVER_PLASMA}x",
            f"{r:.2f}x" if r is not None else "n/a",
            None if r is None else r <= GET_OVER_PLASMA,
        )
    )
    for clients in (1, 2, 4):
        r = _ratio(results, Row("throughput_get", clients), BASELINE, "plasma")
        out.append(_ratio_target(f"{clients}-client get ops/s vs Plasma's",
                                 f">= {OPS_OVER_PLASMA:.0f}x", r,
                                 r is not None and r >= OPS_OVER_PLASMA))  # fmt: skip
    r = _ratio(results, Row("throughput_get", 4), BASELINE, "zmq_floor")
    out.append(
        Target(
            "4-client 4 KiB get ops/s vs raw ZeroMQ echo broker",
            f">= {OVER_ECHO}x",
            f"{r:.2f}x" if r is not None else "n/a",
            None if r is None else r >= OVER_ECHO,
        )
    )
    out.extend(_small_ops(results, small))
    out.extend(_many_and_broadcast(results, small))
    return out


def _ratio_target(name: str, goal: str, r: float | None, met: bool) -> Target:
    """A target on a ratio `r` (None: not measured in this run)."""
    return Target(name, goal, f"{r:.2f}x" if r is not None else "n/a", None if r is None else met)


def _small_ops(results: Results, small: int) -> list[Target]:
    """Small puts and handoffs in one trip (issue 13)."""
    at = format_size(small)
    rtt = results.median(Row("get", small), "zmq_floor")
    out = []
    for scenario, goal, what in (
        ("put", PUT_OVER_RTT, "that waits"),
        ("put_nowait", PUT_NOWAIT_OVER_RTT, "that does not wait"),
    ):
        ours = results.median(Row(scenario, small), BASELINE)
        r = ours / rtt if ours is not None and rtt else None
        out.append(_ratio_target(f"put {at} {what} vs raw ZeroMQ msgpack round trip",
                                 f"<= {goal}x", r, r is not None and r <= goal))  # fmt: skip
    handoff = Row("handoff", small)
    r = _ratio(results, handoff, BASELINE, "mp_queue")
    out.append(_ratio_target(f"handoff {at} through a queue vs {BY_NAME['mp_queue'].label}",
                             f"<= {HANDOFF_OVER_MP_QUEUE}x", r,
                             r is not None and r <= HANDOFF_OVER_MP_QUEUE))  # fmt: skip
    r = _ratio(results, handoff, BASELINE, "plasma")
    out.append(_ratio_target(f"handoff {at} through a queue vs {BY_NAME['plasma'].label}",
                             "< 1x", r, r is not None and r < 1.0))  # fmt: skip
    for clients in (1, 2, 4):
        r = _ratio(results, Row("throughput_putget", clients), BASELINE, "plasma")
        out.append(_ratio_target(f"{clients}-client {at} put+get cycles/s vs Plasma's",
                                 f">= {PUTGET_OVER_PLASMA:.0f}x", r,
                                 r is not None and r >= PUTGET_OVER_PLASMA))  # fmt: skip
    return out


def _ahead_everywhere(results: Results, peer: str) -> Target:
    label = BY_NAME[peer].label
    compared: list[tuple[float, Row]] = []
    for row in sorted(results.values):
        a = advantage(results, row, peer)
        if a is not None:
            compared.append((a, row))
    behind = sorted((a, row) for a, row in compared if a < 1.0)
    if not compared:
        return Target(f"ahead of {label} on every row", "every row", "n/a", None)
    worst = min(compared)
    detail = "; ".join(f"{row_label(row)} {a:.2g}x" for a, row in behind)
    return Target(
        f"ahead of {label} on every row",
        "every row",
        f"ahead on {len(compared) - len(behind)}/{len(compared)} rows; "
        f"worst {worst[0]:.2g}x ({row_label(worst[1])})",
        not behind,
        f"behind on: {detail}" if behind else "",
    )


def _many_and_broadcast(results: Results, small: int) -> list[Target]:
    """Many keys at once and broadcast (issue 15)."""
    out = []
    many = results.median(Row("get_many", small), BASELINE)
    one = results.median(Row("get", small), BASELINE)
    r = many / (100 * one) if many is not None and one else None
    out.append(_ratio_target(f"get_many of 100 existing {format_size(small)} objects vs 100 gets",
                             f"<= {MANY_OVER_GETS}x", r,
                             r is not None and r <= MANY_OVER_GETS))  # fmt: skip
    r = _ratio(results, Row("pingpong", small), BASELINE, "mp_queue")
    out.append(_ratio_target(f"ping-pong handoff of {format_size(small)} vs "
                             f"{BY_NAME['mp_queue'].label}", f"<= {PINGPONG_OVER_MP_QUEUE}x", r,
                             r is not None and r <= PINGPONG_OVER_MP_QUEUE))  # fmt: skip
    r = _ratio(results, Row("stream", small), BASELINE, "mp_queue")
    out.append(_ratio_target(f"streaming {format_size(small)} items/s vs "
                             f"{BY_NAME['mp_queue'].label}", f">= {STREAM_OVER_MP_QUEUE}x", r,
                             r is not None and r >= STREAM_OVER_MP_QUEUE))  # fmt: skip
    four = results.median(Row("fanout", 4), BASELINE)
    one = results.median(Row("fanout", 1), BASELINE)
    r = four / one if four is not None and one else None
    out.append(_ratio_target("a 4 MiB item to 4 subscribers vs one queue to one reader",
                             f"<= {BROADCAST_OVER_QUEUE}x", r,
                             r is not None and r <= BROADCAST_OVER_QUEUE))  # fmt: skip
    peak = results.median(Row("fanout", 4, "peak_bytes"), BASELINE)
    bound = 8 * (4 << 20)  # maxsize 8 items of 4 MiB, each once
    out.append(Target("broadcast to 4: shared memory, one copy per item in flight",
                      f"<= {format_size(bound)}",
                      "n/a" if peak is None else format_size(peak),
                      None if peak is None else peak <= bound))  # fmt: skip
    return out


SCENARIO_TITLES = {
    "put": "put",
    "put_nowait": "put (wait=False)",
    "get": "get",
    "handoff": "handoff",
    "throughput_get": "get ops/s",
    "throughput_putget": "put+get ops/s",
    "memory": "memory",
    "get_many": "get_many",
    "fanout": "fanout",
    "pingpong": "ping-pong handoff",
    "stream": "streaming",
}


def row_label(row: Row) -> str:
    title = SCENARIO_TITLES.get(row.scenario, row.scenario)
    if row.scenario in LATENCY:
        return f"{title} {format_size(row.param)}"
    if row.scenario in THROUGHPUT:
        return f"{title} x{row.param}"
    return f"{title} {row.metric}"
