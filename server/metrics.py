"""Prometheus metrics for `tensorbroker serve --metrics HOST:PORT` (the extra
`tensorbroker[metrics]`: prometheus_client).

Note [metrics]
~~~~~~~~~~~~~~
prometheus_client answers each scrape on a thread of its own, while every counter the
broker keeps belongs to its loop (broker.py), which changes them without locks. So the
scrape thread never reads them: it asks the loop for a copy and waits for it.

    scrape thread                               broker loop
    ask():  asked += 1; wanted = True
            one byte to the wake socket ──────> poll() returns, the batch is handled
            wait for answered >= asked          if exporter.wanted: answer(broker.stats())
                                                  wanted = False; stats() builds new dicts
            <────────────────── notify ────────── last = stats; answered = asked
    families(last): the samples

`wanted` is set before the byte is written, and the loop reads it after the batch that
reads the byte, so a request is never missed; when no one asks, the loop pays one
attribute check per batch. `stats()` returns dicts and lists made for the call, holding
numbers and strings only: once handed over, nothing the loop does changes them. A loop that
does not answer within SNAPSHOT_TIMEOUT_S (a long batch) gets the last copy served, so a
scrape still answers; `tensorbroker_uptime_seconds` then stands still.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..common.errors import BrokerError, InvalidRequest
from .sessions.sockets import AddressInUse


class MetricsUnavailable(BrokerError):
    code = "unavailable"


try:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector
    from prometheus_client.utils import floatToGoString
except ImportError as exc:  # an extra: say how to get it, not a traceback
    raise MetricsUnavailable(
        f"serve --metrics needs prometheus_client, which is not installed here ({exc}): "
        "pip install 'tensorbroker[metrics]'"
    ) from exc

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 1.0  # how long a scrape waits for the loop before serving the last copy

# One sample each: (key of stats(), metric name, help)
GAUGES = (
    ("objects", "tensorbroker_objects", "Keys that have a live version."),
    ("queues", "tensorbroker_queues", "Queues open or still draining."),
    (
        "queued_items",
        "tensorbroker_queue_items_waiting",
        "Queue items sealed and not yet taken by a consumer.",
    ),
    (
        "queue_in_flight",
        "tensorbroker_queue_items_in_flight",
        "Queue items holding memory: being written, waiting, or taken and not yet freed.",
    ),
    (
        "queue_consumers",
        "tensorbroker_queue_consumers_waiting",
        "Consumers waiting for a queue item: parked in the broker, or asleep on a queue ring.",
    ),
    (
        "queue_producers",
        "tensorbroker_queue_producers_waiting",
        "Producers waiting for room in a full queue: parked, or asleep on a queue ring.",
    ),
    ("clients", "tensorbroker_clients", "Client sessions connected."),
    ("leases", "tensorbroker_leases", "Leases clients hold on objects (tensors in use)."),
    (
        "waiters",
        "tensorbroker_parked_requests",
        "Requests parked until they can be answered or time out (gets, waits, queue puts).",
    ),
    ("uptime_s", "tensorbroker_uptime_seconds", "Seconds since the broker started."),
)
COUNTERS = (  # prometheus_client adds _total
    (
        "published",
        "tensorbroker_versions_published",
        "Versions sealed by this broker (puts and queue items).",
    ),
    (
        "crashed",
        "tensorbroker_client_crashes",
        "Client sessions reclaimed after their process died or stopped sending heartbeats.",
    ),
    (
        "evicted",
        "tensorbroker_evicted_objects",
        "Objects evicted to make room for others.",
    ),
    (
        "ring_items",
        "tensorbroker_broadcast_ring_items",
        "Broadcast items posted to rings, taken by subscribers without a message each.",
    ),
)
# Per device, where the broker measures it: (suffix of the stats() key, help)
MEMORY = (
    ("capacity", "Memory the broker may hand out for objects."),
    ("used", "Memory holding objects (sealed, being written, or waiting to be freed)."),
    ("granted", "Memory granted to writing clients ahead of their puts (host only)."),
    (
        "waiting",
        "Memory of objects no one holds any more, waiting to be freed (until the readers' "
        "lease slots are scanned, or on a GPU until the work on it is done).",
    ),
)


def listen_address(text: str) -> tuple[str, int]:
    """HOST and PORT of `--metrics HOST:PORT` ([::1]:PORT for IPv6); InvalidRequest if it
    is not one."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequest(
            f"--metrics must be HOST:PORT, such as 127.0.0.1:9464 or 0.0.0.0:9464, not {text!r}"
        )
    return host, int(port)


