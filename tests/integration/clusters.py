"""Brokers of a cluster on this host, one per node, for the cluster's integration tests
(test_cluster.py, test_cluster_nodes.py): the bytes between them moved by NIXL over UCX's TCP
transport (the tests set UCX_TLS=tcp), as between machines."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorbroker as tb
from tensorbroker.server.cluster.homes import Homes
from tests.support import free_port, wait_until

NODES = ("a", "b", "c")


def cluster_options(node: str, ports: dict[str, int]) -> list[str]:
    peers = ",".join(f"tcp://127.0.0.1:{p}" for n, p in ports.items() if n != node)
    return ["--node", node, "--cluster", f"tcp://127.0.0.1:{ports[node]}", "--peers", peers,
            "--insecure-tcp", "--prefetch", "64KiB"]  # fmt: skip


@contextlib.contextmanager
def cluster(
    nodes: tuple[str, ...], more: dict[str, list[str]] | None = None, memory: str = "64MiB"
) -> Iterator[dict[str, tb.BrokerProcess]]:
    """Brokers of a cluster, one per node, of `memory` each; `more`: more options, by node."""
    ports = {node: free_port() for node in nodes}
    started: dict[str, tb.BrokerProcess] = {}
    try:
        for node in nodes:
            options = [*cluster_options(node, ports), *(more or {}).get(node, [])]
            started[node] = tb.start_broker(memory=memory, options=options, log_level="info")
        yield started
    finally:
        for b in started.values():
            b.stop()


@contextlib.contextmanager
def connected(brokers: dict[str, tb.BrokerProcess]) -> Iterator[dict[str, tb.Client]]:
    opened = {node: tb.connect(b.address) for node, b in brokers.items()}
    try:
        assert wait_until(lambda: all(all_up(c) for c in opened.values()), 10), {
            n: c.stats()["cluster"] for n, c in opened.items()
        }
        yield opened
    finally:
        for c in opened.values():
            c.close()


def all_up(c: tb.Client) -> bool:
    peers = c.stats()["cluster"]["peers"]
    return all(p["state"] == "up" for p in peers.values())


def follow(reader: tb.Client, owner: tb.Client, prefix: str = "") -> Iterator[tb.KeyEvent]:
    """`reader`'s node follows the keys under `prefix` (a `watch_prefix` there), once
    `owner`'s node heard: it is told of each of their versions, a small one with its offer
    (Note [follows]). The watch's events, which the caller may leave unread."""
    before = figures(owner)["followers"]
    events = reader.watch_prefix(prefix)
    assert wait_until(lambda: figures(owner)["followers"] > before, 5)
    return events


def homed(homes: tuple[str, ...], stem: str, nodes: tuple[str, ...] = NODES) -> str:
    """A key whose homes are `homes` among `nodes`, all up (Note [homes])."""
    keys = (f"{stem}{i}" for i in range(10_000))
    return next(k for k in keys if {*Homes.homes_of(k, nodes)} == {*homes})


def figures(c: tb.Client) -> dict[str, Any]:
    return dict(c.stats()["cluster"])


def received(c: tb.Client) -> int:
    return int(c.stats()["cluster"]["bytes_received"])


def loans_out(c: tb.Client) -> int:
    return int(c.stats()["cluster"]["items_lent"])


def loans(c: tb.Client) -> int:
    return int(c.stats()["cluster"]["loans"])
