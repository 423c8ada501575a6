"""The links between brokers as a cluster grows (server/cluster/dealers.py, links.py): the
broker's loop polls the same two cluster sockets whatever the number of peers, an answer
whose signal a send took in is still read at once, more than ZeroMQ's default number of
sockets, and a broker of another release is refused. Cluster objects stepped by hand in this
process (tests/nodes.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from tensorbroker.server.sessions.sockets import raise_fd_limit
from tests.nodes import Node, pair, quad, run

__all__ = ["pair", "quad"]  # the fixtures


def test_the_loop_polls_two_cluster_sockets_whatever_the_number_of_peers(
    quad: Callable[[str], Node],
) -> None:
    """ZeroMQ's poll costs about 1 us a socket at each loop turn: a DEALER a peer in it made
    each turn cost 750 us at 1,000 peers. The ROUTER and one epoll descriptor stand for all."""
    nodes = [quad(n) for n in "abcd"]
    assert run(nodes, 5, lambda: all(n.up(m.name) for n in nodes for m in nodes if m is not n))
    a = nodes[0]
    links = a.cluster.links
    assert len(links.peers) == 3 and links.sockets == {links.router, links.fd}
    assert not any(peer.socket in a.cluster.sockets for peer in links.peers)


def test_an_answer_whose_signal_a_send_took_in_is_read_in_the_same_turn(
    quad: Callable[[str], Node],
) -> None:
    """b answers a's beat; before a looks, a sends b another message on the same DEALER,
    which takes in ZeroMQ's signal of the answer (its descriptor is quiet again): a reads
    the answer in its next turn, not once something else comes."""
    a, b = quad("a"), quad("b")
    peer = _linked(a, b)
    heard = _hearing(a)
    beat = {"op": "beat", "t": time.monotonic(), "pulls": [], "n": peer.sent}
    assert a.cluster.links.send_to(peer, beat)
    run([b], 0.5)  # (b answers it)
    time.sleep(0.1)  # (b's answer is in a's DEALER now)
    assert a.cluster.links.send_to(peer, {**beat, "n": peer.sent})
    a.step()
    assert "beat" in [m["op"] for m in heard]


def test_a_broker_links_to_more_peers_than_zeromqs_default_limit_of_sockets(
    pair: Callable[[str], Node],
) -> None:
    """ZeroMQ's context takes 1,023 sockets unless told more: a broker of a cluster of
    1,100 nodes could not link to them all (each peer is a DEALER)."""
    raise_fd_limit()  # (as the broker does: a descriptor a DEALER)
    a = pair("a")
    links = a.cluster.links
    for port in range(1, 1101):  # (nothing listens there: ZeroMQ keeps trying, quietly)
        links.meet(f"tcp://127.0.0.1:{port}")
    assert len(links.peers) >= 1100
    assert all(peer.fd in links.dealers._by_fd for peer in links.peers)


def test_a_broker_of_another_cluster_protocol_is_not_linked_and_said_so_once(
    pair: Callable[[str], Node], caplog: pytest.LogCaptureFixture
) -> None:
    """b is an older release (its hello and welcome name no protocol): it finds keys at
    other homes than a would, so a does not link to it, and logs why once, not at each of
    b's hellos."""
    a, b = pair("a"), pair("b")
    _older(b)
    with caplog.at_level(logging.ERROR):
        run([a, b], 2.0)
    assert not a.up("b")
    said = [r for r in caplog.records if "speaks cluster protocol 1" in r.getMessage()]
    assert len(said) == 1 and "run the same release" in said[0].getMessage()


def test_answers_left_behind_by_a_fault_are_read_in_the_same_turn(
    pair: Callable[[str], Node],
) -> None:
    """Handling a's first answer from b fails (logged): the second, in the same DEALER, is
    read in the same turn of a's loop, though ZeroMQ signalled both at once (it would wait
    for a's next send to b: a beat, up to 2 s)."""
    a, b = pair("a"), pair("b")
    peer = _linked(a, b)
    run([a, b], 0.1)
    heard = _hearing(a, fail_first=True)
    a.cluster._next_tick = time.monotonic() + 60  # (no beat of a's sends to b meanwhile)
    for _ in range(2):
        assert a.cluster.links.send_to(peer, {"op": "beat", "t": time.monotonic(), "pulls": [],
                                              "n": peer.sent})  # fmt: skip
    run([b], 0.5)  # (b answers both: they are in a's DEALER)
    time.sleep(0.1)
    a.step()
    assert len(heard) == 2


def test_a_peer_that_restarts_on_another_cluster_protocol_is_down(
    pair: Callable[[str], Node],
) -> None:
    """b restarts on an older release: its answers keep coming (hello_first, its welcome),
    but a refuses its welcome, so a takes it for down (its keys, loans and homes go), not
    up for good."""
    a, b = pair("a"), pair("b")
    assert run([a, b], 5, lambda: a.up("b") and b.up("a"))
    b.close()
    b = pair("b")
    _older(b)
    assert run([a, b], 6, lambda: not a.up("b"))


def _linked(a: Node, b: Node) -> Any:
    """a's link to b, once both are up."""
    assert run([a, b], 5, lambda: a.up("b") and b.up("a"))
    peer = a.cluster.links.peer("b")
    assert peer is not None
    return peer


def _hearing(a: Node, fail_first: bool = False) -> list[dict[str, Any]]:
    """The answers a's peers send it from now on, as a handles them (the first failing, if
    `fail_first`)."""
    heard: list[dict[str, Any]] = []
    answer = a.cluster._answer

    def hearing(p: Any, m: dict[str, Any]) -> None:
        heard.append(m)
        if fail_first and len(heard) == 1:
            raise RuntimeError("a fault handling an answer")
        answer(p, m)

    a.cluster._answer = hearing  # type: ignore[method-assign]
    return heard


def _older(b: Node) -> None:
    """b says hello and welcome as an older release does: naming no protocol."""
    hello = b.cluster._hello

    def older(op: str = "hello", to: str | None = None) -> dict[str, Any]:
        m = hello(op, to)
        del m["protocol"]
        return m

    b.cluster._hello = older  # type: ignore[method-assign]
