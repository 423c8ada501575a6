"""The beats of a cluster whose membership is etcd's (Note [beats] in server/cluster/beats.py):
idle links are not beaten, links in use are, and a node found not fresh is beaten at once.
Brokers' cluster sides in one process (tests/nodes.py), `quiet` as with etcd."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from tensorbroker.server.cluster import beats, pulls
from tensorbroker.server.cluster.beats import BEAT, DOWN_AFTER
from tensorbroker.server.cluster.membership import Member
from tensorbroker.server.cluster.offers import OFFER_MAX
from tests.nodes import MiB, Node, pair, run
from tests.unit.test_dealers import _older

__all__ = ["pair"]  # the fixture


def _quiet_pair(pair: Callable[..., Node]) -> tuple[Node, Node]:
    a, b = pair("a", quiet=True), pair("b", quiet=True)
    assert run([a, b], 5, lambda: a.up("b") and b.up("a"))
    return a, b


def _idle(node: Node) -> bool:
    """Whether `node`'s links are idle: what each carried confirmed by a beat's answer."""
    return all(p.answered and p.sent == p.checked for p in node.cluster.links.peers)


def _beats(*nodes: Node) -> int:
    return sum(n.journal.events.count(("sent", "beat")) for n in nodes)


def test_idle_links_are_not_beaten_and_their_silence_takes_no_node_for_down(
    pair: Callable[..., Node],
) -> None:
    """Two brokers that ask nothing of each other send each other nothing (at N brokers,
    beating every pair costs each 2(N-1) messages a beat), for longer than a peer's
    silence takes it for down."""
    a, b = _quiet_pair(pair)
    assert run([a, b], 3, lambda: _idle(a) and _idle(b))  # (the welcome's requests confirmed)
    beats = _beats(a, b)
    run([a, b], DOWN_AFTER + 2 * BEAT)
    assert _beats(a, b) == beats
    assert a.up("b") and b.up("a")


def test_a_peer_that_stops_answering_is_down_once_something_is_asked_of_it(
    pair: Callable[..., Node],
) -> None:
    """An idle peer whose loop stopped is not taken for down (etcd says when a node goes);
    once a get asks it to lend a key, its silence counts, and the get is not left waiting."""
    a, b = _quiet_pair(pair)
    a.put("k", MiB)
    assert run([a, b], 5, lambda: b.knows("k") and _idle(b))  # (its lookup confirmed)
    run([b], DOWN_AFTER + BEAT)  # a's loop stops
    assert b.up("a")
    assert b.get("k")
    assert run([b], DOWN_AFTER + 3 * BEAT, lambda: not b.up("a"))


def test_a_get_after_idling_reads_the_lend_it_asked_for_without_asking_again(
    pair: Callable[..., Node],
) -> None:
    """b's last beat answer from a promised nothing of now; its first get's lend goes behind
    a beat, whose answer comes first: the `lent` is read at once, not given back and asked
    again once a beat made a fresh."""
    a, b = _quiet_pair(pair)
    a.put("k", MiB)
    assert run([a, b], 5, lambda: b.knows("k") and _idle(b))
    assert run([a, b], DOWN_AFTER + 1, lambda: not b.cluster.links.fresh("a", freshen=False))
    mark = len(b.journal.events)
    assert b.get("k")
    assert run([a, b], 3, lambda: "k" in b.reads.started)
    assert b.journal.events[mark:].count(("sent", "lend")) == 1


def test_the_owner_of_offers_held_stays_fresh_so_a_first_get_reads_the_offer(
    pair: Callable[..., Node],
) -> None:
    """b follows a's keys and holds a's offer of a small version: the link is in use, so it
    is beaten while idle otherwise, and b's first get reads the offer, not asking a lend."""
    a, b = _quiet_pair(pair)
    b.cluster.replicas.follow_prefix("")
    assert run([a, b], 3, lambda: "b" in a.cluster.replicas.lending.followers.prefixes)
    a.put("k", 4096)
    assert run([a, b], 5, lambda: len(b.cluster.replicas.held.offers) == 1)
    run([a, b], DOWN_AFTER + BEAT)  # (long past a promise of a beat before)
    assert run([a, b], 3, lambda: b.cluster.links.fresh("a", freshen=False))
    mark = len(b.journal.events)
    assert b.get("k")
    assert run([a, b], 3, lambda: "k" in b.reads.started)
    assert ("sent", "lend") not in b.journal.events[mark:]


def test_a_node_found_not_fresh_is_beaten_at_once(pair: Callable[..., Node]) -> None:
    """A read that waits for its lender to be fresh does not wait for a beat period."""
    a, b = _quiet_pair(pair)
    assert run([a, b], 3, lambda: _idle(b))
    assert run([a, b], DOWN_AFTER + 1, lambda: not b.cluster.links.fresh("a", freshen=False))
    b.cluster._next_tick = time.monotonic() + 60  # (no beat of the period meanwhile)
    assert not b.cluster.links.fresh("a")
    assert run([a, b], 2.0, lambda: b.cluster.links.fresh("a", freshen=False))


