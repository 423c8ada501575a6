"""GPU objects across the nodes of a cluster (server/cluster/transfers.py): lent, pulled and sealed
as replicas on the same device of the reader's node. Brokers' cluster sides stepped by hand
(tests/nodes.py) on a simulated GPU, NIXL replaced by reads a test ends: what this proves is
the bookkeeping; the bytes between GPUs are tests/gpu's (test_gpu_replicas_between_two_brokers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensorbroker.common.protocol import Request, decode
from tests.nodes import Node, pair, run

__all__ = ["pair"]  # the fixture


def _up(a: Node, b: Node) -> bool:
    return run([a, b], 5, lambda: a.up("b") and b.up("a") and b.cluster.links.fresh("a"))


def test_a_gpu_object_is_pulled_into_the_same_device_of_the_reader_node(
    pair: Callable[..., Node],
) -> None:
    a, b = pair("a", gpus=True), pair("b", gpus=True)
    assert _up(a, b)
    put = a.put("w", 4096, device="cuda:0")
    assert run([a, b], 3, lambda: b.cluster.replicas.holds("w"))
    assert ["w", put.version, 4096] in a.cluster.replicas.own()  # (a rejoining peer hears)
    assert b.get("w")  # it waits for the pull
    assert run([a, b], 3, lambda: b.reads.started == ["w"])  # lent by a, read by b
    assert put.leases == 1  # a holds it for the read (its loan)
    b.reads.over = True
    assert run([a, b], 3, lambda: "w" in b.registry.objects)
    replica = b.registry.objects["w"]
    assert (replica.device, replica.version, replica.nbytes) == ("cuda:0", put.version, 4096)
    assert run([a, b], 3, lambda: put.leases == 0)  # given back once read


def test_a_gpu_object_a_node_cannot_hold_is_refused_there_with_why(
    pair: Callable[..., Node],
) -> None:
    a, b = pair("a", gpus=True), pair("b")  # b serves no GPU
    assert _up(a, b)
    a.put("w", 4096, device="cuda:0")
    assert run([a, b], 3, lambda: b.cluster.replicas.holds("w"))
    answers: list[dict[str, Any]] = []
    b.objects._send = lambda route, payload, last=False: answers.append(decode(payload))
    assert b.objects.get(b.session, b"client", Request("get", 9, {"key": "w"}, [])) is None
    assert run([a, b], 3, lambda: bool(answers))
    error = str(answers[0])
    assert "'code': 'invalid'" in error and "'w' lives on cuda:0 of node 'a'" in error, error
    assert not b.cluster.replicas.pulls.pulls and b.registry.arena.used_bytes == 0


def test_a_gpu_object_is_lent_only_once_its_copy_has_run(pair: Callable[..., Node]) -> None:
    """A GPU put seals with its copy still queued on its producer's stream: a peer that read
    its block then would seal what it held before as the new version."""
    a, b = pair("a", gpus=True), pair("b", gpus=True)
    assert _up(a, b)
    put = a.put("w", 4096, device="cuda:0")
    devices = a.registry.devices
    rt, producer = devices.runtime, 0x77
    rt.busy(producer)  # the producer's stream is still busy, its copy queued behind ...
    assert put.events is not None
    rt.record(0, devices._events[put.events[0]][1], producer)  # ... then its write event
    assert run([a, b], 3, lambda: b.cluster.replicas.holds("w"))
    assert b.get("w")
    assert not run([a, b], 0.5, lambda: bool(b.reads.started))  # not lent yet
    assert put.leases == 0
    rt.finish(producer)  # the copy ran
    assert run([a, b], 3, lambda: b.reads.started == ["w"])


def test_a_lend_waiting_for_a_copy_is_dropped_with_its_borrower(pair: Callable[..., Node]) -> None:
    a, b = pair("a", gpus=True), pair("b", gpus=True)
    assert _up(a, b)
    put = a.put("w", 4096, device="cuda:0")
    devices = a.registry.devices
    devices.runtime.busy(0x77)  # the copy never runs while this test looks
    assert put.events is not None
    devices.runtime.record(0, devices._events[put.events[0]][1], 0x77)
    assert run([a, b], 3, lambda: b.cluster.replicas.holds("w"))
    assert b.get("w")
    lending = a.cluster.replicas.lending
    assert run([a, b], 3, lambda: len(lending.unwritten) == 1)
    b.close()  # the borrower goes: its lend is not answered, nothing is pinned for it
    assert run([a], 5, lambda: not lending.unwritten)
    assert put.leases == 0