class Exporter:
    """The HTTP endpoint of `serve --metrics` (Note [metrics]): prometheus_client's server
    on threads of its own, a collector that asks the loop for each scrape's figures, and the
    hand-over between the two. `wake` makes the loop run a batch; safe from any thread."""

    def __init__(
        self,
        host: str,
        port: int,
        wake: Callable[[], None],
        timeout: float = SNAPSHOT_TIMEOUT_S,
    ) -> None:
        self.wanted = False  # a scrape waits for answer(); the loop checks it each batch
        self._wake, self._timeout = wake, timeout
        self._cond = threading.Condition()
        self._asked = self._answered = 0  # the last request made, and the last answered
        self._last: dict[str, Any] | None = None
        self._closed = False
        registry = CollectorRegistry(auto_describe=False)  # not the global one: ours alone
        registry.register(_BrokerCollector(self.ask))
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUse(
                    f"cannot serve metrics on {where}: the port is in use. Stop what listens "
                    "there or choose another --metrics HOST:PORT."
                ) from None
            raise InvalidRequest(f"cannot serve metrics on {where}: {exc}") from None
        log.info("serving Prometheus metrics on http://%s/metrics", where)

    # -- on the scrape's thread ------------------------------------------------------------

    def ask(self) -> dict[str, Any] | None:
        """Fresh figures from the loop; the last ones if it does not answer in time (None
        before its first answer)."""
        with self._cond:
            if self._closed:
                return self._last
            self._asked += 1
            asked = self._asked
            self.wanted = True
        self._wake()
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._answered >= asked or self._closed, self._timeout
            ):
                log.warning(
                    "the broker loop did not answer a scrape within %.1fs: serving the last "
                    "figures", self._timeout,
                )  # fmt: skip
            return self._last

    # -- on the loop's thread --------------------------------------------------------------

    def answer(self, stats: Callable[[], dict[str, Any]]) -> None:
        """Hand `stats()` to the scrapes waiting (built here, on the loop)."""
        with self._cond:
            self.wanted = False  # a request made from now on gets the next batch's figures
            asked = self._asked
        figures = stats()
        with self._cond:
            self._last, self._answered = figures, asked
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the HTTP server (a scrape under way is answered with the last figures).
        Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._server.shutdown()  # returns once its thread stops taking requests
        self._server.server_close()
        self._thread.join()


class _BrokerCollector(Collector):
    """What one scrape reports: the metrics of the figures `ask` returns."""

    def __init__(self, ask: Callable[[], dict[str, Any] | None]) -> None:
        self._ask = ask

    def collect(self) -> Iterator[Metric]:
        stats = self._ask()
        if stats is not None:
            yield from families(stats)


def families(stats: Mapping[str, Any]) -> Iterator[Metric]:
    """The Prometheus metrics of one `stats()` (Broker.stats in broker.py)."""
    devices: dict[str, Mapping[str, Any]] = {"cpu": stats, **stats["devices"]}
    for what, help in MEMORY:
        memory = GaugeMetricFamily(f"tensorbroker_memory_{what}_bytes", help, labels=["device"])
        for device, counters in devices.items():
            if f"{what}_bytes" in counters:
                memory.add_metric([device], counters[f"{what}_bytes"])
        yield memory
    for key, name, help in GAUGES:
        yield GaugeMetricFamily(name, help, value=stats[key])
    for key, name, help in COUNTERS:
        yield CounterMetricFamily(name, help, value=stats[key])
    requests = CounterMetricFamily(
        "tensorbroker_requests", "Requests answered, by op.", labels=["op"]
    )
    for op, count in sorted(stats["requests"].items()):
        requests.add_metric([op], count)
    yield requests
    refused = CounterMetricFamily(
        "tensorbroker_requests_refused",
        "Requests answered with an error, by its code (not_found, timeout, capacity, ...).",
        labels=["code"],
    )
    for code, count in sorted(stats["refused"].items()):
        refused.add_metric([code], count)
    yield refused
    yield _latency(stats["latency"], stats["latency_bounds"])
    if "cluster" in stats:
        yield from _cluster(stats["cluster"])


def _cluster(cluster: Mapping[str, Any]) -> Iterator[Metric]:
    """A cluster's figures (stats()["cluster"]: Cluster.stats in cluster.py)."""
    up = GaugeMetricFamily(
        "tensorbroker_cluster_peer_up", "1 while a peer broker answers, 0 once it is down.",
        labels=["peer"],
    )  # fmt: skip
    for peer, figures in sorted(cluster["peers"].items()):
        up.add_metric([peer], 1.0 if figures["state"] == "up" else 0.0)
    yield up
    for key, help in (
        ("bytes_sent", "Bytes of this node's objects lent to other nodes' pulls."),
        ("bytes_received", "Bytes pulled from other nodes into replicas here."),
    ):
        yield CounterMetricFamily(f"tensorbroker_cluster_{key}", help, value=cluster[key])
    yield GaugeMetricFamily(
        "tensorbroker_cluster_pulls", "Pulls of other nodes' objects under way.",
        value=cluster["pulls"],
    )  # fmt: skip
    pulled = CounterMetricFamily(
        "tensorbroker_cluster_pulled", "Pulls done: read from the offer that came with the "
        "version's announcement (offered), or lent when asked (lent).", labels=["how"],
    )  # fmt: skip
    for how, count in sorted(cluster["pulled"].items()):
        pulled.add_metric([how], count)
    yield pulled
    yield CounterMetricFamily(
        "tensorbroker_cluster_prefetched", "Pulls started as a small version was announced, "
        "for no get (serve --prefetch).", value=cluster["prefetched"],
    )  # fmt: skip
    yield GaugeMetricFamily(
        "tensorbroker_cluster_offered", "Small versions of this node's pinned for the offers "
        "sent with their announcements, until every peer gives its offer back.",
        value=cluster["offered"],
    )  # fmt: skip


def _latency(latency: Mapping[str, Any], bounds: list[float]) -> Metric:
    """The histogram of the broker's own time on each request, by op (server/opstats.py):
    its per-bucket counts made cumulative, as Prometheus counts them."""
    histogram = HistogramMetricFamily(
        "tensorbroker_request_duration_seconds",
        "The broker's own time on a request, from its decoded message to its answer or its "
        "parking (a parked get counts its two visits, not its wait).",
        labels=["op"],
    )
    edges = [*map(floatToGoString, bounds), "+Inf"]
    for op, counters in sorted(latency.items()):
        total, buckets = 0, []
        for edge, count in zip(edges, counters["buckets"], strict=True):
            total += count
            buckets.append((edge, float(total)))
        histogram.add_metric([op], buckets, sum_value=counters["seconds"])
    return histogram