def test_a_loan_whose_lent_was_lost_is_unpinned_once_its_pull_ends(
    pair: Callable[..., Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """a's `lent` to b is lost and b's get gives up: the pull ends with no loan read, and a
    holds the version pinned for it. The link stays in use until a beat sent after that
    (naming the pulls open: Lending.open_pulls) is answered, and a unpins it."""
    a, b = _quiet_pair(pair)
    a.put("k", 2 * OFFER_MAX)  # (lent when asked, not offered)
    assert run([a, b], 5, lambda: b.knows("k"))
    monkeypatch.setattr(pulls, "PULL_WAIT", 0.5)
    read = b.cluster.links.read

    def losing(socket: Any) -> Any:
        for route, peer, m in read(socket):
            if peer is None or m.get("op") != "lent":
                yield route, peer, m

    b.cluster.links.read = losing  # type: ignore[method-assign]
    assert b.get("k")
    assert run([a, b], 3, lambda: bool(a.cluster.replicas.lending.loans))
    for pull in b.cluster.replicas.pulls.pulls.values():
        for waiter in pull.waiters:
            waiter.done = True  # (its get gave up)
    assert run([a, b], 3, lambda: not b.cluster.replicas.pulls.pulls)
    assert run([a, b], 3 * BEAT + 1.0, lambda: not a.cluster.replicas.lending.loans)


def test_a_beat_that_cannot_go_out_does_not_keep_the_loop_turning(
    pair: Callable[..., Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer found not fresh whose link takes no message (reconnecting): the beat is tried
    once in FRESHEN_EVERY, and the loop waits meanwhile, not turning at once for good."""
    a, b = _quiet_pair(pair)
    assert run([a, b], 3, lambda: _idle(b))
    assert run([a, b], DOWN_AFTER + 1, lambda: not b.cluster.links.fresh("a", freshen=False))
    monkeypatch.setattr(beats, "FRESHEN_EVERY", 30.0)  # (this test's steps, however slow)
    peer = b.cluster.links.peer("a")
    assert peer is not None
    peer.tried = 0.0
    b.cluster.links.send_to = lambda peer, message: False  # type: ignore[method-assign]
    assert not b.cluster.links.fresh("a") and b.cluster.links.stale
    b.step()  # (the beat tried)
    assert not b.cluster.links.fresh("a") and b.cluster.wake_in > 0


def test_an_idle_link_that_takes_no_message_is_taken_for_down(
    pair: Callable[..., Node],
) -> None:
    """b's link to a takes nothing any more (a moved, say, and etcd did not tell): a request
    on it goes behind a beat that cannot go, so the link is no longer idle, and its silence
    takes a for down."""
    a, b = _quiet_pair(pair)
    assert run([a, b], 3, lambda: _idle(b))
    peer = b.cluster.links.peer("a")
    assert peer is not None
    peer.socket.disconnect(peer.address)  # (sends fail once it is done: ZMQ_IMMEDIATE)
    assert run([a, b], 2, lambda: not peer.socket.getsockopt(zmq.EVENTS) & zmq.POLLOUT)
    assert peer.sent == peer.checked  # (idle still: nothing went since)
    assert not b.cluster.links.send("a", {"op": "follow", "keys": [], "prefixes": []})
    assert run([a, b], DOWN_AFTER + 3 * BEAT, lambda: not b.up("a"))


def test_a_node_restarted_behind_an_idle_link_is_linked_again_once_etcd_names_it(
    pair: Callable[..., Node],
) -> None:
    """b restarts on an older release: a refuses its hello, and a's link to b, idle, sends
    nothing that would hear `hello_first`. b's new entry in etcd (its new incarnation)
    makes a say hello again: b's welcome is refused, and a takes b for down, not up for
    good."""
    a, b = _quiet_pair(pair)
    assert run([a, b], 3, lambda: _idle(a))  # (the welcome's requests confirmed)
    b.close()
    b = pair("b", quiet=True)
    _older(b)
    run([a, b], DOWN_AFTER + BEAT)
    assert a.up("b")  # (nothing asked of it, nothing heard)
    record = {"address": b.cluster.address, "incarnation": b.cluster.links.incarnation}
    a.cluster._members([Member("b", record)])  # (what Membership tells the loop then)
    assert run([a, b], 3, lambda: not a.up("b"))


def test_a_node_that_etcd_names_restarted_elsewhere_is_down_at_its_old_address(
    pair: Callable[..., Node],
) -> None:
    """etcd names b's new process at another address (a pod's new IP; the old entry's delete
    was missed): a's link to the old address, up and idle, would never hear anything. It is
    taken for down and dropped, and a links to the new address."""
    a, b = _quiet_pair(pair)
    assert run([a, b], 3, lambda: _idle(a))
    moved = "tcp://127.0.0.1:1"  # (nothing answers there)
    newer = a.cluster.links._incarnations["b"] + 1
    a.cluster._members([Member("b", {"address": moved, "incarnation": newer})])
    assert not a.up("b")
    assert [p.address for p in a.cluster.links.peers] == [moved]


def test_a_node_restarted_elsewhere_whose_hello_comes_first_is_not_sent_to_its_old_address(
    pair: Callable[..., Node],
) -> None:
    """b's new process, at another address, says hello to a before etcd's event about it
    reaches a: a's link to the old address, up and idle, would keep a's messages to b going
    there (the first link up is used) until silent 8 s. It says hello again instead."""
    a, b = _quiet_pair(pair)
    assert run([a, b], 3, lambda: _idle(a))
    moved = "tcp://127.0.0.1:1"  # (nothing answers there)
    hello = {**b.cluster._hello(to="a"), "address": moved}
    hello["incarnation"] = b.cluster.links.incarnation + 1
    a.cluster._request(b"new-route", hello)
    old = [p for p in a.cluster.links.peers if p.address != moved]
    assert old and not any(p.up for p in old)
